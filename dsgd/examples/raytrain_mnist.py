"""The MNIST CNN trained by your own loop in Ray Train, with dsgd as the
backend: Keras `model.fit` with `dsgd.train.DistributedOptimizer`, the training
data a Ray Data dataset sharded by Ray Train (`get_dataset_shard`), one
`ray.train.report` (with a checkpoint from rank 0) per epoch. After a restart
(`--max-failures`) the loop resumes from Ray Train's latest checkpoint: the
weights, Adam's state and the next epoch.

    python -m dsgd.examples.raytrain_mnist [--num-workers 2] [--epochs 3]
        [--storage-path DIR --name RUN]   # RUN's latest checkpoint in DIR: go on from it

Prints one JSON line: the per-epoch metrics Ray Train kept, the final test
accuracy and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from dsgd.examples import mnist
from dsgd.examples.cluster import start_ray


def train_loop(config):
    """Runs in every Ray Train worker."""
    import keras
    import ray.train

    import dsgd.train as dt

    context = ray.train.get_context()
    model = mnist.build_cnn()
    # jit_compile=False: the exchange is a tf.numpy_function, which XLA cannot
    # compile (Keras turns XLA on by itself where a GPU is present).
    model.compile(optimizer=dt.DistributedOptimizer(keras.optimizers.Adam(config["lr"])),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    model.optimizer.build(model.trainable_variables)  # Adam's moments exist from here
    state = model.variables + model.optimizer.variables  # what a checkpoint holds
    start = 0
    checkpoint = ray.train.get_checkpoint()  # after a restart: the latest one reported
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            saved = np.load(os.path.join(directory, "state.npz"))
            for k, variable in enumerate(state):
                variable.assign(saved[f"v{k}"])
            start = int(saved["epoch"])  # epochs done
    dt.broadcast_variables(state, root_rank=0)  # everyone starts from rank 0's
    _, _, x_test, y_test = mnist.load_mnist()
    shard = ray.train.get_dataset_shard("train")  # equal shares: workers step together
    for epoch in range(start, config["epochs"]):
        # This worker's share of the epoch as numpy batches (Ray Data's to_tf is a
        # from_generator pipeline that holds the GIL; the share is small).
        batches = list(shard.iter_batches(batch_size=config["batch_size"], batch_format="numpy",
                                          drop_last=True))
        x = np.concatenate([b["image"] for b in batches])
        y = np.concatenate([b["label"] for b in batches])
        history = model.fit(x, y, batch_size=config["batch_size"], epochs=1, shuffle=False,
                            verbose=0)
        _, test_accuracy = model.evaluate(x_test, y_test, batch_size=500, verbose=0)
        metrics = {"epoch": epoch + 1, "loss": float(history.history["loss"][-1]),
                   "test_accuracy": float(test_accuracy), "samples": int(len(x)),
                   "world_size": context.get_world_size(), "resumed_at_epoch": start}
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = None
            if context.get_world_rank() == 0:  # every rank holds the same state
                np.savez(os.path.join(directory, "state.npz"), epoch=epoch + 1,
                         **{f"v{k}": variable.numpy() for k, variable in enumerate(state)})
                checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report(metrics, checkpoint=checkpoint)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=50, help="per worker")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--storage-path", default=None, help="Ray Train's storage (default: temp dir)")
    p.add_argument("--name", default=None,
                   help="Ray Train's run name (default: raytrain_mnist-<time>); an earlier run's, "
                        "with its --storage-path, continues that run from its latest checkpoint")
    p.add_argument("--max-failures", type=int, default=1,
                   help="restarts Ray Train may make, each from the latest checkpoint")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    import dsgd.train as dt

    start = time.perf_counter()
    # Ray Data's read tasks need a CPU beside the workers'.
    start_ray(args.address, max(os.cpu_count() or 1, args.num_workers) + 1)
    x_train, y_train, _, _ = mnist.load_mnist()
    rng = np.random.default_rng(0)  # the digits come sorted by label
    order = rng.permutation(len(x_train))
    train = ray.data.from_items([{"image": x_train[i], "label": y_train[i]} for i in order],
                                override_num_blocks=8)
    storage = args.storage_path or tempfile.mkdtemp(prefix="dsgd-raytrain-")
    # Ray Train hands a run the checkpoints already stored under its name: a new name
    # for a new run.
    name = args.name or f"raytrain_mnist-{time.strftime('%Y%m%d-%H%M%S')}"
    config = {"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr}
    result = dt.DsgdTrainer(train_loop, train_loop_config=config,
                            scaling_config=ScalingConfig(num_workers=args.num_workers),
                            run_config=RunConfig(storage_path=storage, name=name,
                                                 failure_config=FailureConfig(
                                                     max_failures=args.max_failures)),
                            datasets={"train": train}).fit()
    if result.error is not None:
        raise SystemExit(f"raytrain_mnist: fit failed: {result.error}")
    epochs = [metrics for _, metrics in result.best_checkpoints]
    out = {"epochs": epochs, "test_accuracy": result.metrics.get("test_accuracy"),
           "checkpoint": result.checkpoint.path, "num_workers": args.num_workers,
           "wall_s": time.perf_counter() - start}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
