"""Starting a DistributedSGD's actors (driver side): workers (replicas built,
signatures compared, step compiled), the shard plan, PS actors beside the
workers, and the start-up weight broadcast. Used at construction, and by
dsgd/engine/recovery.py to start replacements.

Every function takes the driver (`dsgd.sgd.DistributedSGD`) and blocks until
its actors have answered, each wait at most `start_timeout_s` (start-up) or
`step_timeout_s`.
"""

from __future__ import annotations

import logging

from dsgd import constants
from dsgd.comm import store
from dsgd.engine.resources import check_resources, check_store
from dsgd.errors import ModelMismatchError
from dsgd.comm.sharding import (
    ShardPlan,
    assign_shards,
    group_shards,
    plan_shards,
    whole_plan,
)

logger = logging.getLogger("dsgd")


def worker_scheduling(num_workers: int, devices_per_worker: int, gpu: bool, num_cpus: float):
    """Where workers go: inside the current placement group, if any (a Ray Tune
    trial's resources are one; actors only land in it when asked), in any of its
    bundles with room; otherwise spread over the cluster, after checking that the
    cluster can hold them (ResourceError)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.get_current_placement_group()
    if group is None:
        check_resources(num_workers, devices_per_worker, gpu, num_cpus)
        return "SPREAD"
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=-1,
                                            placement_group_capture_child_tasks=False)


def start_stall_s(sgd) -> float:
    """Stall-report interval while actors start: start-up is slow by nature
    (seconds to import TensorFlow), so report less often than during steps."""
    return max(sgd.actors.stall_warning_s, constants.START_STALL_WARNING_S)


def start_workers(sgd, slots: list[int], first: bool = False) -> None:
    """Start workers for `slots`, build their replicas (check they match the
    others) and compile their step. The first call also makes the shard plan.
    Blocks, at most `start_timeout_s`."""
    handles = sgd.actors.start_workers(slots)
    stall_s = start_stall_s(sgd)
    infos = sgd.actors.wait([w.setup.remote() for w in handles], handles,
                            "starting (setup: import TensorFlow, build replicas)",
                            sgd.start_timeout_s, stall_s)
    if first:
        sgd._info_by_slot = dict(zip(slots, infos))
        check_signatures(infos)
        shapes, dtypes = infos[0]["shapes"], infos[0]["dtypes"]
        sgd._signature = infos[0]
        sgd.plan: ShardPlan = (plan_shards(shapes, dtypes, sgd.grad_shard_bytes,
                                           compression=sgd.compression)
                               if sgd.strategy == "ps" else whole_plan(shapes, dtypes))
        check_store(sgd.plan, sgd.num_workers)
        sgd._warm_store_bytes = store.warm_bytes(sgd.plan, sgd.num_workers)
    else:
        check_signatures([sgd._signature] + infos)
        sgd._info_by_slot.update(zip(slots, infos))
    configured = sgd.actors.wait([w.configure.remote(sgd.plan, sgd.on_nonfinite,
                                                     sgd._warm_store_bytes)
                                  for w in handles], handles, "compiling the step",
                                 sgd.start_timeout_s, stall_s)
    if first:
        # Apply each PS group's mean as it arrives (Worker.apply_staged) where the
        # optimizers allow it; replacements run the same model_creator.
        sgd.per_group_blocker = next((c["per_group_blocker"] for c in configured
                                      if c["per_group_blocker"]), None)


def check_signatures(infos: list[dict]) -> None:
    """ModelMismatchError unless every worker's setup info (`names`, `shapes`,
    `dtypes` of its variables) matches the first one's."""
    first = infos[0]
    for i, info in enumerate(infos[1:], start=1):
        if info["shapes"] != first["shapes"] or info["dtypes"] != first["dtypes"]:
            k = next((k for k, (a, b) in enumerate(zip(info["shapes"], first["shapes"]))
                      if a != b or info["dtypes"][k] != first["dtypes"][k]),
                     min(len(info["shapes"]), len(first["shapes"])))
            raise ModelMismatchError(
                f"worker {i}'s replicas have {len(info['shapes'])} variables, worker 0's have "
                f"{len(first['shapes'])}; first difference at variable {k}: "
                f"{_describe(info, k)} vs {_describe(first, k)}")


def start_ps(sgd, num_ps: int | None) -> None:
    """Plan the shard -> PS assignment and start the PS actors (strategy "ps",
    more than one worker)."""
    sgd.ps_assignment = []
    set_groups(sgd, tuple((j,) for j in range(sgd.plan.num_shards)))
    if sgd.strategy != "ps" or sgd.num_workers == 1:
        return
    num_shards = sgd.plan.num_shards
    if num_ps is None:
        num_ps = min(num_shards, sgd.num_workers)
    elif num_ps > num_shards:
        logger.warning("num_ps=%d but the gradients make only %d shard(s); %d PS actor(s) "
                       "will idle (lower grad_shard_bytes to make more shards)",
                       num_ps, num_shards, num_ps - num_shards)
    nbytes = [s.nbytes for s in sgd.plan.shards]
    sgd.ps_assignment = assign_shards(nbytes, num_ps)
    set_groups(sgd, group_shards(sgd.ps_assignment, nbytes, constants.SHARD_GROUP_MAX_BYTES))
    sgd.actors.ps = [None] * num_ps
    ensure_ps(sgd)


def set_groups(sgd, groups: tuple[tuple[int, ...], ...]) -> None:
    """Shards that travel as one object per worker (and one PS result); see
    sharding.group_shards."""
    sgd.shard_groups = groups
    sgd._group_shards = [tuple(sgd.plan.shards[j] for j in g) for g in groups]


def ensure_ps(sgd) -> None:
    """Start every PS actor that is missing (never started, or dead). PS j
    lives beside worker j (round-robin): every node that sends gradients also
    sums its share, as in BytePS."""
    if sgd.strategy != "ps" or sgd.num_workers == 1:
        return
    if not sgd.ps_assignment:
        start_ps(sgd, sgd._num_ps)
        return
    missing = [j for j, p in enumerate(sgd.actors.ps) if p is None]
    if not missing:
        return
    info = sgd.worker_info
    handles = sgd.actors.start_ps(missing, [info[j % len(info)]["node_id"] for j in missing],
                                  sgd._warm_store_bytes)
    sgd.actors.wait([p.ready.remote() for p in handles], handles, "starting PS actors",
                    sgd.start_timeout_s, start_stall_s(sgd))


def broadcast_state(sgd) -> None:
    """Every replica takes worker 0 / replica 0's full model state (one object)."""
    import ray

    state = sgd._wait([sgd.workers[0].get_state.remote()], sgd.workers[:1],
                      "reading worker 0's weights", sgd.step_timeout_s)[0]
    ref = ray.put(state)
    sgd._wait([w.set_state.remote(ref) for w in sgd.workers[1:]] +
              [sgd.workers[0].set_state.remote(ref)], sgd.workers[1:] + sgd.workers[:1],
              "broadcasting worker 0's weights", sgd.step_timeout_s)


def _describe(info: dict, k: int) -> str:
    if k >= len(info["shapes"]):
        return "(missing)"
    return f"{info['names'][k]} {info['dtypes'][k]}{tuple(info['shapes'][k])}"
