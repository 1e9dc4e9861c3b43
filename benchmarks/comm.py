"""Exchange cost of dsgd's "ps" strategy against the memory bound and a plain-Ray peer.

    python benchmarks/comm.py [--sizes 25 50 100] [--workers 2] [--ps 2] [--steps 20]
                              [--variables 20] [--shard-mb 10] [--compression fp16 bf16]

For each gradient size S (MiB per worker), one run measures, as per-step medians:
  memcpy_s     numpy copy of S MiB into a warm buffer (the memory bound's unit)
  plain_s      a plain single-process tf.function step of the same model
  dsgd_s       a dsgd step (N workers, P PS actors, strategy "ps")
  exchange_s   dsgd_s - plain_s; ratio exchange_s / (2 * memcpy_s) (target <= 1.5)
  peer_s       what a user would write by hand with plain Ray: each worker returns
               its numpy gradient halves, P actors sum them with numpy, workers
               fetch the results (no TensorFlow; exchange only). The floor:
               dsgd_over_floor = dsgd_s / peer_s (target <= 1.0)
  dsgd_train_s a dsgd step inside train(), which keeps the next step in flight
  shared_plain_s  N plain steps at once, one per Ray actor, no exchange: what the
               workers' own compute and update cost when they share the machine
               (on 2 cores with 2 workers, each gets one core: exchange_s counts that too)
and, for the dsgd run, CPU ms and minor page faults per step of every process
(workers, PS actors, raylet, driver) from /proc: where the time goes; for the
floor, CPU ms per step of its processes (cpu_ms_per_step_total compares them).
The model is compute-light (gradient = a constant fill, SGD update) so the exchange shows.
Writes JSON to benchmarks/results/comm.json and a PNG chart beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dsgd  # noqa: E402
from dsgd import constants  # noqa: E402

MIB = 2**20
# 5.2 MiB each at 100 MiB: none is split by the default 10 MB shards (ResNet-50's
# largest gradient is 8 MB). With --variables 10 every 10.5 MiB variable is split
# across two shards and the worker copies it back together on read.
NUM_VARIABLES = 20


class FlatModel(dsgd.Model):
    """`num_variables` float32 vectors totalling `mib` MiB; loss = c * sum(v), so the
    gradient is the constant c everywhere: computing it costs one write pass."""

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


def median_time(fn, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memcpy_s(mib: float, steps: int) -> float:
    src = np.ones(int(mib * MIB) // 4, np.float32)
    dst = np.empty_like(src)
    return median_time(lambda: np.copyto(dst, src), steps, 3)


def plain_s(mib: float, steps: int, warmup: int, num_variables: int) -> float:
    import tensorflow as tf

    model = FlatModel(mib, num_variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = model.get_loss(None)
        model.optimizer.apply_gradients(zip(tape.gradient(loss, model.variables), model.variables))
        return loss

    return median_time(lambda: step().numpy(), steps, warmup)


def proc_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds used so far, minor page faults so far) of process `pid`."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def raylet_pid() -> int | None:
    """The pid of this benchmark's raylet: the process named `raylet` whose
    parent is this process (ray.init(address="local") starts it), from /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                name, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        if name.endswith("(raylet") and int(rest.split()[1]) == os.getpid():
            return int(entry)
    return None


def dsgd_s(mib, workers, num_ps, steps, warmup, shard_bytes, num_variables, compression=None):
    """Per-step medians of the dsgd step and its phases, plus where the CPU went:
    CPU ms and minor page faults per step of every process (Linux /proc)."""
    import ray

    with dsgd.DistributedSGD(lambda w, d: FlatModel(mib, num_variables), workers, 1,
                             gpu=False, strategy="ps", num_ps=num_ps,
                             grad_shard_bytes=shard_bytes, compression=compression) as sgd:
        for _ in range(warmup):
            sgd.step()
        pids = {f"worker{i}": ray.get(w.ping.remote(), timeout=60).pid
                for i, w in enumerate(sgd.workers)}
        pids.update({f"ps{j}": ray.get(p.ping.remote(), timeout=60).pid
                     for j, p in enumerate(sgd.ps_actors)})
        pids.update(raylet=raylet_pid(), driver=os.getpid())
        pids = {k: v for k, v in pids.items() if v is not None}
        before = {k: proc_stat(pid) for k, pid in pids.items()}
        stats = [sgd.step(fetch_stats=True) for _ in range(steps)]
        after = {k: proc_stat(pid) for k, pid in pids.items()}
        groups = len(sgd.shard_groups)
        num_shards = sgd.plan.num_shards
        # train(): each next step submitted before the last one's result is back.
        in_flight = sgd.train(num_steps=steps)["step_s"]
    phases = {k: statistics.median(s[k] for s in stats)
              for k in ("step_s", "compute_s", "exchange_s", "apply_s")}
    phases["train_step_s"] = in_flight
    phases["cpu_ms_per_step"] = {k: 1e3 * (after[k][0] - before[k][0]) / steps for k in pids}
    phases["faults_per_step"] = {k: (after[k][1] - before[k][1]) / steps for k in pids}
    phases.update(num_shards=num_shards, num_groups=groups)
    return phases


def shared_plain_s(mib, workers, steps, warmup, num_variables):
    """`workers` plain tf.function steps at once, one per Ray actor (started like
    dsgd's workers: 1 CPU, niceness 0), no exchange; median wall time of a round."""
    import ray

    @ray.remote(num_cpus=1, runtime_env=constants.ACTOR_RUNTIME_ENV)
    class PlainWorker:
        def __init__(self):
            import tensorflow as tf

            self.model = model = FlatModel(mib, num_variables)

            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    loss = model.get_loss(None)
                grads = tape.gradient(loss, model.variables)
                model.optimizer.apply_gradients(zip(grads, model.variables))
                return loss

            self.step_fn = step

        def step(self):
            return float(self.step_fn().numpy())

    actors = [PlainWorker.remote() for _ in range(workers)]
    try:
        return median_time(lambda: ray.get([a.step.remote() for a in actors], timeout=300),
                           steps, warmup)
    finally:
        for a in actors:
            ray.kill(a)


def peer_s(mib, workers, num_ps, steps, warmup):
    """Plain Ray, numpy only: the exchange a user would hand-write. Returns
    (median step time, CPU ms per step of every process over the timed steps)."""
    import ray

    @ray.remote(num_cpus=0)
    class PeerWorker:
        def __init__(self):
            self.grad = np.full(int(mib * MIB) // 4, 1e-3, np.float32)
            self.parts = np.array_split(self.grad, num_ps)  # views

        def grads(self):
            return tuple(self.parts)  # Ray copies each part into the store

        def apply(self, *means):
            for part, mean in zip(self.parts, means):  # stands in for the optimizer's read
                np.copyto(part, mean)

        def pid(self):
            return os.getpid()

    @ray.remote(num_cpus=0)
    class PeerPS:
        def mean(self, *parts):
            out = parts[0] + parts[1] if len(parts) > 1 else parts[0].copy()
            for p in parts[2:]:
                out += p
            out *= np.float32(1.0 / len(parts))
            return out

        def pid(self):
            return os.getpid()

    ws = [PeerWorker.remote() for _ in range(workers)]
    ps = [PeerPS.remote() for _ in range(num_ps)]

    def step():
        parts = [w.grads.options(num_returns=num_ps).remote() for w in ws]
        parts = [p if isinstance(p, list) else [p] for p in parts]
        means = [ps[j].mean.remote(*[parts[i][j] for i in range(workers)]) for j in range(num_ps)]
        ray.get([w.apply.remote(*means) for w in ws], timeout=120)

    try:
        for _ in range(warmup):
            step()
        pids = {f"worker{i}": ray.get(w.pid.remote(), timeout=60) for i, w in enumerate(ws)}
        pids.update({f"ps{j}": ray.get(p.pid.remote(), timeout=60) for j, p in enumerate(ps)})
        pids.update(raylet=raylet_pid(), driver=os.getpid())
        pids = {k: v for k, v in pids.items() if v is not None}
        before = {k: proc_stat(pid)[0] for k, pid in pids.items()}
        median = median_time(step, steps, 0)
        cpu_ms = {k: 1e3 * (proc_stat(pid)[0] - before[k]) / steps for k, pid in pids.items()}
        return median, cpu_ms
    finally:
        for a in ws + ps:
            ray.kill(a)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[100.0], help="MiB per worker")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ps", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variables", type=int, default=NUM_VARIABLES,
                   help="equal float32 variables the gradient is made of")
    p.add_argument("--shard-mb", type=float, default=10.0,
                   help="grad_shard_bytes in MB (10 is dsgd's default)")
    p.add_argument("--preallocate-store", action="store_true",
                   help="populate the object store's pages at start (RAY_preallocate_plasma_memory)")
    p.add_argument("--compression", nargs="*", default=[], choices=["fp16", "bf16"],
                   help="also run dsgd with these gradient compressions (dsgd_<c>_s columns)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "comm.json"))
    args = p.parse_args(argv)
    import ray

    # Ray refuses an object store under 75 MiB; small --sizes get that floor.
    store = max(int(max(args.sizes) * MIB * (args.workers + args.ps) * 3), 80 * MIB)
    if args.preallocate_store:
        os.environ["RAY_preallocate_plasma_memory"] = "1"
    ray.init(address="local", num_cpus=max(4, args.workers), object_store_memory=store,
             include_dashboard=False, log_to_driver=False)
    rows = []
    for mib in args.sizes:
        row = {"mib": mib, "workers": args.workers, "num_ps": args.ps,
               "memcpy_s": memcpy_s(mib, args.steps), "plain_s": plain_s(mib, args.steps, args.warmup, args.variables)}
        phases = dsgd_s(mib, args.workers, args.ps, args.steps, args.warmup, int(args.shard_mb * 1e6),
                        args.variables)
        row.update(dsgd_s=phases["step_s"], dsgd_phases=phases)
        row["peer_s"], row["peer_cpu_ms_per_step"] = peer_s(mib, args.workers, args.ps, args.steps,
                                                            args.warmup)
        row["shared_plain_s"] = shared_plain_s(mib, args.workers, args.steps, args.warmup,
                                               args.variables)
        row["bound_s"] = 2 * row["memcpy_s"]
        row["exchange_s"] = row["dsgd_s"] - row["plain_s"]
        row["exchange_over_bound"] = row["exchange_s"] / row["bound_s"]
        row["peer_over_exchange"] = row["peer_s"] / row["exchange_s"]
        # The peer is the floor to beat: a whole dsgd step against the hand-written exchange.
        row["dsgd_over_floor"] = row["dsgd_s"] / row["peer_s"]
        # On a machine whose cores the processes fill, wall time follows total CPU.
        row["cpu_ms_per_step_total"] = {"dsgd": sum(phases["cpu_ms_per_step"].values()),
                                        "floor": sum(row["peer_cpu_ms_per_step"].values())}
        print(f"{mib:6.1f} MiB: CPU ms per step, all processes: dsgd "
              f"{row['cpu_ms_per_step_total']['dsgd']:.0f} {phases['cpu_ms_per_step']}, floor "
              f"{row['cpu_ms_per_step_total']['floor']:.0f} {row['peer_cpu_ms_per_step']}", flush=True)
        row["dsgd_train_s"] = phases["train_step_s"]
        row["dsgd_train_over_floor"] = row["dsgd_train_s"] / row["peer_s"]
        for compression in args.compression:
            cphases = dsgd_s(mib, args.workers, args.ps, args.steps, args.warmup,
                             int(args.shard_mb * 1e6), args.variables, compression)
            row[f"dsgd_{compression}_s"] = cphases["step_s"]
            row[f"dsgd_{compression}_train_s"] = cphases["train_step_s"]
            row[f"dsgd_{compression}_over_floor"] = cphases["step_s"] / row["peer_s"]
            row[f"dsgd_{compression}_phases"] = cphases
            print(f"        compression {compression}: dsgd step {1e3 * cphases['step_s']:.1f} ms "
                  f"({row[f'dsgd_{compression}_over_floor']:.2f} x the floor), train() step "
                  f"{1e3 * cphases['train_step_s']:.1f} ms", flush=True)
        rows.append(row)
        print(f"{mib:6.1f} MiB: memcpy {1e3 * row['memcpy_s']:.1f} ms, plain {1e3 * row['plain_s']:.1f} ms, "
              f"dsgd {1e3 * row['dsgd_s']:.1f} ms, exchange {1e3 * row['exchange_s']:.1f} ms "
              f"= {row['exchange_over_bound']:.2f} x (2 x memcpy); plain-Ray peer {1e3 * row['peer_s']:.1f} ms "
              f"({row['peer_over_exchange']:.2f} x dsgd's exchange)", flush=True)
        print(f"        dsgd step / numpy floor (the peer): {row['dsgd_over_floor']:.2f}; "
              f"train() step {1e3 * row['dsgd_train_s']:.1f} ms, "
              f"{row['dsgd_train_over_floor']:.2f} x the floor", flush=True)
        print(f"        {args.workers} plain steps at once (no exchange): "
              f"{1e3 * row['shared_plain_s']:.1f} ms; dsgd step - that: "
              f"{1e3 * (row['dsgd_s'] - row['shared_plain_s']):.1f} ms", flush=True)
        cpu = phases["cpu_ms_per_step"]
        print("        CPU ms per step: " + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items())
              + f" (sum {sum(cpu.values()):.0f}, {os.cpu_count()} cores)", flush=True)
    result = {"benchmark": "comm", "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "steps": args.steps, "warmup": args.warmup, "grad_shard_bytes": int(args.shard_mb * 1e6),
              "num_variables": args.variables,
              "preallocate_store": args.preallocate_store, "object_store_bytes": store, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import charts  # the chart code of every benchmark

    charts.draw_after_run(args.out)
    return result


if __name__ == "__main__":
    main()
