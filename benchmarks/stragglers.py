"""Backup workers against an injected straggler: 4 workers on the MNIST CNN.

    python benchmarks/stragglers.py [--steps 200] [--batch 32] [--out benchmarks/results/stragglers.json]

Worker 3 is slowed in its `get_batch` two ways: "fixed" (every batch waits
0.5 x the straggler-free step time T: a 1.5x slower worker) and "heavy" (a
seeded 20 % of its batches wait an exponential time with mean 2 T). For
`backup_workers` 0 and 1 (one DistributedSGD each, reset to the same
checkpoint before every run) and each straggler ("none", "fixed", "heavy"):
median and p95 step time, test accuracy after `--steps` steps, and test
accuracy at the wall time W that the straggler-free synchronous run took for
its steps (weights read every `--chunk` steps; the last read at or before W).
T and W come from the b=0 "none" run, measured first in the same process.

Targets (DESIGN.md §5): with one straggler, b=1's median step within 1.15x of
the straggler-free synchronous step, while b=0 pays the straggler; accuracy
after equal steps within 0.5 points of synchronous.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dsgd  # noqa: E402
from dsgd.examples import mnist  # noqa: E402

SLOW_WORKER = 3
HEAVY_FRACTION, HEAVY_MEAN_STEPS = 0.2, 2.0


class SlowMnist(mnist.MnistModel):
    """The example's replica; worker SLOW_WORKER waits in get_batch as `set_delay` says."""

    def __init__(self, worker: int, num_workers: int, batch: int):
        super().__init__(worker, num_workers, batch, 1e-3, seed=0)
        self.worker = worker
        self.mode, self.step_s, self.rng = "none", 0.0, None

    def set_delay(self, mode: str, step_s: float, seed: int) -> None:
        self.mode, self.step_s = mode, step_s
        self.rng = np.random.default_rng(seed)
        self._iterator = None  # every run starts its data afresh

    def get_batch(self):
        if self.worker == SLOW_WORKER and self.mode != "none":
            if self.mode == "fixed":
                time.sleep(0.5 * self.step_s)
            elif self.rng.random() < HEAVY_FRACTION:
                time.sleep(self.rng.exponential(HEAVY_MEAN_STEPS * self.step_s))
        return super().get_batch()


def accuracy(model, weights, x_test, y_test) -> float:
    model.set_weights(weights)
    logits = model.predict(x_test, batch_size=500, verbose=0)
    return float(np.mean(np.argmax(logits, axis=1) == y_test))


def run(sgd, mode: str, step_s: float, steps: int, chunk: int, checkpoint: str,
        wall_budget: float | None, seed: int) -> dict:
    """`steps` steps from the checkpoint with straggler `mode`; per-step stats and
    the weights read every `chunk` steps (with the wall time they were read at)."""
    sgd.restore_checkpoint(checkpoint)
    sgd.foreach_model(lambda m: m.set_delay(mode, step_s, seed))
    stats, snapshots = [], []
    start = time.perf_counter()
    for k in range(steps):
        stats.append(sgd.step(fetch_stats=True))
        if (k + 1) % chunk == 0:
            elapsed = time.perf_counter() - start  # before the read: weights of this moment
            weights = sgd.get_weights()
            snapshots.append((k + 1, elapsed, weights))
    train_s = time.perf_counter() - start
    sgd.foreach_model(lambda m: m.set_delay("none", 0.0, seed))
    times = [s["step_s"] for s in stats]
    result = {"mode": mode, "steps": steps, "train_s": train_s,
              "median_step_s": statistics.median(times),
              "p95_step_s": float(np.percentile(times, 95)),
              "snapshots": snapshots}
    if "contributors" in stats[0]:
        result["straggler_contributed_steps"] = sum(SLOW_WORKER in s["contributors"] for s in stats)
        result["dropped_batches"] = sum(len(s["dropped"]) for s in stats)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--chunk", type=int, default=10, help="steps between weight reads")
    p.add_argument("--batch", type=int, default=32, help="per replica")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/stragglers.json")
    args = p.parse_args(argv)

    import keras
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    _, _, x_test, y_test = mnist.load_mnist()
    eval_model = mnist.build_cnn()
    rows, baseline = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for b in (0, 1):
            creator = lambda w, d, n=4, batch=args.batch: SlowMnist(w, n, batch)  # noqa: E731
            with dsgd.DistributedSGD(creator, 4, 1, gpu=False, backup_workers=b,
                                     step_timeout_s=300) as sgd:
                for _ in range(args.warmup):
                    sgd.step()
                checkpoint = sgd.save_checkpoint(os.path.join(tmp, f"start{b}"))
                if b == 0:
                    # The checkpoint of b=0 is the start of every run: same weights.
                    start_ckpt = checkpoint
                    baseline = run(sgd, "none", 0.0, args.steps, args.chunk, start_ckpt, None,
                                   args.seed)
                    step_s = baseline["median_step_s"]
                    wall = baseline["train_s"]
                    rows.append(dict(baseline, backup_workers=0))
                    modes = ("fixed", "heavy")
                else:
                    modes = ("none", "fixed", "heavy")
                for mode in modes:
                    row = run(sgd, mode, step_s, args.steps, args.chunk, start_ckpt, wall,
                              args.seed)
                    rows.append(dict(row, backup_workers=b))
                    print(f"b={b} {mode:5s}: median {row['median_step_s'] * 1e3:.0f} ms, "
                          f"p95 {row['p95_step_s'] * 1e3:.0f} ms", flush=True)
    keras.backend.clear_session()
    for row in rows:
        snapshots = row.pop("snapshots")
        row["accuracy_equal_steps"] = accuracy(eval_model, snapshots[-1][2], x_test, y_test)
        within = [s for s in snapshots if s[1] <= wall] or snapshots[:1]
        row["steps_in_equal_time"] = within[-1][0]
        row["accuracy_equal_time"] = accuracy(eval_model, within[-1][2], x_test, y_test)
        row["step_ratio_vs_sync"] = row["median_step_s"] / step_s
        row["accuracy_points_vs_sync"] = 100 * (row["accuracy_equal_steps"]
                                                - rows[0]["accuracy_equal_steps"])
    result = {"benchmark": "stragglers", "device": f"{platform.node()}: {os.cpu_count()} cores, "
              "CPU only", "workers": 4, "batch_per_replica": args.batch, "steps": args.steps,
              "sync_step_s": step_s, "equal_wall_time_s": wall,
              "straggler": {"worker": SLOW_WORKER, "fixed": "0.5 T wait per batch (1.5x)",
                            "heavy": f"{HEAVY_FRACTION:.0%} of batches wait Exp(mean "
                                     f"{HEAVY_MEAN_STEPS} T)"},
              "rows": rows}
    result["targets"] = {
        f"b1_{mode}_step_within_1.15x_sync": next(
            r["step_ratio_vs_sync"] for r in rows if r["backup_workers"] == 1 and r["mode"] == mode)
        <= 1.15 for mode in ("fixed", "heavy")}
    result["targets"]["b1_accuracy_within_0.5_points"] = all(
        abs(r["accuracy_points_vs_sync"]) <= 0.5 for r in rows if r["backup_workers"] == 1)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    import charts  # the chart code of every benchmark (this directory is on sys.path)

    charts.draw_after_run(args.out)
    for row in rows:
        print(f"b={row['backup_workers']} {row['mode']:5s}: step {row['step_ratio_vs_sync']:.2f}x "
              f"sync (median {row['median_step_s'] * 1e3:.0f} ms, p95 "
              f"{row['p95_step_s'] * 1e3:.0f} ms), accuracy {row['accuracy_equal_steps']:.3f} "
              f"after {args.steps} steps, {row['accuracy_equal_time']:.3f} after "
              f"{wall:.0f} s ({row['steps_in_equal_time']} steps)")
    print(json.dumps(result["targets"]))
    return result


if __name__ == "__main__":
    main()
