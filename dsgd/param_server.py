"""The parameter-server actor: sums one shard from every worker, returns the mean.

Stateless: it holds no model state, so any PS can serve any shard and a dead
one can simply be replaced. The driver wraps `ParameterServer` with `ray.remote`.
"""

from __future__ import annotations

import numpy as np

from dsgd import _core


class ParameterServer:
    def __init__(self, ps_index: int):
        self.ps_index = ps_index

    def ready(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id()}

    def mean(self, *shards: np.ndarray) -> np.ndarray:
        """Mean of the same shard from every worker (Ray passes the object-store
        arrays as read-only views; they are read, never kept). Returns a new array."""
        return mean_of(shards)


def mean_of(shards) -> np.ndarray:
    """(shards[0] + ... + shards[n-1]) * (1/n), summed left to right in the
    shards' dtype by the native kernel."""
    first = shards[0]
    for i, s in enumerate(shards):
        if s.dtype != first.dtype or s.shape != first.shape:
            raise ValueError(f"shard from worker {i} is {s.dtype}{s.shape}, worker 0's is "
                             f"{first.dtype}{first.shape}")
    out = np.empty_like(first)
    _core.sum_scaled(list(shards), out, 1.0 / len(shards))
    return out
