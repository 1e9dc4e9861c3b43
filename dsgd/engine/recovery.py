"""Carrying out the failure policy (driver side): probe the actors after a
failure, ask `failures.decide` what to do, then replace workers and PS actors,
copy state, restore a checkpoint, or grow back (elastic=True).

The policy itself is pure (dsgd/engine/failures.py); this module only executes
it. Every method blocks, each wait at most `step_timeout_s` (replacements:
`start_timeout_s`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dsgd import constants
from dsgd.config import Config
from dsgd.comm import waits
from dsgd.comm.waits import Deadline, actor_died_errors
from dsgd.engine import failures, launch
from dsgd.engine.stragglers import Stragglers
from dsgd.engine.resources import placeable_workers
from dsgd.engine.state import Progress, first_line
from dsgd.errors import DsgdError, StepTimeoutError

logger = logging.getLogger("dsgd")


class Recovery:
    """Recovers one DistributedSGD's actors.

    Args:
        restore_checkpoint: `path -> None`, the driver's restore (used when no
            worker survives).
        restore_snapshot: `() -> None`, restores the automatic snapshot
            (`progress.snapshot`) instead, when it is newer than the last checkpoint.
        workers_changed: hooks run after new workers took a copied state (the
            layers above, e.g. the Trainer, give them what they need).
    """

    def __init__(self, config: Config, launcher: launch.Launcher, progress: Progress,
                 restore_checkpoint: Callable[[str], object],
                 workers_changed: list[Callable[[], object]], stragglers: Stragglers,
                 restore_snapshot: Callable[[], object] | None = None):
        # The launcher started the actors and starts their replacements.
        self.launcher = launcher
        self.config, self.actors, self.topology = config, launcher.actors, launcher.topology
        self.progress = progress
        self.stragglers = stragglers
        self._restore_checkpoint = restore_checkpoint
        self._restore_snapshot = restore_snapshot
        self._workers_changed = workers_changed
        self._next_grow_check = 0.0
        self._joining: dict[int, dict] = {}  # slot -> a background replacement's progress
        # Recoveries in a row with no step completed between them (`_back_off`).
        self._streak, self._last_recovery_at = 0, None
        # What `_say` has logged, and the repeats of it not printed since.
        self._said: dict[str, int] = {}
        self._repeats: dict[str, int] = {}

    def recover(self, error: BaseException, call: str | None = None) -> bool:
        """Carry out what failures.decide says after `error` (`_recover_once`).
        Returns True if the interrupted step had been applied (do not retry it).

        Every failure is charged to the one budget when it is found
        (`Progress.charge`): past `max_failures` this raises DsgdError naming
        the step, the actor and the cause. A failure while recovering (a
        replacement, or the survivor being copied, that dies, or hangs with
        replace_hung) is charged too and recovered from the same way; the
        workers the interrupted pass started are killed first (what state they
        hold is not known, so they are replaced like dead ones). A recovery
        that follows another with no step completed between them first waits
        (`RECOVERY_BACKOFF_S`, doubling with each, at most
        `RECOVERY_BACKOFF_MAX_S`). An error after which every actor answers
        (nothing died) is not one dsgd recovers from: it is raised as it is,
        with a note saying so; DsgdError when the policy refuses."""
        interrupted: str | None = None  # what a failure met while recovering interrupted
        first, began = len(self.progress.failures), time.perf_counter()
        while True:
            self._back_off()
            before = {s: self.actors.worker(s) for s in self.actors.slots}
            try:
                completed = self._recover_once(error, call, interrupted)
            except (*actor_died_errors(), StepTimeoutError) as again:
                if again is error:
                    raise  # nothing died (or the hang is not ours to recover): as it came
                if isinstance(again, StepTimeoutError) and not failures.recovers_hang(
                        self.config.replace_hung, again.late):
                    raise
                self.actors.check_open("recovering")
                for slot in list(self.actors.slots):
                    handle = self.actors.worker(slot)
                    if before.get(slot) is not handle:
                        self.actors.kill(handle)  # started by the interrupted pass
                step = self.progress.steps_done + (0 if call else 1)
                self._say(f"{call or f'step {step}'}: {first_line(again)} while recovering "
                          f"from {type(error).__name__}; recovering again")
                # (charged by the next pass, once its probe has found what died)
                interrupted, error = type(error).__name__, again
                continue
            # The failures whose recovery was interrupted are recovered from now too.
            for index, record in enumerate(self.progress.failures[first:], start=first):
                if record["recovery_s"] is None:
                    self.progress.annotate_failure(
                        index, recovery_s=time.perf_counter() - began)
            return completed

    def _back_off(self) -> None:
        """Before a recovery: wait when it follows another with no step completed
        since (a retried step that failed again, a fault while recovering), the
        wait doubling with each in a row, so that a fault that repeats at once
        cannot spin (each is charged to the budget as well)."""
        done = self.progress.counted
        self._streak = self._streak + 1 if self._last_recovery_at == done else 0
        self._last_recovery_at = done
        if self._streak:
            wait = min(constants.RECOVERY_BACKOFF_MAX_S,
                       constants.RECOVERY_BACKOFF_S * 2 ** (self._streak - 1))
            logger.info("recovery %d in a row without a completed step: waiting %.1f s",
                        self._streak + 1, wait)
            time.sleep(wait)

    def _say(self, message: str) -> None:
        """Log `message` (a warning) the first time this instance meets it; a
        repeat is counted, not printed again (the count is said with the next
        different message)."""
        count = self._said.get(message, 0)
        self._said[message] = count + 1
        if count:
            self._repeats[message] = self._repeats.get(message, 0) + 1
            return
        for earlier, times in self._repeats.items():
            logger.warning("(%s: repeated %d more time(s))", earlier[:120], times)
        self._repeats.clear()
        logger.warning("%s", message)

    def _recover_once(self, error: BaseException, call: str | None = None,
                      interrupted: str | None = None) -> bool:
        """Carry out what failures.decide says after `error`. Returns True if the
        interrupted step had been applied (do not retry it). Raises if the policy
        says the error is not recoverable. call: a driver call outside steps
        (e.g. "get_weights") that failed and will be run again on the new group
        (found between steps: recorded as step `steps_done`'s, nothing to retry;
        its state is taken from the first survivor, the call's retry makes the
        rest agree).
        interrupted: `error` was met while recovering from an error of this
        type (said in its failure record). `error` is charged to the budget
        once the policy says it is recovered from.

        A StepTimeoutError naming actors (replace_hung) first kills them; with
        replace_hung, an actor that neither answers the probe nor dies within
        step_timeout_s is killed too: both are then replaced as dead ones."""
        self.actors.check_open("recovering")
        start = time.perf_counter()
        if isinstance(error, StepTimeoutError) and error.late:
            self._say(f"{call or f'step {self.progress.steps_done + 1}'}: killing hung actor(s) "
                      f"{', '.join(self.actors.name(h) for h in error.late)} to replace them "
                      f"({first_line(error)})")
            for handle in error.late:
                self.actors.kill(handle)
        between_steps = call is not None
        probed, dead_ps = self.actors.probe(self.config.step_timeout_s,
                                            kill_hung=self.config.replace_hung)
        workers = [failures.WorkerStatus(slot, info is not None,
                                         None if info is None else info.applied_steps)
                   for slot, info in probed.items()]
        dead = [w.slot for w in workers if not w.alive]
        for slot in dead:  # frees its resources for the replacement
            self.actors.remove_worker(slot)
        placeable = self._placeable(len(dead))
        steps_done = self.progress.steps_done
        snapshot = self.progress.snapshot if self._restore_snapshot is not None else None
        use_snapshot = snapshot is not None and (
            self.progress.last_checkpoint is None
            or snapshot["step"] >= (self.progress.last_checkpoint_step or 0))
        action = failures.decide(failures.Status(
            workers, dead_ps, steps_done, self.config.elastic, placeable,
            self.progress.last_checkpoint is not None or use_snapshot, between_steps, call,
            f"the automatic snapshot of step {snapshot['step']}" if use_snapshot
            else "the last checkpoint",
            late_behind=self.stragglers.enabled))
        step = steps_done + (0 if between_steps else 1)  # the step it is reported under
        where = call or f"step {step}"
        if not action.recover:
            if not dead and not dead_ps:
                error.add_note(f"dsgd: {where}: every worker and PS actor answered after this "
                               "error (none died), so it is not one dsgd recovers from")
                raise error
            raise DsgdError(f"{where}: {action.reason}") from error
        during = f" (while recovering from {interrupted})" if interrupted else ""
        charged = self.progress.charge(
            {"step": step, "error": type(error).__name__, "reason": action.reason + during,
             **({"call": call} if call is not None else {})},
            self.config.max_failures, f"{where}: {failures.describe(dead, dead_ps)}{during}",
            error)
        self._say(f"{where}: {action.reason} ({type(error).__name__}: {first_line(error)})")
        for j in action.replace_ps:
            self.actors.remove_ps(j)
        self._add_workers(action.replace_workers)
        if action.state_source is not None:
            self._copy_state(action.state_source, action.replace_workers + action.sync_workers)
        elif use_snapshot:
            self._restore_snapshot()
        else:
            self._restore_checkpoint(self.progress.last_checkpoint)
        if action.drop_workers:
            logger.warning("elastic: continuing with %d worker(s); global batch is now %d "
                           "replica batches", self.actors.num_workers,
                           self.actors.num_workers * self.config.devices_per_worker)
        self._changed(action.replace_workers)
        self.stragglers.reset()  # the probe ran after every queued call: nobody is late
        recovery_s = time.perf_counter() - start
        self.progress.annotate_failure(charged, recovery_s=recovery_s)
        logger.warning("recovered in %.1f s", recovery_s)
        return action.step_completed

    def _placeable(self, count: int) -> int:
        """How many of `count` replacements fit, waiting up to RESOURCE_RELEASE_S for
        Ray to release the resources of the workers just lost."""
        if not count:
            return 0
        deadline = Deadline(f"room for {count} replacement(s)", constants.RESOURCE_RELEASE_S)
        while True:
            placeable = placeable_workers(self.actors.worker_options, count)
            if placeable >= count or deadline.over():
                return placeable
            deadline.pause(0.1)

    def maybe_grow(self) -> None:
        """elastic=True, below the asked-for worker count: start workers for the
        missing slots when resources are back (checked at most every
        GROW_CHECK_INTERVAL_S)."""
        if not self.config.elastic or self.actors.num_workers >= self.config.num_workers \
                or time.monotonic() < self._next_grow_check:
            return
        self._next_grow_check = time.monotonic() + constants.GROW_CHECK_INTERVAL_S
        missing = [s for s in range(self.config.num_workers)
                   if s not in self.actors.slots and s not in self._joining]
        room = placeable_workers(self.actors.worker_options, len(missing))
        if not room:
            return
        slots = missing[:room]
        self._add_workers(slots)
        self._copy_state(next(s for s in self.actors.slots if s not in slots), slots)
        self._changed(slots)
        logger.warning("elastic: added worker(s) %s; %d worker(s), global batch %d replica "
                       "batches", ", ".join(map(str, slots)), self.actors.num_workers,
                       self.actors.num_workers * self.config.devices_per_worker)

    # -- backup workers: replacements that no step waits for -------------------------------
    @property
    def joining(self) -> int:
        """Replacements starting in the background."""
        return len(self._joining)

    def replace_in_background(self, dead: list[tuple]) -> None:
        """Backup workers: the workers of `slots` died and steps go on without
        them (the first `need` of the survivors make each step). Start their
        replacements without waiting: `admit_joiners`, called before each step,
        lets each in once it has built its replicas and compiled the step. Each
        counts as one failure (max_failures)."""
        for handle, slot in dead:
            if slot not in self.actors.slots or self.actors.worker(slot) is not handle:
                continue  # already replaced (by a recovery)
            step = self.progress.steps_done + 1
            # Charged now; its recovery_s is known when the replacement joins (`_admit`).
            charged = self.progress.charge(
                {"step": step, "error": "ActorDiedError",
                 "reason": f"worker {slot} died; replaced in the background (backup workers: "
                           "no step waited for it)"},
                self.config.max_failures, f"step {step}: worker {slot} died")
            self.actors.remove_worker(slot)
            # New data loaders for the survivors (a Ray Data split must not wait on it).
            self.actors.next_generation(workers_added=True)
            if self.config.elastic and not placeable_workers(self.actors.worker_options, 1):
                # No room now: go on without it; maybe_grow adds it back when there is.
                self.progress.annotate_failure(
                    charged, recovery_s=0.0,
                    reason=f"worker {slot} died; no room to replace it: elastic, continuing "
                           "without it")
                self._say(f"step {step}: worker {slot} died and cannot be replaced now; "
                          f"elastic: continuing with {self.actors.num_workers} worker(s)")
                continue
            self._spawn(slot, time.perf_counter(), step, charged)
            self._say(f"step {step}: worker {slot} died; steps go on with "
                      f"{self.actors.num_workers} worker(s) while a replacement starts in the "
                      "background")

    def admit_joiners(self) -> None:
        """Let in every background replacement that is ready: it takes a free
        worker's full state (queued behind that worker's applies so far, so it is
        the state after the steps submitted until now) and is late until the
        state is in. Does not wait; a replacement that has not started within
        `start_timeout_s` raises DsgdError. One that dies while starting is
        started again (charged as a failure of its own)."""
        for slot, joiner in list(self._joining.items()):
            try:
                self._admit(slot, joiner)
            except actor_died_errors() as e:  # the replacement died: start another
                self.actors.drop_joining(slot)
                del self._joining[slot]
                what = f"worker {slot}'s replacement died while starting"
                self.progress.charge(
                    {"step": joiner["step"], "error": type(e).__name__, "reason": what,
                     "recovery_s": time.perf_counter() - joiner["start"]},
                    self.config.max_failures, f"step {joiner['step']}: {what}", e)
                self._say(f"{what} ({first_line(e)}); starting another")
                self._spawn(slot, joiner["start"], joiner["step"], joiner["record"])

    def _spawn(self, slot: int, start: float, step: int, record: int) -> None:
        """Start a replacement for `slot` in the background (`record`: the index of
        the failure record its joining completes)."""
        self.actors.next_generation(workers_added=False)
        handle = self.actors.spawn_worker(slot)
        self._joining[slot] = {"handle": handle, "setup": handle.setup.remote(),
                               "configure": None, "info": None, "start": start, "step": step,
                               "record": record}

    def _admit(self, slot: int, joiner: dict) -> None:

        handle = joiner["handle"]
        if joiner["configure"] is None:
            if not waits.ready([joiner["setup"]])[0]:
                self._check_start_time(slot, joiner)
                return
            joiner["info"] = waits.fetch(joiner["setup"], f"worker {slot}'s setup")
            self.launcher.check_joiner(joiner["info"], slot)
            joiner["configure"] = handle.configure.remote(
                self.topology.plan, self.config.on_nonfinite, self.topology.warm_store_bytes)
        if not waits.ready([joiner["configure"]])[0]:
            self._check_start_time(slot, joiner)
            return
        waits.fetch(joiner["configure"], f"worker {slot}'s configure")
        workers = self.actors.workers
        free = self.stragglers.free(workers, self.actors.slots)
        source = workers[free[0] if free else 0]
        state_set = handle.set_full_state.remote(source.get_full_state.remote())
        del self._joining[slot]
        self.actors.admit_worker(slot, joiner["info"])
        self.stragglers.late(handle, slot, state_set)
        recovery_s = time.perf_counter() - joiner["start"]
        self.progress.annotate_failure(joiner["record"], recovery_s=recovery_s)
        logger.warning("worker %d's replacement joined after %.1f s (%d steps ran without "
                       "it)", slot, recovery_s, self.progress.steps_done + 1 - joiner["step"])
        self._changed([slot])

    def _check_start_time(self, slot: int, joiner: dict) -> None:
        waited = time.perf_counter() - joiner["start"]
        if waited > self.config.start_timeout_s:
            self.actors.drop_joining(slot)
            del self._joining[slot]
            raise DsgdError(f"worker {slot}'s replacement did not start within "
                                   f"start_timeout_s={self.config.start_timeout_s:.0f} s "
                                   f"(cluster resources available: see ray.available_resources())")

    def _add_workers(self, slots: list[int]) -> None:
        """Start workers for `slots` and any PS actor that is missing. Their state
        is copied by the caller."""
        self.actors.next_generation(workers_added=bool(slots))
        if slots:
            self.launcher.start_workers(slots)
        self.launcher.ensure_ps()

    def _copy_state(self, source_slot: int, targets: list[int]) -> None:
        """Copy worker `source_slot`'s full state (weights, optimizer state, step
        count) to workers `targets` through the object store."""
        if not targets:
            return
        ref = self.actors.worker(source_slot).get_full_state.remote()
        handles = [self.actors.worker(s) for s in targets]
        self.actors.wait([h.set_full_state.remote(ref) for h in handles], handles,
                         f"copying worker {source_slot}'s state", self.config.step_timeout_s)

    def _changed(self, slots: list[int]) -> None:
        """Tell the layers above that new workers hold the copied state."""
        if slots:
            for hook in self._workers_changed:
                hook()
