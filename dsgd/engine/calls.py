"""The driver's calls to the workers outside steps (`DriverCalls`): each waits
with a deadline and, when a worker died (or hung, with `replace_hung`), has the
failure policy replace it between steps and sends the call again; and the
automatic snapshot, taken and restored through them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dsgd.comm.waits import actor_died_errors
from dsgd.config import Config
from dsgd.engine.actors import ActorSet
from dsgd.engine.failures import recovers_hang
from dsgd.engine.state import Progress
from dsgd.errors import StepTimeoutError

logger = logging.getLogger("dsgd")


class DriverCalls:
    """Calls of `DistributedSGD` to its workers between steps. `recovery` is set
    once the `Recovery` exists (it restores checkpoints through these calls)."""

    def __init__(self, config: Config, actors: ActorSet, progress: Progress):
        self.config, self.actors, self.progress = config, actors, progress
        self.recovery = None
        self.timeline_events: list[dict] = []  # timeline=: the driver's and actors' so far

    def wait(self, refs: list, owners: list, what: str, timeout_s: float | None = None) -> list:
        """The answers of `refs` (`owners` answer each), at most `timeout_s`
        (default step_timeout_s). Blocks."""
        return self.actors.wait(refs, owners, what, timeout_s or self.config.step_timeout_s)

    def call_all(self, method: str, *args) -> list:
        """Worker method `method(*args)` on every worker, retried after a loss."""
        return self.retried(method, lambda ws: ([getattr(w, method).remote(*args) for w in ws], ws))

    def first(self, what: str, method: str, *args):
        """Worker 0's method `method(*args)`, retried after a loss (`retried`)."""
        return self.retried(what, lambda ws: ([getattr(ws[0], method).remote(*args)], ws[:1]))[0]

    def run_each(self, fn, per_worker, args: tuple, timeout_s: float | None, what: str) -> list:
        """`fn(worker, per_worker[k], *args)` on worker k (`per_worker` a list, or a
        callable returning it, asked again for the new group after a loss),
        retried after a loss (`retried`)."""
        def submit(workers):
            args_list = per_worker() if callable(per_worker) else per_worker
            return [w.run.remote(fn, a, *args) for w, a in zip(workers, args_list)], workers

        return self.retried(what, submit, timeout_s)

    def retried(self, what: str, submit: Callable[[list], tuple[list, list]],
                timeout_s: float | None = None) -> list:
        """A driver call outside steps: `submit(workers)` sends it (returns the refs
        and the actor that answers each), then the answers are waited for (at
        most `timeout_s`, default step_timeout_s). If an actor died meanwhile,
        or did not answer (StepTimeoutError) and `replace_hung` is on, the
        failure policy replaces it between steps (state copied from a
        survivor; dsgd/engine/recovery.py) and the call is sent again to the
        new group. Every failure is charged to the one failure budget
        (`max_failures`, as a step's are): past it, or for a failure the policy
        does not recover from, it raises. Blocks."""
        while True:
            self.actors.check_open(what)
            refs, owners = submit(self.actors.workers)
            try:
                return self.wait(refs, owners, what, timeout_s)
            except (*actor_died_errors(), StepTimeoutError) as e:
                hung = isinstance(e, StepTimeoutError)
                if hung:
                    e = self._late_by_index(e, owners)
                if hung and not recovers_hang(self.config.replace_hung, e.late):
                    raise
                self.recovery.recover(e, call=what)  # (raises past the budget)

    def _late_by_index(self, error: StepTimeoutError, workers: list) -> StepTimeoutError:
        """A StepTimeoutError raised in a worker names who did not arrive by worker
        position and PS index (handles do not travel): the same error with the
        driver's handles in `late`, so that recovery kills and replaces them."""
        cause = getattr(error, "cause", error)  # a RayTaskError carries the worker's error
        if getattr(error, "late", None) or not (getattr(cause, "late_workers", None)
                                                or getattr(cause, "late_ps", None)):
            return error
        ps = self.actors.ps
        late = [workers[i] for i in cause.late_workers if i < len(workers)]
        late += [ps[j] for j in cause.late_ps if j < len(ps) and ps[j] is not None]
        return StepTimeoutError(str(cause), late)

    def take_snapshot(self, entry) -> None:
        """(the loop, between steps with none in flight) The automatic snapshot:
        worker 0's checkpoint files copied into the driver's memory, with the
        step count and the data position of the feed of `entry` (a FeedEntry;
        None: get_batch). A worker found dead here is left for the next step
        to recover."""
        start = time.perf_counter()
        steps = self.progress.steps_done
        worker = self.actors.workers[0]
        try:
            files = self.wait([worker.save_checkpoint.remote(steps)], [worker],
                              "taking the automatic snapshot")[0]
        except (*actor_died_errors(), StepTimeoutError) as e:
            logger.debug("no snapshot at step %d: %s", steps, e)
            return
        self.progress.snapshot = {
            "files": files, "step": steps,
            "feed": entry.feed if entry is not None else None,
            "feed_key": entry.key if entry is not None else None,
            "data_position": entry.feed.position if entry is not None else None,
            "bytes": sum(len(b) for b in files.values()),
            "cost_s": time.perf_counter() - start}
        logger.debug("snapshot of step %d: %d bytes in %.3f s", steps,
                     self.progress.snapshot["bytes"], self.progress.snapshot["cost_s"])

    def restore_snapshot(self) -> None:
        """(recovery, every worker lost) Every replica takes the automatic snapshot;
        the dataset it was taken on goes back to its position then."""
        import ray

        snapshot = self.progress.snapshot
        steps = self.call_all("restore_checkpoint", ray.put(snapshot["files"]))
        self.progress.restored(None, int(steps[0]))
        if snapshot["data_position"] is not None:
            snapshot["feed"].seek(int(snapshot["data_position"]))
