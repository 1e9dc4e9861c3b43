"""Failure recovery, runnable: kill a worker and a PS actor mid-training and end
with exactly the weights of an uninterrupted run.

    python -m dsgd.examples.recovery [--steps 20] [--kill-worker-at 8] [--kill-ps-at 14]

Trains a small regression model on 2 workers with strategy "ps" twice: once
undisturbed, once with worker 1 SIGKILLed before step `--kill-worker-at` and PS
actor 0 before step `--kill-ps-at`. dsgd replaces each dead actor, copies the
state from a survivor and retries the step. The batches are keyed by the
optimizer's iteration count (which travels with the optimizer state), so the
two runs must agree to float32 round-off. Prints one JSON line with the
recovery times; exits non-zero if the weights differ.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import numpy as np

import dsgd
from dsgd.comm.waits import fetch


class Keyed(dsgd.Model):
    """y = sum(x) regression; replica r's batch at step t is a function of (r, t)."""

    def __init__(self, worker_index: int, device_index: int):
        import keras

        init = keras.initializers.GlorotUniform  # seeded: both runs start from the same weights
        self.model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh", kernel_initializer=init(seed=1)),
            keras.layers.Dense(1, kernel_initializer=init(seed=2))])
        self.optimizer = keras.optimizers.Adam(0.01)
        self.replica = worker_index

    def get_batch(self):
        step = int(self.optimizer.iterations.numpy())
        rng = np.random.default_rng([self.replica, step])
        x = rng.normal(size=(16, 4)).astype(np.float32)
        return x, x.sum(axis=1, keepdims=True)

    def get_loss(self, batch):
        import tensorflow as tf

        return tf.reduce_mean(tf.square(self.model(batch[0]) - batch[1]))

    def get_optimizer(self):
        return self.optimizer


def kill(handle) -> int:

    pid = fetch(handle.ping.remote(), "the worker's pid", 60).pid
    os.kill(pid, signal.SIGKILL)
    return pid


def train(steps: int, kills: dict) -> tuple[list[np.ndarray], list[dict], list[float]]:
    """`kills`: {step index: "worker" | "ps"}, done just before that step."""
    losses = []
    with dsgd.DistributedSGD(Keyed, 2, 1, gpu=False, strategy="ps", grad_shard_bytes=64,
                             num_ps=2, step_timeout_s=120) as sgd:
        for i in range(steps):
            if i in kills:
                victim = sgd.workers[1] if kills[i] == "worker" else sgd.ps_actors[0]
                print(f"step {i + 1}: SIGKILL {kills[i]} (pid {kill(victim)})", flush=True)
            losses.append(sgd.step(fetch_stats=True)["loss"])
        return sgd.get_weights(), sgd.failures, losses


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kill-worker-at", type=int, default=8, help="1-based step")
    p.add_argument("--kill-ps-at", type=int, default=14, help="1-based step")
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: start one)")
    args = p.parse_args(argv)
    for name in ("kill_worker_at", "kill_ps_at"):
        if not 1 <= getattr(args, name) <= args.steps:
            p.error(f"--{name.replace('_', '-')} must be within 1..--steps ({args.steps})")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    import ray

    start = time.perf_counter()
    if not ray.is_initialized():
        ray.init(address=args.address or "local", num_cpus=None if args.address else 4,
                 include_dashboard=False, log_to_driver=False)
    print("uninterrupted run ...", flush=True)
    expected, _, expected_losses = train(args.steps, {})
    print("run with failures ...", flush=True)
    got, failures, losses = train(args.steps, {args.kill_worker_at - 1: "worker",
                                               args.kill_ps_at - 1: "ps"})
    max_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected))
    result = {"steps": args.steps, "failures": len(failures),
              "recovery_s": [round(f["recovery_s"], 2) for f in failures
                             if f["recovery_s"] is not None],
              "max_weight_difference": max_diff, "final_loss": losses[-1],
              "uninterrupted_final_loss": expected_losses[-1],
              "wall_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(result), flush=True)
    if len(failures) != 2 or max_diff > 1e-6:
        sys.exit("recovery example: the run with failures does not match the uninterrupted run")
    return result


if __name__ == "__main__":
    main()
