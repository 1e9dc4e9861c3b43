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
    if name == "adam_schedule":  # the rate and Adam's bias correction read iterations
        return keras.optimizers.Adam(learning_rate=keras.optimizers.schedules.ExponentialDecay(
            0.03, decay_steps=1, decay_rate=0.6))
    if name == "adamw_schedule":
        return keras.optimizers.AdamW(learning_rate=keras.optimizers.schedules.PiecewiseConstantDecay(
            [1, 2], [0.03, 0.01, 0.004]), weight_decay=0.1)
    if name == "adam_global_clipnorm":
        return keras.optimizers.Adam(learning_rate=0.01, global_clipnorm=0.05)
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


class TwoOptimizerModel(TinyModel):
    """The first layer trained by SGD with momentum, the second by Adam with a
    schedule (get_variable_groups); both minimise the same loss."""

    def __init__(self, worker_index, device_index, devices_per_worker, batch_size):
        super().__init__(worker_index, device_index, devices_per_worker, batch_size,
                         "adam_schedule")
        self.optimizers = [make_optimizer("sgdm"), self.optimizer]

    def get_loss(self, batch):
        loss = mse(self.model, batch[0], batch[1])
        return [loss, loss]

    def get_optimizer(self):
        return self.optimizers

    def get_variable_groups(self):
        return [self.model.layers[0].trainable_variables, self.model.layers[1].trainable_variables]


class StepKeyedModel(TinyModel):
    """Batches keyed by the optimizer's iteration count, which travels with the
    optimizer state: a replacement worker continues the data stream exactly."""

    def get_batch(self):
        return make_batch(self.replica, int(self.optimizer.iterations.numpy()), self.batch_size)


class KillAt(StepKeyedModel):
    """Replica `kill_replica` SIGKILLs `target_pid_file`'s process (or its own
    process if None) when it reads its batch for step `kill_step` (0-based),
    once: `marker` records that it happened, so the replacement carries on.
    `delay_s`: seconds it waits before the kill, so that the reply of the call
    it finished just before (Ray sends it from another thread) reaches the driver
    first; without it the kill can race that reply and the driver loses that
    call as well."""

    def __init__(self, worker_index, device_index, devices_per_worker, batch_size, kill_step,
                 kill_replica, marker, target_pid_file=None, delay_s=0.0):
        super().__init__(worker_index, device_index, devices_per_worker, batch_size)
        self.kill_step, self.kill_replica = kill_step, kill_replica
        self.marker, self.target_pid_file = marker, target_pid_file
        self.delay_s = delay_s

    def get_batch(self):
        import os
        import signal
        import time

        if (self.replica == self.kill_replica and not os.path.exists(self.marker)
                and int(self.optimizer.iterations.numpy()) == self.kill_step):
            with open(self.marker, "w") as f:
                f.write("killed")
            time.sleep(self.delay_s)
            pid = os.getpid()
            if self.target_pid_file:
                with open(self.target_pid_file) as f:
                    pid = int(f.read())
            os.kill(pid, signal.SIGKILL)
        return super().get_batch()


class SlowReplacement(KillAt):
    """KillAt, and the replacement's first batch (read once `marker` exists) comes
    `slow_s` late: a replacement whose first step, tracing its compiled step
    alone, takes longer than step_timeout_s."""

    def __init__(self, *args, slow_s=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.slow_s, self._first = slow_s, True

    def get_batch(self):
        import os
        import time

        if self._first:
            self._first = False
            if os.path.exists(self.marker):
                time.sleep(self.slow_s)
        return super().get_batch()


class KillDuringApply(StepKeyedModel):
    """Replica `kill_replica`'s optimizer SIGKILLs its own process inside the
    compiled apply of step `kill_step` (0-based), once (`marker`)."""

    def __init__(self, worker_index, device_index, devices_per_worker, batch_size, kill_step,
                 kill_replica, marker):
        super().__init__(worker_index, device_index, devices_per_worker, batch_size)
        import keras
        import tensorflow as tf

        replica = self.replica

        def maybe_kill(iteration):
            import os
            import signal

            if replica == kill_replica and int(iteration) == kill_step and not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write("killed")
                os.kill(os.getpid(), signal.SIGKILL)
            return iteration

        class Killing(keras.optimizers.SGD):
            def update_step(self, gradient, variable, learning_rate):
                iteration = tf.py_function(maybe_kill, [self.iterations], self.iterations.dtype)
                with tf.control_dependencies([iteration]):
                    gradient = tf.identity(gradient)
                super().update_step(gradient, variable, learning_rate)

        self.optimizer = Killing(learning_rate=0.1, momentum=0.9)
