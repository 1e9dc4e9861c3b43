"""Scaling regression check: dsgd on a two-node emulated cluster (each Ray node in
its own network namespace behind a rate-shaped veth, benchmarks/simulate/
emulated.py) takes a step within the simulator's prediction band (±25 %,
benchmarks/simulate/check.py), simulated from a calibration measured in the
same run (calibrate.py, for this model: the Ray and PS costs, the host apply,
the shaped link's pulls, the one-worker step) and the link measured here.

A step that grows past the band (a new per-step round trip, bytes sent twice,
phases that stop overlapping) fails here before a user sees it on a cluster.
It runs the compute-free model, so CPU workers' path (the gradient sent after
the backward pass); the overlapped path's two-node runs measured 1.13-1.24 x the
simulation (docs/scaling.md), not checked here. Needs
root (network namespaces, tc); skipped without (with the reason); runs last, on
its own Ray cluster."""

import json
import os
import shutil
import sys

import pytest
import ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = os.path.join(ROOT, "benchmarks", "simulate")
sys.path.insert(0, SIM)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

MIB = 2**20
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="the emulated cluster needs root, ip and tc (network namespaces, veth, htb)")


@needs_root
def test_two_node_step_stays_within_the_simulators_band(tmp_path):
    # The compute-free model (the step is the exchange): emulated.py's two-node runs
    # of it measured 1.08-1.16 x the simulation (benchmarks/results/simulate_check.json,
    # emulated_2node_repeats.json).
    model = {"name": "flat", "mib": 8.0, "num_variables": 16}
    options = {"grad_shard_bytes": 4 * MIB, "num_ps": 2, "overlap": None}
    import check
    from emulated import EmulatedCluster, run_dsgd

    import calibrate

    ray.shutdown()  # the shared single-node cluster; this module runs with the multi-node ones
    # The simulator's software costs measured now, on this machine as it is (calibrate.py,
    # this model only): the committed calibration is another day's machine (on
    # 2026-12-07 this VM's memcpy, ray.put and actor round trip were 3-4 x slower than
    # in it, and this check read 1.44 x against it).
    with open(tmp_path / "emulated.json", "w") as f:
        json.dump({"runs": [{"model": model["name"], "model_params": {
            "mib": model["mib"], "num_variables": model["num_variables"]}}]}, f)
    calibration = calibrate.main(["--emulated", str(tmp_path / "emulated.json"),
                                  "--out", str(tmp_path / "calibration.json")])
    with EmulatedCluster(2, 320.0) as cluster:
        measured = run_dsgd(cluster, model, steps=8, warmup=2, rounds=2, **options)
        link = cluster.link
    run = {"nodes": 2, "model": model["name"],
           "model_params": {k: v for k, v in model.items() if k != "name"},
           "measured_link": link, "latency_ms": 0.0, **options, **measured}
    simulated = check.simulate_run(run, calibration)["step_s"]
    ratio = measured["step_s"] / simulated
    assert abs(ratio - 1) <= check.TOLERANCE, (
        f"{check.label(run)}: measured {1e3 * measured['step_s']:.0f} ms per step, simulated "
        f"{1e3 * simulated:.0f} ms (x{ratio:.2f}; band ±{100 * check.TOLERANCE:.0f} %)")
