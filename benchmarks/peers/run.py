"""Side-by-side throughput of dsgd and its peers on the same model, per-replica
batch and worker counts, in one run: one JSON file and one PNG chart.

    python benchmarks/peers/run.py [--configs comm compute] [--workers 1 2] [--steps 10]
        [--peers plain_tf dsgd_simple dsgd_ps dsgd_ps_fp16 dsgd_ps_bf16 mwms pss dsgd_raytrain horovod]
        [--rounds 1] [--out benchmarks/results/peers.json]

With `--rounds R` the whole list runs R times, interleaved (peer A, B, C, A, B, C, ...),
and `medians` gives each peer's median images/s over the rounds and its ratio to dsgd "ps".
(Rows of `dsgd_ps_relayed` in past result files are of the driver-relayed exchange,
`worker_exchange=False`, since retired from dsgd.)

Every peer runs in fresh processes (`python benchmarks/peers/<peer>.py ...`), one at a
time, each with a timeout. Horovod is optional (`bash benchmarks/peers/setup_horovod.sh`);
without it its rows say "skipped". Reported per row: images/s, the ratio to dsgd "ps"
with the same configuration and worker count, and scaling efficiency =
images/s(N workers) / (N x images/s(1 worker)) of the same peer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "results")
PEER_TIMEOUT_S = 1200
UNAVAILABLE = 3  # exit status of a peer that is not installed

PEERS = {  # name: (label, script, extra args, synchronous)
    "plain_tf": ("plain TF, 1 process (ceiling)", "plain_tf.py", [], True),
    "dsgd_simple": ("dsgd simple", "dsgd_peer.py", ["--strategy", "simple"], True),
    "dsgd_ps": ("dsgd ps", "dsgd_peer.py", ["--strategy", "ps"], True),
    "dsgd_ps_fp16": ("dsgd ps, fp16 compression", "dsgd_peer.py",
                     ["--strategy", "ps", "--compression", "fp16"], True),
    "dsgd_ps_bf16": ("dsgd ps, bf16 compression", "dsgd_peer.py",
                     ["--strategy", "ps", "--compression", "bf16"], True),
    "mwms": ("TF MultiWorkerMirrored", "mwms.py", [], True),
    "pss": ("TF ParameterServer (async)", "pss.py", [], False),
    "dsgd_raytrain": ("dsgd Ray Train (DistributedGradientTape)", "dsgd_raytrain.py", [], True),
    "horovod": ("Horovod 0.28.1 Gloo", "horovod_peer.py", [], True),
}


def run_peer(name: str, config: str, workers: int, steps: int, warmup: int) -> dict:
    label, script, extra, synchronous = PEERS[name]
    cmd = [sys.executable, os.path.join(HERE, script), "--config", config, "--num-workers",
           str(workers), "--steps", str(steps), "--warmup", str(warmup), *extra]
    row = {"peer": name, "label": label, "config": config, "num_workers": workers,
           "synchronous": synchronous}
    print(f"--- {label}: {config}, {workers} worker(s)", flush=True)
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=PEER_TIMEOUT_S, cwd=HERE)
    except subprocess.TimeoutExpired:
        return {**row, "status": "failed", "error": f"no result after {PEER_TIMEOUT_S} s"}
    row["wall_s"] = time.perf_counter() - start
    results = [line[len("RESULT "):] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode == UNAVAILABLE:
        return {**row, "status": "skipped", "error": out.stdout.strip().splitlines()[-1]}
    if out.returncode or not results:
        tail = (out.stdout + out.stderr)[-3000:]
        print(tail, file=sys.stderr)
        return {**row, "status": "failed", "error": f"exit {out.returncode}: {tail[-500:]}"}
    return {**row, "status": "ok", **json.loads(results[-1])}


def medians(rows: list[dict]) -> list[dict]:
    """Each (peer, config, N)'s median images/s over the rounds, and its ratio to
    dsgd "ps"'s median."""
    import statistics

    by = {}
    for r in rows:
        if r["status"] == "ok":
            by.setdefault((r["peer"], r["config"], r["num_workers"]), []).append(r["images_per_s"])
    out = [{"peer": k[0], "config": k[1], "num_workers": k[2], "rounds": len(v),
            "images_per_s_median": statistics.median(v), "images_per_s": v}
           for k, v in by.items()]
    for m in out:
        ps = by.get(("dsgd_ps", m["config"], m["num_workers"]))
        m["ratio_to_dsgd_ps"] = m["images_per_s_median"] / statistics.median(ps) if ps else None
    return out


def add_ratios(rows: list[dict]) -> None:
    ok = {(r["peer"], r["config"], r["num_workers"], r.get("round", 0)): r
          for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        ps = ok.get(("dsgd_ps", r["config"], r["num_workers"], r.get("round", 0)))
        r["ratio_to_dsgd_ps"] = r["images_per_s"] / ps["images_per_s"] if ps else None
        one = ok.get((r["peer"], r["config"], 1, r.get("round", 0)))
        r["scaling_efficiency"] = (r["images_per_s"] / (r["num_workers"] * one["images_per_s"])
                                   if one and r["num_workers"] > 1 else None)
        plain = ok.get(("plain_tf", r["config"], 1, r.get("round", 0)))
        r["ratio_to_plain_tf"] = r["images_per_s"] / plain["images_per_s"] if plain else None


def provenance() -> dict:
    """The commit the run measured, and whether the checkout had changes beside it."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True,
                              cwd=HERE).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no"))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["comm", "compute"])
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    p.add_argument("--peers", nargs="+", choices=list(PEERS), default=list(PEERS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=os.path.join(RESULTS, "peers.json"))
    args = p.parse_args(argv)
    sys.path.insert(0, HERE)
    import common

    rows = []
    for round_ in range(args.rounds):
        for config in args.configs:
            for peer in args.peers:
                for workers in args.workers:
                    if peer == "plain_tf" and workers != 1:
                        continue
                    rows.append({**run_peer(peer, config, workers, args.steps, args.warmup),
                                 "round": round_})
                    r = rows[-1]
                    print(f"    {r['status']}" + (f": {r['images_per_s']:.1f} images/s" if r["status"] == "ok"
                                                  else f" ({r.get('error', '')[:200]})"), flush=True)
    add_ratios(rows)
    result = {"benchmark": "peers", "date": time.strftime("%Y-%m-%d"), **provenance(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
              "python": platform.python_version(), "configs": args.configs, "workers": args.workers,
              "config_details": {c: common.CONFIGS[c] for c in args.configs},
              "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "rows": rows,
              "medians": medians(rows)}
    try:
        import tensorflow as tf
        import ray

        result["versions"] = {"tensorflow": tf.__version__, "ray": ray.__version__}
    except ImportError:
        pass
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    sys.path.insert(0, os.path.dirname(HERE))
    import charts  # the chart code of every benchmark

    charts.draw_after_run(args.out)
    print(f"\n{'config':8s} {'peer':32s} {'N':>2s} {'images/s':>9s} {'vs ps':>6s} {'scaling':>8s}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['config']:8s} {r['label']:32s} {r['num_workers']:2d} {r['status']}")
            continue
        ratio = f"{r['ratio_to_dsgd_ps']:.2f}" if r["ratio_to_dsgd_ps"] else "-"
        scaling = f"{100 * r['scaling_efficiency']:.0f}%" if r["scaling_efficiency"] else "-"
        print(f"{r['config']:8s} {r['label']:32s} {r['num_workers']:2d} {r['images_per_s']:9.1f} "
              f"{ratio:>6s} {scaling:>8s}")
    failed = [r for r in rows if r["status"] == "failed"]
    if failed:
        raise SystemExit(f"{len(failed)} peer run(s) failed: "
                         + ", ".join(f"{r['peer']}/{r['config']}/{r['num_workers']}" for r in failed))
    return result


if __name__ == "__main__":
    main()
