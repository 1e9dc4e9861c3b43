"""What the driver is told about steps, in a size that does not grow with the
number of workers.

On the workers' own exchange (dsgd/engine/worker_steps.py) every worker
receives every worker's meta, report included (dsgd/comm/commit.py), with the
means. So one worker, the *reporter*, can tell the driver each step's totals
(`step_summary`: the loss over every replica, the slowest worker's compute
time, the samples, the non-finite gradients), and each worker keeps its own
running figures for the call (`worker_tally`, `add_step`) and sends them once
per call. The driver then reads one small row per step and N tallies per call
of many steps, instead of N rows per step.

`add_step` is also what the driver applies to a full per-worker report (the
other step kinds), so both ways give the same per-worker figures.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Ping:
    """A worker's or PS actor's answer to `ping` (it runs after every call queued
    on that actor before it): liveness, and what the recovery reads."""
    pid: int                          # the actor's process id
    applied_steps: int | None = None  # (a worker) steps it has applied, a count
    pending: int | None = None        # (a PS) exchanges it keeps parts of


@dataclasses.dataclass
class StepReport:
    """One worker's account of one step, sent to the driver (`Worker.local_steps`,
    `exchange_steps`, "simple"'s `compute`). Seconds are wall time on the
    worker; lists hold one entry per replica (device) of the worker."""
    losses: list = dataclasses.field(default_factory=list)
    finite: list = dataclasses.field(default_factory=list)   # each replica's gradient finite
    metrics: dict = dataclasses.field(default_factory=dict)  # name -> one value per replica
    samples: int = 0        # rows in this worker's batch
    data_s: float = 0.0     # reading the batch
    compute_s: float = 0.0  # from the step's start to the gradient computed
    exchange_s: float = 0.0  # (the exchange) the gradient computed to the means in
    apply_s: float = 0.0    # the update
    applied: bool = False
    decision: str | None = None  # the exchange: commit.APPLY, SKIP or HALT
    nonfinite: list = dataclasses.field(default_factory=list)  # every (slot, replica) not finite
    contributors: list | None = None  # backup workers: the step's contributing slots
    contributed: bool = True  # backup workers: this worker's gradient is in the mean
    sat_out: bool = False     # backup workers: late, it computed nothing
    dropped_rows: int | None = None  # a get_batch batch computed but not in the mean
    epoch_end: bool = False   # the data's epoch ended instead (nothing else is set)
    rebuilt: bool = False     # the driver made it from a survivor's record (a death)


@dataclasses.dataclass
class StepFailed:
    """A call's last entry: the exchange failed (a dead or hung peer or PS, or an
    attempt given up: `abandoned`); nothing of that step was applied."""
    failure: BaseException
    abandoned: bool = False


@dataclasses.dataclass
class StepRaised:
    """A call's last entry: a step raised after the steps before it were applied."""
    error: BaseException


@dataclasses.dataclass
class StepSummary:
    """One step's totals over every contributor (`step_summary`), from one worker."""
    loss: float
    samples: int
    data_s: float      # the slowest contributor's
    compute_s: float   # the slowest contributor's
    exchange_s: float  # the reporting worker's
    apply_s: float     # the reporting worker's
    decision: str
    nonfinite: list
    workers: int
    contributors: list


@dataclasses.dataclass
class CompactAnswer:
    """A worker's answer to a call of steps that were all applied or skipped,
    whose size does not grow with the workers (`Worker.exchange_steps`)."""
    steps_run: int         # how many
    tally: dict            # this worker's figures over them (`worker_tally`)
    steps: list | None     # the reporter's: one StepSummary per step
    skipped: list          # positions of the skipped steps
    dropped: list | None = None   # backup workers: [batches, rows] computed and dropped
    tallies: dict | None = None   # backup workers' reporter: every contributor's, by slot
    end: str | None = None        # backup workers: the call ended at "epoch_end" or "halt"
    nonfinite: list | None = None  # with end "halt": every (slot, replica) not finite


def worker_tally() -> dict:
    """One worker's running figures: samples, batches, and for every metric (the
    loss too) the sum of value x samples and the last value."""
    return {"num_samples": 0, "batch_count": 0, "sums": {}, "last": {}, "dropped_batches": 0,
            "dropped_samples": 0}


def add_step(tally: dict, info: StepReport) -> int:
    """Add one step's report of one worker to its tally: a worker's value of a
    step is the mean over its replicas. Returns the step's samples."""
    samples = int(info.samples)
    values = {"loss": float(np.mean(info.losses))}
    values.update({k: float(np.mean(v)) for k, v in info.metrics.items()})
    tally["num_samples"] += samples
    tally["batch_count"] += 1
    for key, value in values.items():
        tally["sums"][key] = tally["sums"].get(key, 0.0) + value * max(samples, 1)
        tally["last"][key] = value
    return samples


def merge(tally: dict, later: dict) -> None:
    """Add `later` (a tally of the steps after those in `tally`) into `tally`."""
    tally["num_samples"] += later["num_samples"]
    tally["batch_count"] += later["batch_count"]
    for key, value in later["sums"].items():
        tally["sums"][key] = tally["sums"].get(key, 0.0) + value
    tally["last"].update(later["last"])


def step_summary(metas: list, own: StepReport) -> StepSummary:
    """One step's totals from every worker's `commit.Meta` (each with its
    `report`: its losses, metrics, samples, data_s, compute_s) and the
    reporter's own report `own` (its decision, non-finite list,
    exchange and apply times)."""
    reports = [m.report for m in metas]
    losses = [x for r in reports for x in r.losses]
    return StepSummary(loss=float(np.mean(losses)),
                       samples=sum(int(r.samples) for r in reports),
                       data_s=max(r.data_s for r in reports),
                       compute_s=max(r.compute_s for r in reports),
                       exchange_s=own.exchange_s, apply_s=own.apply_s, decision=own.decision,
                       nonfinite=own.nonfinite, workers=len(reports),
                       contributors=sorted(m.slot for m in metas))
