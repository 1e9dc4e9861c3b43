"""A model whose weights count how often each item was trained on, for the
data tests (pickled by value to the workers, like tiny.py)."""

import numpy as np

import dsgd

N = 48  # items; 2 workers x batch_size 4 -> 8 rows a step, 6 steps an epoch


class Counter(dsgd.Model):
    """Replica loss = sum over its rows of v . x. With one-hot rows the gradient
    is the count of every item in the replica's batch; dsgd applies the mean
    over R replicas, so after SGD with lr 1 from v = 0, -R * v counts how often
    each item was trained on."""

    def __init__(self, worker_index=0, device_index=0):
        import keras
        import tensorflow as tf

        self.v = tf.Variable(tf.zeros([N]))
        self.optimizer = keras.optimizers.SGD(1.0)

    def get_variables(self):
        return [self.v]

    def get_loss(self, batch):
        import tensorflow as tf

        x = batch["x"] if isinstance(batch, dict) else batch
        return tf.reduce_sum(tf.cast(x, tf.float32) * self.v)

    def get_optimizer(self):
        return self.optimizer


def one_hot(i):
    return np.eye(N, dtype=np.float32)[i]


def counts(sgd):
    replicas = sgd.num_workers * sgd.devices_per_worker
    return np.round(-replicas * sgd.get_weights()[0]).astype(int)


def reset(sgd):
    sgd.set_weights([np.zeros(N, np.float32)])
