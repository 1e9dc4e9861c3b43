"""One synchronous step of a DistributedSGD, in phases, and the loop that keeps
the next step in flight (driver side).

A step is `submit` (workers start computing: `compute` streams, or one
`local_step` with one worker), `exchange` (the driver waits for the workers'
infos, checks for epoch ends and non-finite gradients, calls the PS actors as
each shard group is written and submits every worker's `apply`), then `finish`
(the applies, or the local step, are waited for).

`run` makes steps one after the other with recovery from actor deaths (and hung
actors, with `replace_hung`). With `ahead`, the next step is submitted right
after this step's applies: Ray runs an actor's calls in order, so each worker
starts the next step's compute the moment its apply ends, instead of idling for
a round trip to the driver. With several workers nothing of a step in flight
touches weights before the step before it has been checked and applied, so
results are those of steps run one at a time; on a failure the step in flight
is dropped and redone. (With one worker the step ahead is a whole local step: if
the one before it had a NaN gradient under on_nonfinite="raise", that one was
applied too, as the error says, and both are counted.)
"""

from __future__ import annotations

import logging
import time

from dsgd import recovery
from dsgd.actors import actor_died_errors
from dsgd.errors import DsgdError, NonFiniteError, StepTimeoutError
from dsgd.param_server import mean_shard, split_group

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
        mean_refs = []
        for g, group in enumerate(sgd.shard_groups):
            refs = sgd.actors.next_all(self.streams, workers, f"{self.label}: writing shard group {g}",
                                       self.time_left())
            shards = sgd._group_shards[g]
            if sgd.strategy == "ps":
                ps = sgd.actors.ps[sgd.ps_assignment[group[0]]]
                mean_refs.append(ps.mean.remote(shards, *refs))
            else:
                worker_groups = sgd.actors.wait(refs, workers, f"{self.label}: gathering shard "
                                                f"group {g}", self.time_left())
                mean_refs.append(ray.put(tuple(
                    mean_shard(s, p) for s, p in zip(shards, split_group(shards, worker_groups)))))
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
    (elastic below its target)."""
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
        yield infos, applied, skipped


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
