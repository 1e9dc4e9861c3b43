"""The driver's own CPU per step, as the number of workers grows.

    python benchmarks/driver_cost.py [--workers 2 4 6 8] [--steps 40] [--mib 8]
                                     [--shard-mib 1] [--paths workers workers_step]
                                     [--label NAME] [--out PATH]

A compute-free model (`--mib` MiB of float32 gradients, loss = c * sum(v): the
gradient is a constant fill) is trained by `DistributedSGD(strategy="ps")` with
N workers of one replica, `--shard-mib` MiB gradient shards and the default PS
layout. For each N, after warm-up steps, `train(num_steps)` runs `--steps` steps
and the driver process's CPU time (user + system, every thread of the process:
Ray's own threads in the driver included, through `time.process_time`) is
divided by the steps; wall time per step is reported beside it.

Paths, measured interleaved for each N in one run (`--paths`):
- `workers`: the workers' own exchange (the default), `train()` running
  max(8, 4 x N) steps per call of each worker (`local_steps_per_call=None`),
  worker 0 reporting every worker's totals per step and each worker its own
  figures per call (dsgd/comm/reports.py);
- `workers_step`: the same with one step per call (`local_steps_per_call=1`, as
  `step()` runs): the driver's cost per call, not amortised.

(Rows labelled `relayed` in the result file are of the driver-relayed exchange,
`worker_exchange=False`, since retired from dsgd: the driver relayed every group
of every step, N*(P+1) streamed items, P PS calls and N applies per step.)

Work per step that grows with N in the driver is the thing this measures
(STYLE 16): the target is N=8 within 1.5x of N=2. An idle driver process
burns CPU too (Ray's timers and polling threads, measured over a sleep of
IDLE_S seconds before each run as `idle_cpu_ms_per_s`), per second of wall
time: with N workers sharing 2 cores a step takes longer as N grows, so
that share grows with N whatever the driver does per step.
`driver_cpu_ms_per_step_net_of_idle` subtracts it; both are reported. On a 2-core machine N workers
share the cores, so wall time grows with N whatever the driver does; the
driver's CPU is the figure to compare.

Writes JSON (one row per N) to benchmarks/results/driver_cost.json, or `--out`.
With `--append` the rows are added to an existing file under `--label`, so that
two code versions (before/after a change, each run from its own checkout) land
in one result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dsgd  # noqa: E402

MIB = 2**20
NUM_VARIABLES = 8
IDLE_S = 3.0


class FlatModel(dsgd.Model):
    """`num_variables` float32 vectors totalling `mib` MiB; its gradient is a constant."""

    def __init__(self, mib: float, num_variables: int = NUM_VARIABLES):
        import keras
        import tensorflow as tf

        n = int(mib * MIB / 4 / num_variables)
        self.variables = [tf.Variable(tf.zeros([n]), name=f"v{i}") for i in range(num_variables)]
        self.optimizer = keras.optimizers.SGD(1e-6)

    def get_loss(self, batch):
        import tensorflow as tf

        return tf.add_n([tf.reduce_sum(v) for v in self.variables]) * 1e-3

    def get_variables(self):
        return self.variables

    def get_optimizer(self):
        return self.optimizer


PATHS = {"workers": {},
         "workers_step": {"local_steps_per_call": 1}}


def measure(num_workers: int, steps: int, mib: float, shard_mib: float, warmup: int,
            path: str = "workers") -> dict:
    sgd = dsgd.DistributedSGD(lambda w, d: FlatModel(mib), num_workers, 1, gpu=False,
                              strategy="ps", grad_shard_bytes=int(shard_mib * MIB),
                              step_timeout_s=120, **PATHS[path])
    try:
        sgd.train(num_steps=warmup)
        # The driver process's CPU while it waits with nothing to do (Ray's own
        # timers and polling threads): paid per second of wall time, not per step.
        idle0 = time.process_time()
        time.sleep(IDLE_S)
        idle_ms_per_s = 1000 * (time.process_time() - idle0) / IDLE_S
        cpu0, wall0 = time.process_time(), time.perf_counter()
        summary = sgd.train(num_steps=steps)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        return {"path": path, "num_workers": num_workers, "steps": steps, "num_ps": len(sgd.ps_actors),
                "num_shards": sgd.plan.num_shards, "num_groups": len(sgd.shard_groups),
                "driver_cpu_ms_per_step": 1000 * cpu / steps,
                "idle_cpu_ms_per_s": idle_ms_per_s,
                # The same less what an idle driver burns over the step's wall time.
                "driver_cpu_ms_per_step_net_of_idle":
                    max(0.0, 1000 * cpu / steps - idle_ms_per_s * wall / steps),
                "wall_ms_per_step": 1000 * wall / steps,
                "median_step_ms": 1000 * summary["step_s"]}
    finally:
        sgd.shutdown()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 6, 8])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--mib", type=float, default=8.0, help="gradient MiB per worker")
    p.add_argument("--shard-mib", type=float, default=1.0)
    p.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=list(PATHS))
    p.add_argument("--label", default=None, help="name of this code version (default: git commit)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "driver_cost.json"))
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to --out instead of replacing it")
    args = p.parse_args(argv)

    import ray

    ray.init(num_cpus=max(args.workers) + 1, object_store_memory=1024 * MIB,
             include_dashboard=False, log_to_driver=False)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.abspath(dsgd.__file__)))
    commit = commit.stdout.strip() or "unknown"
    label = args.label or commit
    rows = []
    for n in args.workers:
        for path in args.paths:
            row = measure(n, args.steps, args.mib, args.shard_mib, args.warmup, path)
            row.update(label=label, commit=commit)
            print(json.dumps(row), flush=True)
            rows.append(row)
    ray.shutdown()

    result = {"benchmark": "driver_cost", "machine": f"{platform.machine()}, "
              f"{os.cpu_count()} cores, no GPU", "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d"), "mib": args.mib, "shard_mib": args.shard_mib,
              "rows": []}
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
        result["rows"] = [r for r in result["rows"] if r["label"] != label]
    result["rows"] += rows
    # Per path: the figure at the largest N over the smallest (target <= 1.5 for
    # "workers").
    for path in args.paths:
        by_n = {r["num_workers"]: r["driver_cpu_ms_per_step"] for r in rows if r["path"] == path}
        net = {r["num_workers"]: r["driver_cpu_ms_per_step_net_of_idle"] for r in rows
               if r["path"] == path}
        if len(by_n) > 1:
            result.setdefault("growth", {})[f"{label}/{path}"] = by_n[max(by_n)] / by_n[min(by_n)]
            result.setdefault("growth_net_of_idle", {})[f"{label}/{path}"] = \
                net[max(net)] / net[min(net)] if net[min(net)] > 0 else float("nan")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"out": args.out, "growth": result.get("growth"),
                      "growth_net_of_idle": result.get("growth_net_of_idle")}))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
