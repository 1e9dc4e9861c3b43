"""`Config`: every argument of `DistributedSGD`, checked once, then frozen.

All argument checks live here: a bad argument fails in the constructor, before
Ray starts, with a message that names the argument and what it accepts. The
cluster checks (can the cluster hold the workers, can its object store hold a
step) need Ray and live in dsgd/engine/resources.py.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from dsgd import constants


@dataclasses.dataclass(frozen=True)
class Config:
    """What a `DistributedSGD` was asked for (see its docstring for each field).

    Fields beyond the constructor's documented arguments: `local_steps_per_call`
    (`train()`: steps per actor call) and `overlap` (the workers' exchange:
    send each bucket during the backward pass): performance switches that
    never change results (`overlap`: to float32 round-off).
    """

    @property
    def during_backward(self) -> bool:
        """Whether the workers' exchange sends the gradient during the backward
        pass (`overlap` resolved): `overlap`, or by default whether the workers
        compute on GPUs."""
        return bool(self.gpu) if self.overlap is None else self.overlap

    model_creator: Callable[[int, int], Any]
    num_workers: int
    devices_per_worker: int
    gpu: bool | None = None
    strategy: str = "ps"
    grad_shard_bytes: int = constants.DEFAULT_GRAD_SHARD_BYTES
    all_reduce_alg: str = "simple"
    num_ps: int | None = None
    num_cpus_per_worker: float = constants.DEFAULT_NUM_CPUS_PER_WORKER
    step_timeout_s: float = constants.DEFAULT_STEP_TIMEOUT_S
    start_timeout_s: float = constants.DEFAULT_START_TIMEOUT_S
    stall_warning_s: float | None = None
    on_nonfinite: str = "raise"
    max_failures: int = constants.DEFAULT_MAX_FAILURES
    elastic: bool = False
    replace_hung: bool = False
    worker_init: Callable[[], Any] | None = None
    compression: str | None = None
    local_steps_per_call: int | None = None
    backup_workers: int = 0
    snapshot_interval_s: float | None = constants.DEFAULT_SNAPSHOT_INTERVAL_S
    local: bool = False
    timeline: str | None = None
    overlap: bool | None = None

    def __post_init__(self):
        if not callable(self.model_creator):
            raise TypeError(f"model_creator must be callable as (worker_index, device_index) -> "
                            f"dsgd.Model, got {type(self.model_creator).__name__}")
        for name in ("num_workers", "devices_per_worker", "grad_shard_bytes"):
            _positive_int(name, getattr(self, name))
        if self.num_ps is not None:
            _positive_int("num_ps", self.num_ps)
        if self.gpu is not None:
            _bool("gpu", self.gpu)
        _one_of("strategy", self.strategy, constants.STRATEGIES)
        _one_of("all_reduce_alg", self.all_reduce_alg, constants.ALL_REDUCE_ALGS)
        if self.all_reduce_alg == "nccl" and self.gpu is False:
            raise ValueError("all_reduce_alg='nccl' needs GPU devices (gpu=True, or None on a "
                             "cluster with GPUs); use 'simple' or 'tree' with gpu=False")
        if self.compression is not None and (not isinstance(self.compression, str)
                                             or self.compression not in constants.COMPRESSIONS):
            raise ValueError(f"compression must be None or one of {list(constants.COMPRESSIONS)}, "
                             f"got {self.compression!r}")
        if self.compression is not None and self.strategy != "ps":
            raise ValueError(f"compression={self.compression!r} needs strategy='ps' (strategy="
                             f"{self.strategy!r} is the uncompressed reference)")
        numbers = ["num_cpus_per_worker", "step_timeout_s", "start_timeout_s"]
        if self.stall_warning_s is not None:
            numbers.append("stall_warning_s")
        for name in numbers:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        _one_of("on_nonfinite", self.on_nonfinite, constants.ON_NONFINITE)
        if isinstance(self.max_failures, bool) or not isinstance(self.max_failures,
                                                                 (int, np.integer)) \
                or self.max_failures < 0:
            raise ValueError(f"max_failures must be an int >= 0, got {self.max_failures!r}")
        _bool("elastic", self.elastic)
        _bool("replace_hung", self.replace_hung)
        if self.worker_init is not None and not callable(self.worker_init):
            raise TypeError(f"worker_init must be callable or None, got "
                            f"{type(self.worker_init).__name__}")
        check_picklable("model_creator", self.model_creator, "Ray sends it to every worker")
        if self.worker_init is not None:
            check_picklable("worker_init", self.worker_init, "Ray sends it to every worker")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise TypeError(f"overlap must be True, False or None (True with gpu), got "
                            f"{self.overlap!r}")
        if self.snapshot_interval_s is not None and (
                isinstance(self.snapshot_interval_s, bool)
                or not isinstance(self.snapshot_interval_s, (int, float))
                or not self.snapshot_interval_s >= 0):
            raise ValueError(f"snapshot_interval_s must be a number of seconds >= 0 or None, "
                             f"got {self.snapshot_interval_s!r}")
        _bool("local", self.local)
        if self.timeline is not None and (not isinstance(self.timeline, str) or not self.timeline):
            raise ValueError(f"timeline must be a file path (str) or None, got {self.timeline!r}")
        if self.local and self.num_workers != 1:
            raise ValueError(f"local=True runs one worker in this process: num_workers must be "
                             f"1, got {self.num_workers}")
        if self.local_steps_per_call is not None:
            _positive_int("local_steps_per_call", self.local_steps_per_call)
        if isinstance(self.backup_workers, bool) \
                or not isinstance(self.backup_workers, (int, np.integer)) \
                or not 0 <= self.backup_workers < self.num_workers:
            raise ValueError(f"backup_workers must be an int with 0 <= backup_workers < "
                             f"num_workers={self.num_workers} (each step averages the first "
                             f"num_workers - backup_workers workers), got {self.backup_workers!r}")
        # Normalised once, so that the rest of dsgd reads plain floats and ints.
        for name in ("step_timeout_s", "start_timeout_s", "num_cpus_per_worker"):
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("num_workers", "devices_per_worker", "grad_shard_bytes", "max_failures",
                     "backup_workers"):
            object.__setattr__(self, name, int(getattr(self, name)))

    def with_gpu(self, gpu: bool) -> Config:
        """This config with `gpu` decided (`gpu=None` resolved against the cluster,
        dsgd/engine/resources.py `resolve_gpu`), checked again."""
        if self.all_reduce_alg == "nccl" and not gpu:
            raise ValueError("all_reduce_alg='nccl' needs GPU devices, and gpu=None found none "
                             "in the cluster; use 'simple' or 'tree'")
        decided = copy.copy(self)  # not dataclasses.replace: that would pickle model_creator again
        object.__setattr__(decided, "gpu", bool(gpu))
        return decided

    @property
    def stall_report_s(self) -> float:
        """Interval of stall reports while a wait is pending: `stall_warning_s`, or a
        quarter of `step_timeout_s`, at most MAX_STALL_WARNING_S."""
        return self.stall_warning_s or min(constants.MAX_STALL_WARNING_S, self.step_timeout_s / 4)

    @property
    def first_steps_timeout_s(self) -> float:
        """The wait for each step of a worker's first call of steps after it
        joined running workers (a replacement, an added worker): part of its
        start, since it traces its compiled step alone while the others wait
        in the exchange. max(step_timeout_s, start_timeout_s): judged by
        step_timeout_s alone, a replacement slower to trace than that would be
        killed as hung and replaced again, step after step."""
        return max(self.step_timeout_s, self.start_timeout_s)

    def steps_timeout_s(self, new_to_steps: bool) -> float:
        """Each step's wait in a call of steps: `first_steps_timeout_s` when a worker
        in it is new to steps (ActorSet.new_to_steps), else `step_timeout_s`."""
        return self.first_steps_timeout_s if new_to_steps else self.step_timeout_s

    @property
    def start_stall_report_s(self) -> float:
        """The same while actors start: start-up is slow by nature (seconds to
        import TensorFlow), so reports come less often."""
        return max(self.stall_report_s, constants.START_STALL_WARNING_S)

    def steps_per_call(self, num_workers: int, exchange: bool) -> int:
        """`train()`'s steps per actor call: `local_steps_per_call` when given; by
        default LOCAL_STEPS_PER_CALL with one worker, and on the workers' own
        exchange (`exchange`) max(LOCAL_STEPS_PER_CALL, CALL_STEPS_PER_WORKER x
        num_workers), so that the driver's calls per step do not grow with N."""
        if self.local_steps_per_call is not None:
            return self.local_steps_per_call
        if exchange:
            return max(constants.LOCAL_STEPS_PER_CALL, constants.CALL_STEPS_PER_WORKER * num_workers)
        return constants.LOCAL_STEPS_PER_CALL

    @property
    def uses_ps(self) -> bool:
        """Whether PS actors exchange the gradients: strategy "ps", 2+ workers."""
        return self.strategy == "ps" and self.num_workers > 1


def check_picklable(name: str, value, why: str) -> None:
    """TypeError naming argument `name` unless Ray can pickle `value` (as it will
    to ship it: `why`), and, where it can tell, the part of `value` that fails
    (a closure variable, a global, an attribute). Pickles it once, in this process."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(value)
    except Exception as e:  # noqa: BLE001 - any failure to pickle, reported with its cause
        culprit = _unpicklable_part(value, name, 3)
        where = f" ({culprit} cannot be)" if culprit and culprit != name else ""
        raise TypeError(f"{name} cannot be pickled{where}: {type(e).__name__}: {e}. {why}; "
                        f"build such objects inside it instead of capturing them") from None


def _unpicklable_part(value, path: str, depth: int) -> str | None:
    """The path of the deepest part of `value` that fails to pickle (searching
    closure variables, globals a function reads, attributes, items), or None."""
    import inspect

    from ray import cloudpickle

    try:
        cloudpickle.dumps(value)
        return None
    except Exception:  # noqa: BLE001
        pass
    if depth == 0:
        return path
    parts: list[tuple[str, object]] = []
    if inspect.isfunction(value):
        code = value.__code__
        cells = value.__closure__ or ()
        parts += [(f"{path}'s closure variable {n!r}", c.cell_contents)
                  for n, c in zip(code.co_freevars, cells) if _filled(c)]
        parts += [(f"{path}'s global {n!r}", value.__globals__[n]) for n in code.co_names
                  if n in value.__globals__ and not inspect.ismodule(value.__globals__[n])]
    elif isinstance(value, dict):
        parts += [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        parts += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        parts += [(f"{path}.{k}", v) for k, v in vars(value).items()]
    for part_path, part in parts:
        found = _unpicklable_part(part, part_path, depth - 1)
        if found:
            return found
    return path


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:  # an empty cell
        return False


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _one_of(name: str, value, accepted) -> None:
    if not isinstance(value, str) or value not in accepted:
        raise ValueError(f"{name} must be one of {list(accepted)}, got {value!r}")
