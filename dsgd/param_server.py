"""The parameter-server actor: sums one shard from every worker, returns the mean.

Stateless: it holds no model state, so any PS can serve any shard and a dead
one can simply be replaced. The driver wraps `ParameterServer` with `ray.remote`.
"""

from __future__ import annotations

import numpy as np

from dsgd import _core, store
from dsgd.sharding import Shard


class ParameterServer:
    def __init__(self, ps_index: int, warm_store_bytes: int = 0):
        self.ps_index = ps_index
        self.warmed_store_bytes = store.warm(warm_store_bytes)
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

    def mean(self, shards: tuple[Shard, ...], *worker_groups: tuple[np.ndarray, ...]) -> tuple:
        """Mean over every worker of a group of shards. Each worker's group arrives
        as one tuple: the pieces of `shards[0]`, then those of `shards[1]`, ...
        (read-only object-store views; read, never kept). Returns a tuple with
        one buffer per shard, laid out as the shard says, padding zeroed; Ray
        writes the tuple into one object."""
        out = []
        for k, shard in enumerate(shards):
            key = (k, shard.dtype, shard.num_elements)
            if key not in self._scratch:
                self._scratch[key] = np.zeros(shard.num_elements, shard.wire_numpy_dtype)
            out.append(self._scratch[key])
        for k, (shard, pieces) in enumerate(zip(shards, split_group(shards, worker_groups))):
            try:
                mean_shard(shard, pieces, out=out[k])
            except ValueError as e:
                raise ValueError(f"PS {self.ps_index}, shard {k} of its group: {e}") from e
        return tuple(out)


_HALF_FORMATS = {"float16": "f16", "bfloat16": "bf16"}


def group_means(shards, worker_groups) -> tuple:
    """The mean over workers of each shard of a group, as new arrays: what a PS's
    `mean` returns, computed where no PS is (strategy "simple", a fallen PS,
    the Ray Train exchange). `worker_groups` as `ParameterServer.mean` takes them."""
    return tuple(mean_shard(s, p) for s, p in zip(shards, split_group(shards, worker_groups)))


def split_group(shards, worker_groups) -> list[list[tuple]]:
    """For each shard of a group, every worker's tuple of its pieces."""
    counts = [len(s.pieces) for s in shards]
    for w, group in enumerate(worker_groups):
        if len(group) != sum(counts):
            raise ValueError(f"worker {w} sent {len(group)} pieces for a group of "
                             f"{len(shards)} shards with {sum(counts)} pieces")
    per_shard, start = [], 0
    for n in counts:
        per_shard.append([tuple(g[start:start + n]) for g in worker_groups])
        start += n
    return per_shard


def mean_shard(shard: Shard, worker_pieces, out: np.ndarray | None = None) -> np.ndarray:
    """Mean over workers of one shard given as each worker's tuple of pieces,
    written into `out` (a new array if None) in the shard's layout. 16-bit
    shards (float16, bfloat16 as uint16 bits: compressed gradients) are summed
    in float32 and the mean rounded back to 16 bits."""
    if out is None:
        out = np.empty(shard.num_elements, shard.wire_numpy_dtype)
    scale = 1.0 / len(worker_pieces)
    half = _HALF_FORMATS.get(shard.dtype)
    cursor = 0
    for k, piece in enumerate(shard.pieces):
        out[cursor:piece.shard_offset] = 0
        end = piece.shard_offset + piece.length
        try:
            inputs = [pieces[k] for pieces in worker_pieces]
            if half is None:
                _core.sum_scaled(inputs, out[piece.shard_offset:end], scale)
            else:
                _core.sum_scaled_16(inputs, out[piece.shard_offset:end], scale, half)
        except (ValueError, TypeError, IndexError) as e:
            raise ValueError(f"piece {k} of the shard (variable {piece.var_index}): {e}") from e
        cursor = end
    return out
