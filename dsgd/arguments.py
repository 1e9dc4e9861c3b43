"""Constructor checks of DistributedSGD: bad arguments fail before Ray starts,
requests the cluster can never hold fail before any actor starts."""

from __future__ import annotations

import logging

import numpy as np

from dsgd import constants
from dsgd.allreduce import check_algorithm
from dsgd.errors import ResourceError

logger = logging.getLogger("dsgd")


def check_args(model_creator, num_workers, devices_per_worker, gpu, strategy, grad_shard_bytes,
               all_reduce_alg, num_ps, num_cpus_per_worker, step_timeout_s, start_timeout_s,
               stall_warning_s=None, on_nonfinite="raise", max_failures=0, elastic=False,
               compression=None):
    if not callable(model_creator):
        raise TypeError(f"model_creator must be callable as (worker_index, device_index) -> "
                        f"dsgd.Model, got {type(model_creator).__name__}")

    def positive_int(name, value):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")

    positive_int("num_workers", num_workers)
    positive_int("devices_per_worker", devices_per_worker)
    positive_int("grad_shard_bytes", grad_shard_bytes)
    if num_ps is not None:
        positive_int("num_ps", num_ps)
    if not isinstance(gpu, bool):
        raise TypeError(f"gpu must be True or False, got {gpu!r}")
    if strategy not in constants.STRATEGIES:
        raise ValueError(f"strategy must be one of {list(constants.STRATEGIES)}, got {strategy!r}")
    check_algorithm(all_reduce_alg, gpu)
    if compression is not None and (not isinstance(compression, str)
                                    or compression not in constants.COMPRESSIONS):
        raise ValueError(f"compression must be None or one of {list(constants.COMPRESSIONS)}, "
                         f"got {compression!r}")
    if compression is not None and strategy != "ps":
        raise ValueError(f"compression={compression!r} needs strategy='ps' (strategy="
                         f"{strategy!r} is the uncompressed reference)")
    numbers = [("num_cpus_per_worker", num_cpus_per_worker), ("step_timeout_s", step_timeout_s),
               ("start_timeout_s", start_timeout_s)]
    if stall_warning_s is not None:
        numbers.append(("stall_warning_s", stall_warning_s))
    for name, value in numbers:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    if on_nonfinite not in constants.ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {list(constants.ON_NONFINITE)}, "
                         f"got {on_nonfinite!r}")
    if isinstance(max_failures, bool) or not isinstance(max_failures, (int, np.integer)) \
            or max_failures < 0:
        raise ValueError(f"max_failures must be an int >= 0, got {max_failures!r}")
    if not isinstance(elastic, bool):
        raise TypeError(f"elastic must be True or False, got {elastic!r}")


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
    hint = " Pass gpu=False to train on CPU devices." if gpu and total_gpu == 0 else ""
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
