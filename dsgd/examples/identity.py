"""The raysgd_dataset seed's complete example, with dsgd: a network with one
hidden layer learns the identity function on [0, 1).

    python -m dsgd.examples.identity [--num-workers 2] [--epochs 10]

Its data is a `dsgd.Dataset` of 6,400 points whose `download_func` turns each
point into an (input, label) pair, in parallel Ray tasks. As in the seed it
trains with the dataset (`sgd.train(dataset=dataset, num_steps=100)`), with
the model's own data (`sgd.train()`: one epoch of `get_batch`), and with a
second dataset (`sgd.train(dataset=dataset2, num_steps=20)`), printing f(0.5)
after each epoch; then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import dsgd
from dsgd.examples.cluster import start_ray

NUM_POINTS = 32 * 100 * 2


def to_mat(x: float) -> np.ndarray:
    return np.array([x], np.float32)


class Net(dsgd.Model):
    """1 -> 128 (ReLU) -> 1; its own data (`get_batch`) is uniform random points."""

    OWN_STEPS_PER_EPOCH = 50

    def __init__(self, worker_index: int, device_index: int, lr: float, batch_size: int):
        import keras

        self.model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(128, activation="relu"),
                                       keras.layers.Dense(1)])
        self.optimizer = keras.optimizers.Adam(lr)
        self.rng = np.random.default_rng([worker_index, device_index])
        self.batch_size = batch_size

    def get_loss(self, batch):
        import tensorflow as tf

        x, y = batch
        return tf.reduce_mean(tf.square(self.model(x, training=True) - y))

    def get_optimizer(self):
        return self.optimizer

    def get_batch(self):
        x = self.rng.random((self.batch_size, 1)).astype(np.float32)
        return x, x

    def steps_per_epoch(self) -> int:
        return self.OWN_STEPS_PER_EPOCH


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--steps", type=int, default=100, help="dataset steps per epoch")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--max-concurrency", type=int, default=4, help="parallel downloads")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    return p.parse_args(argv)


def f(sgd, x: float) -> float:
    """The trained network at x (worker 0 / replica 0; every replica agrees)."""
    return sgd.for_model(lambda m: float(m.model(to_mat(x)[None])[0][0]))


def main(argv=None) -> dict:
    args = parse_args(argv)
    start_ray(args.address, max(os.cpu_count() or 1, args.num_workers + 1))
    data = [i * (1 / NUM_POINTS) for i in range(NUM_POINTS)]
    dataset = dsgd.Dataset(data, download_func=lambda x: (to_mat(x), to_mat(x)),
                           max_concurrency=args.max_concurrency, batch_size=args.batch_size)
    lr, batch = args.lr, args.batch_size

    with dsgd.DistributedSGD(lambda w, d: Net(w, d, lr, batch), args.num_workers, 1,
                             gpu=False) as sgd:
        history = []
        for epoch in range(args.epochs):
            summary = sgd.train(dataset=dataset, num_steps=args.steps)
            history.append(f(sgd, 0.5))
            print(f"epoch {epoch + 1}: loss {summary['loss']:.5f}, f(0.5)={history[-1]:.4f}",
                  flush=True)
        own = sgd.train()  # the model's own data: one epoch of get_batch
        # A second dataset: points in [0.25, 0.75), already pairs (no download_func).
        dataset2 = dsgd.Dataset([(to_mat(x), to_mat(x)) for x in np.linspace(0.25, 0.75, 640)],
                                batch_size=args.batch_size)
        second = sgd.train(dataset=dataset2, num_steps=20)
        result = {"f(0.5)": f(sgd, 0.5), "f(0.25)": f(sgd, 0.25), "f(0.9)": f(sgd, 0.9),
                  "f(0.5) per epoch": history, "dataset_loss": summary["loss"],
                  "own_data_steps": own["steps"], "own_data_loss": own["loss"],
                  "dataset2_steps": second["steps"], "dataset2_loss": second["loss"],
                  "dataset_rows_trained": dataset.position, "steps": sgd.steps_done}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
