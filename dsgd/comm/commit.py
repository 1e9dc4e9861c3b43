"""Whether a step of the worker-driven exchange is applied: one pure decision,
made by every worker from the same inputs.

Each worker sends PS 0 a small `meta` once its gradient is computed (its replicas'
finiteness, its metric names, or that its data ended its epoch), with its part of
PS 0's group after the backward pass or to PS 0's gather during it, and receives
every worker's back through PS 0 (dsgd/comm/ps_client.py `StepExchange.metas`).
`decide` turns those metas into the step's fate before any replica applies
anything; all workers decide alike, so replicas stay identical without asking
the driver. The driver reads the same metas in the workers' reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsgd.comm.reports import StepReport
from dsgd.errors import DsgdError

APPLY, SKIP, HALT, EPOCH_END = "apply", "skip", "halt", "epoch_end"


@dataclass(frozen=True)
class Meta:
    """What a worker sends with its gradient, through PS 0, to every worker
    (`StepExchange.metas`, `StepExchange.choose`). Exactly one of three: its
    step computed (`finite`: each replica's gradient finite, `metrics`: its
    metric names, `report`: its losses, metric values, samples and times, so
    that a survivor can give the driver the report of a worker that died after
    the step, Worker.recent_reports); its data's epoch ended (`epoch_end`); its
    step raised (`error`: it sends no gradient, and the others stop at once
    instead of waiting for it)."""
    slot: int
    finite: tuple = ()              # one bool per replica
    metrics: tuple = ()             # sorted metric names
    report: StepReport | None = None
    epoch_end: bool = False
    error: str | None = None


def meta(slot: int, finite: list[bool] | None, metric_names: list[str] | None,
         error: BaseException | None = None, report: StepReport | None = None) -> Meta:
    """Worker `slot`'s `Meta`: `error` if its step raised, else `finite` None
    if its data's epoch ended, else its computed step."""
    if error is not None:
        return Meta(slot, error=f"{type(error).__name__}: {error}")
    if finite is None:
        return Meta(slot, epoch_end=True)
    return Meta(slot, tuple(finite), tuple(sorted(metric_names or [])), report)


@dataclass(frozen=True)
class Decision:
    action: str                     # APPLY, SKIP (non-finite, "skip"), HALT (non-finite,
                                    # "raise": nothing applied, the run stops), EPOCH_END
    nonfinite: tuple = ()           # (worker slot, replica) of every non-finite gradient

    @property
    def applied(self) -> bool:
        """Whether the step's means are applied."""
        return self.action == APPLY


def decide(metas: list[Meta], on_nonfinite: str) -> Decision:
    """The step's fate from every worker's meta (rank order). Raises ValueError
    when the workers' get_loss return different metric names and DsgdError when
    some workers' data ended its epoch and others' did not (nothing applied
    either way: the same error on every worker), and DsgdError naming a worker
    whose step raised (which raises its own error itself)."""
    failed = [m for m in metas if m.error is not None]
    if failed:
        raise DsgdError("; ".join(f"worker {m.slot}'s step raised {m.error}"
                                  for m in failed) + ". No weights were changed.")
    ended = [m.slot for m in metas if m.epoch_end]
    if ended:
        if len(ended) < len(metas):
            raise DsgdError(f"the data of worker(s) {sorted(ended)} ended its epoch before the "
                            "others': every worker's share must have as many batches")
        return Decision(EPOCH_END)
    names = [m.metrics for m in metas]
    if any(n != names[0] for n in names):
        raise ValueError("get_loss must return the same metric names on every replica: "
                         + "; ".join(f"worker {m.slot} returns {list(m.metrics)}" for m in metas)
                         + ". No weights were changed.")
    bad = tuple((m.slot, r) for m in metas for r, ok in enumerate(m.finite) if not ok)
    if bad and on_nonfinite == "skip":
        return Decision(SKIP, bad)
    if bad and on_nonfinite == "raise":
        return Decision(HALT, bad)
    return Decision(APPLY, bad)
