"""The driver's state besides its actors (dsgd/engine/actors.py): what the model
fixes for an object's life (`Topology`) and what the run has done so far
(`Progress`). `DistributedSGD` makes one of each in `__init__`; a `Topology`
never changes, a `Progress` changes only through its own methods."""

from __future__ import annotations

import dataclasses

from dsgd.comm.sharding import ExchangeLayout, Shard, ShardPlan


@dataclasses.dataclass(frozen=True)
class Topology:
    """How gradients travel, fixed by the first workers' model.

    signature: the variables' names, shapes and dtypes (replacement workers must match).
    layout: the shard plan (strategy "simple": one shard per variable), the
        groups of shards that travel as one object per worker and step (one
        per PS under "ps"; one per shard under "simple") and the PS of every
        group (none under "simple" or with one worker): dsgd/comm/sharding.py.
    per_group_blocker: why steps cannot be applied PS group by group with these
        optimizers (None: they can; see Replicas.per_group_blocker).
    warm_store_bytes: how much of its object-store mapping each actor warms.
    """

    signature: dict
    layout: ExchangeLayout
    per_group_blocker: str | None
    warm_store_bytes: int

    @property
    def plan(self) -> ShardPlan:
        return self.layout.plan

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return self.layout.groups

    @property
    def ps_of_shard(self) -> tuple[int, ...]:
        return self.layout.ps_of_shard

    @property
    def num_ps(self) -> int:
        return self.layout.num_ps

    @property
    def group_shards(self) -> tuple[tuple[Shard, ...], ...]:
        """The `Shard`s of every group."""
        return tuple(self.layout.shards(g) for g in range(len(self.groups)))

    def ps_of_group(self, g: int) -> int:
        return self.layout.ps_of_group[g]


class Progress:
    """Steps applied and skipped, failures recovered and the last checkpoint
    written or restored: the record the failure policy and checkpoints read."""

    def __init__(self):
        self._steps_done = 0
        self._skipped_steps = 0
        self._counted = 0  # steps counted over the object's life (never goes back)
        self._failures: list[dict] = []
        self._last_checkpoint: str | None = None
        self._last_checkpoint_step: int | None = None
        # The automatic snapshot (engine/loop.py): worker 0's checkpoint files held in
        # the driver's memory, with the step, data position and feed they belong to.
        self.snapshot: dict | None = None

    @property
    def steps_done(self) -> int:
        """Steps applied to every replica."""
        return self._steps_done

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient (on_nonfinite="skip")."""
        return self._skipped_steps

    @property
    def failures(self) -> list[dict]:
        """One record per recovered failure: step, error, reason, recovery_s (a copy)."""
        return list(self._failures)

    @property
    def last_checkpoint(self) -> str | None:
        return self._last_checkpoint

    @property
    def counted(self) -> int:
        """Steps applied or skipped over the object's life: unlike `steps_done`, a
        restored checkpoint does not move it back."""
        return self._counted

    def count(self, skipped: bool) -> None:
        """One more step applied, or skipped."""
        self._counted += 1
        if skipped:
            self._skipped_steps += 1
        else:
            self._steps_done += 1

    @property
    def last_checkpoint_step(self) -> int | None:
        return self._last_checkpoint_step

    def restored(self, path: str | None, steps_done: int) -> None:
        """A checkpoint (path None: the automatic snapshot) was restored: the step
        count is the one saved with it."""
        if path is not None:
            self._last_checkpoint, self._last_checkpoint_step = path, int(steps_done)
        self._steps_done = int(steps_done)

    def saved(self, path: str, steps_done: int | None = None) -> None:
        self._last_checkpoint, self._last_checkpoint_step = path, steps_done

    def annotate_failure(self, index: int = -1, **fields) -> None:
        """Add `fields` to failure `index`'s record (default the last: e.g. steps
        lost or replayed, the recovery's time once it is done)."""
        self._failures[index].update(fields)

    def charge(self, record: dict, max_failures: int, what: str,
               cause: BaseException | None = None) -> int:
        """The one failure budget: every failure the driver survives (a recovery,
        one met while recovering, a PS the workers stood in for, a backup
        worker's replacement and its failed start) is charged here, once, when
        it is found. Records `record` (step, error, reason; `recovery_s` is
        added once the recovery is done: `annotate_failure`) and returns its
        index; raises DsgdError instead when it is failure number
        max_failures + 1, naming `what` (the step and the actor) and `cause`."""
        from dsgd.engine.failures import over_budget
        from dsgd.errors import DsgdError

        stop = over_budget(len(self._failures) + 1, max_failures, what)
        if stop is not None:
            if cause is not None:
                stop += f" (cause: {type(cause).__name__}: {first_line(cause)})"
            raise DsgdError(stop) from cause
        self._failures.append({**record, "recovery_s": record.get("recovery_s")})
        return len(self._failures) - 1


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its first note when the message is
    Ray's generic one), without the terminal colours Ray adds, at most 200 characters."""
    import re

    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip().splitlines()
    notes = getattr(error, "__notes__", None)
    if notes and (not lines or lines[0].startswith("The actor died unexpectedly")):
        lines = [notes[0]] + lines
    return lines[0][:200] if lines else type(error).__name__
