"""A tiny deterministic model and its single-process reference, for exactness tests.

Replica r's batch at step t is a pure function of (r, t), so N workers x D
devices with batch b must match one model trained on the concatenation of the
N*D batches of every step, in global replica order (worker-major).
"""

from __future__ import annotations

import numpy as np

import dsgd

IN, HIDDEN, OUT = 5, 7, 3
# Gradient bytes per variable (float32): 140, 28, 84, 12.


def make_batch(replica: int, step: int, batch_size: int):
    rng = np.random.default_rng([replica, step])
    x = rng.normal(size=(batch_size, IN)).astype(np.float32)
    y = rng.normal(size=(batch_size, OUT)).astype(np.float32)
    return x, y


def make_optimizer(name: str):
    import keras

    if name == "sgdm":
        return keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    if name == "adam":
        return keras.optimizers.Adam(learning_rate=0.01)
    raise ValueError(name)


def make_keras_model(seed: int = 0):
    import keras

    init = lambda k: keras.initializers.GlorotUniform(seed=seed + k)  # noqa: E731
    return keras.Sequential([
        keras.Input((IN,)),
        keras.layers.Dense(HIDDEN, activation="tanh", kernel_initializer=init(0)),
        keras.layers.Dense(OUT, kernel_initializer=init(1)),
    ])


def mse(model, x, y):
    import tensorflow as tf

    return tf.reduce_mean(tf.square(model(x, training=True) - y))


class TinyModel(dsgd.Model):
    def __init__(self, worker_index, device_index, devices_per_worker, batch_size,
                 optimizer="sgdm", seed=None):
        self.replica = worker_index * devices_per_worker + device_index
        self.batch_size = batch_size
        # A different seed per replica proves the constructor broadcast works.
        self.model = make_keras_model(self.replica if seed is None else seed)
        self.optimizer = make_optimizer(optimizer)
        self.steps = 0

    def get_loss(self, batch):
        return mse(self.model, batch[0], batch[1])

    def get_optimizer(self):
        return self.optimizer

    def get_batch(self):
        batch = make_batch(self.replica, self.steps, self.batch_size)
        self.steps += 1
        return batch


def creator(devices_per_worker: int, batch_size: int, optimizer: str = "sgdm"):
    return lambda w, d: TinyModel(w, d, devices_per_worker, batch_size, optimizer)


def reference_run(initial_weights, num_replicas: int, batch_size: int, steps: int,
                  optimizer: str):
    """One model, trained in-process on the concatenated batches.
    Returns (weights after `steps`, mean replica loss at each step)."""
    import tensorflow as tf

    model = make_keras_model()
    model.set_weights(initial_weights)
    opt = make_optimizer(optimizer)
    losses = []
    for t in range(steps):
        batches = [make_batch(r, t, batch_size) for r in range(num_replicas)]
        losses.append(float(np.mean([mse(model, x, y).numpy() for x, y in batches])))
        x = np.concatenate([b[0] for b in batches])
        y = np.concatenate([b[1] for b in batches])
        with tf.GradientTape() as tape:
            loss = mse(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights(), losses
