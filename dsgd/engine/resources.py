"""Can the cluster hold what a DistributedSGD asks for? Checked before any actor
starts (workers) and once the model is known (the object store), driver side.
Both read the cluster's resources through Ray and block for one GCS call."""

from __future__ import annotations

import logging
import re

from dsgd.comm.waits import Deadline
from dsgd.errors import ResourceError

logger = logging.getLogger("dsgd")


def resolve_gpu(gpu: bool | None, num_workers: int, devices_per_worker: int) -> bool:
    """Whether the workers use GPUs: `gpu` when it is True or False. For None,
    True when the GPUs could hold every worker (`devices_per_worker` GPUs of one
    node, or one bundle of the placement group this runs in, such as a Ray Tune
    trial's, each), else False; it says which on the "dsgd" logger (INFO;
    WARNING where GPUs exist but are too few). Starts Ray (`ray.init()`) if it
    is not running; blocks for one GCS call."""
    import ray

    if not ray.is_initialized():
        ray.init()
    if gpu is not None:
        return gpu
    group = ray.util.get_current_placement_group()
    if group is not None:
        per_place, where = [b.get("GPU", 0) for b in group.bundle_specs], "this placement group"
    else:
        per_place = [n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")]
        where = "the cluster"
    have = sum(per_place)
    fit = workers_on_gpus(per_place, devices_per_worker)
    if have and fit >= num_workers:
        logger.info("training on GPUs: %d worker(s) x %d GPU(s) (%s has %g GPU(s); gpu=False "
                    "trains on CPU)", num_workers, devices_per_worker, where, have)
        return True
    if have:
        logger.warning("training on CPU: %s has %g GPU(s), room for %d of the %d worker(s) x %d "
                       "GPU(s); pass gpu=True to be told what is missing, or use fewer workers "
                       "or devices_per_worker", where, have, fit, num_workers, devices_per_worker)
    else:
        logger.info("training on CPU: %s has no GPU (gpu=None); %d worker(s) x %d replica(s)",
                    where, num_workers, devices_per_worker)
    return False


def workers_on_gpus(gpus_per_place: list[float], devices_per_worker: int) -> int:
    """How many workers of `devices_per_worker` GPUs each (all on one node, or one
    bundle) places with these GPU counts hold: `gpu=None` (and the Trainer's
    `use_gpu=None`, Ray Tune's trials included) means GPUs only when this is at
    least the number of workers."""
    return sum(int(g // devices_per_worker) for g in gpus_per_place)


def cluster_gpus_hold(num_workers: int, devices_per_worker: int) -> bool:
    """Whether the alive nodes' GPUs hold `num_workers` workers of
    `devices_per_worker` GPUs each (`workers_on_gpus`). Blocks for one GCS call."""
    import ray

    per_node = [n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")]
    return sum(per_node) > 0 and workers_on_gpus(per_node, devices_per_worker) >= num_workers


def check_resources(num_workers: int, devices_per_worker: int, gpu: bool, num_cpus: float) -> None:
    """Fail fast when the cluster, even empty, cannot place every worker."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    need_gpus = devices_per_worker if gpu else 0
    fit = 0
    for res in nodes:
        by_cpu = int(res.get("CPU", 0) // num_cpus) if num_cpus else num_workers
        by_gpu = int(res.get("GPU", 0) // need_gpus) if need_gpus else num_workers
        fit += min(by_cpu, by_gpu)
    if fit >= num_workers:
        return
    total_cpu = sum(r.get("CPU", 0) for r in nodes)
    total_gpu = sum(r.get("GPU", 0) for r in nodes)
    per_node = ", ".join(f"{r.get('CPU', 0):g} CPU/{r.get('GPU', 0):g} GPU" for r in nodes)
    hint = (" Pass gpu=False to train on CPU devices." if gpu and total_gpu == 0 else
            " Pass gpu=False to train on CPU devices, or fewer devices_per_worker." if gpu else "")
    raise ResourceError(
        f"asked for {num_workers} worker(s) x ({num_cpus:g} CPU, {need_gpus} GPU) = "
        f"{num_workers * num_cpus:g} CPU and {num_workers * need_gpus} GPU, each worker's GPUs on one "
        f"node; the cluster has {total_cpu:g} CPU and {total_gpu:g} GPU in {len(nodes)} node(s) "
        f"({per_node}) and fits only {fit} worker(s).{hint}")


def check_store(plan, num_workers: int) -> None:
    """Fail fast when the object store cannot hold one step's objects: every
    worker's gradient shards plus the mean shards are alive at once. Warn when
    it cannot hold two overlapping steps' (train() with the next step in
    flight: up to 2 x num_workers + 1 such sets), which Ray then spills."""
    import ray

    if num_workers == 1:
        return  # one worker exchanges nothing through the store
    grad_bytes = sum(s.nbytes for s in plan.shards)
    need = (num_workers + 1) * grad_bytes
    stores = [n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n.get("Alive")]
    have = sum(stores) or ray.cluster_resources().get("object_store_memory", 0)
    largest = max(s.nbytes for s in plan.shards)
    if need <= have and largest <= min(stores or [have]):
        peak = (2 * num_workers + 1) * grad_bytes
        if peak > have:  # fits one step, not two overlapping ones: works, spills
            logger.warning(
                "the object store (%.1f MB) holds one step's %d x %.1f MB of gradient shards but "
                "not the %d x that train() can have alive while the next step is in flight "
                "(its gradients, this step's and its means): Ray will spill to disk, which is "
                "slower. object_store_memory >= %d bytes avoids it.", have / 1e6,
                num_workers + 1, grad_bytes / 1e6, 2 * num_workers + 1, int(peak * 1.2))
        return
    raise ResourceError(
        f"the object store is too small: one step with {num_workers} workers holds "
        f"{num_workers + 1} x {grad_bytes / 1e6:.1f} MB of gradient shards at once "
        f"({need / 1e6:.1f} MB; largest shard {largest / 1e6:.1f} MB), but object_store_memory is "
        f"{have / 1e6:.1f} MB in all ({', '.join(f'{x / 1e6:.1f}' for x in stores)} MB per node). "
        f"Start Ray with object_store_memory >= {int(need * 1.5)} bytes (ray.init(object_store_memory=...) "
        "or ray start --object-store-memory), or use fewer workers.")


def placeable_workers(options: dict, want: int) -> int:
    """How many more workers with Ray `options` fit in the resources available now
    (each worker's CPUs and GPUs on one node). Blocks for one GCS call. Workers
    placed in a placement group (under Ray Tune) take the bundles a dead one
    left: all of them."""
    from dsgd.ray_private import available_resources_per_node

    if not isinstance(options.get("scheduling_strategy"), str):
        return want
    cpu, gpu = options.get("num_cpus", 1), options.get("num_gpus", 0)
    fit = 0
    for available in available_resources_per_node().values():
        by_cpu = int(available.get("CPU", 0) // cpu) if cpu else want
        by_gpu = int(available.get("GPU", 0) // gpu) if gpu else want
        fit += min(by_cpu, by_gpu)
    return min(fit, want)


def wait_for_room(options: dict, count: int, own_suffix: str, wait_s: float) -> None:
    """Before starting `count` workers with Ray `options`: ResourceError unless the
    cluster has them free now, or within `wait_s` seconds (the resources of
    actors just killed take a moment to be released). The error names what was
    asked, what each node has free, and the dsgd actors of other instances
    alive in the cluster (an instance dropped without `shutdown()` in another
    session, or still in use), rather than the workers waiting for CPUs until
    `start_timeout_s`. Workers placed in a placement group (a Ray Tune trial's)
    are not checked: the group holds their room. Blocks, polling every 0.2 s."""
    from dsgd.ray_private import available_resources_per_node

    if not isinstance(options.get("scheduling_strategy"), str):
        return
    deadline = Deadline(f"room for {count} worker(s)", wait_s)
    while placeable_workers(options, count) < count:
        if deadline.over():
            break
        deadline.pause(0.2)
    else:
        return
    cpu, gpu = options.get("num_cpus", 1), options.get("num_gpus", 0)
    free = [f"{a.get('CPU', 0):g} CPU/{a.get('GPU', 0):g} GPU"
            for a in available_resources_per_node().values()]
    others = _other_instances(own_suffix)
    held = ("; alive in the cluster: " + "; ".join(
        f"instance {suffix} ({', '.join(sorted(names))})" for suffix, names in sorted(others.items()))
        + ": call its shutdown() (or use `with`), or drop every reference to it"
        if others else "; no other dsgd instance is alive: other Ray work holds them")
    raise ResourceError(
        f"cannot place {count} worker(s) x ({cpu:g} CPU, {gpu:g} GPU) now: the cluster has "
        f"{', '.join(free) or 'nothing'} free (per node) after waiting {wait_s:.0f} s{held}")


def _other_instances(own_suffix: str) -> dict[str, list[str]]:
    """{instance id: its dsgd actors' names} of the live dsgd actors in the cluster
    that are not this instance's (Ray's named-actor list, every namespace)."""
    import ray

    from dsgd import constants

    found: dict[str, list[str]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        # <prefix><index>-<instance id>, and -r<generation> for a replacement
        match = re.fullmatch(rf"(?:{constants.WORKER_NAME_PREFIX}|{constants.PS_NAME_PREFIX})"
                             r"\d+-(\w+?)(?:-r\d+)?", name)
        if match and match.group(1) != own_suffix:
            found.setdefault(match.group(1), []).append(name)
    return found
