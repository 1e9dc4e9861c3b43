"""Constructor checks of DistributedSGD: bad arguments fail before Ray starts,
requests the cluster can never hold fail before any actor starts."""

from __future__ import annotations

import logging

import numpy as np

from dsgd import constants

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
    if all_reduce_alg not in constants.ALL_REDUCE_ALGS:
        raise ValueError(f"all_reduce_alg must be one of {list(constants.ALL_REDUCE_ALGS)}, "
                         f"got {all_reduce_alg!r}")
    if all_reduce_alg == "nccl" and not gpu:
        raise ValueError("all_reduce_alg='nccl' needs GPU devices (gpu=True); "
                         "use 'simple' or 'tree' with gpu=False")
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
