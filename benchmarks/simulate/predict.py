"""Predicted scaling of ResNet-50 and ResNet-101 at 8, 32, 64 and 256 workers: dsgd
(as the code does it), ring allreduce (Horovod) and BytePS-style PS, from one
simulator (sim.py) on the same nodes, links and compute profile.

    python benchmarks/simulate/predict.py [--calibration benchmarks/results/simulate_calibration.json]
                                          [--out benchmarks/results/simulate_predictions.json]

Grid: ResNet-50 and ResNet-101; V100 (FP32) and A100 (AMP); 1 and 8 GPUs per
worker (one worker per node); 25 and 100 Gb/s NICs; 8, 32, 64 and 256 workers
(32 x 8 GPUs: 256 GPUs).
dsgd runs in its default layout: one PS per worker node, shards of at most 10 MB
cut so that each PS gets an equal share (sharding.spread_plan; before 2026-11-29
the default kept 10 MB shards, at most ~10 PS busy, and a second column gave one
PS per node). BytePS runs twice: at its real default, 4 MB partitions, and tuned,
partitions of min(4 MB, G/N) (smaller where N servers need more partitions than 4
MB makes); ring allreduce at Horovod's defaults. Efficiency = one device's compute
time / the step time (weak
scaling: the same batch per device), so 8 GPUs per worker pay their NVLink
mean too. Then the ablation (each Ray/PS cost removed, at 64 and 256 workers), a
what-if not built (the tail's buckets cut over more PS: `what_if_tail`) and the
sensitivity to what the model assumes (the pull's serving work, PS wake-ups, TCP
incast: `sensitivity`). Also writes
fp32 against fp16 on the wire for every system (`fp16`), the chart
(results/simulate_predictions.png) and the
place of Ray's 2018 DistributedSGD benchmark (ResNet-101, 16 V100 on two nodes,
25 Gb/s: anchors.md).

dsgd's software costs (Ray's per-object and per-call costs, the PS kernel) are
the calibration measured on the 2-core dev VM (calibrate.py); the GPU, PCIe,
NVLink and NIC figures are published or assumed (docs/scaling.md lists them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import profiles  # noqa: E402
import sim  # noqa: E402
from calibrate import RESULTS, costs_from  # noqa: E402

GBIT = 1e9 / 8
WORKERS = (8, 32, 64, 256)
ALGORITHMS = ("dsgd", "ring", "byteps", "byteps, 4 MB")


def tuned_byteps(w, n: int) -> "sim.BytePSParams":
    """BytePS tuned for `n` nodes: partitions of min(4 MB, G/N), so every node serves some."""
    return sim.BytePSParams(partition_bytes=min(4_096_000, max(64, -(-w.grad_bytes // n))))


AT_4_MB = sim.BytePSParams(partition_bytes=4_096_000)  # BytePS's own default


def run_grid(costs: sim.Costs, quick: bool = False) -> list[dict]:
    rows = []
    models = ("resnet50",) if quick else ("resnet50", "resnet101")
    for model in models:
        for gpu in ("V100", "A100"):
            w, source = profiles.gpu_workload(model, gpu)
            for devices in (1, 8):
                for gbps in (25, 100):
                    hw = sim.Hardware(link_bw=gbps * GBIT, devices=devices)
                    for n in WORKERS:
                        row = {"model": model, "gpu": gpu, "devices": devices, "link_gbps": gbps,
                               "workers": n, "gpus": n * devices, "compute_s": w.compute_s,
                               "compute_source": source}
                        results = {
                            "dsgd": sim.simulate("dsgd", w, hw, costs, n),
                            "ring": sim.simulate("ring", w, hw, None, n),
                            "byteps": sim.simulate("byteps", w, hw, None, n,
                                                   params=tuned_byteps(w, n)),
                            "byteps, 4 MB": sim.simulate("byteps", w, hw, None, n,
                                                         params=AT_4_MB),
                        }
                        for name, r in results.items():
                            row[name] = {"step_s": r["step_s"],
                                         "efficiency": w.compute_s / r["step_s"],
                                         **{k: v for k, v in r.items()
                                            if k in ("groups", "num_ps", "worker0_s", "buffers",
                                                     "partitions")}}
                        rows.append(row)
                        print(f"{model} {gpu} x{devices} {gbps} Gb/s N={n}: " + ", ".join(
                            f"{a} {100 * row[a]['efficiency']:.0f} %" for a in ALGORITHMS),
                            flush=True)
    return rows


def seed_benchmark(costs: sim.Costs) -> dict:
    """Ray's 2018 DistributedSGD benchmark setup (anchors.md): ResNet-101, batch 64 per
    V100, 16 GPUs on two p3.16xlarge nodes (8 V100 each) over 25 Gb/s; 1,712 img/s,
    218 on one GPU. Its workers had 4 GPUs each, two per node sharing the node's NIC;
    the simulator has one worker per node, so this is 2 workers of 8 GPUs: the same
    nodes and NICs, the node's 8 GPUs meeting over NVLink rather than as two workers."""
    w, source = profiles.gpu_workload("resnet101", "V100")
    hw = sim.Hardware(link_bw=25 * GBIT, devices=8)
    out = {"published_img_s_16_gpus": 1712, "published_img_s_1_gpu": 218,
           "batch_per_gpu": 64, "workers": 2, "gpus_per_worker": 8, "compute_s": w.compute_s,
           "compute_source": source}
    for name, r in (("dsgd", sim.simulate("dsgd", w, hw, costs, 2)),
                    ("ring", sim.simulate("ring", w, hw, None, 2)),
                    ("byteps", sim.simulate("byteps", w, hw, None, 2))):
        out[name] = {"step_s": r["step_s"], "img_s": 16 * 64 / r["step_s"],
                     "efficiency": w.compute_s / r["step_s"]}
    return out


def ablation(costs: sim.Costs) -> list[dict]:
    """Which term stops dsgd: ResNet-50, V100, 25 Gb/s, one GPU per worker, the
    default layout (one PS per node), each cost removed on its own (and all
    together), at 64 and 256 workers; ring allreduce beside it."""
    w, _ = profiles.gpu_workload("resnet50", "V100")
    hw = sim.Hardware(link_bw=25 * GBIT)
    variants = [
        ("as built", {}, {}, {}),
        ("PS calls free (c_call = 0)", {"call_s": 0.0}, {}, {}),
        ("pulls free (l_pull = 0)", {"pull_s": 0.0}, {}, {}),
        ("puts free (c_put = 0, B_put = inf)", {"put_s": 0.0, "put_bw": float("inf")}, {}, {}),
        ("PS sum 4x faster, no fresh-page cost", {"sum_bw": 4 * costs.sum_bw, "fresh_bw": 0.0},
         {}, {}),
        ("means pulled as soon as summed (prefetch)", {}, {}, {"prefetch": True}),
        ("no PCIe staging (GPU-direct)", {}, {"pcie_bw": float("inf")}, {}),
    ]
    everything = ("all of the above", {k: v for _, c, _, _ in variants for k, v in c.items()},
                  {"pcie_bw": float("inf")}, {"prefetch": True})
    rows = []
    for n in (64, 256):
        ring = sim.simulate("ring", w, hw, None, n)["step_s"]
        for name, c, h, o in variants + [everything]:
            r = sim.simulate("dsgd", w, dataclasses.replace(hw, **h),
                             dataclasses.replace(costs, **c), n, **o)
            rows.append({"workers": n, "variant": name, "step_s": r["step_s"],
                         "efficiency": w.compute_s / r["step_s"], "worker0_s": r["worker0_s"],
                         "ring_efficiency": w.compute_s / ring})
            print(f"ablation N={n}: {name}: {100 * w.compute_s / r['step_s']:.0f} %", flush=True)
    return rows


def fp16(costs: sim.Costs) -> list[dict]:
    """fp32 against fp16 on the wire, like for like: ResNet-50, V100, 25 Gb/s, one
    GPU per worker, each of dsgd (default layout; `compression="fp16"`), ring
    allreduce (Horovod's `Compression.fp16`) and BytePS (tuned and at 4 MB)
    sending 16-bit gradients, at every worker count."""
    w, _ = profiles.gpu_workload("resnet50", "V100")
    hw = sim.Hardware(link_bw=25 * GBIT)
    rows = []
    for n in WORKERS:
        row = {"workers": n}
        for name, r in (
                ("dsgd", sim.simulate("dsgd", w, hw, costs, n, compression="fp16")),
                ("ring", sim.simulate("ring", w, hw, None, n, compression="fp16")),
                ("byteps", sim.simulate("byteps", w, hw, None, n, compression="fp16",
                                        params=tuned_byteps(w, n))),
                ("byteps, 4 MB", sim.simulate("byteps", w, hw, None, n, compression="fp16",
                                              params=AT_4_MB))):
            row[name] = w.compute_s / r["step_s"]
        rows.append(row)
        print(f"fp16 N={n}: " + ", ".join(f"{a} {100 * row[a]:.0f} %" for a in ALGORITHMS),
              flush=True)
    return rows


def fp16_markdown(rows: list[dict], grid: list[dict]) -> str:
    """The fp16 rows beside the same configuration's fp32 ones (from `grid`)."""
    fp32 = {r["workers"]: r for r in grid if (r["model"], r["gpu"], r["devices"],
                                                r["link_gbps"]) == ("resnet50", "V100", 1, 25)}
    head = ("| workers | dsgd fp32 / fp16 | ring fp32 / fp16 | BytePS tuned fp32 / fp16 "
            "| BytePS 4 MB fp32 / fp16 |\n|---:|---:|---:|---:|---:|\n")
    return head + "\n".join(
        f"| {r['workers']} | " + " | ".join(
            (f"{100 * fp32[r['workers']][a]['efficiency']:.0f} % / " if r["workers"] in fp32
             else "– / ") + f"{100 * r[a]:.0f} %" for a in ALGORITHMS) + " |"
        for r in rows)


SENSITIVITY = ("dsgd", "byteps")


def sensitivity(costs: sim.Costs) -> list[dict]:
    """What the model assumes and one machine cannot measure: ResNet-50, V100, 25
    Gb/s, one GPU per worker, at 64 and 256 workers, each assumption varied on its
    own: the pull's cost as work on the serving node (Costs.pull_serve_s: half or
    all of l_pull; calibrated with both ends on one machine, its split is not
    known), a PS thread's wake-up per call (Costs.wake_s), and TCP incast at the
    fan-in of a PS's downlink (Hardware.incast_fan_in: past 64 or 16 senders the
    link delivers fan-in/senders of its rate). Ring allreduce (one flow per link,
    no object store) is the same in every row."""
    w, _ = profiles.gpu_workload("resnet50", "V100")
    hw = sim.Hardware(link_bw=25 * GBIT)
    variants = [
        ("as modelled (l_pull all latency, no wake-up, no incast)", {}, {}),
        ("half of l_pull is serving work", {"pull_serve_s": costs.pull_s / 2}, {}),
        ("all of l_pull is serving work", {"pull_serve_s": costs.pull_s}, {}),
        ("PS wake-up 50 µs per call", {"wake_s": 50e-6}, {}),
        ("TCP incast past 64 senders", {}, {"incast_fan_in": 64}),
        ("TCP incast past 16 senders", {}, {"incast_fan_in": 16}),
    ]
    rows = []
    for n in (64, 256):
        ring = sim.simulate("ring", w, hw, None, n)["step_s"]
        for name, c, h in variants:
            k, hw2 = dataclasses.replace(costs, **c), dataclasses.replace(hw, **h)
            row = {"workers": n, "variant": name, "ring_efficiency": w.compute_s / ring}
            for algorithm, r in (
                    ("dsgd", sim.simulate("dsgd", w, hw2, k, n)),
                    ("byteps", sim.simulate("byteps", w, hw2, None, n,
                                            params=tuned_byteps(w, n)))):
                row[algorithm] = w.compute_s / r["step_s"]
            rows.append(row)
            print(f"sensitivity N={n}: {name}: " + ", ".join(
                f"{a} {100 * row[a]:.0f} %" for a in SENSITIVITY), flush=True)
    return rows


def sensitivity_markdown(rows: list[dict]) -> str:
    head = ("| assumption (ResNet-50, V100, 25 Gb/s) | workers | dsgd | BytePS (tuned) "
            "| ring |\n|---|---:|---:|---:|---:|\n")
    return head + "\n".join(
        f"| {r['variant']} | {r['workers']} | " + " | ".join(
            f"{100 * r[a]:.0f} %" for a in SENSITIVITY) + f" | {100 * r['ring_efficiency']:.0f} % |"
        for r in rows)


TAIL_PIECES = (1, 4, 16, 64)
# (tail pieces, each mean pulled as soon as summed): the what-if's rows
WHAT_IFS = [(p, False) for p in TAIL_PIECES] + [(1, True), (16, True)]


def what_if_tail(costs: sim.Costs) -> list[dict]:
    """What would: dsgd (ResNet-50, V100, 25 Gb/s, one GPU per worker, its default
    layout: one PS per node) with each bucket whose fan-in would end after the
    backward pass cut into `pieces` pieces on distinct PS actors (sim.dsgd_layout's
    tail_pieces), with and without each mean pulled as soon as it is summed
    (`prefetch`): designs not built, at every worker count; ring allreduce beside
    it."""
    w, _ = profiles.gpu_workload("resnet50", "V100")
    hw = sim.Hardware(link_bw=25 * GBIT)
    rows = []
    for n in WORKERS:
        ring = sim.simulate("ring", w, hw, None, n)["step_s"]
        for pieces, prefetch in WHAT_IFS:
            if pieces > n:
                continue
            r = sim.simulate("dsgd", w, hw, costs, n, tail_pieces=pieces, prefetch=prefetch)
            rows.append({"workers": n, "pieces": pieces, "prefetch": prefetch,
                         "step_s": r["step_s"], "groups": r["groups"],
                         "efficiency": w.compute_s / r["step_s"],
                         "ring_efficiency": w.compute_s / ring})
            print(f"tail split N={n} pieces={pieces} prefetch={prefetch}: "
                  f"{100 * w.compute_s / r['step_s']:.0f} % ({r['groups']} groups)", flush=True)
    return rows


def what_if_markdown(rows: list[dict]) -> str:
    by = {(r["workers"], r["pieces"], r.get("prefetch", False)): r for r in rows}
    head = ("| tail buckets cut into | " + " | ".join(f"{n} workers" for n in WORKERS)
            + " |\n|---|" + "---:|" * len(WORKERS) + "\n")
    body = ""
    for pieces, prefetch in WHAT_IFS:
        cells = [f"{100 * by[n, pieces, prefetch]['efficiency']:.0f} % "
                 f"({by[n, pieces, prefetch]['groups']} groups)"
                 if (n, pieces, prefetch) in by else "–" for n in WORKERS]
        name = "1 (as built)" if pieces == 1 else f"{pieces} pieces"
        if prefetch:
            name += ", each mean pulled as soon as summed"
        body += f"| {name} | " + " | ".join(cells) + " |\n"
    ring = {r["workers"]: r["ring_efficiency"] for r in rows}
    body += "| ring allreduce | " + " | ".join(f"{100 * ring[n]:.0f} %" for n in WORKERS) + " |\n"
    return head + body


# Buckets closed by deadline (`bucket_layout` with a `ReadyProfile`: what the engine
# would do with a measured gradient-ready profile; not built there yet), on shards
# of at most DEADLINE_SHARD_BYTES so that the last-made bytes can form small buckets,
# none under DEADLINE_MIN_BYTES: (name, sim.simulate options).
DEADLINE_SHARD_BYTES, DEADLINE_MIN_BYTES = 500_000, 128 * 1024
DEADLINE_WHAT_IFS = [
    ("as built (default layout)", {}),
    ("as built, each mean pulled as soon as summed", {"prefetch": True}),
    ("buckets by deadline", {"shard_bytes": DEADLINE_SHARD_BYTES,
                             "deadline_min_bytes": DEADLINE_MIN_BYTES}),
    ("buckets by deadline, each mean pulled as soon as summed",
     {"shard_bytes": DEADLINE_SHARD_BYTES, "deadline_min_bytes": DEADLINE_MIN_BYTES,
      "prefetch": True}),
    ("buckets by deadline, pulled as soon as summed, metas with the last bucket",
     {"shard_bytes": DEADLINE_SHARD_BYTES, "deadline_min_bytes": DEADLINE_MIN_BYTES,
      "prefetch": True, "metas_with_last": True}),
    # two-level aggregation (sim.TwoLevel: ceil(sqrt(N)) groups, each summed by a
    # sub-aggregator PS before the bucket's root PS; not built)
    ("buckets by deadline, pulled as soon as summed, two-level aggregation",
     {"shard_bytes": DEADLINE_SHARD_BYTES, "deadline_min_bytes": DEADLINE_MIN_BYTES,
      "prefetch": True, "two_level": True}),
    ("the same, fp16 on the wire",
     {"shard_bytes": DEADLINE_SHARD_BYTES, "deadline_min_bytes": DEADLINE_MIN_BYTES,
      "prefetch": True, "two_level": True, "compression": "fp16"}),
    ("buckets by deadline, pulled as soon as summed, two-level, metas with the last bucket",
     {"shard_bytes": DEADLINE_SHARD_BYTES, "deadline_min_bytes": DEADLINE_MIN_BYTES,
      "prefetch": True, "two_level": True, "metas_with_last": True}),
]


def what_if_deadline(costs: sim.Costs, workers=WORKERS, what_ifs=None) -> list[dict]:
    """What would: dsgd (ResNet-50, V100, 25 Gb/s, one GPU per worker, one PS per
    node) with its buckets closed by deadline from the workload's gradient-ready
    profile (`sim.dsgd_layout`'s `deadline_min_bytes`), with and without each mean
    pulled as soon as it is summed, the metas riding with the last bucket, two-level
    aggregation (`sim.TwoLevel`); ring allreduce beside it. Each row: the step,
    its efficiency and worker 0's marks (where the step's end goes); `what_ifs`: a
    part of DEADLINE_WHAT_IFS (default: all of it)."""
    w, _ = profiles.gpu_workload("resnet50", "V100")
    hw = sim.Hardware(link_bw=25 * GBIT)
    rows = []
    for n in workers:
        ring = sim.simulate("ring", w, hw, None, n)["step_s"]
        for name, options in DEADLINE_WHAT_IFS if what_ifs is None else what_ifs:
            started = time.perf_counter()
            r = sim.simulate("dsgd", w, hw, costs, n, **options)
            rows.append({"workers": n, "what": name, "options": options, "step_s": r["step_s"],
                         "groups": r["groups"], "efficiency": w.compute_s / r["step_s"],
                         "ring_efficiency": w.compute_s / ring, "worker0_s": r["worker0_s"],
                         "root_fan_in": max(r.get("root_calls") or [0]),
                         "wall_s": time.perf_counter() - started})
            print(f"deadline what-if N={n} {name}: {100 * w.compute_s / r['step_s']:.1f} % "
                  f"({r['groups']} groups, {time.perf_counter() - started:.0f} s)", flush=True)
    return rows


def what_if_deadline_markdown(rows: list[dict]) -> str:
    ns = sorted({r["workers"] for r in rows})
    by = {(r["workers"], r["what"]): r for r in rows}
    head = ("| dsgd, one PS per node | " + " | ".join(f"{n} workers" for n in ns)
            + " |\n|---|" + "---:|" * len(ns) + "\n")
    body = ""
    for name, _ in DEADLINE_WHAT_IFS:
        if not any((n, name) in by for n in ns):
            continue
        body += f"| {name} | " + " | ".join(
            f"{100 * by[n, name]['efficiency']:.0f} % ({by[n, name]['groups']} groups)"
            if (n, name) in by else "–" for n in ns) + " |\n"
    ring = {r["workers"]: r["ring_efficiency"] for r in rows}
    return head + body + "| ring allreduce | " + " | ".join(
        f"{100 * ring[n]:.0f} %" for n in ns) + " |\n"


def ablation_markdown(rows: list[dict]) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["workers"], r["variant"]): r for r in rows}
    head = ("| dsgd (default layout) | 64 workers | 256 workers |\n|---|---:|---:|\n")
    lines = [f"| {v} | {100 * by[(64, v)]['efficiency']:.0f} % "
             f"| {100 * by[(256, v)]['efficiency']:.0f} % |" for v in variants]
    lines.append(f"| ring allreduce, for reference | {100 * by[(64, variants[0])]['ring_efficiency']:.0f} % "
                 f"| {100 * by[(256, variants[0])]['ring_efficiency']:.0f} % |")
    return head + "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    head = ("| model | GPU | GPUs/worker | link | workers | dsgd | ring (Horovod) "
            "| BytePS, tuned | BytePS, 4 MB |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        lines.append(f"| {r['model']} | {r['gpu']} | {r['devices']} | {r['link_gbps']} Gb/s "
                     f"| {r['workers']} | " + " | ".join(
                         f"{100 * r[a]['efficiency']:.0f} %" for a in ALGORITHMS) + " |")
    return head + "\n".join(lines)


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, devices in zip(axes, (1, 8)):
        sel = [r for r in rows if r["model"] == "resnet50" and r["gpu"] == "V100"
               and r["link_gbps"] == 25 and r["devices"] == devices]
        xs = [r["workers"] for r in sel]
        ax.plot(xs, [100 * r["dsgd"]["efficiency"] for r in sel], "o-", label="dsgd (default)")
        ax.plot(xs, [100 * r["ring"]["efficiency"] for r in sel], "s-", label="ring allreduce")
        ax.plot(xs, [100 * r["byteps"]["efficiency"] for r in sel], "^-",
                label="BytePS-style PS, tuned")
        ax.plot(xs, [100 * r["byteps, 4 MB"]["efficiency"] for r in sel], "^:",
                label="BytePS-style PS, 4 MB")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("workers (one per node)")
        ax.set_title(f"ResNet-50, V100, 25 Gb/s, {devices} GPU{'s' if devices > 1 else ''}/worker")
        ax.axhline(90, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (%)")
    axes[0].set_ylim(0, 105)
    axes[0].legend(fontsize=8)
    fig.suptitle("Simulated (benchmarks/simulate): software costs from the 2-core dev VM")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", default=os.path.join(RESULTS, "simulate_calibration.json"))
    p.add_argument("--out", default=os.path.join(RESULTS, "simulate_predictions.json"))
    p.add_argument("--quick", action="store_true", help="ResNet-50 only")
    p.add_argument("--deadline", action="store_true",
                   help="only the buckets-by-deadline and two-level what-ifs, to "
                        "results/simulate_deadline_what_if.json")
    args = p.parse_args(argv)
    with open(args.calibration) as f:
        cal = json.load(f)
    # GPU workers: the host part of an apply update is one compiled call (assumed 1 ms;
    # the host apply line is for CPU workers); PCIe and HBM are the simulator's.
    costs = costs_from(cal, apply_s=1e-3, apply_bw=0.0)
    started = time.perf_counter()
    if args.deadline:
        rows = what_if_deadline(costs)
        print(what_if_deadline_markdown(rows))
        result = {"benchmark": "simulate_deadline_what_if", "calibration": os.path.relpath(
            args.calibration, os.path.dirname(RESULTS)), "costs": dataclasses.asdict(costs),
            "shard_bytes": DEADLINE_SHARD_BYTES, "min_bytes": DEADLINE_MIN_BYTES,
            "rows": rows, "markdown": what_if_deadline_markdown(rows),
            "wall_s": time.perf_counter() - started}
        with open(os.path.join(RESULTS, "simulate_deadline_what_if.json"), "w") as f:
            json.dump(result, f, indent=1)
        return result
    rows = run_grid(costs, args.quick)
    seed = seed_benchmark(costs)
    ablated = ablation(costs)
    tail = what_if_tail(costs)
    assumed = sensitivity(costs)
    half = fp16(costs)
    table = markdown(rows)
    print(table)
    print(ablation_markdown(ablated))
    print(what_if_markdown(tail))
    print(sensitivity_markdown(assumed))
    print(fp16_markdown(half, rows))
    print(json.dumps(seed, indent=1))
    result = {"benchmark": "simulate_predictions", "calibration": os.path.relpath(
        args.calibration, os.path.dirname(RESULTS)), "costs": dataclasses.asdict(costs),
        "hardware_defaults": dataclasses.asdict(sim.Hardware(link_bw=25 * GBIT)),
        "ring": dataclasses.asdict(sim.RingParams()),
        "byteps": dataclasses.asdict(sim.BytePSParams()),
        "rows": rows, "seed_benchmark": seed, "table_markdown": table,
        "ablation": ablated, "ablation_markdown": ablation_markdown(ablated),
        "what_if_tail_split": tail, "what_if_tail_split_markdown": what_if_markdown(tail),
        "sensitivity": assumed, "sensitivity_markdown": sensitivity_markdown(assumed),
        "fp16": half, "fp16_markdown": fp16_markdown(half, rows),
        "wall_s": time.perf_counter() - started}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    chart(rows, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
