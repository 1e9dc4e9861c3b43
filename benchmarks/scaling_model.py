"""A model of one synchronous dsgd step ("ps" strategy) on many nodes, and its
predictions for ResNet-50 (docs/scaling.md).

    python benchmarks/scaling_model.py [--check benchmarks/results/scaling_check.json]
                                       [--out benchmarks/results/scaling_model.json]

Prints the markdown table of docs/scaling.md and writes the JSON behind it.

What the model follows (read from the code, not assumed; the points up to the
workers' own exchange describe the driver-relayed step, `exchange="relayed"`,
since retired from dsgd and kept here as the model's baseline):
- `Worker.compute` runs the whole compiled step (forward, backward, local mean,
  NaN check, cast for compression) before it yields anything, so no byte of the
  exchange overlaps the backward pass: compute and exchange add up.
- The worker then yields one object per PS ("group"): pickle 5 copies the
  group's pieces once into the object store (the fusion pass).
- The driver calls PS j's `mean` once every worker has written group j; the PS
  pulls the N objects (one per worker), sums them and returns one object; each
  worker pulls every PS's mean. PS j runs beside worker j (`ps_nodes`).
- Each worker applies once all means are in. So upload, sum, download and
  apply are sequential phases here (the only pipelining is that PS j may sum
  while later groups are written, which the model does not credit).
- The driver is in every step: N compute calls, N·(P+1) streamed items, P PS
  calls with N references each, N apply calls. That is the driver-relayed step
  ("relayed"). The workers' own
  exchange (the default, "workers") takes the driver out of the data path: its
  CPU per step (a + b·N, fitted to benchmarks/results/driver_cost.json) runs
  beside the steps it submits ahead and counts only where it exceeds them; in
  its place each PS handles one call per worker per step (N·driver_call_s,
  the cost of one actor call, an estimate) plus one round trip (step_s).

- The overlapped exchange ("overlapped", the default since issue 35): each
  bucket (consecutive shards, `comm/sharding.py` `bucket_layout`) leaves from
  inside the compiled step as soon as the backward pass has made it, so its
  copy to host, write, upload, sum and download run during the rest of the
  backward pass. The model credits it as: the exchange phases take
  max(E · last / G, E − backward) where E is their sequential sum, `last` the
  bytes of the last bucket the backward pass makes (the first layers': it
  leaves when the backward pass ends) and `backward` = BACKWARD_FRACTION of the
  compute (backward ≈ 2× forward). The decision (one gather of every worker's
  meta on PS 0: one more round trip) and the apply stay after the backward
  pass (no replica applies before every worker knows the step is finite).

Inputs and their sources are in `PARAMS` / `calibration()`; docs/scaling.md
lists them. Everything is an estimate: see the doc for what it leaves out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
GBIT = 1e9 / 8  # bytes per second in one Gb/s


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Inputs:
    """Per-step constants of the model (seconds, bytes per second)."""

    mem_bw: float           # one copy (memcpy) into the object store, bytes/s
    ps_sum_bw: float        # PS cost per input byte summed (kernel + result put), bytes/s
    put_s: float            # fixed cost of creating one store object (worker side)
    pull_s: float           # fixed latency of pulling one object from another node
    driver_item_s: float    # driver-serialised cost per streamed group object
    driver_call_s: float    # driver cost per actor call submitted (compute, mean, apply)
    step_s: float           # per-step constant (round trips compute -> mean -> apply)
    link_efficiency: float  # fraction of the NIC's line rate the object manager reaches
    pcie_bw: float          # host <-> GPU copy, bytes/s (GPU runs only)
    nvlink_bw: float        # in-node allreduce bus bandwidth, bytes/s (D > 1 only)
    hbm_bw: float           # GPU memory bandwidth for the optimizer update, bytes/s
    fresh_read_bw: float = 0.0  # first read of an object pulled from another node, bytes/s
                                # (page faults on new store pages); 0: not counted
    shared_link: bool = False   # one link for every byte (loopback on one host: the
                                # object managers share its cores), not one NIC per node


KEYS = ("memcpy_bw", "ps_sum_bw", "put_s", "pull_s", "driver_item_s", "driver_call_s", "step_s")


def calibration(check_path: str | None) -> tuple[Inputs, dict]:
    """The model's inputs: the CPU-side ones measured on the dev VM (the
    "calibration" block of benchmarks/scaling_check.py's JSON), the GPU and NIC
    ones published or assumed. Returns (inputs, sources)."""
    sources = {}
    if check_path and os.path.exists(check_path):
        with open(check_path) as f:
            cal = json.load(f)["calibration"]
        src = os.path.relpath(check_path, os.path.dirname(HERE))
        mem_bw, put_s, pull_s = cal["memcpy_bw"], cal["put_s"], cal["pull_s"]
        driver_item_s, driver_call_s = cal["driver_item_s"], cal["driver_call_s"]
        step_s, ps_sum_bw = cal["step_s"], cal["ps_sum_bw"]
        fresh_read_bw = cal.get("fresh_read_bw", 0.0)
        for k in KEYS + ("fresh_read_bw",):
            sources[k] = f"{src} calibration.{k}"
    else:  # rough dev-VM values from the README, when no check has been run
        mem_bw, ps_sum_bw, fresh_read_bw = 100 * 2**20 / 0.013, 6e9, 0.0
        put_s, pull_s, driver_item_s, driver_call_s, step_s = 1.9e-3, 1e-3, 0.3e-3, 0.3e-3, 5e-3
        for k in KEYS:
            sources[k] = "rough README (HEAD) values; run benchmarks/scaling_check.py"
    sources["link_efficiency"] = "assumed (TCP goodput and Ray's chunked pushes), not measured"
    sources["pcie_bw"] = ("assumed 12 GB/s: PCIe 3.0 x16 is 15.75 GB/s per direction (PCI-SIG); "
                          "`.numpy()` of a GPU tensor uses pageable memory")
    sources["nvlink_bw"] = "assumed 100 GB/s NCCL bus bandwidth (V100 NVLink, DGX-1 class)"
    sources["hbm_bw"] = "V100 HBM2 900 GB/s (NVIDIA V100 datasheet)"
    inputs = Inputs(mem_bw=mem_bw, ps_sum_bw=ps_sum_bw, put_s=put_s, pull_s=pull_s,
                    driver_item_s=driver_item_s, driver_call_s=driver_call_s, step_s=step_s,
                    link_efficiency=0.9, pcie_bw=12e9, nvlink_bw=100e9, hbm_bw=900e9,
                    fresh_read_bw=fresh_read_bw)
    return inputs, sources


# Published compute times (one GPU, forward + backward + update, synthetic data).
# NVIDIA DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5/README.md,
# "Training performance" (20.06-tf1 container).
GPU_COMPUTE = {
    "V100 fp32 b128": {"step_s": 128 / 412, "source": "DGX-1 1x V100 16G, FP32+XLA, batch 128: 412 img/s"},
    "A100 amp b256": {"step_s": 256 / 2375, "source": "DGX A100 1x A100 40G, AMP+XLA, batch 256: 2375 img/s"},
}


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
    workers: int                 # N, one per node
    num_ps: int                  # P asked for (dsgd idles the PS beyond the shard count)
    group_bytes: tuple           # bytes of each PS's group, on the wire (after compression)
    grad_bytes: float            # float32 gradient bytes (what the GPU holds and applies)
    link_bw: float               # NIC line rate, bytes/s per direction
    compute_s: float             # forward + backward on one device (published or measured)
    devices: int = 1             # D per worker
    gpu: bool = True
    widen: bool = False          # 16-bit wire: the read op widens while copying
    exchange: str = "relayed"    # "relayed" (the driver relays every group), "workers"
                                 # (sent after the backward pass) or "overlapped"
    last_bucket_bytes: float = 0.0  # "overlapped": wire bytes of the last bucket made
    driver_fit: tuple = (0.0, 0.0)  # "workers": the driver's CPU per step = a + b * N (s)


# The share of a step's compute that is the backward pass (backward ≈ 2× forward).
BACKWARD_FRACTION = 2 / 3


def ps_nodes(num_groups: int, workers: int) -> list[int]:
    """Node of each PS (dsgd/comm/param_server.py ps_nodes: PS j beside worker j)."""
    return [j % workers for j in range(num_groups)]


def step_time(c: Config, k: Inputs) -> dict:
    """Phases of one step (seconds) and their sum. Phases are sequential (see the
    module docstring); the network phases take the busiest NIC direction."""
    n, groups = c.workers, list(c.group_bytes)
    p = len(groups)
    wire = sum(groups)
    node_of = ps_nodes(p, n)
    link = c.link_bw * k.link_efficiency
    t = {"compute": c.compute_s}
    t["local_allreduce"] = (2 * (c.devices - 1) / c.devices * c.grad_bytes / k.nvlink_bw
                            if c.devices > 1 else 0.0)
    t["to_host"] = wire / k.pcie_bw if c.gpu else 0.0
    t["write"] = p * k.put_s + wire / k.mem_bw
    if n > 1:
        # Upload: a node sends its worker's groups to PS on other nodes and receives
        # every other worker's group for each PS it hosts; download is the reverse.
        out_up = [sum(g for g, m in zip(groups, node_of) if m != node) for node in range(n)]
        in_up = [(n - 1) * sum(g for g, m in zip(groups, node_of) if m == node)
                 for node in range(n)]
        busiest = (sum(out_up) if k.shared_link
                   else max(max(a, b) for a, b in zip(out_up, in_up)))
        t["upload"] = busiest / link + k.pull_s
        fresh = (lambda b: b / k.fresh_read_bw) if k.fresh_read_bw else (lambda b: 0.0)
        # The PS's raylet pulls the N objects in parallel (latency in "upload"); it
        # reads N - 1 of them from pages the transfer just wrote.
        t["ps_sum"] = max(n * g / k.ps_sum_bw + fresh((n - 1) * g) + g / k.mem_bw + k.put_s
                          for g in groups)
        t["download"] = busiest / link + k.pull_s  # the same bytes, directions swapped
    else:
        t["upload"] = t["ps_sum"] = t["download"] = 0.0
    # The slowest worker is one whose node hosts the fewest PS: it pulls the most means.
    remote_means = (max(sum(g for g, m in zip(groups, node_of) if m != node) for node in range(n))
                    if n > 1 else 0.0)
    t["apply"] = ((c.grad_bytes / k.mem_bw if c.widen else 0.0)
                  + (remote_means / k.fresh_read_bw if k.fresh_read_bw and n > 1 else 0.0)
                  + (c.grad_bytes / k.pcie_bw if c.gpu else 0.0)
                  + (5 * c.grad_bytes / k.hbm_bw if c.gpu else 0.0))
    if c.exchange == "overlapped" and n > 1:
        # Everything of the exchange but the last bucket's share runs during the
        # backward pass (see the module docstring); one more round trip decides.
        phases = ("to_host", "write", "upload", "ps_sum", "download")
        exchange = sum(t[k] for k in phases)
        exposed = max(exchange * c.last_bucket_bytes / wire,
                      exchange - BACKWARD_FRACTION * c.compute_s)
        t["hidden_behind_backward"] = exposed - exchange
        t["decide"] = k.step_s
    if c.exchange in ("workers", "overlapped"):
        # Each PS takes one call per worker per step (its rendezvous), and the step
        # one round trip; the driver submits calls of several steps ahead: its CPU
        # counts only beyond the step it overlaps.
        t["rendezvous"] = (k.step_s + k.driver_call_s * n) if n > 1 else 0.0
        a, b = c.driver_fit
        t["driver"] = max(0.0, (a + b * n) - sum(t.values())) if n > 1 else 0.0
    else:
        # The driver: N x (P + 1) streamed items (a report and P groups per worker),
        # P PS calls and 2N worker calls, plus the round trips between the phases.
        t["driver"] = (k.step_s + k.driver_item_s * n * (p + 1)
                       + k.driver_call_s * (p + 2 * n)) if n > 1 else 0.0
    t["total"] = sum(t.values())
    return t


def driver_fit(path: str) -> tuple[tuple[float, float], str]:
    """(a, b) of the driver's CPU per step, a + b * N seconds, on the workers' own
    exchange: a least-squares line through benchmarks/driver_cost.py's "workers"
    rows (train() with its default steps per call) of the last code version in
    the file (its last label). (0, 0) without the file."""
    if not os.path.exists(path):
        return (0.0, 0.0), "not measured (run benchmarks/driver_cost.py)"
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r.get("path") == "workers"]
    rows = [r for r in rows if r.get("label") == rows[-1].get("label")] if rows else rows
    if len(rows) < 2:
        return (0.0, 0.0), f"{path}: no 'workers' rows"
    xs = [r["num_workers"] for r in rows]
    ys = [r["driver_cpu_ms_per_step"] / 1e3 for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return (my - b * mx, b), os.path.relpath(path, os.path.dirname(HERE)) + " (workers rows)"


# ---------------------------------------------------------------------------
# ResNet-50's gradients and dsgd's shard plan
# ---------------------------------------------------------------------------

def resnet50_shapes() -> list[tuple[int, ...]]:
    """Trainable variable shapes of keras.applications.ResNet50 (224x224, 1000 classes)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import keras

    model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)
    return [tuple(int(d) for d in v.shape) for v in model.trainable_variables]


def groups_for(shapes, shard_bytes: int, num_ps: int | None, workers: int,
               compression: str | None = None) -> dict:
    """dsgd's own plan (dsgd/comm/sharding.py): shards, PS count, bytes per group."""
    from dsgd.comm.sharding import exchange_layout, plan_shards

    plan = plan_shards(shapes, ["float32"] * len(shapes), shard_bytes, compression=compression)
    asked = num_ps or min(plan.num_shards, workers)  # dsgd's default (engine/launch.py)
    layout = exchange_layout(plan, asked)
    sizes = [sum(plan.shards[j].nbytes for j in g) for g in layout.groups]
    from dsgd import constants
    from dsgd.comm.sharding import bucket_layout

    buckets = bucket_layout(layout, constants.BUCKET_MIN_BYTES).groups
    return {"shards": plan.num_shards, "num_ps": asked, "busy_ps": len(layout.groups),
            "group_bytes": tuple(sizes), "buckets": len(buckets),
            "last_bucket_bytes": sum(plan.shards[j].nbytes for j in buckets[-1])}


def predictions(shapes, inputs: Inputs, fit: tuple = (0.0, 0.0)) -> list[dict]:
    grad_bytes = 4 * sum(math.prod(s) for s in shapes)
    rows = []
    compute = GPU_COMPUTE["V100 fp32 b128"]["step_s"]
    for workers in (8, 64, 256):
        for gbits in (25, 100):
            layouts = [(10_000_000, None, None), (10_000_000, 2, None), (10_000_000, 4, None),
                       (4_000_000, None, None),
                       (max(64, grad_bytes // workers), workers, None),
                       (max(64, grad_bytes // (2 * workers)), workers, "fp16")]
            seen = set()
            for shard_bytes, num_ps, compression in layouts:
                g = groups_for(shapes, int(shard_bytes), num_ps, workers, compression)
                key = (g["shards"], g["busy_ps"], compression)
                if key in seen:
                    continue
                seen.add(key)
                for gpu_name in ("V100 fp32 b128", "A100 amp b256"):
                    compute = GPU_COMPUTE[gpu_name]["step_s"]
                    c = Config(workers=workers, num_ps=g["num_ps"], group_bytes=g["group_bytes"],
                               grad_bytes=grad_bytes, link_bw=gbits * GBIT, compute_s=compute,
                               widen=compression is not None)
                    t = step_time(c, inputs)
                    tw = step_time(dataclasses.replace(c, exchange="workers", driver_fit=fit),
                                   inputs)
                    to = step_time(dataclasses.replace(
                        c, exchange="overlapped", driver_fit=fit,
                        last_bucket_bytes=g["last_bucket_bytes"]), inputs)
                    rows.append({
                        "workers": workers, "link_gbps": gbits, "gpu": gpu_name,
                        "shard_bytes": int(shard_bytes), "compression": compression,
                        "shards": g["shards"], "num_ps": g["num_ps"], "busy_ps": g["busy_ps"],
                        "max_group_mb": max(g["group_bytes"]) / 1e6,
                        "phases_s": t, "step_s": t["total"],
                        "efficiency": compute / t["total"],
                        # The driver term rests on a microbenchmark that the two-node
                        # check does not confirm (docs/scaling.md): the bound without it.
                        "efficiency_without_driver": compute / (t["total"] - t["driver"]),
                        # The workers' own exchange (the default since it replaced the
                        # driver-relayed step).
                        "phases_workers_s": tw, "step_workers_s": tw["total"],
                        "efficiency_workers": compute / tw["total"],
                        # The overlapped exchange (the default since issue 35).
                        "buckets": g["buckets"], "phases_overlapped_s": to,
                        "step_overlapped_s": to["total"],
                        "efficiency_overlapped": compute / to["total"],
                    })
    return rows


def markdown(rows) -> str:
    head = ("| workers | link | shard MB | PS (busy) | wire | step V100 (ms) | eff. V100 "
            "| eff. V100, no driver | eff. A100 | eff. A100, no driver | network (ms) "
            "| driver (ms) | eff. V100, workers' exchange | eff. A100, workers' exchange "
            "| eff. V100, overlapped | eff. A100, overlapped |\n"
            "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    out = []
    pairs = {}
    for r in rows:
        key = (r["workers"], r["link_gbps"], r["shard_bytes"], r["compression"], r["num_ps"])
        pairs.setdefault(key, {})[r["gpu"]] = r
    for key, by_gpu in pairs.items():
        v, a = by_gpu["V100 fp32 b128"], by_gpu["A100 amp b256"]
        ph = v["phases_s"]
        out.append(
            f"| {key[0]} | {key[1]} Gb/s | {key[2] / 1e6:.2g} | {v['num_ps']} ({v['busy_ps']}) "
            f"| {key[3] or 'fp32'} | {1e3 * v['step_s']:.0f} | {100 * v['efficiency']:.0f} % "
            f"| {100 * v['efficiency_without_driver']:.0f} % | {100 * a['efficiency']:.0f} % "
            f"| {100 * a['efficiency_without_driver']:.0f} % "
            f"| {1e3 * (ph['upload'] + ph['download']):.0f} | {1e3 * ph['driver']:.0f} "
            f"| {100 * v['efficiency_workers']:.0f} % | {100 * a['efficiency_workers']:.0f} % "
            f"| {100 * v['efficiency_overlapped']:.0f} % "
            f"| {100 * a['efficiency_overlapped']:.0f} % |")
    return head + "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", default=os.path.join(RESULTS, "scaling_check.json"),
                   help="scaling_check.py's JSON (its calibration block); the README's "
                        "one-off numbers if absent")
    p.add_argument("--driver-cost", default=os.path.join(RESULTS, "driver_cost.json"),
                   help="driver_cost.py's JSON: the workers' exchange's driver term")
    p.add_argument("--out", default=os.path.join(RESULTS, "scaling_model.json"))
    args = p.parse_args()
    inputs, sources = calibration(args.check)
    fit, sources["driver_fit"] = driver_fit(args.driver_cost)
    shapes = resnet50_shapes()
    rows = predictions(shapes, inputs, fit)
    table = markdown(rows)
    print(table)
    grad_bytes = 4 * sum(math.prod(s) for s in shapes)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "scaling_model", "model": "resnet50",
                   "trainable_variables": len(shapes), "gradient_bytes": grad_bytes,
                   "inputs": dataclasses.asdict(inputs), "sources": sources,
                   "driver_fit_s": {"a": fit[0], "b_per_worker": fit[1]},
                   "gpu_compute": GPU_COMPUTE, "rows": rows, "table_markdown": table},
                  f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
