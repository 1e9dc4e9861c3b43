"""The worker side of the Ray Train backend: which PS actors to use, where this
worker sits in the run, and the collectives over all workers through them.

The backend installs the context in every Ray Train worker process
(`install`); `allreduce` then packs the arrays with the engine's shard plan and
layout (dsgd/comm/sharding.py: fusion, reverse layer order, alignment,
compression, one group of shards per PS), sends each PS its group as one
store object through this worker's `PSClient` (dsgd/comm/ps_client.py), and
unpacks the results. `broadcast` and `allgather` meet on PS 0. Exchanges are
numbered in call order, the same on every worker (every worker makes the same
calls in the same order): a PS matches the workers' calls by number.
"""

from __future__ import annotations

import threading

import numpy as np

from dsgd.comm import timeline
from dsgd.comm.ps_client import PSClient
from dsgd.comm.sharding import exchange_layout, spread_plan
from dsgd.comm.waits import actor_died_errors
from dsgd.errors import DsgdError

_CONTEXT: dict = {}
_LOCK = threading.Lock()
_DEFAULT = object()


def install(ps_handles: list, ps_names: list[str], grad_shard_bytes: int, timeout_s: float,
            compression: str | None = None, node_sizes: list[int] | None = None) -> None:
    """(run in every Ray Train worker by the backend) The PS actors of this run;
    `node_sizes`: how many of the run's workers each node holds (for
    `cross_size`). This worker's `PSClient` is made at its first exchange."""
    with _LOCK:
        _CONTEXT.clear()
        _CONTEXT.update(ps=list(ps_handles), names=list(ps_names), shard_bytes=grad_shard_bytes,
                        timeout_s=timeout_s, compression=compression,
                        node_sizes=list(node_sizes or []), client=None, layouts={})


def installed() -> bool:
    return bool(_CONTEXT)


def context() -> dict:
    if not _CONTEXT:
        raise DsgdError("dsgd.train: no dsgd backend in this process; run the loop in a "
                        "dsgd.train.DsgdTrainer (or a DataParallelTrainer with "
                        "backend_config=dsgd.train.DsgdConfig()), or launch the script with "
                        "`python -m dsgd.train.run -np N script.py`")
    return _CONTEXT


def client() -> PSClient:
    """This worker's client of the run's PS actors (its rank and the run's size from
    Ray Train; exchanges numbered from 0 in call order, alike on every worker)."""
    ctx = context()
    with _LOCK:
        if ctx["client"] is None:
            rank, size = world()
            ctx["client"] = PSClient(ctx["ps"], ctx["names"], rank, size, ctx["timeout_s"],
                                     "dsgd.train")
        return ctx["client"]


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
    ctx = context()
    ps = client()
    if ps.world == 1:
        ps.next_seq()
        return [np.array(a) for a in arrays]
    compression = ctx["compression"] if compression is _DEFAULT else compression
    shapes = tuple(tuple(a.shape) for a in arrays)
    dtypes = tuple(np.dtype(a.dtype).name for a in arrays)
    layout = _layout(ctx, ps, shapes, dtypes, compression)
    flat = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    # A variable whole in one shard comes back as a view of the PS's result object
    # (the view keeps the object alive while TF uses it).
    with timeline.recorder().span("allreduce" if average else "allreduce (sum)", "collectives",
                                  arrays=len(arrays),
                                  bytes=int(sum(a.nbytes for a in flat))):
        means = _named(lambda: ps.reduce(layout, flat, scale=None if average else 1.0))
    return layout.plan.unpack(means, copy=False)


def broadcast(arrays, root_rank: int):
    """Rank `root_rank`'s `arrays` (any picklable value) on every worker (through
    PS 0); the other ranks' values are ignored."""
    ps = client()
    _check_root(root_rank, ps.world)
    if ps.world == 1:
        ps.next_seq()
        return arrays
    with timeline.recorder().span("broadcast", "collectives", root=root_rank):
        return _named(lambda: ps.broadcast(arrays, root_rank))


def gather(value) -> list:
    """Every rank's `value` (any picklable value), in rank order, on every
    worker (through PS 0)."""
    ps = client()
    if ps.world == 1:
        ps.next_seq()
        return [value]
    with timeline.recorder().span("allgather", "collectives"):
        return _named(lambda: ps.gather(value))


def _check_root(root_rank, size: int) -> None:
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)) \
            or not 0 <= root_rank < size:
        raise ValueError(f"root_rank must be an int in [0, {size}) (the ranks of this run), "
                         f"got {root_rank!r}")


def _layout(ctx: dict, ps: PSClient, shapes: tuple, dtypes: tuple, compression):
    """The exchange layout of these arrays, made once (and the stores warmed for it)."""
    key = (shapes, dtypes, compression)
    if key not in ctx["layouts"]:
        # On several nodes (one PS per node by default), shards cut so that every PS
        # gets an equal share, as the engine cuts them (sharding.spread_plan).
        spread = len(ctx["ps"]) if len(ctx["node_sizes"]) > 1 else 1
        plan = spread_plan(shapes, dtypes, ctx["shard_bytes"], spread, compression=compression)
        ctx["layouts"][key] = exchange_layout(plan, len(ctx["ps"]))
        _warm(ctx, ps, plan)
    return ctx["layouts"][key]


def _warm(ctx: dict, ps: PSClient, plan) -> None:
    """Fault in the store pages the exchanges of `plan` will write, here and on
    every PS, as the engine does at configure time (dsgd/comm/store.py `warm`):
    without it, each put of the first tens of steps pays the kernel's zeroing
    of fresh pages (benchmarks/design_measurements.md)."""
    from dsgd.comm import store

    want = store.warm_bytes(plan, ps.world)
    if want <= ctx.get("warmed", 0):
        return
    ctx["warmed"] = store.warm(want)
    _named(lambda: ps.warm_store(want))


def _named(call):
    """`call()`, a dead PS reported as DsgdError naming it, with what Ray Train can do."""
    try:
        return call()
    except actor_died_errors() as e:
        notes = "; ".join(getattr(e, "__notes__", [])) or f"a PS actor died ({type(e).__name__})"
        raise DsgdError(f"{notes}; with FailureConfig(max_failures>=1) Ray Train restarts the "
                        "run from its last checkpoint and dsgd starts new PS actors") from e
