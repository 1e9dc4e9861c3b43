"""Whether a step of the worker-driven exchange is applied: one pure decision,
made by every worker from the same inputs.

Each worker sends PS 0 a small `meta` once its gradient is computed (its replicas'
finiteness, its metric names, or that its data ended its epoch) and receives
every worker's back through PS 0 (dsgd/comm/ps_client.py `StepExchange.metas`).
`decide` turns those metas into the step's fate before any replica applies
anything; all workers decide alike, so replicas stay identical without asking
the driver. The driver reads the same metas in the workers' reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsgd.errors import DsgdError

APPLY, SKIP, HALT, EPOCH_END = "apply", "skip", "halt", "epoch_end"


def meta(slot: int, finite: list[bool] | None, metric_names: list[str] | None,
         error: BaseException | None = None, report: dict | None = None) -> dict:
    """What a worker sends with its gradient (`finite` None: its data's epoch
    ended; `error`: its step raised, so it sends no gradient and the others stop
    at once instead of waiting for it). `report`: its losses, metric values and
    samples, so that a survivor can give the driver the report of a worker
    that died after the step (Worker.recent_reports)."""
    if error is not None:
        return {"slot": slot, "error": f"{type(error).__name__}: {error}"}
    if finite is None:
        return {"slot": slot, "epoch_end": True}
    out = {"slot": slot, "finite": list(finite), "metrics": sorted(metric_names or [])}
    if report is not None:
        out["report"] = report
    return out


@dataclass(frozen=True)
class Decision:
    action: str                     # APPLY, SKIP (non-finite, "skip"), HALT (non-finite,
                                    # "raise": nothing applied, the run stops), EPOCH_END
    nonfinite: tuple = ()           # (worker slot, replica) of every non-finite gradient


def decide(metas: list[dict], on_nonfinite: str) -> Decision:
    """The step's fate from every worker's meta (rank order). Raises ValueError
    when the workers' get_loss return different metric names and DsgdError when
    some workers' data ended its epoch and others' did not (nothing applied
    either way: the same error on every worker), and DsgdError naming a worker
    whose step raised (which raises its own error itself)."""
    failed = [m for m in metas if "error" in m]
    if failed:
        raise DsgdError("; ".join(f"worker {m['slot']}'s step raised {m['error']}"
                                  for m in failed) + ". No weights were changed.")
    ended = [m["slot"] for m in metas if m.get("epoch_end")]
    if ended:
        if len(ended) < len(metas):
            raise DsgdError(f"the data of worker(s) {sorted(ended)} ended its epoch before the "
                            "others': every worker's share must have as many batches")
        return Decision(EPOCH_END)
    names = [m["metrics"] for m in metas]
    if any(n != names[0] for n in names):
        raise ValueError("get_loss must return the same metric names on every replica: "
                         + "; ".join(f"worker {m['slot']} returns {m['metrics']}" for m in metas)
                         + ". No weights were changed.")
    bad = tuple((m["slot"], r) for m in metas for r, ok in enumerate(m["finite"]) if not ok)
    if bad and on_nonfinite == "skip":
        return Decision(SKIP, bad)
    if bad and on_nonfinite == "raise":
        return Decision(HALT, bad)
    return Decision(APPLY, bad)
