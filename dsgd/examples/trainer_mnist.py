"""The MNIST CNN with `dsgd.Trainer`: a TrainingOperator, epochs, validation
accuracy after each, TensorBoard scalars, save and load.

    python -m dsgd.examples.trainer_mnist [--num-workers 2] [--epochs 3] [--logdir DIR]

Data: the 5,000 offline MNIST digits of dsgd's examples (4,000 to train, 1,000 to
validate) as `dsgd.Dataset`s of (uint8 image, label) examples, shuffled, scaled
to float32 by a transform in the workers. After training, a second Trainer
loads the checkpoint and validates again: the same accuracy. Prints one JSON
line (`tensorboard --logdir DIR` shows the curves).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

import dsgd
from dsgd.examples import mnist
from dsgd.examples.cluster import start_ray


def scale(batch):
    """Worker-side transform: uint8 pixels -> float32 in [0, 1]."""
    pixels, labels = batch
    return pixels.astype(np.float32) / 255.0, labels


def digits(x: np.ndarray, y: np.ndarray) -> list:
    return list(zip(np.round(x * 255).astype(np.uint8), y))


class MnistOperator(dsgd.TrainingOperator):
    def setup(self, config):
        import keras

        self.register(models=mnist.build_cnn(),
                      optimizers=keras.optimizers.Adam(config.get("lr", 1e-3)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
        x_train, y_train, x_test, y_test = mnist.load_mnist()
        self.register_data(
            train_data=dsgd.Dataset(digits(x_train, y_train), transform=scale, shuffle=True),
            validation_data=dsgd.Dataset(digits(x_test, y_test), transform=scale,
                                         batch_size=250))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=100, help="global, split among replicas")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--use-fp16", choices=["no", "float16", "bfloat16"], default="no")
    p.add_argument("--logdir", default=None, help="TensorBoard directory (default: a new temp dir)")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    start_ray(args.address, max(os.cpu_count() or 1, args.num_workers))
    logdir = args.logdir or tempfile.mkdtemp(prefix="dsgd-trainer-mnist-")
    config = {dsgd.BATCH_SIZE: args.batch_size, "lr": args.lr}
    use_fp16 = {"no": False}.get(args.use_fp16, args.use_fp16)
    epochs = []
    with dsgd.Trainer(MnistOperator, num_workers=args.num_workers, config=config,
                      use_fp16=use_fp16, logdir=logdir) as trainer:
        for _ in range(args.epochs):
            train = trainer.train()
            val = trainer.validate()
            epochs.append({"epoch": train["epoch"], "train_loss": train["train_loss"],
                           "val_loss": val["val_loss"], "val_accuracy": val["val_accuracy"]})
            print(f"epoch {train['epoch']}: train_loss {train['train_loss']:.4f}, val_loss "
                  f"{val['val_loss']:.4f}, val_accuracy {val['val_accuracy']:.4f} "
                  f"({val['num_samples']} examples)", flush=True)
        path = trainer.save(os.path.join(logdir, "checkpoint"))
        model = trainer.get_model()
    _, _, x_test, y_test = mnist.load_mnist()
    driver_accuracy = float(np.mean(np.argmax(model.predict(x_test, verbose=0), axis=1) == y_test))
    with dsgd.Trainer(MnistOperator, num_workers=args.num_workers, config=config,
                      use_fp16=use_fp16) as restored:
        restored.load(path)
        reloaded = restored.validate()
    result = {"epochs": epochs, "val_accuracy": epochs[-1]["val_accuracy"],
              "get_model_accuracy": driver_accuracy,
              "reloaded_val_accuracy": reloaded["val_accuracy"], "num_workers": args.num_workers,
              "use_fp16": args.use_fp16, "logdir": logdir, "checkpoint": path,
              "wall_s": time.perf_counter() - start}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
