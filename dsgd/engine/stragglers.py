"""Backup workers (driver side): which workers are late, and what they owe.

With `backup_workers=b`, a step's mean is over the gradients of the first
`need` workers to report theirs (need = workers - b); the others are dropped.
A worker still computing when the step's contributors are chosen is *late*:
the step does not wait for it, it is not given the steps it falls behind on
(it sits them out: no gradient computed, no batch drawn from get_batch, its
share of a dataset's rows skipped), and it is given every step's apply, which
Ray runs in order behind its compute, so its weights stay those of every
other replica. It takes part again in the first step submitted after its
report arrived. `Stragglers` keeps that record: the late workers and the
object whose readiness frees each, the applies submitted to them (checked
when they next take part), and the dropped batches and rows per worker.

A late worker that dies is found here (its report raises); the step loop then
has it replaced in the background (Recovery.replace_in_background).
"""

from __future__ import annotations

import logging
import time

from dsgd.comm.reports import StepReport
from dsgd.comm.waits import Deadline, actor_died_errors, fetch, ready
from dsgd.errors import StepTimeoutError

logger = logging.getLogger("dsgd")


class Stragglers:
    """The late workers of one DistributedSGD (keyed by actor handle identity).

    Args:
        backup_workers: b; 0 turns all of this off (every step waits for every worker).
    """

    def __init__(self, backup_workers: int, step_timeout_s: float = float("inf"),
                 replace_hung: bool = False):
        self.backup_workers = backup_workers
        self.step_timeout_s, self.replace_hung = step_timeout_s, replace_hung
        self._since: dict[int, float] = {}     # id(handle) -> when it became late
        # id(handle) -> (handle, slot, what frees it: its compute's stream or an ObjectRef,
        # whether its report's rows are dropped rows to count on arrival)
        self._busy: dict[int, tuple] = {}
        self._owed: dict[int, list] = {}       # id(handle) -> apply refs not yet checked
        self._dead: dict[int, tuple] = {}      # id(handle) -> (handle, slot), to replace
        self.dropped_batches: dict[int, int] = {}  # slot -> batches computed or skipped, dropped
        self.dropped_samples: dict[int, int] = {}  # slot -> their rows
        # The workers' own exchange (dsgd/engine/worker_steps.py): reads what a late
        # worker's call returned, (slot, value) -> whether it ran every step it was given.
        self.on_result = None

    @property
    def enabled(self) -> bool:
        return self.backup_workers > 0

    def need(self, workers: int) -> int:
        """Contributors of a step among `workers` (live and joining)."""
        return max(1, workers - self.backup_workers)

    # -- late workers ---------------------------------------------------------------------
    def late(self, handle, slot: int, pending, count_rows: bool = False) -> None:
        """`handle` (worker `slot`) has not reported its step's gradient; it is free
        again once `pending` (its compute's stream, or any ObjectRef) is ready and
        the applies it owes by then have run. `count_rows`: its batch is a dropped
        batch, counted with its rows when its report arrives (get_batch: its rows
        are not known before)."""
        self._busy[id(handle)] = (handle, slot, pending, count_rows)
        self._since.setdefault(id(handle), time.monotonic())

    def owe(self, handle, ref) -> None:
        """An apply submitted to a late worker, checked before it takes part again."""
        self._owed.setdefault(id(handle), []).append(ref)

    def owed(self, handle) -> list:
        """(and forgets) the applies submitted to `handle` while it was late."""
        return self._owed.pop(id(handle), [])

    def is_busy(self, handle) -> bool:
        return id(handle) in self._busy

    def is_dead(self, handle) -> bool:
        return id(handle) in self._dead

    def dead(self, handle, slot: int) -> None:
        self._dead[id(handle)] = (handle, slot)
        self._busy.pop(id(handle), None)
        self._since.pop(id(handle), None)
        self._owed.pop(id(handle), None)

    def take_dead(self) -> list[tuple]:
        """(handle, slot) of the workers found dead since the last call (to replace)."""
        dead = sorted(self._dead.values(), key=lambda e: e[1])
        self._dead.clear()
        return dead

    @property
    def late_slots(self) -> list[int]:
        return sorted(entry[1] for entry in self._busy.values())

    def free(self, workers: list, slots: list[int]) -> list[int]:
        """Indices into `workers` of those that may take part in the next step:
        not late, not dead. A late worker is free again once its report has
        arrived and the applies it owes have run; one found dead (or whose owed
        apply failed: its weights would no longer be the others') is recorded
        as dead, to be replaced. Does not wait."""

        if self._busy:
            waiting = [entry[2] for entry in self._busy.values()]
            ready_ids = {id(r) for r in ready(waiting)[0]}
            for key, (handle, slot, pending, count_rows) in list(self._busy.items()):
                if id(pending) in ready_ids:
                    del self._busy[key]
                    self._arrived(handle, slot, pending, count_rows)
            self._hung()
        for key in [key for key in self._since if key not in self._busy]:
            del self._since[key]
        return [k for k, w in enumerate(workers)
                if id(w) not in self._busy and id(w) not in self._dead]

    def _hung(self) -> None:
        """A worker late for longer than step_timeout_s is hung: with replace_hung
        it is killed and replaced in the background (the applies it owes would
        pile up in the object store); without, a StepTimeoutError names every
        hung worker and carries their handles (`late`), as any step timeout."""
        now = time.monotonic()
        hung = [(handle, slot) for key, (handle, slot, _, _) in self._busy.items()
                if now - self._since.get(key, now) > self.step_timeout_s]
        if hung and not self.replace_hung:
            who = ", ".join(f"worker {slot}" for slot in sorted(slot for _, slot in hung))
            raise StepTimeoutError(
                f"{who}: late for more than step_timeout_s={self.step_timeout_s:.0f} s under "
                "backup_workers (hung?); pass replace_hung=True to replace such a worker in the "
                "background", [handle for handle, _ in hung])
        for handle, slot in hung:
            logger.warning("worker %d late for more than %.0f s: killing it to replace it in "
                           "the background", slot, self.step_timeout_s)
            from dsgd.engine.actors import _kill

            _kill(handle)
            self.dead(handle, slot)

    def busy_objects(self, workers: list) -> list:
        """What frees each late worker among `workers` (for ray.wait)."""
        ids = {id(w) for w in workers}
        return [entry[2] for key, entry in self._busy.items() if key in ids]

    def busy_handles(self, workers: list) -> list:
        ids = {id(w) for w in workers}
        return [entry[0] for key, entry in self._busy.items() if key in ids]

    def _arrived(self, handle, slot: int, pending, count_rows: bool) -> None:
        import ray

        try:
            if isinstance(pending, ray.ObjectRefGenerator):
                info = fetch(next(pending), f"late worker {slot}'s report")
                if count_rows and isinstance(info, StepReport) and not info.epoch_end:
                    self.count_dropped(slot, int(info.samples))
            else:
                value = fetch(pending, f"late worker {slot}'s answer")
                if self.on_result is not None and not any(r is pending for r in
                                                          self._owed.get(id(handle), [])):
                    if not self._accepted(handle, slot, value):
                        return
        except actor_died_errors():
            logger.warning("worker %d died while late (its gradient had been dropped); it is "
                           "replaced in the background", slot)
            self.dead(handle, slot)
            return
        owed = self._owed.get(id(handle), [])
        if owed:
            if len(ready(owed)[0]) < len(owed):
                # Its report is in, its owed applies are still running: late until the
                # last of them (Ray runs them in order) has run.
                self._busy[id(handle)] = (handle, slot, owed[-1], False)
                return
            try:
                values = fetch(owed, f"the applies worker {slot} owed")
            except Exception as e:  # noqa: BLE001 - died, or an apply that failed
                logger.warning("worker %d: an apply it owed failed (%s: %s); it is replaced in "
                               "the background", slot, type(e).__name__, str(e)[:200])
                self._replace(handle, slot)
                return
            self._owed.pop(id(handle), None)
            if self.on_result is not None:
                for value in values:
                    if not self._accepted(handle, slot, value):
                        return

    def _accepted(self, handle, slot: int, value) -> bool:
        """`on_result` of a late worker's call: False (it is replaced in the
        background) when it did not run every step it was given (its weights
        would no longer be the others')."""
        if self.on_result(slot, value):
            return True
        logger.warning("worker %d: a call it ran late did not complete its steps (%s); it is "
                       "replaced in the background", slot, str(value)[:200])
        self._replace(handle, slot)
        return False

    def _replace(self, handle, slot: int) -> None:
        from dsgd.engine.actors import _kill

        _kill(handle)
        self.dead(handle, slot)

    def wait_free(self, workers: list, timeout_s: float) -> None:
        """Block until every late worker has reported and applied what it owes (at
        most `timeout_s`, then StepTimeoutError naming them): before a step every
        worker must take part in (the first of a Ray Data epoch)."""

        deadline = Deadline(f"late worker(s) {self.late_slots}, to begin a Ray Data epoch "
                            "together", timeout_s)
        while self._busy and not deadline.over():
            deadline.wait([entry[2] for entry in self._busy.values()])
            self.free([], [])
        if self._busy:
            late = [entry[0] for entry in self._busy.values()]
            raise StepTimeoutError(f"waiting for late worker(s) {self.late_slots} to begin a "
                                   f"Ray Data epoch together: no answer in {timeout_s:.1f} s",
                                   late)

    def count_dropped(self, slot: int, samples: int | None, batches: int = 1) -> None:
        """One batch (or `batches`) of worker `slot` dropped from a step; their rows
        when known."""
        self.dropped_batches[slot] = self.dropped_batches.get(slot, 0) + batches
        if samples:
            self.dropped_samples[slot] = self.dropped_samples.get(slot, 0) + int(samples)

    def reset(self) -> None:
        """After a recovery probed every worker (a ping runs after all their queued
        calls): nobody is late any more, the applies owed were run (a worker that
        failed one was brought to the survivors' state by the recovery), and the
        dead were handled by it."""
        self._busy.clear()
        self._owed.clear()
        self._dead.clear()
        self._since.clear()
