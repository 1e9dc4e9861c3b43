"""Checks benchmarks/scaling_model.py against real two-node dsgd runs on this machine.

    python benchmarks/scaling_check.py [--steps 12] [--out benchmarks/results/scaling_check.json]

Starts two Ray nodes with separate object stores (ray.cluster_utils.Cluster,
as tests/test_multinode.py does; one CPU each, so the two workers land on
different nodes and PS j runs beside worker j). The "link" between them is
Ray's object manager over loopback. In one run it

1. measures the model's local inputs (calibration): memcpy bandwidth, the PS
   kernel's summing rate, the fixed
   and per-byte cost of `ray.put`, the latency and bandwidth of pulling an
   object from the other node, the driver's cost per actor call and per
   streamed item, the first read of an object pulled from the other node, and
   a plain single-process step of each model (compute + update, no exchange);
2. runs dsgd (2 workers, strategy "ps") on compute-light models of several
   sizes, PS counts and wire types, and records per-step medians;
3. predicts each run's step time with scaling_model.step_time from (1) alone,
   except the per-step constant, which is fitted on the first (smallest) run
   and is marked so there. Both "nodes" share this host's cores and memory, so
   the loopback link is modelled as one shared link (every cross-node byte,
   both directions, through it), not as one full-duplex NIC per node.

Writes benchmarks/results/scaling_check.json (scaling_model.py reads its
"calibration" block).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import scaling_model

import dsgd

MIB = 2**20
NODE_STORE_BYTES = 1536 * MIB
# (MiB per worker, variables, shard bytes, num_ps, compression); the first is the
# calibration run of the per-step constant.
RUNS = [
    (0.25, 16, 16384, 1, None),
    (0.25, 16, 16384, 4, None),
    (0.25, 16, 16384, 8, None),
    (32.0, 16, 10_000_000, 1, None),
    (32.0, 16, 10_000_000, 2, None),
    (64.0, 16, 10_000_000, 2, None),
    (64.0, 16, 10_000_000, 2, "fp16"),
]


class FlatModel(dsgd.Model):
    """`num_variables` float32 vectors totalling `mib` MiB; loss = c * sum(v): the
    gradient is a constant fill (benchmarks/comm.py's model)."""

    def __init__(self, mib: float, num_variables: int):
        import keras
        import tensorflow as tf

        n = int(mib * MIB / 4 / num_variables)
        self.variables = [tf.Variable(tf.zeros([n]), name=f"v{i}") for i in range(num_variables)]
        self.optimizer = keras.optimizers.SGD(1e-6)

    def get_loss(self, batch):
        import tensorflow as tf

        return tf.add_n([tf.reduce_sum(v) for v in self.variables]) * 1e-3

    def get_variables(self):
        return self.variables

    def get_optimizer(self):
        return self.optimizer


def median_s(fn, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit(x1, t1, x2, t2) -> tuple[float, float]:
    """(intercept, slope) of the line through two points."""
    slope = (t2 - t1) / (x2 - x1)
    return t1 - slope * x1, slope


def microbenchmarks(other_node: str) -> dict:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    out = {}
    small, big = 256 * 1024, 32 * MIB
    src = np.ones(big // 4, np.float32)
    dst = np.empty_like(src)
    out["memcpy_32mib_s"] = median_s(lambda: np.copyto(dst, src), 15)
    out["memcpy_bw"] = big / out["memcpy_32mib_s"]

    # The PS kernel (dsgd/comm/means.py mean_shard -> csrc/core/reduce.cc), 2 workers,
    # into a warm output buffer as the PS reuses one.
    from dsgd.comm.means import mean_shard
    from dsgd.comm.sharding import plan_shards

    shard = plan_shards([(big // 4,)], ["float32"], big).shards[0]
    inputs = [(np.full(big // 4, 1.0, np.float32),), (np.full(big // 4, 2.0, np.float32),)]
    out_buf = np.zeros(big // 4, np.float32)
    out["ps_sum_2x32mib_s"] = median_s(lambda: mean_shard(shard, inputs, out=out_buf), 15, 2)
    out["ps_sum_bw"] = 2 * big / out["ps_sum_2x32mib_s"]  # input bytes per second

    a_small, a_big = np.ones(small // 4, np.float32), src
    out["put_256kib_s"] = median_s(lambda: ray.put(a_small), 30, 5)
    out["put_32mib_s"] = median_s(lambda: ray.put(a_big), 10, 2)
    out["put_s"], per_byte = fit(small, out["put_256kib_s"], big, out["put_32mib_s"])
    out["put_bw"] = 1 / per_byte

    @ray.remote(num_cpus=0)
    class Remote:
        def make(self, nbytes):
            return np.ones(nbytes // 4, np.float32)  # a fresh object in this node's store

        def items(self, k, nbytes):
            for _ in range(k):
                yield np.ones(nbytes // 4, np.float32)

        def ping(self):
            return 0

    remote = Remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        other_node, soft=False)).remote()
    ray.get(remote.ping.remote())

    reads = []

    def pull(nbytes):
        ref = remote.make.remote(nbytes)
        ray.wait([ref], fetch_local=False)  # made on the other node, not yet here
        start = time.perf_counter()
        array = ray.get(ref)
        took = time.perf_counter() - start
        if nbytes == big:  # first read of the pulled pages, then a second read
            t0 = time.perf_counter()
            array.sum()
            t1 = time.perf_counter()
            array.sum()
            reads.append((t1 - t0, time.perf_counter() - t1))
        return took

    pull(big)
    reads.clear()
    out["pull_1mib_s"] = statistics.median(pull(MIB) for _ in range(9))
    out["pull_32mib_s"] = statistics.median(pull(big) for _ in range(7))
    out["first_read_32mib_s"] = statistics.median(r[0] for r in reads)
    out["second_read_32mib_s"] = statistics.median(r[1] for r in reads)
    extra = out["first_read_32mib_s"] - out["second_read_32mib_s"]
    out["fresh_read_bw"] = big / extra if extra > 0 else 0.0
    out["pull_s"], per_byte = fit(MIB, out["pull_1mib_s"], big, out["pull_32mib_s"])
    out["link_bw"] = 1 / per_byte

    out["actor_rtt_s"] = median_s(lambda: ray.get(remote.ping.remote()), 30, 5)
    calls = 200
    out["driver_call_s"] = median_s(
        lambda: ray.get([remote.ping.remote() for _ in range(calls)]), 5) / calls

    def stream(k):
        for _ in remote.items.options(num_returns="streaming").remote(k, small):
            pass  # the ObjectRef only, as the driver's next_all takes it

    k1, k2 = 1, 33
    t1, t2 = median_s(lambda: stream(k1), 9, 2), median_s(lambda: stream(k2), 9, 2)
    _, out["stream_item_s"] = fit(k1, t1, k2, t2)
    # The worker-side put of each item is counted by the model's "write" phase.
    out["driver_item_s"] = max(0.0, out["stream_item_s"] - out["put_s"])
    ray.kill(remote)
    return out


@contextlib.contextmanager
def two_nodes():
    """Two Ray nodes with separate object stores on this machine (one CPU each), the
    driver connected: yields the other node's id. Shut down on exit."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": NODE_STORE_BYTES, "include_dashboard": False})
    cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE_BYTES)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        head = ray.get_runtime_context().get_node_id()
        yield next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
    finally:
        ray.shutdown()
        cluster.shutdown()


def plain_step_s(mib: float, num_variables: int, steps: int) -> float:
    """A plain single-process tf.function step (gradient fill + SGD update)."""
    import tensorflow as tf

    model = FlatModel(mib, num_variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = model.get_loss(None)
        model.optimizer.apply_gradients(zip(tape.gradient(loss, model.variables),
                                            model.variables))
        return loss

    return median_s(lambda: step().numpy(), steps, 3)


def dsgd_run(mib, num_variables, shard_bytes, num_ps, compression, steps) -> dict:
    import ray

    with dsgd.DistributedSGD(lambda w, d: FlatModel(mib, num_variables), 2, 1, gpu=False,
                             strategy="ps", num_ps=num_ps, grad_shard_bytes=shard_bytes,
                             compression=compression, step_timeout_s=300) as sgd:
        worker_nodes = [i["node_id"] for i in sgd.worker_info]
        ps_nodes = [i["node_id"] for i in sgd.ps_info]
        assert len(set(worker_nodes)) == 2, worker_nodes
        for _ in range(3):
            sgd.step()
        stats = [sgd.step(fetch_stats=True) for _ in range(steps)]
        train_s = sgd.train(num_steps=steps)["step_s"]
        plan, groups = sgd.plan, sgd.shard_groups
        group_bytes = tuple(sum(plan.shards[j].nbytes for j in g) for g in groups)
        assert ray.is_initialized()
    return {
        "step_s": statistics.median(s["step_s"] for s in stats),
        "compute_s": statistics.median(s["compute_s"] for s in stats),
        "exchange_s": statistics.median(s["exchange_s"] for s in stats),
        "apply_s": statistics.median(s["apply_s"] for s in stats),
        "train_step_s": train_s,
        "shards": plan.num_shards, "groups": len(groups), "group_bytes": group_bytes,
        "ps_per_node": [ps_nodes.count(n) for n in worker_nodes],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=os.path.join(scaling_model.RESULTS, "scaling_check.json"))
    p.add_argument("--predict-only", action="store_true",
                   help="recompute the predictions of an existing --out from its measurements")
    args = p.parse_args()
    if args.predict_only:
        with open(args.out) as f:
            result = json.load(f)
        report(result, args.out)
        return

    started = time.perf_counter()
    plain = {(mib, v): plain_step_s(mib, v, 15) for mib, v, *_ in RUNS}
    with two_nodes() as other:
        micro = microbenchmarks(other)
        runs = []
        dsgd_run(*RUNS[0][:4], None, 3)  # the cluster's first dsgd run is slower: not kept
        for mib, v, shard_bytes, num_ps, compression in RUNS:
            r = dsgd_run(mib, v, shard_bytes, num_ps, compression, args.steps)
            r.update(mib=mib, variables=v, shard_bytes=shard_bytes, num_ps=num_ps,
                     compression=compression, plain_step_s=plain[(mib, v)])
            runs.append(r)
            print(f"{mib:6.2f} MiB P={num_ps} {compression or 'fp32'}: "
                  f"step {1e3 * r['step_s']:.1f} ms (train {1e3 * r['train_step_s']:.1f})",
                  flush=True)

    calibration = dict(micro, step_s=0.0)
    result = {"benchmark": "scaling_check", "machine": f"{platform.machine()}, "
              f"{os.cpu_count()} cores", "nodes": 2, "node_cpus": 1,
              "node_store_bytes": NODE_STORE_BYTES, "steps": args.steps,
              "calibration": calibration, "runs": runs,
              "wall_s": time.perf_counter() - started}
    report(result, args.out)


def report(result: dict, out: str) -> None:
    """Predict every run from the calibration (fitting the per-step constant on
    the first run), write the JSON and print the comparison."""
    micro, runs = result["calibration"], result["runs"]

    # The model with this machine's inputs: link = the loopback object manager at the
    # measured rate (efficiency 1), no GPU, compute + update = the plain step.
    def inputs(step_s):
        return scaling_model.Inputs(
            mem_bw=micro["memcpy_bw"], ps_sum_bw=micro["ps_sum_bw"],
            put_s=max(0.0, micro["put_s"]), pull_s=max(0.0, micro["pull_s"]),
            driver_item_s=micro["driver_item_s"], driver_call_s=micro["driver_call_s"],
            step_s=step_s, link_efficiency=1.0, pcie_bw=1.0, nvlink_bw=1.0, hbm_bw=1.0,
            fresh_read_bw=micro["fresh_read_bw"], shared_link=True)

    def predict(r, step_s):
        c = scaling_model.Config(workers=2, num_ps=r["num_ps"], group_bytes=r["group_bytes"],
                                 grad_bytes=r["mib"] * MIB, link_bw=micro["link_bw"],
                                 compute_s=r["plain_step_s"], gpu=False,
                                 widen=r["compression"] is not None)
        return scaling_model.step_time(c, inputs(step_s))

    first = predict(runs[0], 0.0)
    step_const = max(0.0, runs[0]["step_s"] - first["total"])
    for i, r in enumerate(runs):
        t = predict(r, step_const)
        r["predicted_phases_s"] = t
        r["predicted_step_s"] = t["total"]
        r["measured_over_predicted"] = r["step_s"] / t["total"]
        r["role"] = "calibration (per-step constant)" if i == 0 else "check"
    micro["step_s"] = step_const
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n| MiB | PS | wire | measured ms | predicted ms | ratio |")
    for r in runs:
        print(f"| {r['mib']} | {r['num_ps']} | {r['compression'] or 'fp32'} "
              f"| {1e3 * r['step_s']:.1f} | {1e3 * r['predicted_step_s']:.1f} "
              f"| {r['measured_over_predicted']:.2f} |")
    print(f"wrote {out} (measurements took {result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
