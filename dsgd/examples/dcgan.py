"""A small DCGAN on the offline MNIST digits with `dsgd.Trainer`: two models, two
optimizers, one custom `train_batch` computing both losses (the seed's
multi-model case); both models' gradients go through the same exchange. The
operator also writes its own epoch (`train_epoch`: the steps, averaged with
`dsgd.AverageMeterCollection`, then how real the generator's digits from a
fixed noise batch look to the discriminator) and its own validation
(`validate`: the discriminator's accuracy on held-out real digits against
generated ones), as the seed's GAN example does.

    python -m dsgd.examples.dcgan [--num-workers 2] [--epochs 15] [--out digits.png]

Saves a PNG grid of generated digits and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import dsgd
from dsgd.examples import mnist
from dsgd.examples.cluster import start_ray

LATENT = 32


def build_generator():
    import keras

    return keras.Sequential([
        keras.Input((LATENT,)),
        keras.layers.Dense(7 * 7 * 32, activation="relu"),
        keras.layers.Reshape((7, 7, 32)),
        keras.layers.Conv2DTranspose(32, 4, strides=2, padding="same", activation="relu"),
        keras.layers.Conv2DTranspose(1, 4, strides=2, padding="same", activation="tanh"),
    ])


def build_discriminator():
    import keras

    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 4, strides=2, padding="same"), keras.layers.LeakyReLU(0.2),
        keras.layers.Conv2D(64, 4, strides=2, padding="same"), keras.layers.LeakyReLU(0.2),
        keras.layers.Flatten(),
        keras.layers.Dense(1),
    ])


def to_unit_range(batch):
    """Worker-side transform: uint8 digits -> float32 in [-1, 1] (the generator's tanh)."""
    return batch.astype(np.float32) / 127.5 - 1.0


class GanOperator(dsgd.TrainingOperator):
    def setup(self, config):
        import keras

        (self.discriminator, self.generator), _ = self.register(
            models=(build_discriminator(), build_generator()),
            optimizers=(keras.optimizers.Adam(config.get("lr_d", 2e-4), beta_1=0.5),
                        keras.optimizers.Adam(config.get("lr_g", 1e-3), beta_1=0.5)))
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        x_train, _, x_test, _ = mnist.load_mnist()
        images = list(np.round(x_train * 255).astype(np.uint8))
        held_out = list(np.round(x_test * 255).astype(np.uint8))
        self.register_data(train_data=dsgd.Dataset(images, transform=to_unit_range, shuffle=True),
                           validation_data=dsgd.Dataset(held_out, transform=to_unit_range,
                                                        batch_size=100))
        self.fixed_noise = np.random.default_rng(1).normal(size=(64, LATENT)).astype(np.float32)

    def train_epoch(self, iterator, info):
        """Every step of all workers (train_step: train_batch's two losses, each
        model's gradient averaged over all replicas), then one number of the
        epoch's end: D's mean belief that G's digits from fixed noise are real."""
        import tensorflow as tf

        meters = dsgd.AverageMeterCollection()
        for batch in iterator:
            meters.update(self.train_step(batch))
        result = meters.summary()
        fake = self.generator(self.fixed_noise, training=False)
        result["d_fixed_fake"] = float(tf.reduce_mean(tf.sigmoid(
            self.discriminator(fake, training=False))))
        return result

    def validate(self, iterator, info):
        """The discriminator's accuracy on this worker's share of held-out real
        digits and as many generated ones (weighted by samples across workers)."""
        import tensorflow as tf

        correct = total = 0
        for k, real in enumerate(iterator):
            noise = tf.random.stateless_normal([len(real), LATENT], seed=[7, k])
            fake = self.generator(noise, training=False)
            correct += int(tf.reduce_sum(tf.cast(self.discriminator(real) > 0, tf.int32)))
            correct += int(tf.reduce_sum(tf.cast(self.discriminator(fake) <= 0, tf.int32)))
            total += 2 * len(real)
        return {"val_d_accuracy": correct / max(total, 1), "num_samples": total}

    def train_batch(self, batch, batch_info):
        import tensorflow as tf

        # Noise is a function of (replica, epoch, batch): every replica draws its own.
        seed = tf.stack([batch_info["epoch"] * 1000 + self.world_rank, batch_info["batch_idx"]])
        noise = tf.random.stateless_normal([tf.shape(batch)[0], LATENT], seed=seed)
        fake = self.generator(noise, training=True)
        real_logits = self.discriminator(batch, training=True)
        fake_logits = self.discriminator(fake, training=True)
        loss_d = (self.bce(tf.ones_like(real_logits), real_logits)
                  + self.bce(tf.zeros_like(fake_logits), fake_logits)) / 2
        loss_g = self.bce(tf.ones_like(fake_logits), fake_logits)
        # One loss per optimizer: loss_d is differentiated with respect to the
        # discriminator's variables only, loss_g to the generator's (no detach needed).
        return {"loss": (loss_d, loss_g), "loss_d": loss_d, "loss_g": loss_g,
                "d_real": tf.reduce_mean(tf.sigmoid(real_logits))}


def save_grid(images: np.ndarray, path: str) -> None:
    from PIL import Image

    rows = int(np.ceil(len(images) / 8))
    grid = np.ones((rows * 30, 8 * 30), np.uint8) * 255
    for k, image in enumerate(images):
        r, c = divmod(k, 8)
        grid[r * 30 + 1:r * 30 + 29, c * 30 + 1:c * 30 + 29] = \
            np.clip((image[..., 0] + 1) * 127.5, 0, 255).astype(np.uint8)
    Image.fromarray(grid, mode="L").resize((grid.shape[1] * 3, grid.shape[0] * 3)).save(path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64, help="global")
    p.add_argument("--out", default="dcgan_digits.png", help="PNG grid of generated digits")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    start_ray(args.address, max(os.cpu_count() or 1, args.num_workers))
    history = []
    with dsgd.Trainer(GanOperator, num_workers=args.num_workers,
                      config={dsgd.BATCH_SIZE: args.batch_size}) as trainer:
        for _ in range(args.epochs):
            result = trainer.train()
            validation = trainer.validate()
            history.append({k: result[k] for k in ("epoch", "loss_d", "loss_g", "d_real",
                                                   "d_fixed_fake")})
            history[-1]["val_d_accuracy"] = validation["val_d_accuracy"]
            print(f"epoch {result['epoch']}: loss_d {result['loss_d']:.3f}, loss_g "
                  f"{result['loss_g']:.3f}, D(real) {result['d_real']:.3f}, D(G(fixed)) "
                  f"{result['d_fixed_fake']:.3f}, D accuracy (held out) "
                  f"{validation['val_d_accuracy']:.3f}", flush=True)
        discriminator, generator = trainer.get_model()
    noise = np.random.default_rng(0).normal(size=(32, LATENT)).astype(np.float32)
    images = generator.predict(noise, verbose=0)
    save_grid(images, args.out)
    result = {"epochs": history, "png": os.path.abspath(args.out),
              "generated_mean": float(images.mean()), "generated_std": float(images.std()),
              "num_workers": args.num_workers, "wall_s": time.perf_counter() - start}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
