"""Zero-copy numpy views of TensorFlow tensors (DLPack) and buffer addresses.

Used by the worker to hand gradient memory to Ray's serialiser without a copy,
and to pass object-store buffers to the read op by address.
"""

from __future__ import annotations

import numpy as np


class _DLPackCapsule:
    """Hands numpy a TensorFlow DLPack capsule (numpy asks for an object)."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, stream=None, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def tensor_view(tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory, without copying. The view keeps the
    tensor's buffer alive; do not write to it. Dtypes numpy cannot take over
    DLPack (e.g. bfloat16) are copied with `.numpy()` instead."""
    import tensorflow as tf

    try:
        return np.from_dlpack(_DLPackCapsule(tf.experimental.dlpack.to_dlpack(tensor)))
    except (TypeError, BufferError, RuntimeError, tf.errors.InvalidArgumentError):
        return tensor.numpy()


def buffer_address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]
