"""The units the step loop (dsgd/engine/loop.py) submits to the workers when the
workers do not exchange by themselves (dsgd/engine/worker_steps.py does, for
strategy "ps" with several workers).

`ExchangeStep`: one step of strategy "simple", the driver-side reference, in
phases: `submit` (each worker starts `compute`, a streaming generator: its
report, then its gradient shard groups as they are written), `reports` (the
reports), `exchange` (each group gathered and averaged here, every worker's
apply submitted), `finish` (the applies waited for).

`LocalSteps`: up to `local_steps_per_call` steps of one worker in one call of
`Worker.local_steps` (no exchange): Ray's cost per call is paid once for all.

Both turn what the workers report into `StepResult`s, one per step.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from dsgd.comm import timeline
from dsgd.comm.means import group_means
from dsgd.comm.reports import StepRaised, StepReport, StepSummary
from dsgd.comm.waits import Deadline, actor_died_errors, fetch, ready
from dsgd.config import Config
from dsgd.engine.actors import ActorSet
from dsgd.engine.stragglers import Stragglers
from dsgd.engine.state import Topology
from dsgd.errors import DsgdError, StepTimeoutError

logger = logging.getLogger("dsgd")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One step as the loop yields it.

    infos: the contributors' reports (StepReport: losses, finite, metrics,
        samples, timings), in worker order (every worker's without backup workers);
        None for a step that had been applied when a failure interrupted it.
    apply_s: each waited-for worker's seconds applying the step; [] at an
        epoch's end.
    workers: the workers the step's data was shared among (one batch each).
    skipped: not applied (a non-finite gradient under on_nonfinite="skip").
    epoch_end: the data's epoch ended instead of a step.
    step_s: one worker's call of several steps: its wall time per step.
    error: a step of a call of several that raised after the steps before it
        were applied (the loop counts those, then raises this).
    contributors: the worker slots whose gradients make the step's mean (sorted);
        None: every worker of the step (`infos` in slot order).
    dropped: the other slots of the step (backup workers: late, sat out, or
        reported after the contributors were chosen).
    dead: slots found dead during the step (backup workers: replaced in the
        background, the step completed without them).
    dropped_rows: (slot, rows or None) of each batch left out of the mean, for the
        loop to count with the step.
    halted: not applied: a non-finite gradient under on_nonfinite="raise" with
        several workers (the loop raises NonFiniteError; nothing is counted).
    failure: an actor died or hung (or a PS ended the exchange) after the
        results before this one were applied: the loop recovers from it.
    summary: instead of `infos` (then None), every worker's totals of the step
        from one worker (a StepSummary, dsgd/comm/reports.py `step_summary`).
    tallies: with `summary`, on the last step of a call: {worker position:
        its figures over the call's steps} (dsgd/comm/reports.py).
    """

    infos: list[StepReport] | None
    apply_s: list[float]
    workers: int
    skipped: bool = False
    epoch_end: bool = False
    step_s: float | None = None
    error: BaseException | None = None
    contributors: list[int] | None = None
    dropped: list[int] = dataclasses.field(default_factory=list)
    dead: list[int] = dataclasses.field(default_factory=list)
    dropped_rows: list = dataclasses.field(default_factory=list)
    halted: bool = False
    failure: BaseException | None = None
    summary: StepSummary | None = None
    tallies: dict | None = None


def record_call(unit) -> None:
    """timeline=: a unit's call of steps (ExchangeStep, WorkerSteps) on the driver's
    "calls" row, from its submission to now (its `_recorder`: OFF records nothing)."""
    unit._recorder.add(unit.label, "calls", unit._submitted_at, time.time(),
                       workers=len(unit.workers))


class ExchangeStep:
    """One step of several workers (see the module docstring). `data`: one
    argument per worker (None: each replica's get_batch). With backup workers
    (`stragglers.enabled`) only the free workers compute, the step's mean is
    over the first `need` of them to report, and its applies go to every
    worker, the late ones' owed (dsgd/engine/stragglers.py)."""

    exchanges = True
    size = 1

    def __init__(self, config: Config, actors: ActorSet, topology: Topology, data: list,
                 number: int, stragglers: Stragglers, need: int | None = None,
                 recorder=timeline.OFF):
        self.config, self.actors, self.topology = config, actors, topology
        # timeline=: the driver's row ("calls": the step; "relay": each group's mean,
        # made here once every contributor has written it)
        self._recorder, self._submitted_at = recorder, time.time()
        self.data, self.label = data, f"step {number}"
        self.stragglers = stragglers
        self.workers = actors.workers
        self.slots = actors.slots
        self.need = need if need is not None else len(self.workers)
        # longer while a worker that joined running ones traces alone (Config.steps_timeout_s)
        self.timeout_s = config.steps_timeout_s(actors.new_to_steps(self.workers))
        self.start = time.perf_counter()
        self._running: list[int] = []      # indices into workers that compute this step
        self._streams: list = []           # their compute streams
        self._chosen: list[int] = []       # indices (sorted) of the contributors
        self._late: list[int] = []         # indices still computing when they were chosen
        self._dead: list[int] = []         # indices found dead while computing
        self._died_error: BaseException | None = None  # the last such death's error
        self._infos: list[StepReport] | None = None
        self._extra: dict[int, StepReport] = {}  # index -> report of a worker dropped on time
        self._apply_refs: list | None = None  # submitted applies, not yet waited for
        self._apply_owners: list = []
        self._dropped_rows: list[tuple] = []  # (slot, rows or None) left out of the mean

    def time_left(self) -> float:
        return max(0.001, self.timeout_s - (time.perf_counter() - self.start))

    def restart_clock(self) -> None:
        """The driver waits for this step from now on. A step submitted ahead ran
        while the driver did other work (the step before it, the caller's code
        between steps, replacing a PS): that time is not the step's, so its
        `timeout_s` starts again here."""
        self.start = time.perf_counter()

    def submit(self) -> ExchangeStep:
        if self.stragglers.enabled:
            self._running = self.stragglers.free(self.workers, self.slots)
        else:
            self._running = list(range(len(self.workers)))
        self._streams = [self.workers[k].compute.options(num_returns="streaming").remote(
            self.topology.groups, self.data[k], self._recorder.on) for k in self._running]
        return self

    @property
    def _contributors(self) -> list:
        return [self.workers[k] for k in self._chosen]

    def _contributor_streams(self) -> list:
        return [self._streams[self._running.index(k)] for k in self._chosen]

    def reports(self) -> list[dict]:
        """The contributors' reports of their computed gradients, in worker order
        (blocks: for every worker, or with backup workers for the first `need`)."""
        if self._infos is None:
            what = f"{self.label}: computing gradients"
            if not self.stragglers.enabled:
                workers = [self.workers[k] for k in self._running]
                refs = self.actors.next_all(self._streams, workers, what, self.time_left())
                self._infos = self.actors.wait(refs, workers, what, self.time_left())
                self._chosen = list(self._running)
            else:
                self._first_reports(what)
        return self._infos

    def _first_reports(self, what: str) -> None:
        """Backup workers: wait for the first `need` reports; the others are late
        (or, when they were ready together, dropped on time). A worker found dead
        is left out; when too few others are computing, workers that were late
        are given the step as soon as they are free (they have applied every
        step before it by then), and only when none is left does the death
        become a failure to recover from."""

        died = actor_died_errors()
        pending: dict[int, int] = {}  # id(stream) -> index into workers
        streams: dict[int, object] = {}
        for k, stream in zip(self._running, self._streams):
            pending[id(stream)], streams[id(stream)] = k, stream
        arrived: dict[int, dict] = {}
        def stalled(_, waited_s: float) -> None:
            computing = sorted(self.actors.name(self.workers[k]) for k in pending.values())
            logger.warning("stall: %s: %d of the %d workers the step needs answered after "
                           "%.0f s; computing: %s", what, len(arrived), self.need, waited_s,
                           ", ".join(computing))

        deadline = Deadline(what, self.time_left(), stall_s=self.config.stall_report_s,
                            on_stall=stalled)
        while len(arrived) < self.need:
            if len(arrived) + len(pending) < self.need and \
                    not self._recruit(pending, streams, deadline):
                raise self._dead_error()
            # A late worker that becomes free while the step still waits is given it too
            # (the first `need` reports still make the mean): a slow or hung worker of a
            # step with no spare does not set its pace when a late one can stand in.
            self._recruit(pending, streams)
            busy = self.stragglers.busy_objects(self.workers)
            waiting = [streams[key] for key in pending]
            answered = deadline.wait(waiting + busy, num_returns=1)[0]
            answered = [r for r in answered if id(r) in pending]
            if not answered:
                if deadline.over():
                    late = [self.workers[k] for k in pending.values()]
                    raise StepTimeoutError(
                        f"{what}: only {len(arrived)} of the {self.need} workers the step needs "
                        f"answered in {self.timeout_s:.1f} s; no answer from "
                        f"{', '.join(sorted(self.actors.name(w) for w in late))}", late)
                continue
            for stream in answered:
                k = pending.pop(id(stream))
                try:
                    arrived[k] = fetch(next(stream), f"{what}: worker {self.slots[k]}'s report",
                                       self.time_left())
                except died as e:
                    self._dead.append(k)
                    self._died_error = e
                    self.stragglers.dead(self.workers[k], self.slots[k])
        # Workers whose report is in too are dropped on time, the rest are late.
        if pending:
            for stream in ready([streams[key] for key in pending])[0]:
                k = pending.pop(id(stream))
                try:
                    self._extra[k] = fetch(next(stream),
                                           f"{what}: worker {self.slots[k]}'s report")
                except died:
                    self._dead.append(k)
                    self.stragglers.dead(self.workers[k], self.slots[k])
        self._chosen = sorted(arrived)
        self._late = sorted(pending.values())
        for key, k in pending.items():
            # get_batch: its rows are known once its report arrives; a dataset's
            # share is known now (_count_dropped).
            self.stragglers.late(self.workers[k], self.slots[k], streams[key],
                                 count_rows=self.data[k] is None)
        self._infos = [arrived[k] for k in self._chosen]

    def _recruit(self, pending: dict, streams: dict, deadline: Deadline | None = None) -> bool:
        """Give the step to late workers as they become free (with a `deadline`,
        waits for one, at most until it ends). False when none was given it (and,
        with a `deadline`, no worker is left to ask)."""

        while True:
            free = [k for k in self.stragglers.free(self.workers, self.slots)
                    if k not in self._running]
            if free:
                for k in free:
                    stream = self.workers[k].compute.options(num_returns="streaming").remote(
                        self.topology.groups, self.data[k], self._recorder.on)
                    self._running.append(k)
                    self._streams.append(stream)
                    pending[id(stream)], streams[id(stream)] = k, stream
                return True
            busy = self.stragglers.busy_objects(self.workers)
            if deadline is None or not busy or deadline.over():
                return False
            deadline.wait(busy, num_returns=1)

    def _dead_error(self) -> BaseException:
        """Too few workers left for the step: the death (recovered like any), or,
        when late workers never became free, a StepTimeoutError naming them."""
        late = self.stragglers.busy_handles(self.workers)
        if late:
            return StepTimeoutError(
                f"{self.label}: fewer than {self.need} workers could compute the step in "
                f"{self.timeout_s:.1f} s; late: "
                f"{', '.join(sorted(self.actors.name(w) for w in late))}", late)
        if self._died_error is not None:
            return self._died_error
        return DsgdError(f"{self.label}: fewer than {self.need} workers can compute the step")

    def result(self, **flags) -> StepResult:
        """This step, ended before any apply (an epoch end, or a skipped step:
        the streams' shards are dropped)."""
        applied = [] if flags.get("epoch_end") else [0.0]
        return StepResult(self.reports(), applied, len(self.workers),
                          **self._membership(), **flags)

    def membership(self) -> dict:
        """Backup workers: the StepResult fields naming who made the step's mean
        ({} before the contributors were chosen, or without backup workers)."""
        if not self.stragglers.enabled or self._infos is None:
            return {}
        return self._membership()

    def _membership(self) -> dict:
        if not self.stragglers.enabled:
            return {}
        contributors = [self.slots[k] for k in self._chosen]
        return {"contributors": contributors, "dropped_rows": list(self._dropped_rows),
                "dropped": [s for s in sorted(set(range(self.config.num_workers)) | set(self.slots))
                            if s not in contributors],
                "dead": [self.slots[k] for k in self._dead]}

    def exchange(self) -> None:
        """Each shard group's mean, made here as soon as every contributor has
        written the group, then every live worker's apply submitted (Ray runs
        them in order behind the worker's compute)."""
        import ray

        topology = self.topology
        contributors, streams = self._contributors, self._contributor_streams()
        mean_refs = []
        for g, shards in enumerate(topology.group_shards):
            waited = time.time() if self._recorder.on else 0.0
            refs = self.actors.next_all(streams, contributors,
                                        f"{self.label}: writing shard group {g}", self.time_left())
            worker_groups = self.actors.wait(refs, contributors, f"{self.label}: gathering "
                                             f"shard group {g}", self.time_left())
            mean_refs.append(ray.put(group_means(shards, worker_groups)))
            self._recorder.add(f"gather and average group {g}", "relay", waited,
                               time.time(), workers=len(refs))
        self._count_dropped()
        dead = set(self._dead)
        appliers = [w for k, w in enumerate(self.workers)
                    if k not in dead and not self.stragglers.is_dead(w)]
        refs = [w.apply.remote(topology.groups, *mean_refs) for w in appliers]
        # Late workers apply behind their compute: nothing waits for them now.
        self._apply_refs, self._apply_owners = [], []
        for w, ref in zip(appliers, refs):
            if self.stragglers.is_busy(w):
                self.stragglers.owe(w, ref)
            else:
                for owed in self.stragglers.owed(w):
                    self._apply_refs.append(owed)
                    self._apply_owners.append(w)
                self._apply_refs.append(ref)
                self._apply_owners.append(w)

    def _count_dropped(self) -> None:
        """Backup workers: one dropped batch for every worker left out of this
        step that computed one, or, with a dataset, whose share of rows it skips
        (slots missing from the set too), with its rows; counted by the loop when
        it counts the step. A late worker's get_batch batch is counted when its
        report arrives (its rows are not known before)."""
        if not self.stragglers.enabled:
            return
        chosen, running = set(self._chosen), set(self._running)
        share = self._infos[0].samples if self._infos else 0
        dataset = any(d is not None for d in self.data)
        rows = []
        for k, slot in enumerate(self.slots):
            if k in chosen:
                continue
            if k in self._extra:
                rows.append((slot, self._extra[k].samples))
            elif k in self._late:
                if self.data[k] is not None:  # get_batch: counted when its report arrives
                    rows.append((slot, share))
            elif k not in running or k in self._dead:
                if self.data[k] is not None:  # a dataset: its share of rows is skipped
                    rows.append((slot, share))
                elif k in self._dead:
                    rows.append((slot, None))
        if dataset:  # slots missing from the set (being replaced, elastic) skip theirs too
            rows += [(slot, share) for slot in range(self.config.num_workers)
                     if slot not in self.slots]
        self._dropped_rows = rows

    @property
    def applies_pending(self) -> bool:
        """Whether applies were submitted and not waited for."""
        return self._apply_refs is not None

    def finish(self) -> list[StepResult]:
        """Waits for the applies (blocks, at most what is left of `timeout_s`),
        not for those of late workers."""
        try:
            return self._finish()
        finally:
            record_call(self)

    def _finish(self) -> list[StepResult]:
        refs, self._apply_refs = self._apply_refs, None
        applied = self.actors.wait(refs, self._apply_owners, f"{self.label}: applying",
                                   self.time_left())
        return [StepResult(self.reports(), applied, len(self.workers), **self._membership())]


class LocalSteps:
    """Several steps of one worker in one actor call (`Worker.local_steps`).
    `run_id` ties the calls of one loop together: after a step that stops the
    call (a non-finite gradient under "raise", or a step that raised), the
    worker runs nothing more of that run."""

    exchanges = False

    def __init__(self, config: Config, actors: ActorSet, data: list, run_id: int,
                 first_number: int):
        self.config, self.actors, self.data, self.run_id = config, actors, data, run_id
        self.label = (f"step {first_number}" if len(data) == 1
                      else f"steps {first_number}-{first_number + len(data) - 1}")
        self.workers = actors.workers
        # longer for a replacement's first call (Config.steps_timeout_s)
        self.timeout_s = config.steps_timeout_s(actors.new_to_steps(self.workers))
        self.start = time.perf_counter()  # its steps began (for step_s)
        self._clock = self.start          # step_timeout_s counts from here
        self._ref = None

    @property
    def size(self) -> int:
        return len(self.data)

    def _membership(self) -> dict:
        """Backup workers with one live worker (the others being replaced): its own
        steps, the others' slots dropped."""
        if not self.config.backup_workers:
            return {}
        slot = self.actors.slots[0]
        return {"contributors": [slot],
                "dropped": [s for s in range(self.config.num_workers) if s != slot]}

    def submit(self) -> LocalSteps:
        self._ref = self.workers[0].local_steps.remote(self.data, self.run_id,
                                                       self.config.timeline is not None)
        return self

    def started(self) -> None:
        """Its steps begin now (the call before it has ended): restart both clocks."""
        self.start = self._clock = time.perf_counter()

    def restart_clock(self) -> None:
        """The driver waits for this call from now on: the caller's code between
        steps does not count against step_timeout_s (see ExchangeStep)."""
        self._clock = time.perf_counter()

    @property
    def applies_pending(self) -> bool:
        return self._ref is not None

    def finish(self) -> list[StepResult]:
        """One result per step run (fewer than submitted at an epoch's end, after a
        non-finite gradient under "raise", or at a step that raised). Waits at
        most step_timeout_s per step."""
        ref, self._ref = self._ref, None
        timeout = self.timeout_s * self.size - (time.perf_counter() - self._clock)
        infos = self.actors.wait([ref], self.workers, self.label, max(0.001, timeout))[0]
        step_s = (time.perf_counter() - self.start) / max(1, len(infos))
        results = []
        for info in infos:
            if isinstance(info, StepRaised):
                results.append(StepResult(None, [], 1, error=info.error))
            elif info.epoch_end:
                results.append(StepResult([info], [], 1, epoch_end=True))
            else:
                results.append(StepResult([info], [0.0], 1,
                                          skipped=not info.applied, step_s=step_s,
                                          **self._membership()))
        return results


def workers_exchange(config: Config, num_workers: int) -> bool:
    """Whether steps go through the workers' own exchange (WorkerSteps): strategy
    "ps" and several workers (backup workers too)."""
    return config.strategy == "ps" and num_workers > 1
