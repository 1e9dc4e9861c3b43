"""Custom epochs (worker side): a TrainingOperator's own `train_epoch(iterator,
info)` and `validate(iterator, info)`.

The Trainer calls `custom_train_epoch` on every worker at once (one call per
worker per epoch). The worker first loads the state the epoch started from
(so that an epoch run again after a failure starts where the first attempt
did), then runs replica 0's operator's `train_epoch` over an iterator of this
worker's batches. Inside it, `self.train_step(batch)` is one synchronous step
of all workers, driven by the workers themselves: this worker's compiled
gradient (averaged over its replicas), the mean over all workers through the
engine's PS actors (`ParameterServer.reduce`, matched by a step number that
every worker counts alike), then the update of every replica. Every worker
applies the same mean, so weights stay identical, provided every worker calls
`train_step` equally often (the iterators yield the same number of batches on
every worker).

While a worker waits for a step's mean it watches its peers: a peer that died
ends the wait at once (as Ray's ActorDiedError, so that the driver's retry
policy treats it as the death it is), one that neither arrives nor dies ends it
after `step_timeout_s` with a StepTimeoutError naming the workers (or PS) that
did not arrive, so that the driver replaces them and runs the epoch again.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import numpy as np

from dsgd.errors import NonFiniteError
from dsgd.worker.records import FullState

if TYPE_CHECKING:
    from dsgd.comm.sharding import ExchangeLayout
    from dsgd.trainer.sources import OwnSource, RaySplitSource, RowsSource


@dataclasses.dataclass(frozen=True)
class EpochContext:
    """What one worker needs for its part of a custom epoch (the Trainer's
    `_train_custom` -> `custom_train_epoch`): its place among the workers, the
    exchange's actors and layout, and its batches."""
    rank: int                # this worker's position among `peers`
    world: int               # workers in the epoch
    peers: list              # every worker's actor handle, in rank order
    ps: list                 # the PS actor handles, in PS order
    layout: ExchangeLayout   # how the gradient's shards are grouped among the PS actors
    timeout_s: float         # the longest wait for one step's mean, in seconds
    seq_base: int            # the first exchange sequence number of this epoch's run
    source: RowsSource | RaySplitSource | OwnSource  # this worker's batches
    timeline: bool = False   # record each train_step's spans (dsgd/comm/timeline.py)


@dataclasses.dataclass(frozen=True)
class EpochOutcome:
    """One worker's custom epoch, back to the Trainer (`custom_train_epoch`)."""
    result: dict      # what the operator's train_epoch returned (name -> number)
    steps: int        # train_step calls (one batch each)
    num_samples: int  # rows in this worker's batches


class CustomSteps:
    """`TrainingOperator.train_step` inside a custom `train_epoch` (one per call)."""

    def __init__(self, worker, ctx: EpochContext, epoch: int | None = None):
        from dsgd.comm.ps_client import PSClient

        self.worker, self.replicas = worker, worker.replicas
        self.world, self.layout = ctx.world, ctx.layout
        self.client = PSClient(ctx.ps, [f"PS {j}" for j in range(len(ctx.ps))],
                               ctx.rank, ctx.world, ctx.timeout_s,
                               "custom train_epoch", seq_base=ctx.seq_base, peers=ctx.peers)
        self.steps = self.samples = 0
        self.epoch = epoch

    def step(self, batch) -> dict:
        """One step of every worker on this worker's `batch` (split among its
        replicas). Blocks until applied. Returns this worker's values: "loss"
        (mean over its replicas), train_batch's metrics, "num_samples"."""
        import time

        from dsgd.comm import timeline
        from dsgd.data.batching import num_rows
        from dsgd.trainer.replica import split_uneven

        replicas = self.replicas
        tl = timeline.recorder()
        started = time.perf_counter()
        rows = num_rows(batch)
        parts = split_uneven(batch, replicas.num_devices)
        if self.world == 1:
            losses, finite, metrics = replicas.local_step(parts)
            finite = finite.numpy().tolist()
            if not all(finite) and replicas.check_finite and not replicas.gate_apply:
                raise NonFiniteError(f"custom train_epoch, step {self.steps + 1}: replica(s) "
                                     f"{[i for i, f in enumerate(finite) if not f]}'s gradient "
                                     "holds NaN/Inf; the update was applied (one worker)")
        else:
            self.worker.begin_compute()  # (timeline=: the forward pass's end noted)
            losses, finite, flat, metrics = replicas.compute(parts)
            computed = time.perf_counter()
            # A dead peer ends the wait at once (ActorDiedError, which the driver's
            # policy recovers from: the epoch runs again on the new group); a hung one
            # after step_timeout_s (StepTimeoutError naming it).
            means = self.client.reduce_pieces(self.layout, replicas.shard_pieces(flat),
                                              label=f"step {self.steps + 1}")
            exchanged = time.perf_counter()
            if replicas.check_finite and not _all_finite(means):
                if not replicas.gate_apply:  # every worker sees the same mean: all raise
                    raise NonFiniteError(f"custom train_epoch, step {self.steps + 1}: the mean "
                                         "gradient holds NaN/Inf (this worker's replicas: "
                                         f"finite={finite.numpy().tolist()}); nothing applied")
            else:
                replicas.apply(means)
            if tl.on:  # (train_step's own row: the Trainer's custom epochs, by epoch step)
                to_wall = tl.to_wall
                step, end = self.steps + 1, time.perf_counter()
                for name, a, b in (("compute", started, computed),
                                   ("exchange", computed, exchanged), ("apply", exchanged, end)):
                    tl.add(name, "train_step", a + to_wall, b + to_wall, step=step,
                           epoch=self.epoch)
                self.worker.forward_backward_spans(tl, started, computed, step, "train_step",
                                              epoch=self.epoch)
        # Not counted in worker.applied_steps: that counts the engine's steps, which
        # recovery compares with the driver's count (dsgd/engine/failures.py).
        self.steps += 1
        self.samples += rows
        out = {"loss": float(np.mean(losses.numpy()))}
        out.update({k: float(np.mean(v.numpy())) for k, v in metrics.items()})
        out["num_samples"] = rows
        return out


def _all_finite(means: list) -> bool:
    return all(np.isfinite(a).all() for a in means if np.issubdtype(a.dtype, np.floating))


def custom_train_epoch(worker, ctx: EpochContext, state: FullState, epoch: int,
                       info: dict | None) -> EpochOutcome:
    """(worker side, via Worker.run) Load the epoch's starting state, then run
    replica 0's operator's `train_epoch` over this worker's batches (`ctx.source`)."""
    worker.set_full_state(state)
    worker.use_timeline(ctx.timeline)  # (timeline=: each train_step's spans)
    operator = worker.models()[0].operator
    steps = CustomSteps(worker, ctx, epoch)
    operator._stepper = steps
    try:
        result = operator.train_epoch(batches(ctx.source, worker),
                                      {"epoch": epoch, **(info or {})})
    finally:
        operator._stepper = None
    if not isinstance(result, dict):
        raise ValueError(f"{type(operator).__name__}.train_epoch must return a dict of numbers, "
                         f"got {type(result).__name__}")
    return EpochOutcome(result=result, steps=steps.steps, num_samples=steps.samples)


def custom_validate(worker, source: tuple, num_steps: int | None, info: dict | None) -> dict:
    """(worker side) Replica 0's operator's `validate` over this worker's share of
    the validation data (at most `num_steps` batches)."""
    from dsgd.trainer.replica import validation_batches

    operator = worker.models()[0].operator
    for replica in worker.models():
        replica.begin_validation(info, worker.replicas.eager)
    iterator = validation_batches(worker, source)
    if num_steps is not None:
        iterator = itertools.islice(iterator, num_steps)
    result = operator.validate(iterator, dict(info or {}))
    if not isinstance(result, dict):
        raise ValueError(f"{type(operator).__name__}.validate must return a dict of numbers, "
                         f"got {type(result).__name__}")
    return result


def batches(source, worker):
    """This worker's training batches of a custom epoch (dsgd/trainer/sources.py):
    a `RowsSource` or `RaySplitSource`, or an `OwnSource`: replica i's tf.data
    shard, the replicas' batches of a step concatenated."""
    from dsgd.trainer.replica import worker_batches
    from dsgd.trainer.sources import OwnSource

    if not isinstance(source, OwnSource):
        yield from worker_batches(source)
        return
    import tensorflow as tf

    iterators = [iter(r.own_batches()) for r in worker.models()]
    for _ in range(source.steps):
        parts = [tf.nest.map_structure(lambda t: t.numpy(), next(it)) for it in iterators]
        yield parts[0] if len(parts) == 1 else tf.nest.map_structure(
            lambda *leaves: np.concatenate(leaves), *parts)
