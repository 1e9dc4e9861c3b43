"""What a worker actor's calls return to the driver (dsgd/worker/worker.py),
as typed records read by attribute. Each is plain data that pickles through
Ray's object store."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Configured:
    """A worker's answer to `Worker.configure` (its step compiled for a shard plan)."""
    per_group_blocker: str | None  # why its update cannot run PS group by group, or None


@dataclasses.dataclass(frozen=True)
class FullState:
    """Everything a replacement worker needs to continue exactly where another
    stopped (`Worker.get_full_state` -> object store -> `Worker.set_full_state`):
    replica 0's state, in the order of its `state_variables`, and its
    optimizers' variables (iteration count, slots), as host arrays."""
    model: list[np.ndarray]      # the model's full state (non-trainable included)
    optimizer: list[np.ndarray]  # every optimizer variable, optimizer by optimizer
    applied_steps: int           # steps the worker had applied (count, not index)
