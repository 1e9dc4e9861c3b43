"""The mean over workers of a group of gradient shards, with the native kernel.

One implementation for every place that averages: the PS actor, the driver
under strategy "simple", a worker whose PS died mid-step, and the Ray Train
exchange. 16-bit (compressed) shards are summed in float32 and the mean
rounded back once.
"""

from __future__ import annotations

import numpy as np

from dsgd.comm.sharding import Shard
from dsgd.native import _core

_HALF_FORMATS = {"float16": "f16", "bfloat16": "bf16"}


def group_means(shards, worker_groups, scale: float | None = None) -> tuple:
    """The mean over workers of each shard of a group, as new arrays: what a PS
    sums (`ParameterServer.reduce`), computed where no PS is (strategy "simple",
    a fallen PS). `worker_groups`: every worker's tuple of the group's pieces
    (those of `shards[0]`, then those of `shards[1]`, ...).
    `scale` replaces the mean's 1/workers (1.0: the sum)."""
    return tuple(mean_shard(s, p, scale=scale)
                 for s, p in zip(shards, split_group(shards, worker_groups)))


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


def mean_shard(shard: Shard, worker_pieces, out: np.ndarray | None = None,
               scale: float | None = None) -> np.ndarray:
    """Mean over workers of one shard given as each worker's tuple of pieces,
    written into `out` (a new array if None) in the shard's layout. 16-bit
    shards (float16, bfloat16 as uint16 bits: compressed gradients) are summed
    in float32 and the mean rounded back to 16 bits. `scale` replaces the
    mean's 1/workers (1.0: the sum, exact for two workers)."""
    if out is None:
        out = np.empty(shard.num_elements, shard.wire_numpy_dtype)
    if scale is None:
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
