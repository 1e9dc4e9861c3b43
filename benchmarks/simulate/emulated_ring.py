"""Horovod's ring allreduce on the emulated cluster of emulated.py, beside dsgd.

    sudo python benchmarks/simulate/emulated.py --ring [--nodes 2 4 8] ...

Horovod 0.28.1 over Gloo (build it first: `bash benchmarks/peers/setup_horovod.sh`;
without it the ring runs are recorded as unavailable and dsgd's still run). One
process per emulated node, started inside the node's network namespace (`ip netns
exec`), so every byte of the ring crosses the same shaped veths as dsgd's
transfers. The launch is what `horovodrun --gloo` does, without its ssh: Horovod's
own rendezvous server (`horovod.runner.http.http_server.RendezvousServer`) in the
root namespace on the bridge address, the host plan `n0:1,...,n{N-1}:1` from
Horovod's `get_host_assignments`, and each rank's environment from Horovod's
`create_run_env_vars` / `create_slot_env_vars` (`HOROVOD_GLOO_IFACE` the node's
veth). The Ray cluster stays up and idle meanwhile.

Each rank runs the same model as dsgd's run (emulated.py `model_creator`: the
compute-free flat model or the sleepy one, whose compute is a sleep) in a
compiled step: one `hvd.allreduce` (Average) per gradient, as
`hvd.DistributedGradientTape` does, then the model's own optimizer. Inside a
`tf.function` each gradient's allreduce is enqueued as soon as that gradient exists, so Horovod's background thread fuses and reduces the
gradients during the backward pass, at its defaults (fusion threshold, cycle
time): what the simulator's ring model (`sim.simulate_ring`) describes. Every
step ends with the loss read on the host, so a step's time is one whole step.

Per-step times are taken on rank 0 after `warmup` steps, `rounds` x `steps` of
them; `step_s` is the median over the rounds of each round's median, as dsgd's.
The shaped links' byte counters are read around the measured steps (the ranks
wait on stdin for the launcher between warm-up and measurement). A one-rank run
(Horovod size 1, no network) of the same model gives the compute and update the
simulator's check starts from (`one_rank_step_s`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)
UNAVAILABLE = "horovod is not installed: bash benchmarks/peers/setup_horovod.sh"
TIMEOUT_S = 900


def available() -> str | None:
    """None if Horovod with Gloo can run here, else why not."""
    try:
        import horovod.tensorflow as hvd
    except ImportError:
        return UNAVAILABLE
    if not hvd.gloo_built():
        return "horovod is built without Gloo: rebuild it with benchmarks/peers/setup_horovod.sh"
    return None


def _launch(netns: list[str], ifaces: list[str], server_ip: str, model: dict, steps: int,
            warmup: int, rounds: int, on_warm=None) -> dict:
    """Run one rank per namespace; returns rank 0's RESULT. `on_warm()` runs
    between the warm-up and the measured steps, while every rank waits."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    n = len(netns)
    plan = get_host_assignments(parse_hosts(",".join(f"n{i}:1" for i in range(n))), n)
    server = RendezvousServer()
    port = server.start()
    server.init(plan)
    spec = json.dumps({"model": model, "steps": steps, "warmup": warmup, "rounds": rounds})
    procs = []
    try:
        for slot in plan:
            i = slot.cross_rank
            env = dict(os.environ, **{k: str(v) for k, v in
                                      create_run_env_vars(server_ip, [ifaces[i]], port).items()},
                       **create_slot_env_vars(slot), TF_CPP_MIN_LOG_LEVEL="3",
                       CUDA_VISIBLE_DEVICES="")
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", netns[i], sys.executable, __file__, spec],
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + TIMEOUT_S
        lines = _read_until(procs[0], "WARM", deadline, procs)
        if on_warm is not None:
            on_warm()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        lines += _read_until(procs[0], "RESULT ", deadline, procs)
        result = json.loads(lines[-1][len("RESULT "):])
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        bad = [(k, p.returncode) for k, p in enumerate(procs) if p.returncode]
        if bad:
            raise RuntimeError(f"horovod ranks exited with {bad}: "
                               + "".join(procs[bad[0][0]].stdout.read()[-2000:]))
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.stop()


def _read_until(proc, marker: str, deadline: float, procs: list) -> list[str]:
    """Rank 0's output lines up to the first that starts with `marker` (the
    others' exits are checked as it goes); raises on a timeout or an exit."""
    lines = []
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"horovod rank 0 did not print {marker!r} within {TIMEOUT_S} s: "
                               + "".join(lines[-20:]))
        line = proc.stdout.readline()
        if not line:
            others = [(k, p.poll()) for k, p in enumerate(procs)]
            raise RuntimeError(f"horovod rank 0 exited ({proc.wait()}) before {marker!r}; ranks "
                               f"{others}: " + "".join(lines[-30:]))
        lines.append(line)
        if line.startswith(marker):
            return lines


def run_horovod(cluster, model: dict, steps: int, warmup: int, rounds: int = 1) -> dict:
    """Horovod's ring on `cluster` (emulated.py's EmulatedCluster): one rank per node,
    plus a one-rank run of the same model in node 0's namespace. Returns "step_s"
    (median over the rounds of each round's median step), "round_step_s",
    "step_times", "one_rank_step_s", "tc_bytes" / "tc_bytes_per_step" (every node's
    shaped uplink and downlink during the measured steps), "cpu_busy", "wall_s"."""
    import emulated

    began = time.perf_counter()
    n = cluster.num_nodes
    netns = [emulated.netns_name(i) for i in range(n)]
    ifaces = [emulated.ns_veth(i) for i in range(n)]
    one = _launch(netns[:1], ifaces[:1], emulated.HEAD_IP, model, steps, warmup, 1)
    marks = {}

    def mark():
        marks["before"], marks["cpu_before"] = cluster.tc_bytes(), emulated._cpu_times()

    out = _launch(netns, ifaces, emulated.HEAD_IP, model, steps, warmup, rounds, on_warm=mark)
    after, cpu_after = cluster.tc_bytes(), emulated._cpu_times()
    before, cpu_before = marks["before"], marks["cpu_before"]
    total = cpu_after[0] - cpu_before[0]
    tc = {node: {d: after[node][d] - before[node][d] for d in ("up", "down")} for node in after}
    measured = steps * rounds
    return {"step_s": out["step_s"], "round_step_s": out["round_step_s"],
            "step_times": out["step_times"], "one_rank_step_s": one["step_s"],
            "steps": steps, "rounds": rounds, "warmup": warmup, "horovod": out["horovod"],
            "tc_bytes": tc,
            "tc_bytes_per_step": {node: {d: v / measured for d, v in dirs.items()}
                                  for node, dirs in tc.items()},
            "cpu_busy": 1.0 - (cpu_after[1] - cpu_before[1]) / total if total else float("nan"),
            "wall_s": time.perf_counter() - began}


# -- one rank (run by _launch inside a namespace) ----------------------------------

def work(spec: dict) -> None:
    sys.path.insert(0, HERE)
    sys.path.insert(0, BENCHMARKS)
    import horovod
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import emulated

    hvd.init()
    model = emulated.model_creator(spec["model"])(hvd.rank(), 0)
    variables = list(model.get_variables())
    optimizer = model.get_optimizer()
    batch = model.get_batch() if hasattr(model, "get_batch") else None
    batch = None if batch is None else tf.convert_to_tensor(batch)
    for v in variables:  # everyone starts from rank 0's weights
        v.assign(hvd.broadcast(v, root_rank=0, name=f"bcast_{v.name.split(':')[0]}"))

    # The flat model's gradients are constant fills, equal for every variable of one
    # size: TensorFlow folds such allreduces into constants and merges identical ones
    # when it optimizes the graph (measured: ~2 KB, then one variable's 0.5 MiB of the
    # 8 MiB on the links per step). Each gradient times its own variable holding 1.0
    # keeps the values and makes every allreduce its own, fed by a variable's read,
    # as a real model's are. Then each is allreduced (Average) as soon as it exists,
    # which is what `hvd.DistributedGradientTape` does (one `hvd.allreduce` per
    # gradient; Horovod's background thread fuses whatever is ready).
    ones = [tf.Variable(1.0, trainable=False) for _ in variables]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = model.get_loss(batch)
        grads = tape.gradient(loss, variables)
        grads = [hvd.allreduce(g * k, op=hvd.Average, name=f"grad_{i}")
                 for i, (g, k) in enumerate(zip(grads, ones))]
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    for _ in range(spec["warmup"]):
        step().numpy()
    print("WARM", flush=True)
    sys.stdin.readline()
    rounds = []
    for _ in range(spec["rounds"]):
        times = []
        for _ in range(spec["steps"]):
            start = time.perf_counter()
            step().numpy()
            times.append(time.perf_counter() - start)
        rounds.append(times)
    if hvd.rank() == 0:
        medians = [statistics.median(t) for t in rounds]
        print("RESULT " + json.dumps({
            "step_s": statistics.median(medians), "round_step_s": medians, "step_times": rounds,
            "horovod": {"version": horovod.__version__, "size": hvd.size(),
                        "fusion_threshold": os.environ.get("HOROVOD_FUSION_THRESHOLD", "default"),
                        "cycle_time": os.environ.get("HOROVOD_CYCLE_TIME", "default")}}),
              flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    work(json.loads(sys.argv[1]))
