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

import itertools
import time

import numpy as np

from dsgd.errors import NonFiniteError, StepTimeoutError


class CustomSteps:
    """`TrainingOperator.train_step` inside a custom `train_epoch` (one per call)."""

    def __init__(self, worker, ctx: dict):
        self.worker, self.replicas = worker, worker.replicas
        self.rank, self.world = ctx["rank"], ctx["world"]
        self.ps, self.groups, self.ps_of_group = ctx["ps"], ctx["groups"], ctx["ps_of_group"]
        self.peers = ctx["peers"]
        self.timeout_s = ctx["timeout_s"]
        self.sequence = itertools.count(ctx["seq_base"])
        self.steps = self.samples = 0

    def step(self, batch) -> dict:
        """One step of every worker on this worker's `batch` (split among its
        replicas). Blocks until applied. Returns this worker's values: "loss"
        (mean over its replicas), train_batch's metrics, "num_samples"."""
        from dsgd.data.batching import num_rows
        from dsgd.trainer.replica import split_uneven

        replicas = self.replicas
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
            losses, finite, flat, metrics = replicas.compute(parts)
            means = self._exchange(replicas.shard_pieces(flat))
            if replicas.check_finite and not _all_finite(means):
                if not replicas.gate_apply:  # every worker sees the same mean: all raise
                    raise NonFiniteError(f"custom train_epoch, step {self.steps + 1}: the mean "
                                         "gradient holds NaN/Inf (this worker's replicas: "
                                         f"finite={finite.numpy().tolist()}); nothing applied")
            else:
                replicas.apply(means)
        # Not counted in worker.applied_steps: that counts the engine's steps, which
        # recovery compares with the driver's count (dsgd/engine/failures.py).
        self.steps += 1
        self.samples += rows
        out = {"loss": float(np.mean(losses.numpy()))}
        out.update({k: float(np.mean(v.numpy())) for k, v in metrics.items()})
        out["num_samples"] = rows
        return out

    def _exchange(self, pieces: list) -> list:
        import ray

        plan = self.replicas.plan
        seq = next(self.sequence)
        refs = []
        for g, group in enumerate(self.groups):
            shards = tuple(plan.shards[j] for j in group)
            part = ray.put(tuple(piece for j in group for piece in pieces[j]))
            refs.append(self.ps[self.ps_of_group[g]].reduce.remote(seq, self.rank, self.world,
                                                                   shards, part, None))
        answers = self._wait(refs, seq)
        result_refs = [a[0] for a in answers]
        results = self._wait(result_refs, seq)
        means: list = [None] * plan.num_shards
        for group, arrays in zip(self.groups, results):
            for j, array in zip(group, arrays):
                means[j] = array
        return means

    def _wait(self, refs: list, seq: int) -> list:
        """The answers of the PS calls of step `seq`; ends early when a peer worker died,
        after `timeout_s` naming who did not arrive."""
        import ray

        from dsgd.comm.waits import actor_died_errors

        pings = None
        start = time.monotonic()
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            if not pending:
                break
            if pings is None:  # a busy peer answers after its epoch; a dead one at once
                pings = {r: p.ping.remote() for r, p in enumerate(self.peers) if r != self.rank}
            for r, ping in pings.items():
                ready, _ = ray.wait([ping], timeout=0)
                if ready:
                    try:
                        ray.get(ping, timeout=1.0)
                    except actor_died_errors():
                        raise _peer_died(f"custom train_epoch, step {self.steps + 1}: worker "
                                         f"{r} died") from None
            if time.monotonic() - start > self.timeout_s:
                raise self._timeout(refs, pending, seq)
        try:
            return ray.get(list(refs), timeout=self.timeout_s)
        except actor_died_errors():
            raise _peer_died(f"custom train_epoch, step {self.steps + 1}: a PS actor "
                             "died") from None

    def _timeout(self, refs: list, pending: list, seq: int) -> StepTimeoutError:
        import ray

        late_ps = sorted({self.ps_of_group[refs.index(r)] for r in pending}) \
            if len(refs) == len(self.groups) else []
        missing: set[int] = set()
        asked = [self.ps[j].missing_ranks.remote("reduce", seq) for j in range(len(self.ps))
                 if j not in late_ps]
        if asked:
            ready, _ = ray.wait(asked, num_returns=len(asked), timeout=1.0)
            for ref in ready:
                try:
                    missing.update(ray.get(ref))
                except Exception:  # noqa: BLE001 - a dead PS names itself elsewhere
                    pass
        missing.discard(self.rank)
        who = [f"worker {r}" for r in sorted(missing)] + [f"PS {j}" for j in late_ps]
        return StepTimeoutError(
            f"custom train_epoch, step {self.steps + 1}: no mean after {self.timeout_s:.1f} s; "
            f"not arrived: {', '.join(who) or 'unknown'}", late_workers=sorted(missing),
            late_ps=late_ps)


def _peer_died(what: str) -> Exception:
    """An actor of the exchange died: reported as Ray's ActorDiedError, so that the
    driver recovers (replaces it) and runs the epoch again on the new group."""
    from ray.exceptions import ActorDiedError

    error = ActorDiedError()
    error.add_note(what + "; the epoch is run again on the new group")
    return error


def _all_finite(means: list) -> bool:
    return all(np.isfinite(a).all() for a in means if np.issubdtype(a.dtype, np.floating))


def custom_train_epoch(worker, ctx: dict, state: dict, epoch: int, info: dict | None) -> dict:
    """(worker side, via Worker.run) Load the epoch's starting state, then run
    replica 0's operator's `train_epoch` over this worker's batches (`ctx["source"]`).
    Returns {"result": what train_epoch returned, "steps", "num_samples"}."""
    worker.set_full_state(state)
    operator = worker.replicas.replicas[0].operator
    steps = CustomSteps(worker, ctx)
    operator._stepper = steps
    try:
        result = operator.train_epoch(batches(ctx["source"], worker),
                                      {"epoch": epoch, **(info or {})})
    finally:
        operator._stepper = None
    if not isinstance(result, dict):
        raise ValueError(f"{type(operator).__name__}.train_epoch must return a dict of numbers, "
                         f"got {type(result).__name__}")
    return {"result": result, "steps": steps.steps, "num_samples": steps.samples}


def custom_validate(worker, source: tuple, num_steps: int | None, info: dict | None) -> dict:
    """(worker side) Replica 0's operator's `validate` over this worker's share of
    the validation data (at most `num_steps` batches)."""
    from dsgd.trainer.replica import validation_batches

    operator = worker.replicas.replicas[0].operator
    for replica in worker.replicas.replicas:
        replica.begin_validation(info)
        replica.eager = worker.replicas.eager
    iterator = validation_batches(worker, source)
    if num_steps is not None:
        iterator = itertools.islice(iterator, num_steps)
    result = operator.validate(iterator, dict(info or {}))
    if not isinstance(result, dict):
        raise ValueError(f"{type(operator).__name__}.validate must return a dict of numbers, "
                         f"got {type(result).__name__}")
    return result


def batches(source: tuple, worker):
    """This worker's training batches of a custom epoch: ("rows", [RowSpans],
    transform, timeout_s) of a dsgd.Dataset, ("ray", split iterator, batch size,
    transform) or ("own", steps): replica i's tf.data shard, the replicas'
    batches of a step concatenated."""
    from dsgd.trainer.replica import worker_batches

    if source[0] != "own":
        yield from worker_batches(source)
        return
    import tensorflow as tf

    iterators = [iter(r.own_batches()) for r in worker.replicas.replicas]
    for _ in range(source[1]):
        parts = [tf.nest.map_structure(lambda t: t.numpy(), next(it)) for it in iterators]
        yield parts[0] if len(parts) == 1 else tf.nest.map_structure(
            lambda *leaves: np.concatenate(leaves), *parts)
