"""Applying a step in parts (Replicas.apply_stage): which variables each part
updates, and whether the optimizers allow it at all (`per_group_blocker`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dsgd.comm.sharding import ShardPlan


@dataclasses.dataclass(frozen=True)
class _Stage:
    var_ids: tuple[int, ...]    # the variables it updates
    shard_ids: tuple[int, ...]  # the shards holding their gradients
    fn: Callable                # compiled: (addresses, byte_sizes) of every shard -> update


def _last_group_of_variables(plan: ShardPlan, groups) -> list[int]:
    """For each variable, the group holding its last-arriving piece (the last
    group for a variable with no elements, which has no piece)."""
    group_of = {j: g for g, shards in enumerate(groups) for j in shards}
    return [max((group_of[j] for j, _ in plan.pieces_of(v)), default=len(groups) - 1)
            for v in range(len(plan.shapes))]


# Keras optimizers whose update of a variable reads only that variable's
# gradient, its own slots and the iteration count (held by apply_stage), so that
# applying a step in parts equals one apply. Exact types only: a subclass may
# change that. Not here: Nadam (a product updated once per apply), Muon and
# ScheduleFreeAdamW (cross-variable or per-call state), LossScaleOptimizer
# (one finiteness check over all gradients).
_PER_VARIABLE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax",
                            "Ftrl", "Lion", "Lamb", "Adafactor")


def per_group_blocker(optimizers) -> str | None:
    """Why a step cannot be applied shard group by group with these optimizers
    (None: it can): global_clipnorm, EMA and gradient accumulation need every
    gradient of the step at once, and optimizers not known to update each
    variable on its own are not split."""
    import keras

    known = tuple(getattr(keras.optimizers, name) for name in _PER_VARIABLE_OPTIMIZERS)
    for optimizer in optimizers:
        name = type(optimizer).__name__
        if type(optimizer) not in known:
            return f"optimizer {name} is not one known to update each variable on its own"
        if getattr(optimizer, "global_clipnorm", None):
            return f"{name} has global_clipnorm (needs every gradient at once)"
        if getattr(optimizer, "use_ema", False):
            return f"{name} has use_ema=True (averages every variable on each apply)"
        if getattr(optimizer, "gradient_accumulation_steps", None):
            return f"{name} accumulates gradients (gradient_accumulation_steps)"
    return None
