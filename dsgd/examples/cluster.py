"""The Ray cluster the examples run on."""

from __future__ import annotations



def start_ray(address: str | None, num_cpus: int) -> None:
    """Join the Ray cluster at `address`, or start an embedded local one with
    `num_cpus` CPUs (no dashboard). Does nothing if Ray is already initialised
    in this process (e.g. by a test). Workers' output reaches this terminal:
    TensorFlow's start-up probing lines are dropped by dsgd (dsgd/tf_logging.py)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
