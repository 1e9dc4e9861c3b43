"""The parameter-server actor: sums one shard from every worker, returns the mean.

Stateless: it holds no model state, so any PS can serve any shard and a dead
one can simply be replaced. The driver wraps `ParameterServer` with `ray.remote`.
"""

from __future__ import annotations

import numpy as np

from dsgd import _core
from dsgd.sharding import Shard


class ParameterServer:
    def __init__(self, ps_index: int):
        self.ps_index = ps_index
        # Scratch output buffers, reused step after step so that summing never
        # touches fresh pages (first touch costs more than the sum on a VM).
        # Ray copies the returned array into the store before the next call.
        self._scratch: dict = {}

    def ready(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id()}

    def ping(self) -> dict:
        """Liveness; runs after every call queued before it."""
        import os

        return {"pid": os.getpid()}

    def mean(self, shard: Shard, *worker_pieces: tuple[np.ndarray, ...]) -> np.ndarray:
        """Mean of one shard over every worker. Each worker's shard arrives as the
        tuple of its pieces (read-only object-store views; read, never kept).
        Returns the shard's buffer laid out as `shard` says, padding zeroed."""
        key = (shard.dtype, shard.num_elements)
        if key not in self._scratch:
            self._scratch[key] = np.zeros(shard.num_elements, shard.dtype)
        return mean_shard(shard, worker_pieces, out=self._scratch[key])


def mean_shard(shard: Shard, worker_pieces, out: np.ndarray | None = None) -> np.ndarray:
    """Mean over workers of one shard given as each worker's tuple of pieces,
    written into `out` (a new array if None) in the shard's layout."""
    if out is None:
        out = np.empty(shard.num_elements, shard.dtype)
    scale = 1.0 / len(worker_pieces)
    cursor = 0
    for k, piece in enumerate(shard.pieces):
        out[cursor:piece.shard_offset] = 0
        end = piece.shard_offset + piece.length
        try:
            _core.sum_scaled([pieces[k] for pieces in worker_pieces], out[piece.shard_offset:end], scale)
        except (ValueError, TypeError, IndexError) as e:
            raise ValueError(f"piece {k} of the shard (variable {piece.var_index}): {e}") from e
        cursor = end
    return out
