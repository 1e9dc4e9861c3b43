"""The simulator against the emulated cluster: measured / simulated step time of
every run of benchmarks/results/emulated.json.

    python benchmarks/simulate/check.py [--emulated benchmarks/results/emulated.json ...]
                                        [--calibration benchmarks/results/simulate_calibration.json]
                                        [--out benchmarks/results/simulate_check.json]

Each run is simulated from inputs measured apart from it: the calibration
(calibrate.py: Ray's and the PS's costs, the host apply, a Ray pull's fixed
cost and share of the TCP rate on an emulated link, one worker's step of the
same model) and the run's cluster's links (emulated.py measures each one's TCP
payload rate, both directions at once, before its runs). The emulated
"nodes" share this machine's cores, so the simulation runs with one pool of
`os.cpu_count()` cores for every node's CPU work (`Hardware.host_cores`), and
a transfer costs CPU at the loopback object manager's measured rate. Nothing
is fitted to the runs being checked. Target: every run within ±25 %.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import profiles  # noqa: E402
import sim  # noqa: E402
from calibrate import RESULTS, costs_from, model_key, model_of  # noqa: E402

MIB = 2**20
TOLERANCE = 0.25


def host_apply_s(run: dict, cal: dict) -> float:
    """One compiled update of the run's model on the host (calibration)."""
    m, a = model_of(run), cal["apply"]
    nbytes = m["mib"] * MIB if m["model"] == "flat" else m["layers"] * 4 * MIB
    return a["apply_s"] + nbytes / a["apply_bw"]


def workload_of(run: dict, cal: dict, one: float | None = None) -> sim.Workload:
    """The run's model with its compute from the calibration's one-worker step (or
    from `one`, a one-worker step of the same model measured otherwise)."""
    m = model_of(run)
    key = model_key(m)
    if one is None:
        if key not in cal["one_worker_step_s"]:
            raise KeyError(f"the calibration has no one-worker step of {key}: re-run "
                           "calibrate.py after emulated.py")
        one = cal["one_worker_step_s"][key]
    apply = host_apply_s(run, cal)
    if m["model"] == "flat":
        return profiles.flat_workload(m["mib"], m["variables"], max(0.0, one - apply))
    sleeps = m["layers"] * (m["forward_ms"] + m["backward_ms"]) / 1e3
    return profiles.sleepy_workload(m["layers"], m["forward_ms"] / 1e3, m["backward_ms"] / 1e3,
                                    overhead_s=max(0.0, one - sleeps - apply))


def hardware_of(run: dict, cal: dict, cores: int | None = None) -> sim.Hardware:
    """The run's link: its measured TCP payload rate (both directions at once) times
    the fraction of it a Ray pull reached on an emulated link (calibration)."""
    link = run["measured_link"]
    mbit = statistics.median(link.get("duplex_mbit") or [link["one_way_mbit"]])
    efficiency = cal.get("emulated_link", {}).get("efficiency_of_tcp", 1.0)
    return sim.Hardware(link_bw=mbit * 1e6 / 8, link_efficiency=min(1.0, efficiency),
                        link_latency_s=run.get("latency_ms", 0.0) / 1e3, gpu=False,
                        host_cores=cores or os.cpu_count())


def simulate_run(run: dict, cal: dict, cores: int | None = None) -> dict:
    shaped = cal.get("emulated_link", {})
    costs = costs_from(cal, xfer_cpu_bw=cal["ray"]["link_bw"],
                       **({"pull_s": max(0.0, shaped["pull_s"])} if "pull_s" in shaped else {}))
    overlap = run.get("overlap_resolved", run.get("overlap"))
    if isinstance(overlap, list):
        overlap = overlap[0]
    return sim.simulate("dsgd", workload_of(run, cal), hardware_of(run, cal, cores), costs,
                        run["nodes"], shard_bytes=run["grad_shard_bytes"], num_ps=run["num_ps"],
                        overlap=bool(overlap), steps=3)


def simulate_ring_run(run: dict, cal: dict) -> dict:
    """A Horovod ring run (emulated_ring.py) in the simulator's ring model: the run's
    compute from its own one-rank step, Horovod's defaults (`sim.RingParams`), the
    link at its measured TCP payload rate (Gloo sends over plain TCP: no Ray
    pull efficiency), the update on the host after the last allreduce."""
    link = run["measured_link"]
    mbit = statistics.median(link.get("duplex_mbit") or [link["one_way_mbit"]])
    hw = sim.Hardware(link_bw=mbit * 1e6 / 8, link_efficiency=1.0,
                      link_latency_s=run.get("latency_ms", 0.0) / 1e3, gpu=False,
                      hbm_bw=float("inf"))  # (the update: the host's, added below)
    r = sim.simulate_ring(workload_of(run, cal, one=run["one_rank_step_s"]), hw, run["nodes"])
    return {**r, "step_s": r["step_s"] + host_apply_s(run, cal),
            "link_mbit": mbit * 1e6 / 8 * 8 / 1e6}


def label(run: dict) -> str:
    m = model_of(run)
    if run.get("system") == "horovod":
        return f"{run['nodes']} nodes, {model_key(m)}, Horovod ring (Gloo)"
    overlap = run.get("overlap_resolved", run.get("overlap"))
    if isinstance(overlap, list):
        overlap = overlap[0]
    ps = f"{run['num_ps']} PS" if run.get("num_ps") else \
        f"default layout ({len(run.get('ps_nodes') or [])} PS)"
    return (f"{run['nodes']} nodes, {model_key(m)}, {ps}, "
            f"{'overlapped' if overlap else 'after backward'}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--emulated", nargs="+", default=[os.path.join(RESULTS, "emulated.json")],
                   help="emulated.py result files (their runs, in order)")
    p.add_argument("--calibration", default=os.path.join(RESULTS, "simulate_calibration.json"))
    p.add_argument("--out", default=os.path.join(RESULTS, "simulate_check.json"))
    args = p.parse_args(argv)
    runs = []
    for path in args.emulated:
        with open(path) as f:
            runs += json.load(f)["runs"]
    with open(args.calibration) as f:
        cal = json.load(f)
    rows = []
    for run in runs:
        if "step_s" not in run:
            continue
        ring = run.get("system") == "horovod"
        r = simulate_ring_run(run, cal) if ring else simulate_run(run, cal)
        ratio = run["step_s"] / r["step_s"]
        rows.append({"config": label(run), "system": "horovod" if ring else "dsgd",
                     "nodes": run["nodes"], "model": run["model"],
                     "num_ps": run.get("num_ps"), "grad_shard_bytes": run.get("grad_shard_bytes"),
                     "link_mbit": r["link_mbit"] if ring else hardware_of(run, cal).rate * 8 / 1e6,
                     "measured_step_s": run["step_s"], "simulated_step_s": r["step_s"],
                     "measured_over_simulated": ratio,
                     "within": abs(ratio - 1) <= TOLERANCE,
                     "simulated_worker0_s": r.get("worker0_s", {})})
    lines = ["| configuration | link (Mb/s) | measured ms | simulated ms | measured / simulated |",
             "|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['link_mbit']:.0f} "
                     f"| {1e3 * row['measured_step_s']:.1f} | {1e3 * row['simulated_step_s']:.1f} "
                     f"| {row['measured_over_simulated']:.2f}{'' if row['within'] else ' ✗'} |")
    table = "\n".join(lines)
    print(table)
    inside = sum(r["within"] for r in rows)
    print(f"{inside} of {len(rows)} within ±{100 * TOLERANCE:.0f} %")
    result = {"benchmark": "simulate_check", "tolerance": TOLERANCE,
              "emulated": [os.path.relpath(p, os.path.dirname(RESULTS)) for p in args.emulated],
              "calibration": os.path.relpath(args.calibration, os.path.dirname(RESULTS)),
              "rows": rows, "within": inside, "table_markdown": table}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
