"""Train a DLRM-style click-through model with dsgd on synthetic Criteo-shaped data.

    python -m dsgd.examples.ctr [--num-workers 2] [--steps 300] [--batch-size 256]
                                [--rows 10000] [--dim 8] [--examples 200000] ...

Data: synthetic, shaped like the Criteo display-advertising logs: each example
has 13 dense count features (log-normal counts, fed as log(1 + count)) and 26
categorical ones, each an id among `--rows` ids drawn from a Zipf law (exponent
`--zipf`: a few ids carry most of the traffic, most are rare, as in real logs).
Clicks come from a hidden logistic model of both (a weight per dense feature, an
effect per id of the first 13 categorical features, an intercept that makes
the click rate Criteo's 25 %), so a model can learn them: the test AUC rises
well above 0.5.
`--seed` fixes everything; the last 10 % of the examples are the test set, the
rest are shared out among the replicas.

The model: DLRM (Naumov et al., 2019) in small. A bottom MLP turns the dense
features into a `--dim` vector; each categorical feature has its own
`keras.layers.Embedding` table of `--rows` x `--dim`; the pairwise dot products
of the 27 vectors (the bottom one and one per table), beside the bottom vector,
go through a top MLP to one logit.
Adagrad, binary cross-entropy.

Cost of the tables: dsgd exchanges a table's gradient as a dense tensor today,
every row every step (26 x rows x dim x 4 bytes through the parameter servers,
8.3 MB at the defaults), however few rows the batch touched; so keep `--rows`
to what a dense exchange carries (docs/embeddings.md).

Starts an embedded local Ray cluster unless `--address` names one. Prints the
test AUC every `--eval-every` steps and, at the end, one JSON line with the
results (AUC, examples/s).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import dsgd
from dsgd import progress
from dsgd.examples.cluster import start_ray

DENSE = 13        # dense features, as in Criteo
CATEGORICAL = 26  # categorical features, as in Criteo
INFORMATIVE = 13  # the categorical features whose ids move the click rate
TEST_SHARE = 0.1
CLICK_RATE = 0.25  # about Criteo's


def make_data(examples: int, rows: int, zipf: float, seed: int):
    """`(dense, ids, clicks)` of `examples` synthetic examples: float32 (n, 13)
    log(1 + count) features, int32 (n, 26) ids in [0, rows), float32 (n,) clicks
    in {0, 1}. The same arguments give the same arrays."""
    rng = np.random.default_rng(seed)
    counts = np.floor(rng.lognormal(mean=1.0, sigma=1.2, size=(examples, DENSE)))
    dense = np.log1p(counts).astype(np.float32)
    weights = 1.0 / np.arange(1, rows + 1) ** zipf  # a Zipf law over the ids' ranks
    cdf = np.cumsum(weights / weights.sum())
    ids = np.empty((examples, CATEGORICAL), np.int32)
    logit = (dense - dense.mean(axis=0)) @ rng.normal(0.0, 0.3, DENSE)
    for f in range(CATEGORICAL):
        rank = np.minimum(np.searchsorted(cdf, rng.random(examples)), rows - 1)
        ids[:, f] = rng.permutation(rows)[rank]  # (hot ids spread over the table)
        if f < INFORMATIVE:
            logit += rng.normal(0.0, 0.5, rows)[ids[:, f]]
    low, high = -20.0, 20.0  # the intercept that makes the click rate CLICK_RATE
    for _ in range(50):
        middle = (low + high) / 2
        rate = np.mean(1.0 / (1.0 + np.exp(-(logit + middle))))
        low, high = (middle, high) if rate < CLICK_RATE else (low, middle)
    clicks = rng.random(examples) < 1.0 / (1.0 + np.exp(-(logit + low)))
    return dense, ids, clicks.astype(np.float32)


def split(examples: int, rows: int, zipf: float, seed: int):
    """((dense, ids, clicks) of the training set, the same of the test set)."""
    dense, ids, clicks = make_data(examples, rows, zipf, seed)
    n_train = examples - max(1, int(examples * TEST_SHARE))
    return ((dense[:n_train], ids[:n_train], clicks[:n_train]),
            (dense[n_train:], ids[n_train:], clicks[n_train:]))


def build_dlrm(rows: int, dim: int):
    """The DLRM: inputs {"dense": (13,) float32, "ids": (26,) int32}, one logit out."""
    import keras

    dense_in = keras.Input((DENSE,), name="dense")
    ids_in = keras.Input((CATEGORICAL,), dtype="int32", name="ids")
    bottom = keras.layers.Dense(32, activation="relu", name="bottom_1")(dense_in)
    bottom = keras.layers.Dense(dim, activation="relu", name="bottom_2")(bottom)
    vectors = [bottom] + [
        keras.layers.Embedding(rows, dim, name=f"table_{f}")(ids_in[:, f])
        for f in range(CATEGORICAL)]
    stacked = keras.ops.stack(vectors, axis=1)  # (batch, 27, dim)
    dots = keras.ops.matmul(stacked, keras.ops.transpose(stacked, (0, 2, 1)))
    upper = np.triu_indices(CATEGORICAL + 1, k=1)  # each pair once
    pairs = keras.ops.take(keras.ops.reshape(dots, (-1, (CATEGORICAL + 1) ** 2)),
                           upper[0] * (CATEGORICAL + 1) + upper[1], axis=1)
    top = keras.layers.Concatenate(name="interactions")([bottom, pairs])
    top = keras.layers.Dense(64, activation="relu", name="top_1")(top)
    logit = keras.layers.Dense(1, name="logit")(top)
    return keras.Model({"dense": dense_in, "ids": ids_in}, logit)


class CtrModel(dsgd.KerasModel):
    """One replica: the DLRM, Adagrad, this replica's shard of the training set."""

    def __init__(self, replica: int, num_replicas: int, args):
        import keras
        import tensorflow as tf

        keras.utils.set_random_seed(args.seed)  # the same initial weights on every run
        (dense, ids, clicks), self.test = split(args.examples, args.rows, args.zipf, args.seed)
        data = (tf.data.Dataset.from_tensor_slices(({"dense": dense, "ids": ids}, clicks))
                .shard(num_replicas, replica)
                .shuffle(16384, seed=args.seed + replica, reshuffle_each_iteration=True)
                .batch(args.batch_size, drop_remainder=True))
        super().__init__(build_dlrm(args.rows, args.dim),
                         keras.losses.BinaryCrossentropy(from_logits=True),
                         keras.optimizers.Adagrad(args.lr), data)

    def get_metrics(self) -> dict[str, float]:
        import keras

        dense, ids, clicks = self.test
        logits = self.model.predict({"dense": dense, "ids": ids}, batch_size=4096, verbose=0)
        auc = keras.metrics.AUC(num_thresholds=1000, from_logits=True)
        auc.update_state(clicks, logits[:, 0])
        return {"test_auc": float(auc.result())}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--devices-per-worker", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256, help="examples per replica and step")
    p.add_argument("--lr", type=float, default=0.05, help="Adagrad's learning rate")
    p.add_argument("--rows", type=int, default=10_000, help="ids (table rows) per categorical feature")
    p.add_argument("--dim", type=int, default=8, help="embedding width")
    p.add_argument("--examples", type=int, default=200_000, help="synthetic examples in all")
    p.add_argument("--zipf", type=float, default=1.1, help="the ids' Zipf exponent (> 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100, help="steps; 0 evaluates only at the end")
    devices = p.add_mutually_exclusive_group()
    devices.add_argument("--gpu", dest="gpu", action="store_const", const=True, default=None,
                         help="one GPU per device (default: GPUs if the cluster has them)")
    devices.add_argument("--cpu", dest="gpu", action="store_const", const=False,
                         help="CPU devices even where the cluster has GPUs")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--min-auc", type=float, default=None,
                   help="exit with status 1 if the final test AUC is lower")
    args = p.parse_args(argv)
    for name in ("num_workers", "devices_per_worker", "steps", "batch_size", "rows", "dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("zipf", "lr"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.eval_every < 0:
        p.error(f"--eval-every must be 0 (only at the end) or more, got {args.eval_every}")
    replicas = args.num_workers * args.devices_per_worker
    train = args.examples - max(1, int(args.examples * TEST_SHARE))
    if train < replicas * args.batch_size:
        p.error(f"--examples {args.examples} leaves {train} training examples: fewer than one "
                f"batch of {args.batch_size} for each of the {replicas} replicas")
    return args


def evaluate(sgd) -> float:
    """Test AUC of every replica; they hold identical weights, so they must agree."""
    aucs = [m["test_auc"] for m in sgd.foreach_model(lambda model: model.get_metrics())]
    if len(set(aucs)) != 1:
        raise AssertionError(f"replicas disagree on the test AUC: {aucs}")
    return aucs[0]


def main(argv=None) -> dict:
    args = parse_args(argv)
    wall_start = time.perf_counter()
    start_ray(args.address, max(os.cpu_count() or 1, args.num_workers))
    devices = args.devices_per_worker
    replicas = args.num_workers * devices

    def creator(worker_index, device_index):
        return CtrModel(worker_index * devices + device_index, replicas, args)

    table_bytes = CATEGORICAL * args.rows * args.dim * 4
    with dsgd.DistributedSGD(creator, args.num_workers, devices, gpu=args.gpu) as sgd:
        train_s, loss, first_loss, step = 0.0, float("nan"), None, 0
        evaluations = list(range(args.eval_every, args.steps, args.eval_every)) \
            if args.eval_every else []
        first_auc = evaluate(sgd)
        with progress.bar(args.steps, "training") as bar:
            for until in evaluations + [args.steps]:
                for _ in range(until - step):
                    stats = sgd.step(fetch_stats=True)
                    train_s, loss = train_s + stats["step_s"], stats["loss"]
                    first_loss = loss if first_loss is None else first_loss
                    bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                    bar.update()
                step = until
                if until in evaluations:
                    progress.write(f"step {step}: loss {loss:.4f}, test AUC {evaluate(sgd):.4f} "
                                   f"(all {replicas} replicas agree)")
        auc = evaluate(sgd)
    result = {
        "test_auc": auc, "untrained_test_auc": first_auc, "first_loss": first_loss,
        "final_loss": loss, "steps": args.steps, "num_workers": args.num_workers,
        "devices_per_worker": devices, "batch_size_per_replica": args.batch_size,
        "global_batch_size": args.batch_size * replicas, "rows_per_table": args.rows,
        "dim": args.dim, "tables_bytes": table_bytes,
        "examples_per_s": args.steps * args.batch_size * replicas / train_s,
        "train_s": train_s, "wall_s": time.perf_counter() - wall_start,
    }
    print(json.dumps(result), flush=True)
    if args.min_auc is not None and auc < args.min_auc:
        raise SystemExit(f"test AUC {auc:.4f} is below --min-auc {args.min_auc}")
    return result


if __name__ == "__main__":
    main()
