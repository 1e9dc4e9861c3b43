"""Local allreduce: the mean of one worker's per-replica gradients.

Runs inside the worker's compiled step. Every algorithm returns, for each
replica, the list of averaged gradients that replica applies:

- "simple": reduce to the first device with one `add_n` per variable, then every
  replica reads that result (TensorFlow copies it to the replica's device).
- "tree":   pairwise sums, each on the lower-numbered device of the pair, in
  log2(D) rounds; the mean ends on the first device. Fewer bytes land on one
  device at a time than with "simple" when D is large.
- "nccl":   TensorFlow's NCCL all-sum (GPUs only); every replica gets the mean
  on its own device.
"""

from __future__ import annotations

from typing import Sequence

from dsgd.constants import ALL_REDUCE_ALGS


def mean_across_devices(grads: Sequence[Sequence], devices: Sequence[str], algorithm: str):
    """grads[i][v]: gradient of variable v on replica i. Returns means[i][v]."""
    import tensorflow as tf

    num = len(grads)
    if num == 1:
        return [list(grads[0])]
    num_vars = len(grads[0])
    if algorithm == "nccl":
        from tensorflow.python.ops import nccl_ops

        per_var = [nccl_ops.all_sum([grads[i][v] for i in range(num)]) for v in range(num_vars)]
        means = []
        for i in range(num):
            with tf.device(devices[i]):
                means.append([per_var[v][i] / num for v in range(num_vars)])
        return means
    if algorithm == "simple":
        with tf.device(devices[0]):
            mean = [tf.add_n([grads[i][v] for i in range(num)]) / num for v in range(num_vars)]
        return [mean] * num
    if algorithm == "tree":
        partial = [list(g) for g in grads]
        stride = 1
        while stride < num:
            for i in range(0, num - stride, 2 * stride):
                with tf.device(devices[i]):
                    partial[i] = [a + b for a, b in zip(partial[i], partial[i + stride])]
            stride *= 2
        with tf.device(devices[0]):
            mean = [g / num for g in partial[0]]
        return [mean] * num
    raise ValueError(f"all_reduce_alg must be one of {list(ALL_REDUCE_ALGS)}, got {algorithm!r}")
