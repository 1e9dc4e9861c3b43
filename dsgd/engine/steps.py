"""One synchronous step of a DistributedSGD, in phases, and the loop that keeps
the next step in flight (driver side).

A step is `submit` (workers start computing: `compute` streams, or one
`local_step` with one worker), `exchange` (the driver waits for the workers'
infos, checks for epoch ends and non-finite gradients, calls the PS actors as
each shard group is written and submits every worker's `apply`), then `finish`
(the applies, or the local step, are waited for). With strategy "ps" and
several groups, each worker's `apply_staged` applies a group's variables as
soon as that group's mean is in the store (`per_group`); a mean whose PS died
is computed by the workers themselves, so the step still completes exactly.

`run` makes steps one after the other with recovery from actor deaths (and hung
actors, with `replace_hung`). With `ahead`, the next step is submitted right
after this step's applies: Ray runs an actor's calls in order, so each worker
starts the next step's compute the moment its apply ends, instead of idling for
a round trip to the driver. With several workers nothing of a step in flight
touches weights before the step before it has been checked and applied, so
results are those of steps run one at a time; on a failure the step in flight
is dropped and redone.

With one worker and a known count (`train()`), `run_local` runs the steps
LOCAL_STEPS_PER_CALL per actor call, the next call queued behind the current
one: Ray's cost per call is paid once per chunk. A NaN gradient under
on_nonfinite="raise" (applied: one worker checks alongside the update) stops
that call and the one queued behind it.
"""

from __future__ import annotations

import logging
import time

from dsgd import constants
from dsgd.engine import recovery
from dsgd.engine.actors import actor_died_errors
from dsgd.errors import DsgdError, NonFiniteError, StepTimeoutError
from dsgd.comm.means import group_means

logger = logging.getLogger("dsgd")


class Step:
    """One step of `sgd` on `data` (one argument per worker; None: get_batch)."""

    def __init__(self, sgd, data: list, number: int):
        self.sgd, self.data, self.label = sgd, data, f"step {number}"
        self.start = time.perf_counter()
        self.workers = list(sgd.workers)
        self.infos = self.applied = None

    def time_left(self) -> float:
        return max(0.001, self.sgd.step_timeout_s - (time.perf_counter() - self.start))

    def submit(self) -> "Step":
        sgd = self.sgd
        if len(self.workers) == 1:
            self.local = self.workers[0].local_step.remote(self.data[0])
        else:
            self.streams = [w.compute.options(num_returns="streaming").remote(sgd.shard_groups, d)
                            for w, d in zip(self.workers, self.data)]
        return self

    @property
    def ended_epoch(self) -> bool:
        return bool(self.infos) and bool(self.infos[0].get("epoch_end"))

    def exchange(self) -> None:
        """(several workers) Infos, checks, PS calls, applies submitted."""
        import ray

        sgd, workers = self.sgd, self.workers
        if len(workers) == 1:
            return
        what = f"{self.label}: computing gradients"
        info_refs = sgd.actors.next_all(self.streams, workers, what, self.time_left())
        self.infos = sgd.actors.wait(info_refs, workers, what, self.time_left())
        ended = [i for i, info in enumerate(self.infos) if info.get("epoch_end")]
        if ended:
            if len(ended) < len(self.infos):
                raise DsgdError(f"{self.label}: the data of worker(s) {ended} ended its epoch "
                                "before the others': every worker's share must have as many batches")
            self.applied = []
            return
        if not check_finite(sgd, self.infos):
            self.applied = [{"apply_s": 0.0}]  # skipped: the streams' shards are dropped
            return
        mean_refs, grad_refs = [], []
        for g, group in enumerate(sgd.shard_groups):
            refs = sgd.actors.next_all(self.streams, workers, f"{self.label}: writing shard group {g}",
                                       self.time_left())
            shards = sgd._group_shards[g]
            if sgd.strategy == "ps":
                ps = sgd.actors.ps[sgd.ps_assignment[group[0]]]
                mean_refs.append(ps.mean.remote(shards, *refs))
                grad_refs.append(refs)
            else:
                worker_groups = sgd.actors.wait(refs, workers, f"{self.label}: gathering shard "
                                                f"group {g}", self.time_left())
                mean_refs.append(ray.put(group_means(shards, worker_groups)))
        if per_group(sgd):
            # Every gradient is in the store by now: a worker applies group g while
            # the PS actors still sum the groups after it, and can compute a mean
            # itself if its PS dies (Worker.apply_staged).
            # The workers wait a little past the driver, so that a late PS is the
            # driver's StepTimeoutError, and once they have begun to apply a step,
            # another step_timeout_s before they give up on it.
            self.apply_refs = [w.apply_staged.remote(
                sgd.shard_groups, mean_refs, grad_refs,
                self.time_left() + constants.WORKER_WAIT_MARGIN_S, sgd.step_timeout_s)
                for w in workers]
        else:
            self.apply_refs = [w.apply.remote(sgd.shard_groups, *mean_refs) for w in workers]

    def finish(self) -> tuple[list, list]:
        """(infos, applied): waits for the applies, or for the local step."""
        sgd, workers = self.sgd, self.workers
        if len(workers) == 1:
            self.infos = sgd.actors.wait([self.local], workers, self.label, self.time_left())
            if not self.ended_epoch:
                check_finite(sgd, self.infos)
            return self.infos, ([] if self.ended_epoch else [{"apply_s": 0.0}])
        if self.applied is None:
            self.applied = sgd.actors.wait(self.apply_refs, workers, f"{self.label}: applying",
                                           self.time_left())
        return self.infos, self.applied


def run(sgd, feed, count: int | None):
    """Steps, one after the other, as a generator of (infos, applied, skipped):
    `count` of them (None: until the caller stops, which then must not need the
    step in flight to be applied). Recovers from actor deaths; infos is None for
    a step that had been applied when a failure interrupted it; applied is []
    and every info {"epoch_end": True} when the feed's epoch ended instead. The
    next step is submitted ahead while this one finishes, except where that could
    apply a step nobody asked for (one worker, count None) or workers may change
    (elastic below its target). One worker with a count runs several steps per
    call (`run_local`)."""
    if (count is not None and count > 1 and sgd.target_workers == 1 and sgd.num_workers == 1
            and constants.LOCAL_STEPS_PER_CALL > 1):
        yield from run_local(sgd, feed, count)
        return
    done, pending = 0, None
    while count is None or done < count:
        ahead = None
        try:
            if pending is None:
                if sgd.elastic:
                    recovery.maybe_grow(sgd)
                pending = Step(sgd, feed_args(sgd, feed, 0), sgd.steps_done + 1).submit()
            step_workers = len(pending.workers)
            pending.exchange()
            try:
                if _may_run_ahead(sgd, pending, count, done):
                    ahead = Step(sgd, feed_args(sgd, feed, 1), sgd.steps_done + 2).submit()
                infos, applied = pending.finish()
            except NonFiniteError:
                # One worker: that update was applied (check_finite counted it), and so
                # is the step ahead, if any; count both and move the data on.
                _advance(feed, sgd, step_workers)
                if ahead is not None:
                    _finish_quietly(ahead, feed)
                raise
            except (*actor_died_errors(), StepTimeoutError):
                raise
            except BaseException:
                # Not an actor failure (e.g. the next step's data failed to download):
                # this step's applies are on their way; wait for them and count them.
                if pending.applied is None and len(pending.workers) > 1:
                    _finish_quietly(pending, feed)
                raise
        except actor_died_errors() as e:
            pending = None
            if not recovery.recover(sgd, e):
                continue  # retry the step
            infos, applied = None, [{"apply_s": 0.0}]
            ahead = None
        except StepTimeoutError as e:
            if not sgd.replace_hung or not getattr(e, "late", None):
                raise
            logger.warning("step %d: killing hung actor(s) %s to replace them (%s)",
                           sgd.steps_done + 1, ", ".join(sgd.actors.name(h) for h in e.late),
                           recovery.first_line(e))
            for handle in e.late:
                sgd.actors.kill(handle)
            pending = None
            if not recovery.recover(sgd, e):
                continue
            infos, applied = None, [{"apply_s": 0.0}]
            ahead = None
        pending = ahead
        if infos is not None and infos[0].get("epoch_end"):
            yield infos, [], False
            continue
        skipped = infos is not None and not all(f for info in infos for f in info["finite"])
        if skipped:
            sgd.skipped_steps += 1
        else:
            sgd.steps_done += 1
        _advance(feed, sgd, step_workers)  # the rows of the workers the step ran on
        done += 1
        fallen = sorted({g for a in applied for g in a.get("ps_fallback", ())})
        if fallen:  # counted first: the workers have applied it, whatever happens next
            workers = list(sgd.workers)
            recovery.replace_dead_ps(sgd, fallen)
            if pending is not None and list(sgd.workers) != workers:
                # A worker was found dead too and replaced (or a checkpoint restored):
                # the step submitted ahead went to the old workers; submit it again.
                pending = None
        yield infos, applied, skipped


class LocalSteps:
    """Several steps of a one-worker `sgd` in one actor call (Worker.local_steps):
    Ray's cost per call (submitting, scheduling, the result's round trip) is
    paid once for all of them."""

    def __init__(self, sgd, data: list, run_id: int, first_number: int):
        self.sgd, self.data, self.run_id = sgd, data, run_id
        self.label = f"steps {first_number}-{first_number + len(data) - 1}"
        self.workers = list(sgd.workers)

    @property
    def size(self) -> int:
        return len(self.data)

    def submit(self) -> "LocalSteps":
        self.start = time.perf_counter()
        self.ref = self.workers[0].local_steps.remote(self.data, self.run_id)
        return self

    def finish(self) -> list[dict]:
        """One info per step run (fewer than asked at an epoch's end or after a
        non-finite gradient under on_nonfinite="raise"). Waits at most
        step_timeout_s per step."""
        sgd = self.sgd
        timeout = sgd.step_timeout_s * self.size - (time.perf_counter() - self.start)
        return sgd.actors.wait([self.ref], self.workers, self.label, max(0.001, timeout))[0]


def run_local(sgd, feed, count: int):
    """`run` for one worker and a known count: chunks of up to
    LOCAL_STEPS_PER_CALL steps per actor call, the next chunk submitted while
    this one runs. Yields per step as `run` does; each step's applied entry
    carries "step_s", the chunk's wall time per step (steps of one chunk
    arrive together). A worker death loses the unreported steps of the chunk,
    which recovery (a checkpoint) redoes; after a non-finite gradient under
    "raise" the worker runs nothing more of this call (NonFiniteError)."""
    sgd._local_runs = run_id = getattr(sgd, "_local_runs", 0) + 1
    chunk = constants.LOCAL_STEPS_PER_CALL
    done, pending, last = 0, None, time.perf_counter()

    def submit(offset: int, size: int) -> LocalSteps:
        data = [feed_args(sgd, feed, offset + k)[0] for k in range(size)]
        return LocalSteps(sgd, data, run_id, sgd.steps_done + offset + 1).submit()

    while done < count:
        ahead = None
        try:
            if pending is None:
                pending = submit(0, min(chunk, count - done))
            rest = count - done - pending.size
            try:
                if rest > 0:
                    ahead = submit(pending.size, min(chunk, rest))
            except Exception:
                _count_quietly(pending, feed)  # e.g. the next data failed: these steps run
                raise
            try:
                infos = pending.finish()
                if ahead is not None:
                    ahead.start = time.perf_counter()  # its steps start now
            except Exception as e:
                if ahead is not None and not isinstance(e, (*actor_died_errors(),
                                                            StepTimeoutError)):
                    _count_quietly(ahead, feed)  # the worker halted this run: runs nothing
                raise
        except (*actor_died_errors(), StepTimeoutError) as e:
            if isinstance(e, StepTimeoutError):
                if not sgd.replace_hung or not getattr(e, "late", None):
                    raise
                logger.warning("%s: killing the hung worker to replace it (%s)",
                               pending.label if pending else f"step {sgd.steps_done + 1}",
                               recovery.first_line(e))
                for handle in e.late:
                    sgd.actors.kill(handle)
            pending = None
            recovery.recover(sgd, e)  # one worker: a checkpoint, or an error
            continue
        now = time.perf_counter()
        step_s, last = (now - last) / max(1, len(infos)), now
        for info in infos:
            if info.get("epoch_end"):
                yield [info], [], False
                continue
            if "error" in info:  # a step failed after others of the call were applied
                if ahead is not None:
                    _count_quietly(ahead, feed)
                raise info["error"]
            try:
                skipped = not check_finite(sgd, [info])
            except NonFiniteError:
                _advance(feed, sgd, 1)  # check_finite counted the applied step
                if ahead is not None:
                    _count_quietly(ahead, feed)
                raise
            if skipped:
                sgd.skipped_steps += 1
            else:
                sgd.steps_done += 1
            _advance(feed, sgd, 1)
            done += 1
            yield [info], [{"apply_s": 0.0, "step_s": step_s}], skipped
        pending = ahead


def _count_quietly(chunk: LocalSteps, feed) -> None:
    """Wait for a call of local steps whose outcome no one will read (the
    caller raises another error), counting the steps it applied or skipped."""
    try:
        infos = chunk.finish()
    except Exception:  # noqa: BLE001 - the caller's error is the one to report
        return
    sgd = chunk.sgd
    for info in infos:
        if info.get("epoch_end") or "error" in info:
            continue
        if info["applied"]:
            sgd.steps_done += 1
            if not all(info["finite"]):  # its NonFiniteError would hide the caller's
                logger.warning("step %d: non-finite gradient on replica(s) %s, applied "
                               "(reported here: another error is being raised)", sgd.steps_done,
                               [i for i, f in enumerate(info["finite"]) if not f])
        else:
            sgd.skipped_steps += 1
        _advance(feed, sgd, 1)


def per_group(sgd) -> bool:
    """Whether steps apply each PS group's mean as it arrives: strategy "ps", more
    than one group, optimizers that allow it (Replicas.per_group_blocker), every
    worker on one node, and not turned off (constants.APPLY_PER_GROUP). One node:
    a worker computes a dead PS's mean from the workers' gradient objects, which
    outlive their processes there; a lost node takes its workers' objects with
    it, and survivors that had begun to apply could neither finish nor undo."""
    return (constants.APPLY_PER_GROUP and sgd.strategy == "ps" and len(sgd.shard_groups) > 1
            and getattr(sgd, "per_group_blocker", "unknown") is None
            and len({info["node_id"] for info in sgd.worker_info}) == 1)


def _advance(feed, sgd, num_workers: int) -> None:
    if feed is not None:
        feed.advance(sgd, num_workers)


def _may_run_ahead(sgd, pending: Step, count: int | None, done: int) -> bool:
    if pending.ended_epoch or (count is not None and done + 1 >= count):
        return False
    if sgd.num_workers < sgd.target_workers:
        return False  # elastic: growing back needs a quiet moment
    return count is not None or len(pending.workers) > 1


def _finish_quietly(step: Step, feed) -> None:
    """Wait for a step whose outcome no one will read, and count it if applied
    (a non-finite one applied with one worker is counted by check_finite)."""
    try:
        infos, applied = step.finish()
    except NonFiniteError:
        _advance(feed, step.sgd, len(step.workers))
        return
    if applied and not (infos and infos[0].get("epoch_end")):
        step.sgd.steps_done += 1
        _advance(feed, step.sgd, len(step.workers))


def feed_args(sgd, feed, ahead: int) -> list:
    """Each worker's data argument for a step `ahead` steps after the next one
    (None: get_batch), after sending the workers `feed`'s loaders if it is new
    to them or workers changed."""
    if feed is None:
        return [None] * sgd.num_workers
    if feed.attached_membership != sgd.membership:
        workers = list(sgd.workers)
        sgd._wait([w.attach_data.remote(feed.key, loader)
                   for w, loader in zip(workers, feed.loaders(sgd))], workers,
                  "attaching data loaders", sgd.step_timeout_s)
        feed.attached_membership = sgd.membership
    sgd.last_feed = feed
    return [(feed.key, arg) for arg in feed.step_args(sgd, ahead)]


def check_finite(sgd, infos: list[dict]) -> bool:
    """True if every replica's gradient was finite. Otherwise raise
    NonFiniteError (on_nonfinite="raise") or return False ("skip")."""
    bad = [(slot, r) for slot, info in zip(sgd.actors.slots, infos)
           for r, ok in enumerate(info["finite"]) if not ok]
    if not bad:
        return True
    fp16_hint = ""
    if getattr(sgd, "compression", None) == "fp16" and sgd.num_workers > 1:
        fp16_hint = (" With compression='fp16' this includes a mean gradient beyond "
                     "float16's range (|g| >= 65520 rounds to Inf): use compression='bf16' "
                     "(float32's range), or none.")
    if sgd.on_nonfinite == "skip":
        logger.warning("step %d skipped: non-finite gradient on %s.%s", sgd.steps_done + 1,
                       ", ".join(f"worker {w} replica {r}" for w, r in bad), fp16_hint)
        return False
    step = sgd.steps_done + 1
    applied = any(info.get("applied") for info in infos)
    if applied:  # one worker: the update ran alongside the check (see Replicas.configure)
        sgd.steps_done += 1
        outcome = ("the update was applied (with one worker the check runs alongside it): "
                   "the weights now hold NaN/Inf; restore a checkpoint. Pass "
                   "on_nonfinite='skip' to check before updating and skip such steps.")
    else:
        outcome = "no weights were changed. Pass on_nonfinite='skip' to skip such steps."
    slot, r = bad[0]
    outcome += fp16_hint
    raise NonFiniteError(
        f"step {step}: non-finite gradient (NaN or Inf) on worker {slot}, replica {r} "
        f"(global replica {slot * sgd.devices_per_worker + r})"
        + (f" and {len(bad) - 1} more" if len(bad) > 1 else "") + "; " + outcome)
