"""How much of the exchange hides behind the compute: an emulated accelerator.

    python benchmarks/overlap.py [--layers 8] [--forward-ms 10] [--backward-ms 20]
                                 [--steps 30] [--rounds 3] [--timeline PATH] [--paths 'P;...']
                                 [--out benchmarks/results/overlap.json]

This machine has no GPU; to behave like a GPU node, the model's compute is a
sleep: `--layers` layers, each with a 1024 x 1024 float32 weight (4 MiB), whose
forward waits `--forward-ms` and whose backward waits `--backward-ms` (inside
`tf.numpy_function`, which releases the GIL: the CPU stays free while the
"accelerator" computes, as it does while a GPU runs a kernel). The backward
runs layer by layer in reverse, so layer k's gradient exists only once the
layers above it have waited: gradients become ready during the backward pass,
in reverse layer order, as on a GPU. Gradients are cheap constant fills of the
weight's shape (the exchange moves real 4 MiB tensors).

Eight configurations, interleaved in `--rounds` rounds (medians over the rounds
of each one's median step over `--steps` steps of `train()`, batches from a
`dsgd.Dataset` as in real training):
- `one, compute`: one worker, the sleeps (no exchange): the compute alone;
- `two, compute, overlapped`: two workers, the sleeps, the gradient sent during
  the backward pass (`overlap=True`, what `gpu=True` does by default: the sleeps
  leave the CPU free as a GPU does), each step applied inside the next step's
  compiled call, beside its forward pass (a layer's forward sleep starts once
  its weight is read, i.e. updated), except a call's last step;
- `two, compute, overlapped, applied before the next`: the same, each step
  applied before the next begins (the plan's update "in stages": issue 35 before
  its item 3);
- `two, compute, after backward`: sent after the backward pass (`overlap=False`,
  the step before issue 35): compute + whatever of the exchange is not hidden;
- the same with zero sleeps: their differences are each path's own cost.

`--paths` picks the two-worker paths, separated by `;` (default: the three above).
(Past result files also hold the paths `overlapped, sent from a thread` and
`overlapped, applied before the next, each bucket its own update`: options
since retired from dsgd, measured without gain; benchmarks/README.md "Overlap".)

`exposed = (two, compute) - (one, compute)`; `own = (two, no compute) - (one, no
compute)`, for each path; the figure of merit is the overlapped path's
`exposed / own` (issue 35's target: <= 0.25; with no overlap it is ~1), also
given against the after-backward path's own cost. Layers are one shard each (`grad_shard_bytes` = 4 MiB),
two PS.

Then one more two-worker run with the sleeps records a Chrome trace
(DistributedSGD(timeline=...); kept at `--timeline PATH` if given): its middle
step goes into the JSON ("timeline_step") and the chart (results/overlap.png,
benchmarks/charts.py): when each bucket left, was summed, received and applied,
against the compute.

Real models (`--real-rounds R`, 0 to skip): the MNIST CNN (dsgd/examples/mnist.py,
batch 64 per worker) and ResNet-50 on 32x32 images (benchmarks/peers, batch 2 per
worker), two workers each, one instance per model: R rounds of `--real-steps`
steps of `train()` with the gradient sent during the backward pass, then the
same with it sent after (the plan's during_backward False, the step before issue 35),
interleaved on the same workers; the median step time of each, and their ratio.
(Their batches come from get_batch: each step is applied before the next.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dsgd  # noqa: E402

MIB = 2**20
WIDTH = 1024  # a layer's weight: WIDTH x WIDTH float32 = 4 MiB
BATCH = 8


class SleepyModel(dsgd.Model):
    """`layers` 4 MiB weights; forward and backward of each is a sleep (see above)."""

    def __init__(self, layers: int, forward_s: float, backward_s: float):
        import keras
        import numpy as np
        import tensorflow as tf

        self.weights = [tf.Variable(tf.zeros([WIDTH, WIDTH]), name=f"w{k}") for k in range(layers)]
        self.optimizer = keras.optimizers.SGD(1e-6)
        self.forward_s, self.backward_s = forward_s, backward_s

        def wait(seconds):
            def run(x):
                if seconds > 0:
                    time.sleep(seconds)
                return x
            return lambda x: tf.numpy_function(run, [x], tf.float32, stateful=True)

        forward_wait, backward_wait = wait(forward_s), wait(backward_s)

        @tf.custom_gradient
        def layer(x, w):
            # (the layer's "kernel" starts once its weight is read: after its update)
            y = forward_wait(x + 0.0 * w[0, 0])

            def grad(dy):
                dy = backward_wait(dy)
                # A real 4 MiB gradient, made cheaply once dy (this layer's backward) exists.
                return dy, tf.fill([WIDTH, WIDTH], tf.reduce_mean(dy)) * 1e-3
            return y, grad

        self._layer = layer
        self._x = np.ones([BATCH, 4], np.float32)

    def get_loss(self, batch):
        import tensorflow as tf

        x = tf.convert_to_tensor(batch)
        for w in self.weights:
            x = self._layer(x, w)
        return tf.reduce_mean(x)

    def get_batch(self):
        return self._x

    def get_variables(self):
        return self.weights

    def get_optimizer(self):
        return self.optimizer


# (workers, emulated compute, path): two workers overlapped (the gradient sent during
# the backward pass, each step applied in the next step's compiled call, beside its
# forward pass), overlapped but each step applied before the next begins (before
# item 3 of issue 35), and after the backward pass (the step before issue 35).
OVERLAPPED, APPLIED_BEFORE, AFTER = "overlapped", "overlapped, applied before the next", \
    "after backward"
PATHS = (OVERLAPPED, APPLIED_BEFORE, AFTER)
CONFIGS = [("one", True, None), ("two", True, OVERLAPPED), ("two", True, APPLIED_BEFORE),
           ("two", True, AFTER), ("one", False, None), ("two", False, OVERLAPPED),
           ("two", False, APPLIED_BEFORE), ("two", False, AFTER)]


def label(workers: str, compute: bool, path: str | None) -> str:
    return (f"{workers}, {'compute' if compute else 'no compute'}"
            + ("" if workers == "one" else f", {path}"))


def run(workers: str, compute: bool, path: str | None, args,
        timeline: str | None = None) -> dict:
    import numpy as np

    n = 1 if workers == "one" else 2
    overlap = path in (OVERLAPPED, APPLIED_BEFORE)
    forward = args.forward_ms / 1e3 if compute else 0.0
    backward = args.backward_ms / 1e3 if compute else 0.0
    sgd = dsgd.DistributedSGD(lambda w, d: SleepyModel(args.layers, forward, backward), n, 1,
                              gpu=False, grad_shard_bytes=4 * MIB, num_ps=2 if n > 1 else None,
                              step_timeout_s=300, timeline=timeline,
                              # (the sleeps leave the CPU free, as a GPU does: overlap as
                              # gpu=True would by default)
                              overlap=overlap)
    try:
        if path == APPLIED_BEFORE:
            sgd._loop.replan(True, "in stages")
        # (batches from a dataset, as in real training: a step is applied in the next
        # step's call only then, as get_batch may read the model's state)
        data = dsgd.Dataset([np.ones(4, np.float32)] * (64 * BATCH), batch_size=BATCH)
        sgd.train(args.warmup, data)
        summary = sgd.train(args.steps, data)
        deferred = sum(sgd.foreach_worker(lambda w: w.deferred_applies))
        return {"config": label(workers, compute, path), "workers": n, "compute": compute,
                "overlap": overlap, "deferred_applies": deferred,
                "median_step_ms": 1e3 * summary["step_s"],
                "mean_times_ms": {k: 1e3 * v for k, v in summary["mean_times"].items()}}
    finally:
        sgd.shutdown()


def timeline_step(path: str) -> list[dict]:
    """One step of a two-worker trace (the middle one), for the chart: every span of
    each worker and PS that belongs to it, in ms from the start of worker 0's
    compute span ({"process", "row", "name", "start_ms", "dur_ms"})."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = [e for e in events if e["ph"] == "X" and names.get(e["pid"], "").startswith(
        ("worker", "PS"))]
    steps = sorted({e["args"]["step"] for e in spans
                    if e["tid"] == "step" and names[e["pid"]] == "worker 0"})
    step = steps[len(steps) // 2]
    mine = [e for e in spans if e["args"].get("step", e["args"].get("exchange")) == step]
    origin = min(e["ts"] for e in mine if e["name"] == "compute" and names[e["pid"]] == "worker 0")
    return sorted(({"process": names[e["pid"]], "row": e["tid"], "name": e["name"],
                    "start_ms": (e["ts"] - origin) / 1e3, "dur_ms": e["dur"] / 1e3}
                   for e in mine), key=lambda e: (e["process"], e["row"], e["start_ms"]))


def real_models(args) -> dict:
    """Overlapped vs sent-after-the-backward-pass on real models, interleaved."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
    import ray

    import common  # benchmarks/peers/common.py
    from dsgd.examples import mnist

    import dsgd_peer

    for module in (common, dsgd_peer):  # (the workers cannot import benchmarks/peers)
        ray.cloudpickle.register_pickle_by_value(module)
    models = {"MNIST CNN, batch 64": lambda w, d: mnist.MnistModel(w, 2, 64, 1e-3),
              "ResNet-50 32x32, batch 2": lambda w, d: dsgd_peer.PeerModel("comm", seed=w)}
    out = {}
    for name, creator in models.items():
        times: dict = {True: [], False: []}
        with dsgd.DistributedSGD(creator, 2, 1, gpu=False, step_timeout_s=600) as sgd:
            sgd.train(args.warmup)
            for r in range(args.real_rounds):
                for overlap in (True, False):
                    # (as overlap=True or False would: the workers join again)
                    sgd._loop.replan(overlap)
                    sgd.train(2)  # (the other path's first steps: warm)
                    summary = sgd.train(args.real_steps)
                    times[overlap].append(1e3 * summary["step_s"])
            grad_mib = sum(s.nbytes for s in sgd.plan.shards) / MIB
            buckets = len(sgd.foreach_worker(lambda w: w._buckets.groups)[0])
        row = {"gradient_mib": round(grad_mib, 2), "buckets": buckets,
               "overlapped_ms": statistics.median(times[True]),
               "after_backward_ms": statistics.median(times[False]),
               "rounds_ms": {"overlapped": times[True], "after_backward": times[False]}}
        row["overlapped_over_after"] = row["overlapped_ms"] / row["after_backward_ms"]
        print(json.dumps({name: row}), flush=True)
        out[name] = row
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--forward-ms", type=float, default=10.0)
    p.add_argument("--backward-ms", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeline", default=None,
                   help="keep the two-worker trace (the chart's step comes from it) here")
    p.add_argument("--real-rounds", type=int, default=5)
    p.add_argument("--real-steps", type=int, default=8)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "overlap.json"))
    p.add_argument("--paths", default=None,
                   help="two-worker paths to run, separated by ';' (default: all), e.g. "
                        f"'{OVERLAPPED};{AFTER}'; the one-worker rows always run")
    args = p.parse_args(argv)
    paths = list(PATHS) if args.paths is None else [x.strip() for x in args.paths.split(";")]
    unknown = set(paths) - set(PATHS)
    if unknown:
        p.error(f"--paths: unknown path(s) {sorted(unknown)}")
    configs = [c for c in CONFIGS if c[2] is None or c[2] in paths]

    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    for r in range(args.rounds):
        for workers, compute, path in configs:
            row = run(workers, compute, path, args)
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), flush=True)
    median = {label(*c): statistics.median(x["median_step_ms"] for x in rows
                                           if x["config"] == label(*c)) for c in configs}
    figures = {}
    for name, path in (("overlapped", OVERLAPPED), ("applied_before_the_next", APPLIED_BEFORE),
                       ("after_backward", AFTER)):
        if path not in paths:
            continue
        exposed = median[label("two", True, path)] - median["one, compute"]
        own = median[label("two", False, path)] - median["one, no compute"]
        figures[name] = {"exposed_ms": exposed, "exchange_own_ms": own,
                         "exposed_over_own": exposed / own if own > 0 else None}
    # The overlapped step's exposed time against the exchange's own cost before
    # issue 35 (sent after the backward pass), both measured here.
    if "overlapped" in figures and "after_backward" in figures:
        figures["overlapped"]["exposed_over_own_after_backward"] = (
            figures["overlapped"]["exposed_ms"] / figures["after_backward"]["exchange_own_ms"])
    trace = args.timeline or os.path.join(tempfile.mkdtemp(), "overlap_trace.json")
    run("two", True, OVERLAPPED, args, timeline=trace)
    one_step = timeline_step(trace)
    real = real_models(args) if args.real_rounds else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    result = {"benchmark": "overlap", "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
              "no GPU (emulated accelerator: compute is a sleep)", "date": time.strftime("%Y-%m-%d"),
              "commit": commit, "args": vars(args), "grad_mib": 4 * args.layers,
              "median_step_ms": median, **figures.get("overlapped", {}), "figures": figures,
              "rows": rows,
              "real_models": real, "timeline_step": one_step,
              "target": "exposed_over_own <= 0.25 (issue 35)"}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    from charts import draw_after_run

    draw_after_run(args.out)
    print(json.dumps({k: result[k] for k in ("median_step_ms", "figures")}, indent=1))
    return result


if __name__ == "__main__":
    main()
