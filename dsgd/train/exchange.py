"""The worker side of the Ray Train backend: which PS actors to use, where this
worker sits in the run, and the collectives over all workers through them.

The backend installs the context in every Ray Train worker process
(`install`); `allreduce` then packs the arrays with the engine's shard plan and
layout (dsgd/comm/sharding.py: fusion, reverse layer order, alignment,
compression, one group of shards per PS), sends each PS its group as one
store object, and unpacks the results (dsgd/comm/param_server.py `reduce`).
`broadcast` and `allgather` meet on PS 0. Exchanges are numbered in call
order, the same on every worker (SPMD): a PS matches the workers' calls by
number.
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
_DEFAULT = object()


def install(ps_handles: list, ps_names: list[str], grad_shard_bytes: int, timeout_s: float,
            compression: str | None = None, node_sizes: list[int] | None = None) -> None:
    """(run in every Ray Train worker by the backend) The PS actors of this run;
    `node_sizes`: how many of the run's workers each node holds (for
    `cross_size`)."""
    with _LOCK:
        _CONTEXT.clear()
        _CONTEXT.update(ps=list(ps_handles), names=list(ps_names), shard_bytes=grad_shard_bytes,
                        timeout_s=timeout_s, compression=compression,
                        node_sizes=list(node_sizes or []),
                        sequence=itertools.count(), layouts={})


def installed() -> bool:
    return bool(_CONTEXT)


def context() -> dict:
    if not _CONTEXT:
        raise DsgdError("dsgd.train: no dsgd backend in this process; run the loop in a "
                        "dsgd.train.DsgdTrainer (or a DataParallelTrainer with "
                        "backend_config=dsgd.train.DsgdConfig()), or launch the script with "
                        "`python -m dsgd.train.run -np N script.py`")
    return _CONTEXT


def world() -> tuple[int, int]:
    """(rank, size) of this worker in the Ray Train run."""
    import ray.train

    train_context = ray.train.get_context()
    return train_context.get_world_rank(), train_context.get_world_size()


def topology() -> dict:
    """This worker's place, as Horovod names it: rank, size, local_rank,
    local_size (workers on this node), cross_rank (this node's index),
    cross_size (nodes holding a worker of this local_rank)."""
    import ray.train

    ctx = context()
    tc = ray.train.get_context()
    local_rank, node_rank = tc.get_local_rank(), tc.get_node_rank()
    sizes = ctx["node_sizes"] or [tc.get_world_size()]
    return {"rank": tc.get_world_rank(), "size": tc.get_world_size(), "local_rank": local_rank,
            "local_size": tc.get_local_world_size(), "cross_rank": node_rank,
            "cross_size": sum(1 for n in sizes if n > local_rank)}


def next_sequence() -> int:
    with _LOCK:
        return next(context()["sequence"])


def mean(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The mean over all workers of each array: `allreduce(arrays)`."""
    return allreduce(arrays)


def allreduce(arrays: list[np.ndarray], average: bool = True,
              compression=_DEFAULT) -> list[np.ndarray]:
    """The mean (or, with `average=False`, the sum) over all workers of each
    array (floating arrays with the same shapes and dtypes on every worker, in
    the same call order): read-only arrays, views of the object store where a
    variable sits whole in one shard (each keeps its store object alive). `compression` (default: the backend's)
    as the engine's. Blocks, at most the backend's timeout; a dead PS raises
    DsgdError naming it."""
    import ray

    ctx = context()
    rank, size = world()
    seq = next_sequence()
    if size == 1:
        return [np.array(a) for a in arrays]
    compression = ctx["compression"] if compression is _DEFAULT else compression
    shapes = tuple(tuple(a.shape) for a in arrays)
    dtypes = tuple(np.dtype(a.dtype).name for a in arrays)
    plan, owner, groups = _layout(ctx, shapes, dtypes, compression)
    flat = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    scale = None if average else 1.0
    refs, owners = [], []
    for group in groups:
        shards = tuple(plan.shards[j] for j in group)
        # One object per group (pickle 5 copies each piece once into its place in the
        # store buffer): Ray's fixed cost per object would dominate one per piece.
        pieces = ray.put(tuple(to_wire(flat[p.var_index][p.var_offset:p.var_offset + p.length],
                                       s.dtype)
                               for s in shards for p in s.pieces))
        ps = owner[group[0]]
        refs.append(ctx["ps"][ps].reduce.remote(seq, rank, size, shards, pieces, scale))
        owners.append(ps)
    # Each PS answers with the ref of its group's result, put once for all workers;
    # reading it maps the store (no copy), and a variable whole in one shard comes
    # back as a view of it (the view keeps the object alive while TF uses it).
    result_refs = [answer[0] for answer in _get(ctx, refs, owners, f"exchange {seq}")]
    results = _get(ctx, result_refs, owners, f"exchange {seq}")
    out = [None] * plan.num_shards
    for group, group_result in zip(groups, results):
        for j, array in zip(group, group_result):
            out[j] = array
    return plan.unpack(out, copy=False)


def broadcast(arrays, root_rank: int):
    """Rank `root_rank`'s `arrays` (any picklable value) on every worker (through
    PS 0); the other ranks' values are ignored."""
    ctx = context()
    rank, size = world()
    _check_root(root_rank, size)
    seq = next_sequence()
    if size == 1:
        return arrays
    ref = ctx["ps"][0].broadcast.remote(seq, rank, size, root_rank,
                                        arrays if rank == root_rank else None)
    return _get(ctx, [ref], [0], f"broadcast {seq}")[0]


def gather(value) -> list:
    """Every rank's `value` (any picklable value), in rank order, on every
    worker (through PS 0)."""
    ctx = context()
    rank, size = world()
    seq = next_sequence()
    if size == 1:
        return [value]
    ref = ctx["ps"][0].gather.remote(seq, rank, size, value)
    return _get(ctx, [ref], [0], f"allgather {seq}")[0]


def _check_root(root_rank, size: int) -> None:
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)) \
            or not 0 <= root_rank < size:
        raise ValueError(f"root_rank must be an int in [0, {size}) (the ranks of this run), "
                         f"got {root_rank!r}")


def _layout(ctx: dict, shapes: tuple, dtypes: tuple, compression):
    """(plan, PS of every shard, groups) for these arrays, made once."""
    key = (shapes, dtypes, compression)
    if key not in ctx["layouts"]:
        plan = plan_shards(shapes, dtypes, ctx["shard_bytes"], compression=compression)
        owner, groups = exchange_layout(plan, len(ctx["ps"]))
        ctx["layouts"][key] = (plan, owner, groups)
        _warm(ctx, plan)
    return ctx["layouts"][key]


def _warm(ctx: dict, plan) -> None:
    """Fault in the store pages the exchanges of `plan` will write, here and on
    every PS, as the engine does at configure time (dsgd/comm/store.py `warm`):
    without it, each put of the first tens of steps pays the kernel's zeroing
    of fresh pages (benchmarks/design_measurements.md)."""
    from dsgd.comm import store

    _, size = world()
    want = store.warm_bytes(plan, size)
    if want <= ctx.get("warmed", 0):
        return
    refs = [ps.warm_store.remote(want) for ps in ctx["ps"]]
    ctx["warmed"] = store.warm(want)
    _get(ctx, refs, list(range(len(refs))), "warming the store")


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
