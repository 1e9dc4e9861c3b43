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

import numpy as np


def worker_tally() -> dict:
    """One worker's running figures: samples, batches, and for every metric (the
    loss too) the sum of value x samples and the last value."""
    return {"num_samples": 0, "batch_count": 0, "sums": {}, "last": {}, "dropped_batches": 0,
            "dropped_samples": 0}


def add_step(tally: dict, info: dict) -> int:
    """Add one step's report of one worker (`losses`: one per replica, `metrics`:
    name -> one value per replica, `samples`) to its tally: a worker's value of
    a step is the mean over its replicas. Returns the step's samples."""
    samples = int(info.get("samples", 0))
    values = {"loss": float(np.mean(info["losses"]))}
    values.update({k: float(np.mean(v)) for k, v in info.get("metrics", {}).items()})
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


def step_summary(metas: list[dict], own: dict) -> dict:
    """One step's totals from every worker's meta (each with its `report`:
    losses, metrics, samples, data_s, compute_s) and the reporter's own report
    `own` (its decision, non-finite list, exchange and apply times)."""
    reports = [m["report"] for m in metas]
    losses = [x for r in reports for x in r["losses"]]
    return {"loss": float(np.mean(losses)), "samples": sum(int(r["samples"]) for r in reports),
            "data_s": max(r.get("data_s", 0.0) for r in reports),
            "compute_s": max(r.get("compute_s", 0.0) for r in reports),
            "exchange_s": own["exchange_s"], "apply_s": own["apply_s"],
            "decision": own["decision"], "nonfinite": own["nonfinite"],
            "workers": len(reports), "contributors": sorted(m["slot"] for m in metas)}
