"""Tune the MNIST CNN's learning rate with Ray Tune over `dsgd.Trainer`s:
`Trainer.as_trainable` gives a trainable whose trial resources (a placement
group) hold the trainable and its workers; each training iteration is one
`train()` epoch plus `validate()`.

    python -m dsgd.examples.tune_mnist [--lrs 3e-4 1e-3] [--iterations 2] [--num-workers 1]

Prints one JSON line with every trial's result and the best learning rate.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import dsgd
from dsgd.examples.cluster import start_ray
from dsgd.examples.trainer_mnist import MnistOperator


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3])
    p.add_argument("--iterations", type=int, default=2, help="epochs per trial")
    p.add_argument("--num-workers", type=int, default=1, help="per trial")
    p.add_argument("--batch-size", type=int, default=100, help="global")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from ray import tune

    start = time.perf_counter()
    start_ray(args.address, 2 * (1 + args.num_workers))  # a trial holds 1 + num_workers CPUs: two at once
    trainable = dsgd.Trainer.as_trainable(MnistOperator, num_workers=args.num_workers,
                                          config={dsgd.BATCH_SIZE: args.batch_size})
    tuner = tune.Tuner(trainable, param_space={"lr": tune.grid_search(args.lrs)},
                       run_config=tune.RunConfig(stop={"training_iteration": args.iterations},
                                                 storage_path=tempfile.mkdtemp(prefix="dsgd-tune-"),
                                                 verbose=0))
    results = tuner.fit()
    if results.errors:
        raise RuntimeError(f"{len(results.errors)} trial(s) failed: {results.errors[0]}")
    best = results.get_best_result(metric="val_accuracy", mode="max")
    trials = [{"lr": r.config["lr"], "val_accuracy": r.metrics["val_accuracy"],
               "val_loss": r.metrics["val_loss"], "epochs": r.metrics["epoch"]} for r in results]
    result = {"trials": trials, "best_lr": best.config["lr"],
              "best_val_accuracy": best.metrics["val_accuracy"],
              "wall_s": time.perf_counter() - start}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
