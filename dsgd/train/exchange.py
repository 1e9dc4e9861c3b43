"""The worker side of the Ray Train backend: which PS actors to use, and the
allreduce of a list of gradients through them.

The backend installs the context in every Ray Train worker process
(`install`); `allreduce` then packs the gradients with the engine's shard plan
(dsgd/comm/sharding.py: fusion, reverse layer order, alignment), sends each PS its
group of shards, and unpacks the means. Exchanges are numbered in call order,
the same on every worker (SPMD): a PS matches the workers' calls by number.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from dsgd.errors import DsgdError, StepTimeoutError
from dsgd.comm.sharding import assign_shards, group_shards, plan_shards

_CONTEXT: dict = {}
_LOCK = threading.Lock()


def install(ps_handles: list, ps_names: list[str], grad_shard_bytes: int, timeout_s: float) -> None:
    """(run in every Ray Train worker by the backend) The PS actors of this run."""
    with _LOCK:
        _CONTEXT.clear()
        _CONTEXT.update(ps=list(ps_handles), names=list(ps_names), shard_bytes=grad_shard_bytes,
                        timeout_s=timeout_s, sequence=itertools.count(), plans={})


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


def allreduce(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The mean over all workers of each array (same shapes and dtypes on every
    worker, same call order). Blocks, at most the backend's timeout; a dead PS
    raises DsgdError naming it."""
    import ray

    ctx = context()
    rank, size = world()
    seq = next_sequence()
    if size == 1:
        return [np.array(a) for a in arrays]
    shapes = tuple(tuple(a.shape) for a in arrays)
    dtypes = tuple(np.dtype(a.dtype).name for a in arrays)
    plan, owner, groups = _plan(ctx, shapes, dtypes)
    flat = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    refs, handles = [], []
    for group in groups:
        shards = tuple(plan.shards[j] for j in group)
        # One object per group (pickle 5 copies each piece once into its place in the
        # store buffer): Ray's fixed cost per object would dominate one per piece.
        pieces = ray.put(tuple(flat[p.var_index][p.var_offset:p.var_offset + p.length]
                               for s in shards for p in s.pieces))
        handle = ctx["ps"][owner[group[0]]]
        refs.append(handle.reduce.remote(seq, rank, size, shards, pieces))
        handles.append(owner[group[0]])
    means = _get(ctx, refs, handles, f"exchange {seq}")
    out = [None] * plan.num_shards
    for group, mean in zip(groups, means):
        for j, array in zip(group, mean):
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


def _plan(ctx: dict, shapes: tuple, dtypes: tuple):
    key = (shapes, dtypes)
    if key not in ctx["plans"]:
        plan = plan_shards(shapes, dtypes, ctx["shard_bytes"])
        nbytes = [s.nbytes for s in plan.shards]
        owner = assign_shards(nbytes, len(ctx["ps"]))
        ctx["plans"][key] = (plan, owner, group_shards(owner, nbytes))
    return ctx["plans"][key]


def _get(ctx: dict, refs: list, ps_indices: list[int], what: str) -> list:
    import ray
    from ray import exceptions as rx

    try:  # a little longer than the PS waits, so its error naming missing ranks comes first
        return ray.get(refs, timeout=ctx["timeout_s"] + max(10.0, 0.1 * ctx["timeout_s"]))
    except rx.GetTimeoutError:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        late = sorted({ctx["names"][j] for r, j in zip(refs, ps_indices) if r not in ready})
        raise StepTimeoutError(f"dsgd.train {what}: no answer after {ctx['timeout_s']:.0f} s "
                               f"from {', '.join(late)}") from None
    except rx.RayActorError as e:
        dead = set()
        for ref, j in zip(refs, ps_indices):
            try:
                ray.get(ref, timeout=0.1)
            except rx.RayActorError:
                dead.add(ctx["names"][j])
            except Exception:  # noqa: BLE001 - only the dead ones are named
                pass
        names = sorted(dead) or sorted({ctx["names"][j] for j in ps_indices})
        raise DsgdError(f"dsgd.train {what}: PS actor {', '.join(names)} died ({type(e).__name__}); "
                        "with FailureConfig(max_failures>=1) Ray Train restarts the run from its "
                        "last checkpoint and dsgd starts new PS actors") from e
