"""Carrying out the failure policy (driver side): probe the actors after a
failed step, ask `failures.decide` what to do, then replace workers and PS
actors, copy state, restore a checkpoint, or grow back (elastic=True).

The policy itself is pure (dsgd/engine/failures.py); this module only executes it.
Every function takes the driver (`dsgd.sgd.DistributedSGD`) and blocks, each
wait at most `step_timeout_s` (replacements: `start_timeout_s`).
"""

from __future__ import annotations

import logging
import re
import time

from dsgd import constants
from dsgd.engine import failures, launch
from dsgd.engine.actors import placeable_workers
from dsgd.errors import DsgdError

logger = logging.getLogger("dsgd")


def recover(sgd, error: BaseException, between_steps: bool = False) -> bool:
    """Carry out what failures.decide says after `error`. Returns True if the
    interrupted step had been applied (do not retry it). Raises if the policy
    says the error is not recoverable. between_steps: the failure was found
    after step `steps_done` was counted and before the next step's applies
    (logged and recorded as step `steps_done`'s, nothing to retry; a step
    already submitted to workers that were replaced must be submitted again)."""
    start = time.perf_counter()
    probed, dead_ps = sgd.actors.probe(sgd.step_timeout_s)
    workers = [failures.WorkerStatus(slot, info is not None,
                                     None if info is None else info["applied_steps"])
               for slot, info in probed.items()]
    dead = [w.slot for w in workers if not w.alive]
    for slot in dead:  # frees its resources for the replacement
        sgd.actors.remove_worker(slot)
        sgd._info_by_slot.pop(slot, None)
    for j in dead_ps:
        sgd.actors.ps[j] = None
    placeable = placeable_workers(sgd.actors.worker_options, len(dead)) if dead else 0
    action = failures.decide(failures.Status(
        workers, dead_ps, sgd.steps_done, len(sgd.failures) + 1, sgd.max_failures,
        sgd.elastic, placeable, sgd._last_checkpoint is not None, between_steps))
    step = sgd.steps_done + (0 if between_steps else 1)  # the step it is reported under
    if not action.recover:
        if not dead and not dead_ps:
            raise error
        raise DsgdError(f"step {step}: {action.reason}") from error
    logger.warning("step %d: %s (%s: %s)", step, action.reason,
                   type(error).__name__, first_line(error))
    add_workers(sgd, action.replace_workers)
    if action.state_source is not None:
        copy_state(sgd, action.state_source, action.replace_workers + action.sync_workers)
    else:
        sgd.restore_checkpoint(sgd._last_checkpoint)
    if action.drop_workers:
        logger.warning("elastic: continuing with %d worker(s); global batch is now %d "
                       "replica batches", sgd.num_workers, sgd.num_workers * sgd.devices_per_worker)
    _workers_changed(sgd, action.replace_workers)
    sgd.failures.append({"step": step, "error": type(error).__name__,
                         "reason": action.reason, "recovery_s": time.perf_counter() - start})
    logger.warning("recovered in %.1f s", sgd.failures[-1]["recovery_s"])
    return action.step_completed


def replace_dead_ps(sgd, groups: list[int]) -> None:
    """After a step (already counted) that the workers completed by computing
    the means of shard `groups` themselves (their PS did not answer:
    Worker.apply_staged): replace the dead PS actors now, as a recovered
    failure, rather than fail the next step. A worker found dead too goes
    through the general policy (its state copied from a survivor)."""
    what = (f"step {sgd.steps_done}: the PS of shard group(s) {groups} did not answer; "
            "the workers computed those means themselves")
    probed, dead_ps = sgd.actors.probe(sgd.step_timeout_s)
    if any(info is None for info in probed.values()):
        recover(sgd, DsgdError(what), between_steps=True)
        return
    if not dead_ps:
        logger.warning("%s (no PS actor found dead)", what)
        return
    start = time.perf_counter()
    reason = (f"PS actor(s) {', '.join(map(str, dead_ps))} died; the workers computed its "
              "means: the step had been applied, not retried")
    if len(sgd.failures) + 1 > sgd.max_failures:
        raise DsgdError(f"step {sgd.steps_done}: {reason}; failure {len(sgd.failures) + 1} "
                        f"exceeds max_failures={sgd.max_failures}")
    logger.warning("%s: %s", what, reason)
    for j in dead_ps:
        sgd.actors.ps[j] = None
    add_workers(sgd, [])
    sgd.failures.append({"step": sgd.steps_done, "error": "ActorDiedError", "reason": reason,
                         "recovery_s": time.perf_counter() - start})


def add_workers(sgd, slots: list[int]) -> None:
    """Start workers for `slots` (replacements, or growth back with elastic=True)
    and any PS actor that is missing. Their state is copied by the caller."""
    sgd.actors.next_generation()
    if slots:
        launch.start_workers(sgd, slots)
    sgd.num_workers = len(sgd.workers)
    if slots:
        sgd.membership += 1  # a data feed sends its loaders again (steps.feed_args)
    launch.ensure_ps(sgd)


def copy_state(sgd, source_slot: int, targets: list[int]) -> None:
    """Copy worker `source_slot`'s full state (weights, optimizer state, step
    count) to workers `targets` through the object store."""
    if not targets:
        return
    source = sgd.actors.worker(source_slot)
    ref = source.get_full_state.remote()
    handles = [sgd.actors.worker(s) for s in targets]
    sgd._wait([h.set_full_state.remote(ref) for h in handles], handles,
              f"copying worker {source_slot}'s state", sgd.step_timeout_s)


def maybe_grow(sgd) -> None:
    """elastic: start workers for missing slots when resources are back
    (checked at most every GROW_CHECK_INTERVAL_S)."""
    if sgd.num_workers >= sgd.target_workers or time.monotonic() < sgd._next_grow_check:
        return
    sgd._next_grow_check = time.monotonic() + constants.GROW_CHECK_INTERVAL_S
    missing = [s for s in range(sgd.target_workers) if s not in sgd.actors.slots]
    room = placeable_workers(sgd.actors.worker_options, len(missing))
    if not room:
        return
    slots = missing[:room]
    add_workers(sgd, slots)
    copy_state(sgd, next(s for s in sgd.actors.slots if s not in slots), slots)
    _workers_changed(sgd, slots)
    logger.warning("elastic: added worker(s) %s; %d worker(s), global batch %d replica batches",
                   ", ".join(map(str, slots)), sgd.num_workers,
                   sgd.num_workers * sgd.devices_per_worker)


def _workers_changed(sgd, slots: list[int]) -> None:
    """Tell the layers above (DistributedSGD.on_workers_changed) that new workers
    hold the copied state, e.g. so the Trainer gives them its train() info."""
    if slots:
        for hook in sgd.on_workers_changed:
            hook()


def first_line(error: BaseException) -> str:
    """The first line of an error's message, without the terminal colours Ray adds."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip().splitlines()
    return lines[0][:200] if lines else ""
