"""The step loop: the only place where steps are submitted, counted, and
recovered from (driver side).

`StepLoop.run` makes steps one after the other as a generator of
`StepResult`s. With several workers each unit is one `ExchangeStep`; with one
worker, a `LocalSteps` call of up to `local_steps_per_call` steps (one when
the caller stops it). While a unit finishes, the next one is submitted
(*ahead*): Ray runs an actor's calls in order, so each worker starts the next
step the moment it has applied this one instead of idling for a round trip to
the driver. Nothing of a step in flight touches weights before the step
before it has been checked and applied (several workers: its applies are
submitted only after this step's; one worker: the worker halts a run after a
step that stops it), so results are those of steps run one at a time.

One failure path: an actor that died (or hung, with `replace_hung`) is
recovered by `Recovery` and the interrupted unit retried unless its step had
been applied; the unit ahead is dropped and submitted again. Any other error
first waits for what is already on its way to be applied and counts it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator

from dsgd.comm import ps_client, timeline
from dsgd.comm.ps_client import sequence_number
from dsgd.comm.waits import actor_died_errors
from dsgd.config import Config
from dsgd.engine.actors import ActorSet
from dsgd.engine.stragglers import Stragglers
from dsgd.engine.datasets import FeedEntry
from dsgd.engine.failures import recovers_hang
from dsgd.engine.recovery import Recovery
from dsgd.engine.state import Progress, Topology
from dsgd.engine.step import ExchangeStep, LocalSteps, StepResult, workers_exchange
from dsgd.engine.worker_steps import Attempts, WorkerSteps
from dsgd.errors import DsgdError, NonFiniteError, StepTimeoutError

logger = logging.getLogger("dsgd")


class StepLoop:
    def __init__(self, config: Config, actors: ActorSet, topology: Topology, progress: Progress,
                 recovery: Recovery, take_snapshot: Callable[[FeedEntry | None], None] | None = None):
        self.config, self.actors, self.topology = config, actors, topology
        self.progress, self.recovery = progress, recovery
        # The automatic snapshot (DistributedSGD._take_snapshot), and when it was taken.
        self._take_snapshot = take_snapshot
        self._snapshot_at: float | None = None
        # Backup workers' late-worker record, shared with Recovery (which resets it).
        self.stragglers = recovery.stragglers if recovery is not None \
            else Stragglers(config.backup_workers)
        self._run_ids = itertools.count(1)
        # The worker-driven exchange (WorkerSteps): exchange numbers, the attempt they
        # belong to (a new one after every failure) and the group the workers last joined.
        self._next_step = 1  # the next step's exchange number (below the attempt's bits)
        # timeline=: the driver's recorder (DistributedSGD sets it; dsgd/comm/timeline.py)
        self.timeline = timeline.OFF
        self._timeline_ps: tuple | None = None  # the PS actors told to record (`_ps_timeline`)
        self._joined_workers: list = []
        self._attempts = Attempts()
        self._joined = None
        # The workers' step plan (StepPlan.make): buckets leave during the backward
        # pass or after it; when the update runs (None: the default for the first).
        self._during_backward, self._update = config.during_backward, None

    def run(self, entry: FeedEntry | None, count: int | None) -> Iterator[StepResult]:
        """`count` steps (None: until the caller stops, which then must not need
        the step in flight to be applied), each replica's batch from `entry`'s
        feed (None: get_batch). Yields each step's result once it is counted,
        and epoch ends (not counted) as they come. Raises NonFiniteError (under
        on_nonfinite="raise"), DsgdError for a failure the policy does not
        recover from, and any error of a step."""
        run_id = next(self._run_ids)
        done, in_flight = 0, None
        while count is None or done < count:
            ahead = None
            if in_flight is not None:
                # Submitted ahead: the driver's time since (the caller's code between
                # steps, a PS replaced) does not count against its step_timeout_s.
                in_flight.restart_clock()
            try:
                if in_flight is None:
                    self.recovery.maybe_grow()
                    if self._snapshot_due(entry):  # nothing in flight: the state is steps_done's
                        self._snapshot_at = time.monotonic()
                        self._take_snapshot(entry)
                    in_flight = self._submit(entry, run_id, 0, count, done)
                results = self._early_results(in_flight)
                if results is None:
                    if self._may_run_ahead(in_flight, count, done, entry):
                        ahead = self._submit(entry, run_id, in_flight.size, count,
                                             done + in_flight.size)
                    results = in_flight.finish()
                    if ahead is not None and not ahead.exchanges:
                        ahead.started()
            except (*actor_died_errors(), StepTimeoutError) as e:
                if isinstance(e, StepTimeoutError) and not recovers_hang(self.config.replace_hung,
                                                                         e.late):
                    # Raised submitting the step after `in_flight` (under backup_workers: a
                    # late worker hung, or late for an epoch's start): `in_flight`'s applies
                    # are on their way, counted as for any other error. (Raised by
                    # `in_flight` itself, it has none left to wait for.)
                    self._drain(in_flight, entry)
                    raise
                workers = len(in_flight.workers) if in_flight is not None else 0
                membership = in_flight.membership() \
                    if in_flight is not None and hasattr(in_flight, "membership") else {}
                in_flight = ahead = None  # both went to actors that may be gone: redone
                self._attempts.give_up(self.actors.ps)  # (WorkerSteps) the retry is a new one
                run_id = next(self._run_ids)  # the survivors halted the old run
                before = self.progress.steps_done
                completed = self.recovery.recover(e)  # kills the hung actors first
                done -= self._rolled_back(before, entry)
                if not completed:
                    continue  # retry
                # Applied before the failure: the mean of the contributors chosen.
                results = [StepResult(None, [0.0], workers, **membership)]
            except BaseException as e:
                # shutdown() from another thread mid-step empties the actor lists under
                # the step (an IndexError, a KeyError): the error to report is that.
                if isinstance(e, Exception) and not isinstance(e, DsgdError):
                    label = in_flight.label if in_flight is not None else "step"
                    try:
                        self.actors.check_open(label)
                    except DsgdError as closed:
                        raise closed from e
                # Not an actor failure (a non-finite gradient under "raise" before any
                # apply, the next step's data failing, a step raising): what is on its
                # way to be applied is waited for and counted.
                self._drain(in_flight, entry)
                self._drain(ahead, entry)
                raise
            self._stepped(in_flight, results)
            in_flight = ahead
            failure = None  # (WorkerSteps gave its attempt up: retries are a new one)
            if results and results[-1].failure is not None:
                failure, results = results[-1].failure, results[:-1]
            done += yield from self._counted(results, in_flight, entry)
            if failure is not None:
                # The workers stopped at a failed exchange, the steps before it counted:
                # recover, then go on from the first step not applied everywhere.
                in_flight = None  # its calls stop at once (the same run halted on the failure)
                run_id = next(self._run_ids)  # ... so the steps after the failure are a new run
                done += yield from self._recovered_after(failure, entry)

    def _stepped(self, unit, results: list[StepResult]) -> None:
        """A unit's call ended with a step done: its workers new to steps (a replacement
        that traced them) are judged by step_timeout_s from now on."""
        if unit is not None and any(r.failure is None and r.error is None for r in results):
            self.actors.stepped(unit.workers)

    def _counted(self, results: list[StepResult], in_flight, entry: FeedEntry | None
                 ) -> Iterator[StepResult]:
        """Count and yield each of `results` (an epoch end is yielded, not
        counted). A step's error, a halted step and a non-finite step under
        "raise" are raised once what `in_flight` has on its way is counted.
        Returns how many were counted."""
        counted = 0
        for result in results:
            if result.epoch_end:
                if entry is not None:
                    entry.feed.epoch_ended()
                yield result
                continue
            if result.error is not None:
                self._drain(in_flight, entry)
                raise result.error
            if result.halted:  # several workers, "raise": nothing of it was applied
                self._drain(in_flight, entry)
                raise self._nonfinite_error(self.progress.steps_done + 1,
                                            result.infos[0].nonfinite, applied=False)
            error = self._count(result, entry)
            if error is not None:  # one worker, "raise": the step was applied
                self._drain(in_flight, entry)
                raise error
            counted += 1
            yield result
        return counted

    def _recovered_after(self, failure: BaseException, entry: FeedEntry | None
                         ) -> Iterator[StepResult]:
        """Recover from a failed exchange (`_recover_from`), yielding the steps the
        survivors had applied past it as counted. Returns how many steps that
        adds to the run's count (less the steps rolled back to a snapshot)."""
        before, counted = self.progress.steps_done, 0
        for result in self._recover_from(failure, len(self.actors.workers)):
            self._count(result, entry)
            counted += 1
            yield result
        return counted - self._rolled_back(before, entry)

    def _recover_from(self, error: BaseException, workers: int) -> list[StepResult]:
        """After a WorkerSteps failure: a hang without replace_hung raises; else the
        policy recovers (replacing the dead or hung actors) and, if the interrupted
        step had been applied by a survivor, returns it to count."""
        if isinstance(error, StepTimeoutError) and not recovers_hang(self.config.replace_hung,
                                                                     error.late):
            raise error
        if self.recovery.recover(error):
            return [StepResult(None, [0.0], workers)]
        return []

    # -- the automatic snapshot ------------------------------------------------------------
    def _snapshot_due(self, entry: FeedEntry | None) -> bool:
        """Whether to take the automatic snapshot before the next step: none yet,
        `snapshot_interval_s` passed, or it belongs to another feed (its data
        position could not be replayed on this one)."""
        interval = self.config.snapshot_interval_s
        if interval is None or self._take_snapshot is None or self.config.local:
            return False
        snapshot = self.progress.snapshot
        return (snapshot is None or self._snapshot_at is None
                or time.monotonic() - self._snapshot_at >= interval
                or snapshot["feed_key"] != (entry.key if entry is not None else None))

    def _rolled_back(self, before: int, entry: FeedEntry | None) -> int:
        """After a recovery that restored an older state (every worker lost): how
        many steps this run does again. From a dataset whose position went back
        with it, every step since is run again on the same rows (the result is
        the uninterrupted run's); from get_batch they cannot be replayed: they
        are lost, and the failure's record says how many."""
        lost = before - self.progress.steps_done
        if lost <= 0:
            return 0
        snapshot = self.progress.snapshot
        replayable = (entry is not None and snapshot is not None
                      and self.progress.steps_done == snapshot["step"]
                      and snapshot["feed_key"] == entry.key
                      and snapshot["data_position"] is not None)
        if replayable:
            logger.warning("the %d step(s) since step %d are run again on the same data",
                           lost, self.progress.steps_done)
            self.progress.annotate_failure(replayed_steps=lost)
            return lost
        logger.warning("%d step(s) lost: the state went back to step %d and %s", lost,
                       self.progress.steps_done,
                       "get_batch cannot replay its batches" if entry is None
                       else "this dataset's position did not go back with it")
        self.progress.annotate_failure(lost_steps=lost)
        return 0

    def _join(self) -> None:
        """Tell the workers who takes part in their exchange (after start-up and after
        any change of workers or PS actors). Blocks, at most step_timeout_s."""
        workers, ps = self.actors.workers, self.actors.ps
        # Backup workers: each step's mean is over the first `need` (replacements that
        # are starting count: the steps do not wait for fewer workers meanwhile).
        need = self.stragglers.need(len(workers) + self.recovery.joining) \
            if self.stragglers.enabled else None
        # By name, never by id(): a replaced PS's new handle can have the dead one's id.
        key = (self.actors.membership, tuple(self.actors.name(w) for w in workers),
               tuple(None if p is None else self.actors.name(p) for p in ps), need)
        if key == self._joined:
            return
        if need is not None:
            # Workers of the last membership that died: the PS actors stop keeping the
            # means of its steps for them (ParameterServer.gone).
            alive = {id(w) for w in workers}
            gone = [r for r, w in enumerate(self._joined_workers) if id(w) not in alive]
            if gone:
                ps_client.gone(ps, gone, sequence_number(self._attempts.current,
                                                         self._next_step))
        self._joined_workers = list(workers)
        names = [self.actors.name(p) if p is not None else f"PS {j}" for j, p in enumerate(ps)]
        recording = self.config.timeline is not None
        if recording:
            ps_client.enable_timeline(ps, True)
        self.actors.wait([w.join.remote(rank, workers, ps, names, self.topology.layout,
                                        self.config.step_timeout_s, self.config.on_nonfinite,
                                        need, recording, during_backward=self._during_backward,
                                        update=self._update)
                          for rank, w in enumerate(workers)], workers,
                         "joining the exchange", self.config.step_timeout_s)
        self._joined = key

    def replan(self, during_backward: bool, update: str | None = None) -> None:
        """Plan the workers' next steps anew (`StepPlan.make`: ValueError for a bad
        `update`): every worker joins again before the next step, so a plan never
        changes inside one. For tests and benchmarks that compare plans on one
        instance; results are the same to float32 round-off."""
        from dsgd.worker.exchange_session import checked_update

        checked_update(during_backward, update)
        self._during_backward, self._update = during_backward, update
        self._joined = None

    def _ps_timeline(self) -> None:
        """timeline= on the driver-relayed exchange: have the PS actors record their
        sums (once per set of PS actors; the workers' exchange does it in `_join`)."""
        ps = self.actors.ps
        key = tuple(None if p is None else self.actors.name(p) for p in ps)
        if self.config.timeline is None or key == self._timeline_ps:
            return
        ps_client.enable_timeline(ps, True)
        self._timeline_ps = key

    # -- units -----------------------------------------------------------------------------
    def _submit(self, entry: FeedEntry | None, run_id: int, offset: int, count: int | None,
                done: int):
        """The unit whose first step is `offset` steps after the next one."""
        number = self.progress.steps_done + offset + 1
        self.actors.check_open(f"step {number}")
        if self.stragglers.enabled:
            # Late workers found dead, and replacements ready to join (dsgd/engine/stragglers.py).
            self.stragglers.free(self.actors.workers, self.actors.slots)
            self.recovery.replace_in_background(self.stragglers.take_dead())
            self.recovery.admit_joiners()
        if workers_exchange(self.config, self.actors.num_workers):
            self._join()
            size = 1 if count is None else \
                min(self.config.steps_per_call(self.actors.num_workers, True), count - done)
            datas = None if entry is None else [self._step_args(entry, offset + k)
                                                for k in range(size)]
            seqs = [sequence_number(self._attempts.current, self._next_step + k)
                    for k in range(size)]
            self._next_step += size
            return WorkerSteps(self.config, self.actors, datas, seqs, self._attempts, run_id,
                               number, self.stragglers, self.timeline).submit()
        if self.actors.num_workers > 1:
            need = self.stragglers.need(self.actors.num_workers + self.recovery.joining)
            self._ps_timeline()
            return ExchangeStep(self.config, self.actors, self.topology,
                                self._step_args(entry, offset), number, self.stragglers,
                                need, self.timeline).submit()
        size = 1
        if count is not None and self.actors.num_workers == self.config.num_workers:
            size = min(self.config.steps_per_call(1, False), count - done)
        data = [self._step_args(entry, offset + k)[0] for k in range(size)]
        return LocalSteps(self.config, self.actors, data, run_id, number).submit()

    def _step_args(self, entry: FeedEntry | None, ahead: int) -> list:
        """Each worker's data argument for the step `ahead` steps after the next one
        (None: get_batch), after sending the workers the feed's loaders if they
        are new to them or the workers changed."""
        workers = self.actors.workers
        if entry is None:
            return [None] * len(workers)
        if entry.needs_loaders(self.actors.membership):
            if self.stragglers.enabled and hasattr(entry.feed, "use_step_positions"):
                entry.feed.use_step_positions()
            loaders = entry.feed.loaders(len(workers), self.config.step_timeout_s, ahead)
            refs = [w.attach_data.remote(entry.key, loader) for w, loader in zip(workers, loaders)]
            if self.stragglers.enabled:
                # Late workers get theirs in order behind their compute; a feed whose
                # loaders start an epoch together (Ray Data's split) waits for them.
                if entry.feed.reports_epoch_end:
                    self.stragglers.wait_free(workers, self.config.step_timeout_s)
            else:
                self.actors.wait(refs, workers, "attaching data loaders",
                                 self.config.step_timeout_s)
            entry.loaders_sent(self.actors.membership)
        if self.stragglers.enabled:
            # Every slot keeps its share of each step's rows; a worker out of a step
            # (late, dead) skips its share.
            args = entry.feed.step_args(self.config.num_workers, ahead, self.config.step_timeout_s)
            return [(entry.key, args[slot]) for slot in self.actors.slots]
        return [(entry.key, arg) for arg in
                entry.feed.step_args(len(workers), ahead, self.config.step_timeout_s)]

    def _may_run_ahead(self, in_flight, count: int | None, done: int,
                       entry: FeedEntry | None) -> bool:
        if count is not None and done + in_flight.size >= count:
            return False
        if self._snapshot_due(entry):
            return False  # the snapshot waits for a moment with no step in flight
        if self.config.elastic and \
                self.actors.num_workers + self.recovery.joining < self.config.num_workers:
            return False  # elastic: growing back needs a quiet moment
        # One worker would apply a step ahead by itself: only when it was asked for.
        return count is not None or in_flight.exchanges

    def _early_results(self, step) -> list[StepResult] | None:
        """Several workers: the step's reports; a step that ends an epoch or is
        skipped ends here, one with a non-finite gradient under "raise" raises
        (nothing applied); otherwise the exchange starts and None is returned."""
        if not step.exchanges:
            return None
        infos = step.reports()
        ended = [i for i, info in enumerate(infos) if info.epoch_end]
        if ended:
            if len(ended) < len(infos):
                raise DsgdError(f"{step.label}: the data of worker(s) {ended} ended its epoch "
                                "before the others': every worker's share must have as many batches")
            if self.stragglers.enabled:
                # The next epoch's first step starts every worker's share together.
                self.stragglers.wait_free(self.actors.workers, self.config.step_timeout_s)
            return [step.result(epoch_end=True)]
        self._check_metric_names(infos, step.membership().get("contributors"))
        bad = self._nonfinite(infos, step.membership().get("contributors"))
        if bad:
            if self.config.on_nonfinite == "raise":
                raise self._nonfinite_error(self.progress.steps_done + 1, bad, applied=False)
            return [step.result(skipped=True)]
        step.exchange()
        return None

    def _check_metric_names(self, infos: list, slots: list[int] | None) -> None:
        """ValueError (before any apply) when workers' get_loss return different
        metric names (each worker compares its own replicas)."""
        names = [sorted(info.metrics) for info in infos]
        if any(n != names[0] for n in names):
            slots = self.actors.slots if slots is None else slots
            raise ValueError("get_loss must return the same metric names on every replica: "
                             + "; ".join(f"worker {s} returns {n}" for s, n in zip(slots, names))
                             + ". No weights were changed.")

    # -- counting --------------------------------------------------------------------------
    def _count(self, result: StepResult, entry: FeedEntry | None) -> NonFiniteError | None:
        """Count one step, applied or skipped, and move the data on by the rows of
        the workers it ran on. Returns the NonFiniteError to raise for an applied
        step with a non-finite gradient (one worker, on_nonfinite="raise")."""
        if result.summary is not None:
            bad = [tuple(b) for b in result.summary.nonfinite]
        else:
            bad = self._nonfinite(result.infos, result.contributors) \
                if result.infos is not None else []
        if bad and result.skipped:
            logger.warning("step %d skipped: non-finite gradient on %s.%s",
                           self.progress.steps_done + 1,
                           ", ".join(f"worker {w} replica {r}" for w, r in bad), self._fp16_hint())
        self.progress.count(result.skipped)
        for slot, rows in result.dropped_rows:
            self.stragglers.count_dropped(slot, rows)
        if entry is not None:
            entry.feed.advance(self.config.num_workers if self.stragglers.enabled
                               else result.workers)
        if bad and not result.skipped and self.config.on_nonfinite == "raise":
            return self._nonfinite_error(self.progress.steps_done, bad, applied=True)
        return None

    def _drain(self, unit, entry: FeedEntry | None) -> None:
        """Wait for a unit whose outcome no one will read (another error is being
        raised) if it will apply steps by itself, and count what it applied or
        skipped; its own errors give way to the one being raised."""
        if unit is None or not unit.applies_pending:
            return
        try:
            results = unit.finish()
        except Exception:  # noqa: BLE001 - the caller's error is the one to report
            return
        for result in results:
            if result.epoch_end or result.error is not None:
                continue
            if self._count(result, entry) is not None:  # its NonFiniteError would hide the caller's
                logger.warning("step %d: non-finite gradient on replica(s) %s, applied "
                               "(reported here: another error is being raised)",
                               self.progress.steps_done,
                               [r for info in result.infos or [] for r, ok in
                                enumerate(info.finite) if not ok])

    def _nonfinite(self, infos: list, slots: list[int] | None = None
                   ) -> list[tuple[int, int]]:
        """(worker slot, replica) of every non-finite gradient; `slots`: the workers
        of `infos` (default: every worker, in order)."""
        slots = self.actors.slots if slots is None else slots
        return [(slot, r) for slot, info in zip(slots, infos)
                for r, ok in enumerate(info.finite) if not ok]

    def _nonfinite_error(self, step: int, bad: list, applied: bool) -> NonFiniteError:
        if applied:  # one worker: the update ran alongside the check (see Replicas.configure)
            outcome = ("the update was applied (with one worker the check runs alongside it): "
                       "the weights now hold NaN/Inf; restore a checkpoint. Pass "
                       "on_nonfinite='skip' to check before updating and skip such steps.")
        else:
            outcome = "no weights were changed. Pass on_nonfinite='skip' to skip such steps."
        slot, r = bad[0]
        return NonFiniteError(
            f"step {step}: non-finite gradient (NaN or Inf) on worker {slot}, replica {r} "
            f"(global replica {slot * self.config.devices_per_worker + r})"
            + (f" and {len(bad) - 1} more" if len(bad) > 1 else "") + "; " + outcome
            + self._fp16_hint())

    def _fp16_hint(self) -> str:
        if self.config.compression != "fp16" or self.actors.num_workers == 1:
            return ""
        return (" With compression='fp16' this includes a mean gradient beyond float16's range "
                "(|g| >= 65520 rounds to Inf): use compression='bf16' (float32's range), or none.")
