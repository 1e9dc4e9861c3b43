"""When a decided step's update runs on a worker of the overlapped exchange: at
once, in two updates as the means arrive, or inside the next step's compiled
call (`_Deferred`). A mixin of `Worker` (dsgd/worker/worker.py), which holds
`replicas`, `applied_steps` and the exchange's buckets."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any



@dataclasses.dataclass
class _Deferred:
    """An overlapped step decided and read, whose update runs in the next step's
    compiled call (Replicas.compute_sending's `deferred`): the forward pass of
    the first layers then overlaps the update of the others. Kept only within
    one exchange_steps call (flushed at its end, so that weights read between
    calls are the applied step's)."""
    exchange: Any           # the step's StepExchange (its means are released once applied)
    shards: list            # the mean of every shard, by shard index (read-only views)
    step: int               # the timeline's step number


class ApplySchedule:
    """The update of a decided step (see the module docstring). A worker that
    cannot finish a step it has begun to apply exits (`_exit_partly_applied`):
    its weights would be neither the step's nor the last."""

    def _init_apply_schedule(self) -> None:
        self.deferred_applies = 0  # steps applied so, in all
        self._deferred: _Deferred | None = None

    def _apply_arriving(self, exchange, buckets) -> float:
        """Apply the step's means as they arrive, in the order the backward pass
        made the buckets (bucket 0, the last layers', first): the buckets
        already in when the step is decided in one update, while the PS actors
        still sum the later ones, which are applied in a second update once
        in (Replicas.apply_stage keeps the two exactly one update); everything
        in one update when all or none are in, or when the optimizers cannot
        be applied in parts (`per_group_blocker`). A worker that cannot finish
        a step it has begun to apply exits: its weights would be neither the
        step's nor the last (the driver recovers it like any dead worker).
        When another step follows in this exchange_steps call (and the plan's
        update runs "in the next call"), the means are only read: the step is applied, whole, in
        the next step's compiled call, beside its forward pass (`_Deferred`).
        Returns the seconds spent applying here."""
        from dsgd.comm import timeline

        tl = timeline.recorder()
        step = exchange.seq & ((1 << 32) - 1)
        count = len(buckets.groups)
        if self.plan.update == "in the next call" and self._next_in_call:
            means = self._read_means(exchange, buckets, tuple(range(count)))
            self._deferred = _Deferred(exchange, [means[j] for j in range(len(means))], step)
            return 0.0  # (counted in applied_steps once applied: `_deferred_applied`)
        stages = [tuple(range(count))]  # one update of everything, unless:
        if self.plan.update != "now" and self.plan.stages:
            ready = exchange.ready_prefix()
            nbytes = [sum(self.replicas.plan.shards[j].nbytes for j in g) for g in buckets.groups]
            if 0 < ready and sum(nbytes[ready:]) >= self.plan.split_min_share * sum(nbytes):
                # (two updates: more cost more than they hide, measured: benchmarks/README.md)
                stages = [tuple(range(ready)), tuple(range(ready, count))]
        groups = tuple(tuple(j for b in stage for j in buckets.groups[b]) for stage in stages)
        means: dict = {}
        apply_s, begun = 0.0, False
        try:
            for k, stage in enumerate(stages):
                means.update(self._read_means(exchange, buckets, stage))
                arrived = time.perf_counter()
                if len(stages) == 1:
                    self.replicas.apply([means[j] for j in range(self.replicas.plan.num_shards)])
                else:
                    begun = self.replicas.apply_stage(groups, k, means) or begun
                applied = time.perf_counter()
                apply_s += applied - arrived
                if tl.on:
                    to_wall = tl.to_wall
                    tl.add(f"apply group {', '.join(map(str, stage))}", "apply",
                           arrived + to_wall, applied + to_wall, step=step)
        except BaseException as e:
            if begun:
                self._exit_partly_applied(e)
            raise
        self.applied_steps += 1
        return apply_s

    def _read_means(self, exchange, buckets, stage) -> dict:
        """{shard index: mean} of the buckets in `stage`, read in parallel
        (StepExchange.read), then each from there; the timeline's receive spans (the
        stage's first bucket's holds the parallel read). Blocks (StepExchange.read)."""
        from dsgd.comm import timeline

        tl = timeline.recorder()
        step = exchange.seq & ((1 << 32) - 1)
        means: dict = {}
        reading = time.perf_counter()
        exchange.read(stage)
        for b in stage:
            waited = reading if b == stage[0] else time.perf_counter()
            means.update(zip(buckets.groups[b], exchange.mean(b)))
            if tl.on:
                to_wall = tl.to_wall
                tl.add(f"receive group {b}", "receive", waited + to_wall,
                       time.perf_counter() + to_wall, step=step)
        return means

    def _deferred_applied(self, deferred: _Deferred, started: float) -> None:
        """`deferred` was applied, whole, in the compiled call begun at `started`
        (compute_sending): release its means and draw the timeline's apply span
        (from the call's start to the end of the update)."""
        from dsgd.comm import timeline

        self._deferred = None
        self.applied_steps += 1
        self.deferred_applies += 1
        deferred.exchange.release_means()
        tl = timeline.recorder()
        if tl.on and self.replicas.applied_at is not None:
            to_wall = tl.to_wall
            tl.add(f"apply group {', '.join(map(str, range(len(self._buckets.groups))))} "
                   "(in the next step's call)", "apply", started + to_wall,
                   self.replicas.applied_at + to_wall, step=deferred.step)

    def _apply_deferred(self) -> None:
        """Apply a decided step kept for the next step's compiled call (`_Deferred`)
        now: the call's last step, or the next did not get that far. An error
        applying it is raised, as `apply` raises it for a step applied at once."""
        from dsgd.comm import timeline

        deferred = self._deferred
        if deferred is None:
            return
        started = time.perf_counter()
        self._deferred = None
        try:
            self.replicas.apply(deferred.shards)
        finally:
            deferred.exchange.release_means()
        self.applied_steps += 1
        tl = timeline.recorder()
        if tl.on:
            to_wall = tl.to_wall
            tl.add(f"apply group {', '.join(map(str, range(len(self._buckets.groups))))}",
                   "apply", started + to_wall, time.perf_counter() + to_wall, step=deferred.step)

    def _step_number(self) -> int:
        """The number of the step this worker is at: the steps it has applied, and
        one decided and kept for the next call's update (`_Deferred`), plus one."""
        return self.applied_steps + (self._deferred is not None) + 1

    def _exit_partly_applied(self, e: BaseException, step: int | None = None) -> None:
        import sys
        import traceback

        step = self.applied_steps + 1 if step is None else step
        print(f"dsgd worker {self.worker_index}: exiting: step {step} "
              f"was partly applied when {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
