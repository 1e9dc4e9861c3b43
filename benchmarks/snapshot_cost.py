"""What the automatic snapshot costs (DistributedSGD(snapshot_interval_s=...)).

    python benchmarks/snapshot_cost.py [--mib 8 64 256] [--repeats 5] [--out PATH]

For a compute-free model of `--mib` MiB of float32 weights with SGD momentum (the
state a snapshot copies is the weights, the momentum and the step count: about 2x
the weights), two workers: the wall time of one snapshot (worker 0 serialises
its checkpoint files, the driver copies them into its own memory through the
object store), median of `--repeats`, and the median step time beside it, so
that the cost can be read as a fraction of the interval. JSON to
benchmarks/results/snapshot_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dsgd  # noqa: E402
from driver_cost import MIB, FlatModel  # noqa: E402


class MomentumModel(FlatModel):
    def __init__(self, mib: float):
        import keras

        super().__init__(mib)
        self.optimizer = keras.optimizers.SGD(1e-6, momentum=0.9)


def measure(mib: float, repeats: int) -> dict:
    with dsgd.DistributedSGD(lambda w, d: MomentumModel(mib), 2, 1, gpu=False,
                             grad_shard_bytes=8 * MIB, step_timeout_s=300,
                             snapshot_interval_s=None) as sgd:
        summary = sgd.train(num_steps=5)
        costs = []
        for _ in range(repeats):
            start = time.perf_counter()
            sgd._take_snapshot(None)
            costs.append(time.perf_counter() - start)
        snapshot = sgd._progress.snapshot
        return {"weights_mib": mib, "snapshot_bytes": snapshot["bytes"],
                "snapshot_s_median": statistics.median(costs), "snapshot_s": costs,
                "step_s_median": summary["step_s"],
                "snapshot_over_step": statistics.median(costs) / summary["step_s"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, nargs="+", default=[8, 64, 256])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "snapshot_cost.json"))
    args = p.parse_args(argv)

    import ray

    ray.init(num_cpus=3, object_store_memory=3 * 1024 * MIB, include_dashboard=False,
             log_to_driver=False)
    rows = []
    for mib in args.mib:
        row = measure(mib, args.repeats)
        print(json.dumps({k: v for k, v in row.items() if k != "snapshot_s"}), flush=True)
        rows.append(row)
    ray.shutdown()
    result = {"benchmark": "snapshot_cost", "machine": f"{platform.machine()}, "
              f"{os.cpu_count()} cores, no GPU", "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d"), "workers": 2, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
