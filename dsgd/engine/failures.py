"""What to do when actors die: a small pure policy, no Ray here.

The driver probes every actor after a step fails, describes what it found in a
`Status`, and carries out the `Action` that `decide` returns. Keeping the
decision pure makes every branch testable in-process (tests/test_failures.py).

The invariant that makes recovery exact: a worker's `applied_steps` counts the
steps it has applied. Steps are synchronous, so after a failure every surviving
worker has applied either `steps_done` or `steps_done + 1` steps (the latter when
the failure hit during the apply phase, after some workers had applied). The
survivor furthest ahead holds the true state; everyone else is brought to it.
If it is ahead, the interrupted step is complete and must not be retried;
otherwise the step is retried from identical state, so no step is lost or
applied twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerStatus:
    slot: int                      # worker index (its data shard); kept by a replacement
    alive: bool
    applied_steps: int | None = None  # None when dead


@dataclass(frozen=True)
class Status:
    workers: list[WorkerStatus]
    dead_ps: list[int]             # PS indices that died
    steps_done: int                # steps the driver had completed before the failed one
    elastic: bool
    placeable_workers: int         # new workers the cluster can place right now
    has_checkpoint: bool           # a checkpoint to fall back on if no worker survives
    between_steps: bool = False    # found after step `steps_done` was counted: none interrupted
    call: str | None = None        # a driver call outside steps, to be run again afterwards
    restore_from: str = "the last checkpoint"  # what has_checkpoint restores
    late_behind: bool = False      # backup workers on the workers' own exchange: late
                                   # survivors may be any number of steps behind (synced)


@dataclass(frozen=True)
class Action:
    recover: bool                  # False: raise `reason`
    reason: str
    replace_workers: list[int] = field(default_factory=list)  # slots to restart
    drop_workers: list[int] = field(default_factory=list)     # slots to give up (elastic)
    replace_ps: list[int] = field(default_factory=list)      # PS indices to restart
    state_source: int | None = None   # slot whose state everyone copies; None: checkpoint
    sync_workers: list[int] = field(default_factory=list)     # survivors behind the source
    step_completed: bool = False   # the interrupted step was applied: do not retry it


def over_budget(failure: int, max_failures: int, what: str) -> str | None:
    """Why to stop at failure number `failure` (this one included) when it is more
    than `max_failures`; None when it may be recovered. The one budget's rule
    (dsgd/engine/state.py `Progress.charge`, which every failure goes through);
    `decide` says what to do, the budget whether it may still be done."""
    if failure > max_failures:
        return f"{what}: failure {failure} exceeds max_failures={max_failures}"
    return None


def recovers_hang(replace_hung: bool, late: list) -> bool:
    """Whether a StepTimeoutError is recovered from (the late actors replaced)
    rather than raised: only with `replace_hung` and when it names who is late."""
    return bool(replace_hung and late)


def decide(status: Status) -> Action:
    dead = [w.slot for w in status.workers if not w.alive]
    survivors = [w for w in status.workers if w.alive]
    if not dead and not status.dead_ps:
        return Action(False, "no actor died, so the error is not one dsgd recovers from")
    what = describe(dead, status.dead_ps)
    replace = dead[:max(0, status.placeable_workers)]
    drop = dead[len(replace):]
    if drop and not status.elastic:
        return Action(False, f"{what}: no free resources to replace worker(s) "
                             f"{', '.join(map(str, drop))} (pass elastic=True to continue with "
                             "fewer workers)")
    if not survivors and not replace:
        return Action(False, f"{what}: no worker left and none can be started")
    if not survivors:
        if not status.has_checkpoint:
            return Action(False, f"{what}: every worker died and there is no checkpoint to "
                                 "restore from (call save_checkpoint regularly, or keep the "
                                 "automatic snapshot: snapshot_interval_s)")
        return Action(True, f"{what}; every worker died: restoring {status.restore_from}",
                      replace, drop, list(status.dead_ps), None, [], False)
    if status.call is not None:
        # Outside steps every survivor holds the state the steps left, unless the call
        # itself was rewriting it (restore_checkpoint, set_weights): its retry makes
        # every replica agree again, so the first survivor's state serves.
        source = survivors[0]
        reason = (f"{what} during {status.call}: replaced, the call is run again"
                  + (f"; continuing without worker(s) {', '.join(map(str, drop))}" if drop else ""))
        return Action(True, reason, replace, drop, list(status.dead_ps), source.slot, [], False)
    source = max(survivors, key=lambda w: (w.applied_steps, -w.slot))
    target = source.applied_steps
    if target not in (status.steps_done, status.steps_done + 1) or any(
            w.applied_steps not in (status.steps_done, status.steps_done + 1)
            and not (status.late_behind and w.applied_steps < status.steps_done)
            for w in survivors):
        steps = {w.slot: w.applied_steps for w in survivors}
        return Action(False, f"{what}: surviving workers have applied {steps} steps, but the "
                             f"driver completed {status.steps_done}; cannot tell which step to retry")
    sync = [w.slot for w in survivors if w.applied_steps != target]
    completed = target == status.steps_done + 1
    if status.between_steps and completed:
        steps = {w.slot: w.applied_steps for w in survivors}
        return Action(False, f"{what} between steps, but surviving workers have applied {steps} "
                             f"steps and the driver counted {status.steps_done}")
    outcome = ("found between steps: no step to retry" if status.between_steps
               else "the step had been applied: not retried" if completed else "retrying the step")
    reason = (f"{what}; {outcome}"
              + (f"; continuing without worker(s) {', '.join(map(str, drop))}" if drop else ""))
    return Action(True, reason, replace, drop, list(status.dead_ps), source.slot, sync, completed)


def describe(dead_workers: list[int], dead_ps: list[int]) -> str:
    """What died, in words ("worker(s) 1 died and PS actor(s) 0 died")."""
    parts = []
    if dead_workers:
        parts.append(f"worker(s) {', '.join(map(str, dead_workers))} died")
    if dead_ps:
        parts.append(f"PS actor(s) {', '.join(map(str, dead_ps))} died")
    return " and ".join(parts)
