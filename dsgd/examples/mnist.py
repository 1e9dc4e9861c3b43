"""Train the classic deep-MNIST CNN with dsgd on real MNIST digits, offline.

    python -m dsgd.examples.mnist [--num-workers 2] [--strategy ps] [--steps 300]
                                  [--input memory|files|ray-data] ...

Data: 5,000 real MNIST digits that ship with dsgd's examples (no download:
dsgd/examples/data/mnist_5k.npz); the last 100 of each class (1,000 images) are
held out as the test set. The other 4,000 are the training set, fed by `--input`:
  memory    (default) each replica's own shard, a tf.data pipeline in memory;
  files     written once as PNG files, read by a `dsgd.Dataset` of their paths
            (download_func decodes a file in parallel Ray tasks, the transform
            scales the pixels in the worker), `DistributedSGD.train(dataset=...)`;
  ray-data  the same files through Ray Data: `read_images` + `map_batches`.
Starts an embedded local Ray cluster unless `--address` names one. Ends by
printing one JSON line with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import dsgd
from dsgd import progress
from dsgd.examples import mnist_data
from dsgd.examples.cluster import start_ray

TEST_PER_CLASS = 100
# 5,000 MNIST digits, 500 per class (data/README.md: source and license).
MNIST_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "mnist_5k.npz")


def load_mnist():
    """(x_train, y_train, x_test, y_test): float32 images in [0, 1], shape (n, 28, 28, 1)."""
    with np.load(MNIST_FILE) as data:
        x = (data["images"].astype(np.float32) / 255.0).reshape(-1, 28, 28, 1)
        y = data["labels"].astype(np.int64)
    test = np.zeros(len(y), bool)
    for digit in range(10):
        test[np.flatnonzero(y == digit)[-TEST_PER_CLASS:]] = True
    return x[~test], y[~test], x[test], y[test]


def build_cnn():
    import keras

    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 5, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(64, 5, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(10),
    ])


class MnistModel(dsgd.KerasModel):
    """One replica: the CNN, Adam, and this replica's shard of the training set."""

    def __init__(self, replica: int, num_replicas: int, batch_size: int, lr: float, seed: int = 0,
                 own_data: bool = True):
        import keras
        import tensorflow as tf

        x_train, y_train, self.x_test, self.y_test = load_mnist()
        data = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shard(num_replicas, replica)
                .shuffle(4096, seed=seed + replica, reshuffle_each_iteration=True)
                .batch(batch_size, drop_remainder=True)) if own_data else None
        super().__init__(build_cnn(), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         keras.optimizers.Adam(lr), data)

    def get_loss(self, batch):
        if isinstance(batch, dict):  # Ray Data's columns
            batch = (batch["image"], batch["label"])
        return super().get_loss(batch)

    def get_metrics(self) -> dict[str, float]:
        logits = self.model.predict(self.x_test, batch_size=500, verbose=0)
        return {"test_accuracy": float(np.mean(np.argmax(logits, axis=1) == self.y_test))}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--devices-per-worker", type=int, default=1)
    p.add_argument("--strategy", choices=["simple", "ps"], default="ps")
    p.add_argument("--compression", choices=["fp16", "bf16"], default=None,
                   help="gradients travel as 16-bit values (strategy ps, 2+ workers)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=50, help="per replica")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=100, help="steps; 0 evaluates only at the end")
    p.add_argument("--input", choices=["memory", "files", "ray-data"], default="memory",
                   help="where training batches come from (see above)")
    p.add_argument("--data-dir", default=None,
                   help=f"PNG files of --input files/ray-data (default {mnist_data.default_directory()})")
    p.add_argument("--max-concurrency", type=int, default=4, help="parallel decodes (--input files)")
    devices = p.add_mutually_exclusive_group()
    devices.add_argument("--gpu", dest="gpu", action="store_const", const=True, default=None,
                         help="one GPU per device (default: GPUs if the cluster has them)")
    devices.add_argument("--cpu", dest="gpu", action="store_const", const=False,
                         help="CPU devices even where the cluster has GPUs")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--min-accuracy", type=float, default=None,
                   help="exit with status 1 if the final test accuracy is lower")
    return p.parse_args(argv)


def evaluate(sgd) -> float:
    """Test accuracy of every replica; they hold identical weights, so they must agree."""
    accuracies = [m["test_accuracy"] for m in sgd.foreach_model(lambda model: model.get_metrics())]
    if len(set(accuracies)) != 1:
        raise AssertionError(f"replicas disagree on test accuracy: {accuracies}")
    return accuracies[0]


def make_dataset(args, batch_size_per_worker: int) -> dsgd.Dataset:
    """--input files / ray-data: the training images as PNG files (written once)."""
    x_train, y_train, _, _ = load_mnist()
    directory = args.data_dir or mnist_data.default_directory()
    paths = mnist_data.write_png_files(x_train, y_train, directory)
    if args.input == "files":
        return mnist_data.files_dataset(paths, batch_size_per_worker, args.max_concurrency)
    return mnist_data.ray_data_dataset(directory, batch_size_per_worker)


def run_steps(sgd, num_steps: int, dataset, bar) -> tuple[float, float]:
    """`num_steps` steps from the replicas' own data (dataset None) or from
    `dataset`. Returns (loss of the last step or, from a dataset, the mean
    loss of these steps; seconds spent in steps)."""
    if dataset is not None:
        summary = sgd.train(dataset=dataset, num_steps=num_steps)
        bar.update(num_steps)
        return summary["loss"], summary["train_s"]
    seconds, loss = 0.0, float("nan")
    for _ in range(num_steps):
        stats = sgd.step(fetch_stats=True)
        seconds, loss = seconds + stats["step_s"], stats["loss"]
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.update()
    return loss, seconds


def main(argv=None) -> dict:
    args = parse_args(argv)
    wall_start = time.perf_counter()
    extra = 0 if args.input == "memory" else 2  # Ray Data's tasks need CPUs beside the workers'
    start_ray(args.address, max(os.cpu_count() or 1, args.num_workers) + extra)
    num_replicas = args.num_workers * args.devices_per_worker
    devices, batch, lr = args.devices_per_worker, args.batch_size, args.lr
    own_data = args.input == "memory"
    dataset = None if own_data else make_dataset(args, batch * devices)

    def creator(worker_index, device_index):
        return MnistModel(worker_index * devices + device_index, num_replicas, batch, lr,
                          own_data=own_data)

    with dsgd.DistributedSGD(creator, args.num_workers, args.devices_per_worker, gpu=args.gpu,
                             strategy=args.strategy, compression=args.compression) as sgd:
        train_s, loss, first_loss, step = 0.0, float("nan"), None, 0
        evaluations = [s for s in range(args.eval_every, args.steps, args.eval_every)] \
            if args.eval_every else []
        # From a dataset, each DistributedSGD.train call draws its own progress bar.
        with progress.bar(args.steps, "training", disable=True if dataset else None) as bar:
            for until in [1] + evaluations + [args.steps]:
                if until <= step:
                    continue
                loss, seconds = run_steps(sgd, until - step, dataset, bar)
                train_s, step = train_s + seconds, until
                first_loss = loss if first_loss is None else first_loss
                if until in evaluations:
                    progress.write(f"step {step}: loss {loss:.4f}, test accuracy "
                                   f"{evaluate(sgd):.4f} (all {num_replicas} replicas agree)")
        accuracy = evaluate(sgd)
    result = {
        "test_accuracy": accuracy, "first_loss": first_loss, "final_loss": loss, "steps": args.steps,
        "num_workers": args.num_workers, "devices_per_worker": args.devices_per_worker,
        "strategy": args.strategy, "input": args.input, "batch_size_per_replica": batch,
        "global_batch_size": batch * num_replicas,
        "images_per_s": args.steps * batch * num_replicas / train_s,
        "train_s": train_s, "wall_s": time.perf_counter() - wall_start,
    }
    print(json.dumps(result), flush=True)
    if args.min_accuracy is not None and accuracy < args.min_accuracy:
        raise SystemExit(f"test accuracy {accuracy:.4f} is below --min-accuracy {args.min_accuracy}")
    return result


if __name__ == "__main__":
    main()
