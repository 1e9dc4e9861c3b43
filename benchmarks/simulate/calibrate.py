"""Measures the simulator's software inputs on this machine.

    python benchmarks/simulate/calibrate.py [--out benchmarks/results/simulate_calibration.json]

In one run (about 2 minutes):
1. the per-object, per-call and per-byte costs of Ray and dsgd's PS kernel,
   on two Ray nodes with separate object stores (`ray.cluster_utils.Cluster`;
   benchmarks/scaling_check.py's `microbenchmarks`: `ray.put` line, pull from
   the other node line, actor round trip, pipelined call cost, the PS kernel's
   summing rate, memcpy, first read of pulled pages);
2. the host apply: a compiled SGD update of M MiB of float32 variables from
   read-only numpy means (as `Replicas.apply` gets them from the store), at 4
   and 32 MiB: a line (fixed cost per update, bytes per second);
3. Ray's object transfer on an emulated link (emulated.py: two nodes in
   network namespaces, each link shaped to `--link-mbit`): the time one
   node takes to pull a 1 MiB and a 16 MiB object from the other, against
   the link's TCP payload rate measured on the same link (a line: the fixed
   cost of a pull, and the fraction of the TCP rate a pull reaches);
4. one worker's step of each model the emulated cluster runs
   (`DistributedSGD(num_workers=1)`: compute and its own update, no exchange),
   median of `train()`: the simulator's compute for that model is this minus
   the apply of (2). Models: those of benchmarks/results/emulated.json's runs
   if it exists, else the defaults below.

These are this 2-core VM's costs: on a real node (more cores, no other
"nodes" beside it) the CPU-side ones are smaller, so predictions built on them
err towards a slower step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

MIB = 2**20
RESULTS = os.path.join(os.path.dirname(HERE), "results")
DEFAULT_MODELS = [{"model": "flat", "mib": 8.0, "variables": 16},
                  {"model": "sleepy", "layers": 4, "forward_ms": 10.0, "backward_ms": 20.0}]


def model_key(m: dict) -> str:
    if m["model"] == "flat":
        return f"flat {m['mib']:g} MiB / {m['variables']}"
    return f"sleepy {m['layers']} x 4 MiB, {m['forward_ms']:g}/{m['backward_ms']:g} ms"


def model_of(run: dict) -> dict:
    """A run of emulated.json's model, in this file's form."""
    p = run["model_params"]
    if run["model"] == "flat":
        return {"model": "flat", "mib": p["mib"], "variables": p["num_variables"]}
    return {"model": "sleepy", "layers": p["layers"], "forward_ms": p["forward_ms"],
            "backward_ms": p["backward_ms"]}


def models_of(path: str) -> list[dict]:
    if not os.path.exists(path):
        return DEFAULT_MODELS
    with open(path) as f:
        runs = json.load(f)["runs"]
    seen, out = set(), []
    for r in runs:
        m = model_of(r)
        if model_key(m) not in seen:
            seen.add(model_key(m))
            out.append(m)
    return out


def shaped_pulls(link_mbit: float) -> dict:
    """Pulls between two emulated nodes (see the module docstring, item 3)."""
    import ray
    from emulated import EmulatedCluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from scaling_check import fit

    out = {"link_mbit": link_mbit}
    with EmulatedCluster(2, link_mbit) as cluster:
        out["tcp"] = cluster.link
        ids = {name: node_id for node_id, name in cluster.node_names.items()}

        @ray.remote(num_cpus=0)
        class Node:
            def make(self, nbytes):
                return np.ones(nbytes // 4, np.float32)

            def pull(self, refs):
                start = time.perf_counter()
                ray.get(refs[0])
                return time.perf_counter() - start

        a, b = (Node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            ids[name], soft=False)).remote() for name in ("n0", "n1"))

        def once(nbytes):
            ref = a.make.remote(nbytes)
            ray.wait([ref], fetch_local=False)
            return ray.get(b.pull.remote([ref]))

        small, big = MIB, 16 * MIB
        once(small)
        out["pull_1mib_s"] = statistics.median(once(small) for _ in range(7))
        out["pull_16mib_s"] = statistics.median(once(big) for _ in range(5))
    out["pull_s"], per_byte = fit(small, out["pull_1mib_s"], big, out["pull_16mib_s"])
    tcp = statistics.median(out["tcp"].get("duplex_mbit") or [out["tcp"]["one_way_mbit"]])
    out["pull_rate_mbit"] = 8 / per_byte / 1e6
    out["efficiency_of_tcp"] = out["pull_rate_mbit"] / tcp
    return out


def apply_line() -> dict:
    """A compiled SGD update from numpy means: (fixed s, bytes/s)."""
    import keras
    import tensorflow as tf

    from scaling_check import fit, median_s

    out = {}
    for mib in (4, 32):
        n = mib * MIB // 4 // 8
        variables = [tf.Variable(tf.zeros([n])) for _ in range(8)]
        opt = keras.optimizers.SGD(1e-6)
        means = [np.full(n, 1e-3, np.float32) for _ in range(8)]
        for m in means:
            m.setflags(write=False)

        @tf.function
        def apply(grads):
            opt.apply_gradients(zip(grads, variables))

        out[f"apply_{mib}mib_s"] = median_s(lambda: apply(means), 15, 3)
    out["apply_s"], per_byte = fit(4 * MIB, out["apply_4mib_s"], 32 * MIB, out["apply_32mib_s"])
    out["apply_s"] = max(0.0, out["apply_s"])
    out["apply_bw"] = 1 / per_byte
    return out


def one_worker_step(m: dict, steps: int = 20) -> float:
    import dsgd
    from emulated import model_creator

    spec = ({"name": "flat", "mib": m["mib"], "num_variables": m["variables"]}
            if m["model"] == "flat" else
            {"name": "sleepy", "layers": m["layers"], "forward_ms": m["forward_ms"],
             "backward_ms": m["backward_ms"]})
    with dsgd.DistributedSGD(model_creator(spec), 1, 1, gpu=False, step_timeout_s=300) as sgd:
        sgd.train(5)
        return sgd.train(steps)["step_s"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--emulated", default=os.path.join(RESULTS, "emulated.json"),
                   help="the emulated cluster's results: which models to time")
    p.add_argument("--out", default=os.path.join(RESULTS, "simulate_calibration.json"))
    p.add_argument("--link-mbit", type=float, default=160.0,
                   help="the emulated link of the pull measurement (Mbit/s per direction)")
    args = p.parse_args(argv)

    from scaling_check import microbenchmarks, two_nodes

    started = time.perf_counter()
    with two_nodes() as other:
        micro = microbenchmarks(other)
        print("Ray and PS costs measured", flush=True)
        steps = {}
        for m in models_of(args.emulated):
            steps[model_key(m)] = one_worker_step(m)
            print(f"one worker, {model_key(m)}: {1e3 * steps[model_key(m)]:.1f} ms", flush=True)
    applied = apply_line()
    print("host apply measured", flush=True)
    shaped = shaped_pulls(args.link_mbit)
    print(f"emulated link: pull {1e3 * shaped['pull_s']:.1f} ms + {shaped['pull_rate_mbit']:.0f} "
          f"Mbit/s ({shaped['efficiency_of_tcp']:.2f} of TCP)", flush=True)
    result = {"benchmark": "simulate_calibration",
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
              "ray": micro, "apply": applied, "one_worker_step_s": steps,
              "emulated_link": shaped,
              "models": models_of(args.emulated), "wall_s": time.perf_counter() - started}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "models"}, indent=1))
    print(f"wrote {args.out}")
    return result


def costs_from(cal: dict, **overrides):
    """The simulator's Costs from a calibration JSON (this machine's)."""
    from sim import Costs

    r, a = cal["ray"], cal["apply"]
    values = dict(put_s=max(0.0, r["put_s"]), put_bw=r["put_bw"], call_s=r["driver_call_s"],
                  rpc_s=r["actor_rtt_s"] / 2, pull_s=max(0.0, r["pull_s"]),
                  sum_bw=r["ps_sum_bw"], mem_bw=r["memcpy_bw"], fresh_bw=r["fresh_read_bw"],
                  apply_s=a["apply_s"], apply_bw=a["apply_bw"])
    values.update(overrides)
    return Costs(**values)


if __name__ == "__main__":
    main()
