"""What `dsgd.Trainer` costs over Keras `model.fit`: an epoch of `Trainer.train()`
(one worker actor) against an epoch of `fit` in this process, on the same data
(the 4,000 offline MNIST training digits, in order), model, batch size and
optimizer (Adam 1e-3), interleaved in one run (ABBA order per round), medians
over rounds. Also 2 workers (the same global batch) against `fit`, reported.

    python benchmarks/trainer_overhead.py [--models mlp cnn] [--rounds 6] [--batch 100]

Models: the MNIST MLP (784-256-10, ReLU) and the MNIST CNN of the examples
(dsgd/examples/mnist.py build_cnn). `fit` runs with Keras's defaults
(jit_compile="auto", verbose=0). The Trainer's single worker reserves every
CPU, as `fit` uses them all (Ray sets OMP_NUM_THREADS to an actor's CPUs); two
workers get half each. Its data: a `dsgd.Dataset` of (image, label) examples,
batches made in the driver's object store. Target (issue 24): 1 worker <= 1.05x.

Writes benchmarks/results/trainer_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import dsgd  # noqa: E402
from dsgd.examples import mnist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LR = 1e-3


def build(model_name: str):
    import keras

    keras.utils.set_random_seed(0)
    if model_name == "cnn":
        return mnist.build_cnn()
    return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                             keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])


def loss_fn():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Operator(dsgd.TrainingOperator):
    def setup(self, config):
        import keras

        self.register(models=build(config["model"]), optimizers=keras.optimizers.Adam(LR),
                      loss=loss_fn())
        x, y = config["data"]
        self.register_data(train_data=dsgd.Dataset(list(zip(x, y))))


def fit_epoch(model, x, y, batch: int, out: dict | None = None) -> float:
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    elapsed = time.perf_counter() - start
    if out is not None:
        out["loss"] = float(history.history["loss"][-1])
    return elapsed


def trainer_epoch(trainer, out: dict | None = None) -> float:
    start = time.perf_counter()
    result = trainer.train()
    elapsed = time.perf_counter() - start
    if out is not None:
        out.update(result)
    return elapsed


def measure(model_name: str, x, y, batch: int, rounds: int, workers: int) -> dict:
    import keras

    model = build(model_name)
    model.compile(optimizer=keras.optimizers.Adam(LR), loss=loss_fn())
    cpus = os.cpu_count() or 1
    trainer = dsgd.Trainer(Operator, num_workers=workers,
                           config={"model": model_name, "data": (x, y), dsgd.BATCH_SIZE: batch},
                           num_cpus_per_worker=max(1, cpus // workers))
    try:
        # Warm-up (tracing, first touch); from the same initial weights on the same
        # batches, the first epochs' mean losses show that both do the same work.
        fit_first, dsgd_first = {}, {}
        fit_epoch(model, x, y, batch, fit_first)
        trainer_epoch(trainer, dsgd_first)
        steps = len(x) // batch
        if dsgd_first["num_samples"] != steps * batch:
            raise RuntimeError(f"the Trainer's epoch trained {dsgd_first['num_samples']} rows, "
                               f"not {steps * batch}")
        fit_s, dsgd_s = [], []
        for r in range(rounds):
            if r % 2 == 0:
                fit_s.append(fit_epoch(model, x, y, batch))
                dsgd_s.append(trainer_epoch(trainer))
            else:
                dsgd_s.append(trainer_epoch(trainer))
                fit_s.append(fit_epoch(model, x, y, batch))
    finally:
        trainer.shutdown()
    fit_med, dsgd_med = statistics.median(fit_s), statistics.median(dsgd_s)
    return {"model": model_name, "workers": workers, "global_batch": batch,
            "steps_per_epoch": len(x) // batch, "rounds": rounds,
            "first_epoch_loss": {"fit": round(fit_first["loss"], 5),
                                 "trainer": round(dsgd_first["train_loss"], 5)},
            "fit_epoch_s": fit_s, "trainer_epoch_s": dsgd_s,
            "fit_median_s": round(fit_med, 4), "trainer_median_s": round(dsgd_med, 4),
            "ratio": round(dsgd_med / fit_med, 3)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    p.add_argument("--out", default=os.path.join(HERE, "results", "trainer_overhead.json"))
    args = p.parse_args(argv)

    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    x, y, _, _ = mnist.load_mnist()
    x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
    runs = []
    for model_name in args.models:
        for workers in args.workers:
            run = measure(model_name, x, y, args.batch, args.rounds, workers)
            print(json.dumps({k: v for k, v in run.items() if not k.endswith("_epoch_s")}),
                  flush=True)
            runs.append(run)
    one = [r for r in runs if r["workers"] == 1]
    result = {"benchmark": "trainer_overhead", "date": time.strftime("%Y-%m-%d"),
              "device": f"CPU only, {os.cpu_count()} cores ({platform.machine()})",
              "tensorflow": __import__("tensorflow").__version__, "ray": ray.__version__,
              "runs": runs,
              "targets": {"1 worker <= 1.05x fit": all(r["ratio"] <= 1.05 for r in one)}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["targets"]))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
