"""Median step time of small models under dsgd, against a plain single-process
`tf.function` step of the same model measured in the same run.

    python benchmarks/step_time.py [--steps 60] [--warmup 10] [--out benchmarks/results/step_time.json]

Rows: plain TF (one replica, in this process), dsgd with 1 worker (no exchange),
and dsgd with 2 workers under "simple" and "ps". Each dsgd row also has an
interleaved A/B of steps run one at a time (`step()`) against `train()`, which
keeps the next step in flight. Per-replica batch is the same
everywhere, so 2 workers do twice the work per step; on a 2-core machine they
share the cores, so compare the exchange column, not raw step times.
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

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dsgd  # noqa: E402
from dsgd.examples import mnist  # noqa: E402


class MlpModel(dsgd.Model):
    """784-256-10 MLP on random data: ~0.8 MB of gradients."""

    def __init__(self, batch_size: int, seed: int = 0):
        import keras

        self.model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                                       keras.layers.Dense(10)])
        self.optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        rng = np.random.default_rng(seed)
        self.batch = (rng.normal(size=(batch_size, 784)).astype(np.float32),
                      rng.integers(0, 10, batch_size))
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def get_loss(self, batch):
        return self.loss_fn(batch[1], self.model(batch[0], training=True))

    def get_optimizer(self):
        return self.optimizer

    def get_batch(self):
        return self.batch


def make(model_name: str, batch: int):
    if model_name == "mlp":
        return lambda w, d: MlpModel(batch, seed=w)
    return lambda w, d: mnist.MnistModel(w, 2, batch, 1e-3)


def plain_step(replica):
    """A plain compiled training step of one replica, in this process: returns
    a callable that runs one step (next batch included) and blocks until done."""
    import tensorflow as tf

    variables, optimizer = replica.get_variables(), replica.get_optimizer()

    @tf.function
    def step(batch):
        with tf.GradientTape() as tape:
            loss = replica.get_loss(batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    def run():
        batch = replica.get_batch()
        step(None if batch is None else tf.nest.map_structure(tf.convert_to_tensor, batch)).numpy()
    return run


def plain_step_s(model_name: str, batch: int, steps: int, warmup: int) -> list[float]:
    """Times of a plain compiled training step of one replica, in this process."""
    run = plain_step(make(model_name, batch)(0, 0))
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        run()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def dsgd_step_s(model_name, batch, workers, strategy, steps, warmup, rounds=6):
    """Per-step stats of `sgd.step(fetch_stats=True)`, then, interleaved in
    `rounds` rounds, steps of one at a time (`step()`) and of `train()` (which
    submits each next step before the last one's result is back): the median
    over rounds of each's mean step time."""
    with dsgd.DistributedSGD(make(model_name, batch), workers, 1, gpu=False, strategy=strategy) as sgd:
        stats = [sgd.step(fetch_stats=True) for _ in range(warmup + steps)][warmup:]
        grad_bytes = sum(s.nbytes for s in sgd.plan.shards)
        per_round = max(1, steps // rounds)
        one_at_a_time, in_flight = [], []
        sgd.train(num_steps=per_round)
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(per_round):
                sgd.step()
            one_at_a_time.append((time.perf_counter() - start) / per_round)
            in_flight.append(sgd.train(num_steps=per_round)["train_s"] / per_round)
    return stats, grad_bytes, statistics.median(one_at_a_time), statistics.median(in_flight)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--models", nargs="+", default=["mlp", "mnist_cnn"])
    p.add_argument("--batch-size", type=int, default=32, help="per replica")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "step_time.json"))
    args = p.parse_args(argv)
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    for model_name in args.models:
        plain = statistics.median(plain_step_s(model_name, args.batch_size, args.steps, args.warmup))
        rows.append({"model": model_name, "config": "plain tf.function, 1 replica", "workers": 1,
                     "median_step_s": plain, "ratio_to_plain": 1.0})
        for workers, strategy in ((1, "ps"), (2, "simple"), (2, "ps")):
            stats, grad_bytes, one, ahead = dsgd_step_s(model_name, args.batch_size, workers,
                                                        strategy, args.steps, args.warmup)
            med = {k: statistics.median(s[k] for s in stats)
                   for k in ("step_s", "compute_s", "exchange_s", "apply_s")}
            rows.append({"model": model_name, "config": f"dsgd {strategy}", "workers": workers,
                         "grad_bytes": grad_bytes, "median_step_s": med["step_s"],
                         "median_compute_s": med["compute_s"], "median_exchange_s": med["exchange_s"],
                         "median_apply_s": med["apply_s"], "ratio_to_plain": med["step_s"] / plain,
                         "ab_step_one_at_a_time_s": one, "ab_train_step_in_flight_s": ahead,
                         "ab_gain": one / ahead, "train_ratio_to_plain": ahead / plain})
            print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "step_time", "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "batch_size_per_replica": args.batch_size, "steps": args.steps, "warmup": args.warmup,
              "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        print(f"{r['model']:10s} {r['config']:32s} workers={r['workers']}  "
              f"median step {1000 * r['median_step_s']:7.2f} ms  x{r['ratio_to_plain']:.2f} plain"
              + (f"  exchange {1000 * r['median_exchange_s']:.2f} ms  A/B step() "
                 f"{1000 * r['ab_step_one_at_a_time_s']:.2f} vs train() "
                 f"{1000 * r['ab_train_step_in_flight_s']:.2f} ms" if "median_exchange_s" in r else ""))
    return result


if __name__ == "__main__":
    main()
