"""The worker side of the Ray Train backend: which PS actors to use, and the
mean over all workers of a list of gradients through them.

The backend installs the context in every Ray Train worker process
(`install`); `mean` then packs the gradients with the engine's shard plan and
layout (dsgd/comm/sharding.py: fusion, reverse layer order, alignment,
compression, one group of shards per PS), sends each PS its group as one
store object, and unpacks the means (dsgd/comm/param_server.py `reduce`).
Exchanges are numbered in call order, the same on every worker (SPMD): a PS
matches the workers' calls by number.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from dsgd.comm.sharding import exchange_layout, plan_shards, to_wire
from dsgd.comm.waits import actor_died_errors, dead_owners, get_all
from dsgd.errors import DsgdError

_CONTEXT: dict = {}
_LOCK = threading.Lock()


def install(ps_handles: list, ps_names: list[str], grad_shard_bytes: int, timeout_s: float,
            compression: str | None = None) -> None:
    """(run in every Ray Train worker by the backend) The PS actors of this run."""
    with _LOCK:
        _CONTEXT.clear()
        _CONTEXT.update(ps=list(ps_handles), names=list(ps_names), shard_bytes=grad_shard_bytes,
                        timeout_s=timeout_s, compression=compression,
                        sequence=itertools.count(), layouts={})


def context() -> dict:
    if not _CONTEXT:
        raise DsgdError("dsgd.train: no dsgd backend in this process; run the loop in a "
                        "dsgd.train.DsgdTrainer (or a DataParallelTrainer with "
                        "backend_config=dsgd.train.DsgdConfig())")
    return _CONTEXT


def world() -> tuple[int, int]:
    """(rank, size) of this worker in the Ray Train run."""
    import ray.train

    train_context = ray.train.get_context()
    return train_context.get_world_rank(), train_context.get_world_size()


def next_sequence() -> int:
    with _LOCK:
        return next(context()["sequence"])


def mean(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The mean over all workers of each array (same shapes and dtypes on every
    worker, same call order), as new arrays. Blocks, at most the backend's
    timeout; a dead PS raises DsgdError naming it."""
    import ray

    ctx = context()
    rank, size = world()
    seq = next_sequence()
    if size == 1:
        return [np.array(a) for a in arrays]
    shapes = tuple(tuple(a.shape) for a in arrays)
    dtypes = tuple(np.dtype(a.dtype).name for a in arrays)
    plan, owner, groups = _layout(ctx, shapes, dtypes)
    flat = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    refs, owners = [], []
    for group in groups:
        shards = tuple(plan.shards[j] for j in group)
        # One object per group (pickle 5 copies each piece once into its place in the
        # store buffer): Ray's fixed cost per object would dominate one per piece.
        pieces = ray.put(tuple(to_wire(flat[p.var_index][p.var_offset:p.var_offset + p.length],
                                       s.dtype)
                               for s in shards for p in s.pieces))
        ps = owner[group[0]]
        refs.append(ctx["ps"][ps].reduce.remote(seq, rank, size, shards, pieces))
        owners.append(ps)
    means = _get(ctx, refs, owners, f"exchange {seq}")
    out = [None] * plan.num_shards
    for group, group_mean in zip(groups, means):
        for j, array in zip(group, group_mean):
            out[j] = array
    return plan.unpack(out)


def broadcast(arrays: list[np.ndarray] | None, root_rank: int) -> list[np.ndarray]:
    """Rank `root_rank`'s arrays on every worker (through PS 0)."""
    ctx = context()
    rank, size = world()
    seq = next_sequence()
    if size == 1:
        return arrays
    ref = ctx["ps"][0].broadcast.remote(seq, rank, size, root_rank,
                                        arrays if rank == root_rank else None)
    return _get(ctx, [ref], [0], f"broadcast {seq}")[0]


def _layout(ctx: dict, shapes: tuple, dtypes: tuple):
    """(plan, PS of every shard, groups) for these gradients, made once."""
    key = (shapes, dtypes)
    if key not in ctx["layouts"]:
        plan = plan_shards(shapes, dtypes, ctx["shard_bytes"], compression=ctx["compression"])
        owner, groups = exchange_layout(plan, len(ctx["ps"]))
        ctx["layouts"][key] = (plan, owner, groups)
    return ctx["layouts"][key]


def _get(ctx: dict, refs: list, ps_indices: list[int], what: str) -> list:
    """The PS answers, waiting a little longer than the PS's own rendezvous
    timeout, so that its error naming the missing ranks comes first."""
    timeout_s = ctx["timeout_s"] + max(10.0, 0.1 * ctx["timeout_s"])
    try:
        return get_all(refs, ps_indices, f"dsgd.train {what}", timeout_s,
                       name_of=lambda j: ctx["names"][j])
    except actor_died_errors() as e:
        names = sorted(ctx["names"][j] for j in dead_owners(refs, ps_indices)) \
            or sorted({ctx["names"][j] for j in ps_indices})
        raise DsgdError(f"dsgd.train {what}: PS actor {', '.join(names)} died ({type(e).__name__}); "
                        "with FailureConfig(max_failures>=1) Ray Train restarts the run from its "
                        "last checkpoint and dsgd starts new PS actors") from e
