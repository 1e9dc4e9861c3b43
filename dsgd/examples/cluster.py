"""The Ray cluster the examples run on."""

from __future__ import annotations

import os


def start_ray(address: str | None, num_cpus: int) -> None:
    """Join the Ray cluster at `address`, or start an embedded local one with
    `num_cpus` CPUs (no dashboard, worker logs not echoed). Does nothing if Ray
    is already initialised in this process (e.g. by a test). Quietens
    TensorFlow's C++ logging first, for this process and the workers it starts."""
    import ray

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
