"""A worker's devices: one per replica (dsgd/worker/replicas.py)."""

from __future__ import annotations

import os

from dsgd.errors import DsgdError, ResourceError


def configure_devices(num: int, gpu: bool) -> list[str]:
    """The TensorFlow device names of a worker's `num` replicas: its GPUs (each
    with memory growth on; ResourceError if it sees fewer), or the CPU split into
    `num` logical devices. Call before TensorFlow builds anything in the process."""
    import tensorflow as tf

    if gpu:
        gpus = tf.config.list_physical_devices("GPU")
        if len(gpus) < num:
            raise ResourceError(f"devices_per_worker={num} with gpu=True, but this worker sees "
                                f"{len(gpus)} GPU(s) (CUDA_VISIBLE_DEVICES="
                                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        for g in gpus:
            try:
                tf.config.experimental.set_memory_growth(g, True)
            except RuntimeError:
                pass  # already initialised; growth then stays as it was
        return [f"/device:GPU:{i}" for i in range(num)]
    if num > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num)])
        except RuntimeError as e:
            have = len(tf.config.list_logical_devices("CPU"))
            if have < num:
                raise DsgdError(f"cannot split the CPU into {num} logical devices: TensorFlow "
                                f"was already initialised in this process with {have}") from e
    return [f"/device:CPU:{i}" for i in range(num)]
