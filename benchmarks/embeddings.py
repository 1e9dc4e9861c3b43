"""Embedding tables through dsgd: step time, bytes per step and worker memory, by table size.

    python benchmarks/embeddings.py [--rows 1000000 4000000] [--dim 32] [--optimizers sgd adagrad]
                                    [--steps 8] [--batch 1024] [--out PATH]

The model: one `keras.layers.Embedding(rows, dim)` looked up by 26 ids per example
(Zipf-distributed over the rows, as categorical features are: a few ids carry most
of the traffic), the mean of the 26 vectors, one Dense logit; binary cross-entropy.
`DistributedSGD` with 2 workers of one replica each and 2 PS actors, `--batch`
examples per replica and step. For each table size and optimizer:

* `step_s`: the median step (`fetch_stats`), over `--steps` steps after 2 warm-up ones;
* `bytes_per_worker_step`: what one worker sends to the PS actors and receives back
  each step, from the variables' sizes: today the table's gradient travels dense
  (every row, every step), 2 x (rows x dim + dim + 1) x 4 bytes;
* `touched_rows_per_batch` and `touched_bytes_both_ways`: the distinct rows one
  replica's batch looks up (mean over the measured steps), and their bytes with their
  ids, sent and received as the dense figure is (2 x rows x (dim x 4 + 4)): about what
  a worker's step would move if only the rows it touched travelled;
* `worker_memory_bytes` / `worker_own_memory_growth_bytes`: each worker process's
  resident memory after the steps (its own, `RssAnon`; the object store's pages it
  touched, `RssShmem`; the peak of both, `VmHWM`), and the growth of its own over the
  same run with a 1,000-row table (measured first; with one PS, as its gradient makes
  one shard: a worker holds none of a PS's memory), against the table's bytes. The
  peak includes the store's pages; the growth, read after the steps, does not include
  the step's transient dense gradient.

This is path (a) of the issue on embedding tables, today's dense exchange; paths
(b) sparse exchange and (c) tables on the PS are not built. JSON to
benchmarks/results/embeddings.json; run alone (the timings share the machine's cores).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FEATURES = 26  # ids per example, as Criteo's categorical features
BASE_ROWS = 1000  # the table of the memory baseline


def batch_of(rows: int, batch: int, replica: int, step: int):
    """(ids (batch, 26) int32, Zipf over the rows; labels (batch, 1) float32)."""
    rng = np.random.default_rng(7919 * step + replica)
    ids = (rng.zipf(1.2, size=(batch, FEATURES)) - 1) % rows
    return ids.astype(np.int32), rng.integers(0, 2, (batch, 1)).astype(np.float32)


class TableModel(dsgd.Model):
    """One replica: the table, its head, the optimizer; batches from `batch_of`."""

    def __init__(self, replica: int, rows: int, dim: int, batch: int, optimizer: str):
        import keras

        keras.utils.set_random_seed(0)
        ids = keras.Input((FEATURES,), dtype="int32")
        vectors = keras.layers.Embedding(rows, dim, name="table")(ids)
        logit = keras.layers.Dense(1, name="logit")(keras.ops.mean(vectors, axis=1))
        self.model = keras.Model(ids, logit)
        self.optimizer = {"sgd": lambda: keras.optimizers.SGD(0.1),
                          "adagrad": lambda: keras.optimizers.Adagrad(0.05)}[optimizer]()
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        self.replica, self.rows, self.batch, self.step = replica, rows, batch, 0
        self.touched: list[int] = []

    def get_loss(self, batch):
        ids, labels = batch
        return self.loss_fn(labels, self.model(ids, training=True))

    def get_optimizer(self):
        return self.optimizer

    def get_batch(self):
        self.step += 1
        ids, labels = batch_of(self.rows, self.batch, self.replica, self.step)
        self.touched.append(len(np.unique(ids)))
        return ids, labels


def memory(_worker) -> dict:
    """This process's resident memory, bytes (Linux /proc/self/status): its own
    (`RssAnon`: TensorFlow's tensors, the table, its slots, the gradients), the
    object store's pages it has touched (`RssShmem`: shared with the store, not its
    own), and the peak of both (`VmHWM`)."""
    keys = {"RssAnon:": "anon", "RssShmem:": "shmem", "VmHWM:": "peak"}
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(maxsplit=1)[0]
            if name in keys:
                found[keys[name]] = int(line.split()[1]) * 1024
    if len(found) != len(keys):
        raise RuntimeError(f"/proc/self/status lacks {set(keys.values()) - set(found)}")
    return found


def measure(rows: int, dim: int, optimizer: str, steps: int, batch: int,
            num_ps: int = 2) -> dict:
    started = time.perf_counter()
    with dsgd.DistributedSGD(lambda w, d: TableModel(w, rows, dim, batch, optimizer), 2, 1,
                             gpu=False, num_ps=num_ps, step_timeout_s=600) as sgd:
        for _ in range(2):
            sgd.step()
        times = [sgd.step(fetch_stats=True)["step_s"] for _ in range(steps)]
        touched = sgd.foreach_model(lambda m: statistics.mean(m.touched[2:]))
        rss = sgd.foreach_worker(memory)
    params = rows * dim + dim + 1
    mean_touched = statistics.mean(touched)
    return {"rows": rows, "dim": dim, "optimizer": optimizer, "table_bytes": rows * dim * 4,
            "step_s": statistics.median(times), "step_times_s": times,
            "bytes_per_worker_step": 2 * params * 4,
            "touched_rows_per_batch": mean_touched,
            "touched_bytes_both_ways": 2 * mean_touched * (dim * 4 + 4),
            "worker_memory_bytes": rss, "wall_s": time.perf_counter() - started}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 4_000_000])
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--optimizers", nargs="+", choices=["sgd", "adagrad"],
                   default=["sgd", "adagrad"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=1024, help="examples per replica and step")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "embeddings.json"))
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.dim < 1 or args.steps < 1 or args.batch < 1:
        p.error("--rows, --dim, --steps and --batch must be at least 1")
    import ray

    ray.init(num_cpus=4, include_dashboard=False)
    runs = []
    for optimizer in args.optimizers:
        base = measure(BASE_ROWS, args.dim, optimizer, args.steps, args.batch, num_ps=1)
        for rows in args.rows:
            run = measure(rows, args.dim, optimizer, args.steps, args.batch)
            run["worker_own_memory_growth_bytes"] = [a["anon"] - b["anon"] for a, b in zip(
                run["worker_memory_bytes"], base["worker_memory_bytes"])]
            run["growth_over_table"] = statistics.mean(run["worker_own_memory_growth_bytes"]) \
                / run["table_bytes"]
            runs.append(run)
            print(f"{optimizer} {rows:>10,} rows x {args.dim}: step {1e3 * run['step_s']:8.1f} ms, "
                  f"{run['bytes_per_worker_step'] / 2**20:7.1f} MiB/worker/step "
                  f"({run['touched_rows_per_batch']:,.0f} rows touched: "
                  f"{run['touched_bytes_both_ways'] / 2**20:.2f} MiB), worker memory +"
                  f"{run['growth_over_table']:.2f} x the table", flush=True)
    ray.shutdown()
    result = {"benchmark": "embeddings", "path": "(a) dense exchange (today's only path)",
              "workers": 2, "num_ps": 2, "batch_per_replica": args.batch, "ids_per_example": FEATURES,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "date": time.strftime("%Y-%m-%d"), "runs": runs}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    from charts import draw_after_run

    draw_after_run(args.out)
    return result


if __name__ == "__main__":
    main()
