"""`WorkerSteps`: steps of several workers that exchange by themselves (driver side).

Under strategy "ps" every worker runs `Worker.exchange_steps`: it computes its
gradient, sends each group to its PS through its own `PSClient`, reads every
mean back, decides the step with every other worker alike
(dsgd/comm/commit.py) and applies it, step after step. The driver starts one
call of up to `size` steps per worker and reads one list of small reports per
worker per call: its work per step is O(N / size) calls and reports, and
nothing per PS or per gradient group (the driver-relayed `ExchangeStep` made
O(N * P) stream items, P calls and N applies per step).

When something fails (a worker or PS died, a peer hung, a worker's step
raised), the workers that notice stop with what they applied reported; the
driver tells the PS actors to give up the attempt (`ps_client.abandon`), so
that the workers still waiting in it return at once, collects what every
worker applied, and hands the failure to the loop's recovery. A step is
counted once every surviving worker reports it applied (or skipped).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from dsgd.comm import ps_client, timeline
from dsgd.comm.reports import CompactAnswer, StepFailed, StepRaised, StepReport
from dsgd.comm.waits import Deadline, actor_died_errors, fetch, outcomes, ready
from dsgd.config import Config
from dsgd.engine.actors import ActorSet
from dsgd.engine.stragglers import Stragglers
from dsgd.engine.step import StepResult, record_call
from dsgd.errors import DsgdError, StepTimeoutError

logger = logging.getLogger("dsgd")

# After a failure is known, how long the driver still waits for the other workers'
# reports (they return at once once the attempt is abandoned; one that does not is hung).
FAILURE_GRACE_S = 5.0


class Attempts:
    """The attempt that exchange numbers belong to (dsgd/comm/ps_client.py
    `sequence_number`): a new one whenever the driver gives one up, so that the
    steps retried after a failure never meet the parts of the failed attempt."""

    def __init__(self):
        self.current = 1

    def give_up(self, ps: list) -> None:
        """Have the PS actors `ps` end the current attempt's exchanges (the workers
        waiting in them return at once) and start a new attempt. Does not wait."""
        ps_client.abandon(ps, self.current)
        self.current += 1


class WorkerSteps:
    """Up to `size` steps of every worker in one `exchange_steps` call each.
    `datas[i][k]`: worker k's data argument for step i (None: get_batch; `datas`
    None: get_batch for every step of every worker);
    `seqs[i]`: step i's exchange number (in `attempts.current`)."""

    exchanges = False  # nothing for the driver to do between a step's compute and apply

    def __init__(self, config: Config, actors: ActorSet, datas: list[list] | None, seqs: list[int],
                 attempts: Attempts, run_id: int, first_number: int,
                 stragglers: Stragglers | None = None, recorder=timeline.OFF):
        self.config, self.actors = config, actors
        self.datas, self.seqs, self.attempts, self.run_id = datas, seqs, attempts, run_id
        self.attempt = attempts.current
        # Backup workers: the driver reads the calls of `reporters` (up to b + 1 workers
        # that were not late when it began) and waits for no other (see `_finish_backups`).
        self.stragglers = stragglers if stragglers is not None and stragglers.enabled else None
        self._reporters = [0]
        self._recorder, self._submitted_at = recorder, time.time()
        self.label = (f"step {first_number}" if len(seqs) == 1
                      else f"steps {first_number}-{first_number + len(seqs) - 1}")
        self.workers = actors.workers
        # Each step's wait: step_timeout_s, or longer while a worker that joined running
        # ones has not ended a call of steps (it traces alone: Config.first_steps_timeout_s).
        self._first = actors.new_to_steps(self.workers)
        self.timeout_s = config.steps_timeout_s(self._first)
        self.start, self._clock = time.perf_counter(), time.monotonic()
        self._refs: list | None = None

    @property
    def size(self) -> int:
        return len(self.seqs)

    def submit(self) -> WorkerSteps:
        # Compact answers (dsgd/comm/reports.py): worker 0 sums every worker's
        # figures per step, each worker its own per call.
        if self.stragglers is not None:
            self.stragglers.on_result = self._late_result
            # b + 1 reporters, the free ones first: losing all of them means more than b
            # workers died, when the steps cannot be made anyway.
            free = [k for k, w in enumerate(self.workers) if not self.stragglers.is_busy(w)]
            busy = [k for k in range(len(self.workers)) if k not in free]
            self._reporters = (free + busy)[:self.stragglers.backup_workers + 1]
        self._refs = [w.exchange_steps.remote(None if self.datas is None
                                              else [d[k] for d in self.datas], self.seqs,
                                              self.run_id, True, k in self._reporters,
                                              self.timeout_s if self._first else None)
                      for k, w in enumerate(self.workers)]
        return self

    def started(self) -> None:
        """Its steps begin now (the call before it has ended): restart both clocks."""
        self.start, self._clock = time.perf_counter(), time.monotonic()

    def restart_clock(self) -> None:
        """The driver waits for this call from now on (see ExchangeStep.restart_clock)."""
        self._clock = time.monotonic()

    @property
    def applies_pending(self) -> bool:
        return self._refs is not None

    def membership(self) -> dict:
        return {}

    def finish(self) -> list[StepResult]:
        """One result per step every surviving worker ran (blocks, at most
        `timeout_s` per step, or FAILURE_GRACE_S past a failure); a last
        result with `failure` when an actor died or hung, or the error of a step
        that raised after the steps before it were applied (raised here when
        none was)."""
        try:
            return self._finish()
        finally:
            record_call(self)

    def _finish(self) -> list[StepResult]:
        if self.stragglers is not None:
            results = self._finish_backups()
            if results is not None:
                return results
        outcome, pending = self._collect(*self._partial)
        step_s = (time.perf_counter() - self.start) / max(1, self.size)
        failure = self._failure(outcome, pending)
        if self.stragglers is not None:
            return self._backup_failure_results(outcome, failure, step_s)
        compact = {k: out for k, out in outcome.items() if isinstance(out, CompactAnswer)}
        if failure is None and len(compact) == len(self.workers) and compact[0].steps:
            return self._summaries(compact, step_s)
        reports = {k: out for k, out in outcome.items() if isinstance(out, list)}
        errors = [out for out in outcome.values() if isinstance(out, BaseException)]
        # Rows of workers whose call failed (a death) for the steps they applied
        # before it, and of those that answered in compact form while others
        # failed, rebuilt from the metas a survivor received with the means.
        lost = [k for k in range(len(self.workers)) if k not in reports]
        survivors = sorted(reports) + sorted(compact)
        rebuilt = self._rebuilt_rows(survivors[0], lost) \
            if (failure is not None or compact) and lost and survivors else {}
        for k, out in compact.items():
            reports[k] = [dataclasses.replace(rebuilt[(seq, k)],
                                              decision="skip" if i in out.skipped else "apply")
                          if (seq, k) in rebuilt else None for i, seq in enumerate(self.seqs)]
        reports = dict(sorted(reports.items()))
        if failure is None and errors:
            raise _first(errors)  # the first step of every worker raised: nothing applied
        results = []
        for i in range(self.size if reports else 0):
            rows = [out[i] if i < len(out) else None for out in reports.values()]
            if any(r is None or isinstance(r, StepFailed) for r in rows):
                break
            raised = [r.error for r in rows if isinstance(r, StepRaised)]
            if raised:
                results.append(StepResult(None, [], len(self.workers), error=_first(raised)))
                return results
            if any(r.epoch_end for r in rows):
                results.append(StepResult(rows, [], len(self.workers), epoch_end=True))
                return results
            decision = reports[min(reports)][i].decision
            rows = [reports[k][i] if k in reports else rebuilt.get((self.seqs[i], k))
                    for k in range(len(self.workers))]
            rows = [r for r in rows if r is not None]
            applied = [r.apply_s for r in rows]
            if decision == "halt":
                results.append(StepResult(rows, applied, len(self.workers), halted=True))
                return results
            results.append(StepResult(rows, applied, len(self.workers),
                                      skipped=decision != "apply", step_s=step_s))
        if failure is not None:
            results.append(StepResult(None, [], len(self.workers), failure=failure))
        elif len(results) < self.size and not any(r.epoch_end for r in results):
            raise DsgdError(f"{self.label}: the workers ran {len(results)} of {self.size} steps "
                            "and named no failure (an exchange of a given-up attempt?)")
        return results

    def _summaries(self, compact: dict, step_s: float) -> list[StepResult]:
        """Every worker ran every step (the usual case): one result per step from
        worker 0's totals, each worker's figures on the last (O(1) per step)."""
        rows = compact[0].steps
        tallies = {k: out.tally for k, out in compact.items()}
        return [StepResult(None, [row.apply_s], len(self.workers),
                           skipped=row.decision != "apply", step_s=step_s, summary=row,
                           tallies=tallies if i == len(rows) - 1 else None)
                for i, row in enumerate(rows)]

    def _rebuilt_rows(self, survivor: int, lost: list[int]) -> dict:
        """{(exchange number, worker position): report row} for the `lost` workers,
        from the record of every worker's meta of the worker at position
        `survivor` (Worker.recent_reports); empty if it cannot say (their rows
        are then left out)."""

        survivor = self.workers[survivor]
        try:
            metas = fetch(survivor.recent_reports.remote(self.seqs),
                          f"{self.label}: {self.actors.name(survivor)}'s record of the metas",
                          self.config.step_timeout_s)
        except Exception:  # noqa: BLE001 - the survivors' rows still count the step
            return {}
        rows = {}
        for seq, step_metas in metas.items():
            for k in lost:
                meta = step_metas[k] if k < len(step_metas) else None
                if meta is None or meta.report is None:
                    continue
                rows[(seq, k)] = dataclasses.replace(meta.report, data_s=0.0, compute_s=0.0,
                                                     finite=list(meta.finite), rebuilt=True)
        return rows

    # -- backup workers ---------------------------------------------------------------------
    _partial: tuple = ()  # (outcome, pending) read before a failure (`_finish_backups`)

    def _finish_backups(self) -> list[StepResult] | None:
        """Backup workers: the steps' results from the first reporter whose call
        ends (its compact answer holds every step's contributors and totals);
        the calls of the other workers that have not ended yet are late
        (Stragglers: read when they end, a dead one replaced in the background,
        a hung one past step_timeout_s named or replaced). None when a call
        failed (an error, a failed exchange, no reporter left): the caller then
        goes on as without backup workers, from what was read (`_partial`)."""

        refs = self._refs
        died = actor_died_errors()
        index = {ref.hex(): k for k, ref in enumerate(refs)}
        outcome: dict[int, object] = {}
        pending = list(refs)
        deadline = self._deadline(index)
        answer = None
        while pending and answer is None and not deadline.over():
            answered, pending = deadline.wait(pending, num_returns=1)
            # each a report, a death or the worker's own error
            for ref, out in zip(answered, outcomes(answered, self.label,
                                                   self.config.step_timeout_s)):
                outcome[index[ref.hex()]] = out
            if any(not isinstance(out, died) and _failed(out) for out in outcome.values()):
                break
            answers = [k for k in self._reporters if isinstance(outcome.get(k), CompactAnswer)]
            if answers:
                answer = outcome[answers[0]]
            elif all(isinstance(outcome.get(k), died) for k in self._reporters):
                break  # no reporter left to say what the steps were
            elif not answered:
                self.actors.check_open(self.label)
        if answer is None:
            self._partial = (outcome, pending)
            return None
        answered, pending = ready(pending)
        for ref, out in zip(answered, outcomes(answered, self.label, self.config.step_timeout_s)):
            outcome[index[ref.hex()]] = out
        self._refs = None
        for k, out in sorted(outcome.items()):
            handle, slot = self.workers[k], self.actors.slots[k]
            if isinstance(out, died):
                logger.warning("worker %d died (backup workers: the steps went on without it); "
                               "it is replaced in the background", slot)
                self.stragglers.dead(handle, slot)
            elif not self.stragglers.is_busy(handle) and not self._late_result(slot, out):
                self.stragglers._replace(handle, slot)
            elif self.stragglers.is_busy(handle):
                self.stragglers.owe(handle, refs[k])  # read in order behind its earlier calls
        for ref in pending:
            k = index[ref.hex()]
            handle, slot = self.workers[k], self.actors.slots[k]
            if self.stragglers.is_busy(handle):
                self.stragglers.owe(handle, ref)
            else:
                self.stragglers.late(handle, slot, ref)
        results = self._backup_results(answer, (time.perf_counter() - self.start)
                                       / max(1, self.size))
        if any(r.epoch_end for r in results) and self.datas is not None:
            # The next epoch's first step starts every worker's share together.
            self.stragglers.wait_free(self.workers, self.config.step_timeout_s)
        return results

    def _backup_failure_results(self, outcome: dict, failure: BaseException | None,
                                step_s: float) -> list[StepResult]:
        """Backup workers, a call that failed: the steps the survivor furthest on
        applied or skipped (late workers are behind it: the recovery brings them
        to its state, dsgd/engine/failures.py), then the failure or the error."""
        died = actor_died_errors()
        errors = [out for out in outcome.values()
                  if isinstance(out, BaseException) and not isinstance(out, died)]
        errors += [out[-1].error for out in outcome.values()
                   if isinstance(out, list) and out and isinstance(out[-1], StepRaised)]
        best: list = []
        for out in outcome.values():
            rows = _step_rows(out)
            if len(rows) > len(best):
                best = rows
        if any(contributors is None for _, contributors, _ in best):
            best = self._with_contributors(best, outcome)
        if failure is None and errors and not best:
            raise _first(errors)  # the first step raised everywhere it ran: nothing applied
        results = []
        for decision, contributors, summary in best:
            dropped = [] if contributors is None else \
                [s for s in range(self.config.num_workers) if s not in contributors]
            results.append(StepResult(None, [0.0],
                                      len(self.workers), skipped=decision != "apply",
                                      step_s=step_s, summary=summary, contributors=contributors,
                                      dropped=dropped))
        if failure is not None:
            results.append(StepResult(None, [], len(self.workers), failure=failure))
        elif errors:
            results.append(StepResult(None, [], len(self.workers), error=_first(errors)))
        return results

    def _with_contributors(self, rows: list, outcome: dict) -> list:
        """`rows` (from a worker that was no reporter) with each step's contributors,
        read from a survivor's record of the steps' metas (Worker.recent_reports);
        unchanged when none can say."""

        survivors = [k for k, out in outcome.items() if isinstance(out, (CompactAnswer, list))]
        deadline = Deadline(f"{self.label}: a survivor's record of the metas",
                            self.config.step_timeout_s)
        for k in survivors:
            try:
                metas = fetch(self.workers[k].recent_reports.remote(self.seqs),
                              f"{self.label}: worker {k}'s record of the metas",
                              deadline.left())
            except Exception:  # noqa: BLE001 - another survivor may say
                continue
            return [(decision, sorted(m.slot for m in metas[seq] if m is not None)
                     if contributors is None and seq in metas else contributors, summary)
                    for (decision, contributors, summary), seq in zip(rows, self.seqs)]
        return rows

    def _late_result(self, slot: int, out) -> bool:
        """Read one worker's call under backup workers: count the get_batch batches it
        computed and saw dropped; False when it did not run every step it was
        given (its call stopped at a failure or an error)."""
        if isinstance(out, CompactAnswer):
            batches, rows = out.dropped or (0, 0)
            if batches:
                self.stragglers.count_dropped(slot, rows, batches)
            return True
        if isinstance(out, list):
            rows = [r for r in out if isinstance(r, StepReport) and r.dropped_rows is not None]
            if rows:
                self.stragglers.count_dropped(slot, sum(r.dropped_rows for r in rows), len(rows))
            return not out or isinstance(out[-1], StepReport)
        return out is None  # (a replacement's set_full_state); an exception: it failed

    def _backup_results(self, answer: CompactAnswer, step_s: float) -> list[StepResult]:
        """One result per step from a reporter's compact answer: its totals and
        contributors; on the last applied step every contributor's figures; an
        epoch end or a halting non-finite step last, when the call ended so."""
        workers, rows = len(self.workers), answer.steps
        results = []
        for i, row in enumerate(rows):
            contributors = row.contributors
            dropped = [s for s in range(self.config.num_workers) if s not in contributors]
            dropped_rows = []
            if self.datas is not None:  # a dataset: every slot out of the step skips its share
                share = row.samples // max(1, len(contributors))
                dropped_rows = [(s, share) for s in dropped]
            results.append(StepResult(
                None, [row.apply_s], workers, skipped=row.decision != "apply",
                step_s=step_s, summary=row, contributors=contributors, dropped=dropped,
                dropped_rows=dropped_rows,
                tallies=answer.tallies if i == len(rows) - 1 else None))
        if answer.end == "epoch_end":
            results.append(StepResult([], [], workers, epoch_end=True))
        elif answer.end == "halt":
            results.append(StepResult([StepReport(nonfinite=answer.nonfinite)], [], workers,
                                      halted=True))
        return results

    def _collect(self, outcome: dict | None = None, pending: list | None = None
                 ) -> tuple[dict, list]:
        """Every worker's reports (or the exception its call raised), by position;
        and the positions still pending: hung, or past the grace after a failure.
        (`outcome`, `pending`: what `_finish_backups` read already.)"""
        refs, self._refs = self._refs, None
        index = {ref.hex(): k for k, ref in enumerate(refs)}
        outcome = dict(outcome or {})
        pending = list(refs) if pending is None else list(pending)
        # The workers' own waits end first (and name who did not arrive).
        grace = None  # after a failure: the others' answers, FAILURE_GRACE_S more at most
        deadline = self._deadline(index, quiet=lambda: grace is not None)
        while True:
            if grace is None and any(_failed(out) for out in outcome.values()):
                # Workers still waiting in this attempt's exchanges return now.
                if self.attempts.current == self.attempt:
                    self.attempts.give_up(self.actors.ps)
                grace = Deadline(f"{self.label}: the others after a failure", FAILURE_GRACE_S)
            if not pending or deadline.over() or (grace and grace.over()):
                break
            answered, pending = deadline.wait(pending, slice_s=grace and grace.left())
            # each a report, a death or the worker's own error (reported)
            for ref, out in zip(answered, outcomes(answered, self.label,
                                                   self.config.step_timeout_s)):
                outcome[index[ref.hex()]] = out
            if pending and grace is None:
                self.actors.check_open(self.label)
        return outcome, sorted(index[ref.hex()] for ref in pending)

    def _deadline(self, index: dict, quiet=lambda: False) -> Deadline:
        """The driver's wait for this call's answers (`index`: ref hex -> worker
        position): the workers' own waits end first, so `timeout_s` per step
        and FAILURE_GRACE_S more; a stall report every stall_report_s names whom
        the others wait for (none while `quiet()`)."""
        return Deadline(self.label, self.timeout_s * self.size + FAILURE_GRACE_S,
                        stall_s=self.config.stall_report_s, start=self._clock,
                        on_stall=lambda pending, waited_s: quiet() or self._stall_report(
                            pending, index, waited_s))

    def _stall_report(self, pending: list, index: dict, waited_s: float) -> None:
        """Log which workers the others wait for in the exchange (the PS actors know),
        or, when none waits there, which calls are still running."""
        numbers = dict(zip(self.seqs, range(self.size)))
        waits = {seq: ranks for seq, ranks in
                 ps_client.waiting(self.actors.ps, self.config.stall_report_s).items()
                 if seq in numbers}
        first = self.label.split()[1].split("-")[0]
        if waits:
            seq = min(waits, key=numbers.get)
            late = sorted(waits[seq])
            step = int(first) + numbers[seq]
            logger.warning("stall: step %d: %s ha%s not reached the exchange after %.0f s "
                           "(%d of %d waiting in it); StepTimeoutError after %.0f s", step,
                           ", ".join(self.actors.name(self.workers[r]) for r in late),
                           "s" if len(late) == 1 else "ve", waited_s,
                           len(self.workers) - len(late), len(self.workers), self.timeout_s)
            return
        running = sorted(self.actors.name(self.workers[index[r.hex()]]) for r in pending)
        logger.warning("stall: %s: %s still running after %.0f s", self.label,
                       ", ".join(running), waited_s)

    def _failure(self, outcome: dict, pending: list[int]) -> BaseException | None:
        """The failure to recover from: a dead worker, else a dead PS, else the
        workers or PS named hung (the pending calls' workers included), or None."""
        died = actor_died_errors()
        dead = [e for e in outcome.values() if isinstance(e, died)]
        if dead:
            return dead[0]
        failures = [r[-1].failure for r in outcome.values()
                    if isinstance(r, list) and r and isinstance(r[-1], StepFailed)
                    and not r[-1].abandoned]
        dead_ps = [e for e in failures if isinstance(e, died)]
        if dead_ps:
            return dead_ps[0]
        late_ranks = sorted({r for e in failures if isinstance(e, StepTimeoutError)
                             for r in e.late_workers} | set(pending))
        late_ps = sorted({j for e in failures if isinstance(e, StepTimeoutError)
                          for j in e.late_ps})
        if late_ranks or late_ps or failures:
            late = [self.workers[r] for r in late_ranks if r < len(self.workers)]
            late += [self.actors.ps[j] for j in late_ps
                     if j < len(self.actors.ps) and self.actors.ps[j] is not None]
            who = [self.actors.name(h) for h in late]
            cause = failures[0] if failures else None
            return StepTimeoutError(
                f"{self.label}: no answer after {self.timeout_s:.1f} s from "
                f"{', '.join(who) or 'an actor of the exchange'}"
                + (f" ({cause})" if cause is not None else ""), late)
        if any(_failed(out) for out in outcome.values()):
            # Only abandoned exchanges: the failure that caused it was a worker's error.
            return None
        return None


def _step_rows(out) -> list[tuple]:
    """(decision, contributors or None, summary or None) of each step a worker's call
    applied or skipped, from its answer (backup workers)."""
    if isinstance(out, CompactAnswer):
        if out.steps is not None:
            return [(row.decision, row.contributors, row) for row in out.steps]
        return [("skip" if i in out.skipped else "apply", None, None)
                for i in range(out.steps_run)]
    if not isinstance(out, list):
        return []
    rows = []
    for row in out:
        if not isinstance(row, StepReport) or row.decision not in ("apply", "skip"):
            break
        rows.append((row.decision, row.contributors, None))
    return rows


def _failed(out) -> bool:
    """A worker's outcome that ends the attempt: its call raised, or it stopped at
    a failed exchange or a step that raised."""
    if isinstance(out, CompactAnswer):  # every step applied or skipped
        return False
    if not isinstance(out, list):
        return True
    return bool(out) and isinstance(out[-1], (StepFailed, StepRaised))


def _first(errors: list) -> BaseException:
    """The error to report among the workers' errors of one step: a worker's own
    (its step raised) before the others' DsgdError naming it."""
    own = [e for e in errors if not isinstance(e, DsgdError) or "step raised" not in str(e)]
    return (own or errors)[0]
