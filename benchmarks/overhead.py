"""What one dsgd worker costs over a plain single-process `tf.function` step of
the same model, measured interleaved: rounds of `--per-round` plain steps (in
this process) then as many `sgd.step()` calls (1 worker actor), so both see the
same machine state; medians over all rounds. Each round also times one
`sgd.train(num_steps=--train-steps)` call (which keeps the next step in flight)
against as many plain steps: the median over rounds of their mean step times.

    python benchmarks/overhead.py [--models resnet50_64 mnist_cnn] [--rounds 15] [--per-round 4]
                                  [--in-actor]

--in-actor then splits the cost inside one actor, without Ray calls: plain steps
against `Worker.local_steps` (what train() runs per call) with on_nonfinite
"raise", "ignore" and "skip", interleaved ABBA: the step and its non-finite
check apart from Ray's per-call cost (train() minus in-actor).

Writes benchmarks/results/overhead.json. dsgd runs with its defaults
(on_nonfinite="raise": the non-finite check runs alongside the update), except
that its one worker reserves every CPU of the machine, as the plain process uses
them all: Ray sets OMP_NUM_THREADS to an actor's CPU count, and at 1 a plain
step inside an actor measured 3-6 % slower than in the driver (ResNet-50, 64x64).
(dsgd's actors also run at niceness 0, not Ray's 15: see benchmarks/design_measurements.md.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import common  # noqa: E402

import dsgd  # noqa: E402
from dsgd import constants  # noqa: E402
from dsgd.examples import mnist  # noqa: E402
from comm import proc_stat, raylet_pid  # noqa: E402
import step_time  # noqa: E402
from step_time import plain_step  # noqa: E402


class ResNet64(dsgd.Model):
    """benchmarks/peers' "compute" configuration: ResNet-50, 64x64, batch 8."""

    def __init__(self, worker_index=0, device_index=0):
        self.model = common.build_model("compute")
        self.optimizer, self.loss_fn = common.make_optimizer(), common.make_loss_fn()
        self.images, self.labels = common.synthetic_batch("compute", 0)

    def get_loss(self, batch):
        return self.loss_fn(self.labels, self.model(self.images, training=True))

    def get_optimizer(self):
        return self.optimizer


CREATORS = {
    "resnet50_64": lambda w, d: ResNet64(w, d),
    "mnist_cnn": lambda w, d: mnist.MnistModel(w, 2, 32, 1e-3),
}


def timed(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def in_actor(creator, driver_plain, rounds: int, steps: int, cpus: int) -> dict:
    """Inside ONE Ray actor (every CPU, niceness 0, as dsgd's worker): blocks of
    `steps` plain tf.function steps and of `Worker.local_steps` (what one
    worker's train() runs per actor call, without Ray's per-call cost) with
    each on_nonfinite, interleaved in ABBA order; the median over rounds of
    each's mean step time. Splits the one-worker cost into the step itself, the
    non-finite check, and (by difference with train()) the calls. The same
    plain step in this process (`driver_plain`, the main comparison's baseline)
    joins the rounds: what running inside an actor costs by itself."""
    import ray

    from dsgd.comm.sharding import whole_plan
    from dsgd.worker.worker import Worker

    modes = ("raise", "ignore", "skip")

    @ray.remote(num_cpus=cpus, runtime_env=constants.ACTOR_RUNTIME_ENV)
    class Probe:
        def __init__(self):
            self.workers = {}
            for mode in modes:
                worker = Worker(creator, 0, 1, False, "auto")
                info = worker.setup()
                worker.configure(whole_plan(info["shapes"], info["dtypes"]), mode)
                self.workers[mode] = worker
            self.plain = plain_step(creator(0, 0))
            self.runs = 0

        def time(self, what: str, n: int) -> float:
            start = time.perf_counter()
            if what == "plain":
                for _ in range(n):
                    self.plain()
            else:
                self.runs += 1
                infos = self.workers[what].local_steps([None] * n, self.runs)
                assert len(infos) == n, infos
            return (time.perf_counter() - start) / n

    probe = Probe.remote()
    try:
        order = ("plain",) + modes + ("driver_plain",)

        def block(what: str, n: int) -> float:
            if what == "driver_plain":
                return sum(timed(driver_plain, n)) / n
            return ray.get(probe.time.remote(what, n), timeout=600)

        for what in order:  # warm-up: traces, first-step costs
            block(what, 3)
        times = {what: [] for what in order}
        for r in range(rounds):
            for what in (order if r % 2 == 0 else order[::-1]):
                times[what].append(block(what, steps))
    finally:
        ray.kill(probe)
    med = {what: statistics.median(v) for what, v in times.items()}
    return {"steps_per_block": steps, "rounds": rounds,
            **{f"median_{what}_s": v for what, v in med.items()},
            **{f"ratio_{mode}": med[mode] / med["plain"] for mode in modes},
            "ratio_actor_plain_over_driver_plain": med["plain"] / med["driver_plain"],
            "ratio_raise_over_driver_plain": med["raise"] / med["driver_plain"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=sorted(CREATORS), default=["resnet50_64", "mnist_cnn"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--per-round", type=int, default=4)
    p.add_argument("--train-steps", type=int, default=16,
                   help="steps of one sgd.train() call per round (and as many plain steps)")
    p.add_argument("--on-nonfinite", choices=["raise", "skip", "ignore"], default="raise",
                   help="dsgd's non-finite check (ignore: none, to see what the check costs)")
    p.add_argument("--compare-one-step-per-call", action="store_true",
                   help="each round also times train() with one step per actor call "
                        "(a second instance with local_steps_per_call=1, after the first: "
                        "both cannot hold the machine's CPUs at once)")
    p.add_argument("--in-actor", action="store_true",
                   help="then, per model, the same split inside one actor: plain steps vs "
                        "Worker.local_steps with on_nonfinite raise/ignore/skip (no Ray calls)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "overhead.json"))
    args = p.parse_args(argv)
    import ray

    cpus = os.cpu_count() or 1
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(common)
    ray.cloudpickle.register_pickle_by_value(step_time)  # plain_step, inside --in-actor's actor
    rows = []
    for name in args.models:
        creator = CREATORS[name]
        plain = plain_step(creator(0, 0))
        t_plain, t_dsgd, round_plain, round_train, round_train_1 = [], [], [], [], []
        steps_per_call = constants.LOCAL_STEPS_PER_CALL
        with dsgd.DistributedSGD(creator, 1, 1, gpu=False, num_cpus_per_worker=cpus,
                                 on_nonfinite=args.on_nonfinite) as sgd:
            timed(plain, 3)
            timed(sgd.step, 3)
            sgd.train(num_steps=3)
            pids = {"worker": ray.get(sgd.workers[0].ping.remote(), timeout=60).pid,
                    "raylet": raylet_pid(), "driver": os.getpid()}
            pids = {k: v for k, v in pids.items() if v is not None}
            cpu_ms = {k: [] for k in pids}  # CPU ms per step of each process, in train()
            for r in range(args.rounds):
                t_plain += timed(plain, args.per_round)
                t_dsgd += timed(sgd.step, args.per_round)
                # train(): the next step is submitted before this one's result is back.
                before = {k: proc_stat(pid)[0] for k, pid in pids.items()}
                round_train.append(timed(lambda: sgd.train(num_steps=args.train_steps), 1)[0]
                                   / args.train_steps)
                for k, pid in pids.items():
                    cpu_ms[k].append(1e3 * (proc_stat(pid)[0] - before[k]) / args.train_steps)
                round_plain.append(sum(timed(plain, args.train_steps)) / args.train_steps)
                print(f"{name} round {r + 1}/{args.rounds}", flush=True)
        round_plain_1 = []
        if args.compare_one_step_per_call:  # the same train() one step per call
            with dsgd.DistributedSGD(creator, 1, 1, gpu=False, num_cpus_per_worker=cpus,
                                     on_nonfinite=args.on_nonfinite,
                                     local_steps_per_call=1) as sgd:
                sgd.train(num_steps=3)
                for r in range(args.rounds):
                    round_train_1.append(timed(lambda: sgd.train(num_steps=args.train_steps),
                                               1)[0] / args.train_steps)
                    round_plain_1.append(sum(timed(plain, args.train_steps)) / args.train_steps)
        row = {"model": name, "median_plain_s": statistics.median(t_plain),
               "median_dsgd_1_worker_s": statistics.median(t_dsgd), "samples": len(t_plain),
               "train_steps_per_call": args.train_steps,
               "median_plain_round_mean_s": statistics.median(round_plain),
               "median_dsgd_train_round_mean_s": statistics.median(round_train),
               "train_cpu_ms_per_step": {k: statistics.median(v) for k, v in cpu_ms.items()}}
        row["ratio"] = row["median_dsgd_1_worker_s"] / row["median_plain_s"]
        row["ratio_train"] = row["median_dsgd_train_round_mean_s"] / row["median_plain_round_mean_s"]
        row["train_steps_per_actor_call"] = steps_per_call
        if round_train_1:
            row["median_dsgd_train_1_per_call_round_mean_s"] = statistics.median(round_train_1)
            row["ratio_train_1_per_call"] = (row["median_dsgd_train_1_per_call_round_mean_s"]
                                             / statistics.median(round_plain_1))
        if args.in_actor:  # dsgd's worker is gone: the probe gets its CPUs
            row["in_actor"] = in_actor(creator, plain, args.rounds, args.train_steps, cpus)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"benchmark": "overhead", "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "rounds": args.rounds, "per_round": args.per_round,
              "on_nonfinite": args.on_nonfinite, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
