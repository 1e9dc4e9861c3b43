"""Does ingest starve the step? The MNIST CNN on 2 workers, fed three ways in
one run, interleaved in rounds so all three see the same machine:

  (a) memory     each replica's `get_batch()` returns rows of float32 arrays it holds;
  (b) dataset    a `dsgd.Dataset` of (uint8 image, label) examples, shuffled, whose
                 transform scales the pixels to float32 in the worker;
  (c) ray-data   a `ray.data.Dataset` of the same rows (`from_items`, 8 blocks),
                 `map_batches` scaling the pixels on Ray Data's executors,
                 `streaming_split` + `iter_batches`.

Each round runs `--steps` steps of each (`DistributedSGD.train(num_steps=...)`,
whose summary has the median step time of the call); the result is the median
over rounds, and (b)/(a), (c)/(a). Goal: both <= 1.05.

Then slow storage: a `download_func` that sleeps 20 ms per item, downloaded
through the dataset's block stream for max_concurrency 1, 2, 4, 8: items/s.

    python benchmarks/ingest.py [--rounds 8] [--steps 20] [--batch-size 32] [--no-plot]

Writes benchmarks/results/ingest.json (and ingest.png).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dsgd
from dsgd.data.stream import BlockStream
from dsgd.examples import mnist


class MemoryCnn(mnist.MnistModel):
    """(a): the MNIST CNN fed from arrays it holds (its shard, float32), no tf.data."""

    def __init__(self, replica: int, batch_size: int):
        super().__init__(replica, 2, batch_size, 1e-3, own_data=False)
        x, y, _, _ = mnist.load_mnist()
        self.x, self.y = x[replica::2], y[replica::2]
        self.batch_size, self.cursor = batch_size, 0

    def get_batch(self):
        start = self.cursor
        self.cursor = (start + self.batch_size) % (len(self.x) - self.batch_size)
        return self.x[start:start + self.batch_size], self.y[start:start + self.batch_size]


def scale(batch):
    pixels, labels = batch
    return pixels.astype(np.float32) / 255.0, labels


def scale_columns(batch: dict) -> dict:
    return {"image": batch["image"].astype(np.float32) / 255.0, "label": batch["label"]}


def feeding_rounds(rounds: int, steps: int, batch: int) -> dict:
    import ray

    x, y, _, _ = mnist.load_mnist()
    pixels = np.round(x * 255).astype(np.uint8)
    examples = list(zip(pixels, y))
    datasets = {
        "memory": None,
        "dataset": dsgd.Dataset(examples, transform=scale, batch_size=batch, shuffle=True),
        # 8 blocks of 500 rows (from_items' default makes ~200 blocks of 20 rows here,
        # and Ray Data's cost per block then dominates).
        "ray-data": dsgd.Dataset(ray.data.from_items([{"image": p, "label": label}
                                                      for p, label in examples],
                                                     override_num_blocks=8)
                                 .map_batches(scale_columns), batch_size=batch),
    }
    times: dict[str, list[float]] = {name: [] for name in datasets}
    data_times: dict[str, list[float]] = {name: [] for name in datasets}
    with dsgd.DistributedSGD(lambda w, d: MemoryCnn(w, batch), 2, 1, gpu=False) as sgd:
        for name, dataset in datasets.items():  # warm-up: trace, download, start Ray Data
            sgd.train(dataset=dataset, num_steps=steps)
        for r in range(rounds):
            for name, dataset in datasets.items():
                summary = sgd.train(dataset=dataset, num_steps=steps)
                times[name].append(summary["step_s"])
                data_times[name].append(summary["data_s"])
            print(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {1000 * t[-1]:.1f} ms (data {1000 * data_times[n][-1]:.1f})"
                for n, t in times.items()), flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"step_s": medians, "per_round_step_s": times,
            "data_s": {name: statistics.median(t) for name, t in data_times.items()},
            "ratio_to_memory": {n: medians[n] / medians["memory"] for n in medians}}


def download_rates(items: int, sleep_s: float, concurrencies: list[int], block_rows: int) -> dict:
    def slow(i):
        time.sleep(sleep_s)
        return np.full(16, i, np.float32)

    BlockStream(range(items), slow, max(concurrencies), block_rows).ready(
        0, items, 0, timeout_s=600)  # warm-up: Ray starts the task worker processes
    rates = {}
    for c in concurrencies:
        stream = BlockStream(range(items), slow, c, block_rows)
        start = time.perf_counter()
        stream.ready(0, items, 0, timeout_s=600)
        rates[c] = items / (time.perf_counter() - start)
        print(f"max_concurrency {c}: {rates[c]:.0f} items/s (ideal {c / sleep_s:.0f})", flush=True)
    return {"items": items, "sleep_s": sleep_s, "block_rows": block_rows,
            "items_per_s": rates, "ideal_items_per_s": {c: c / sleep_s for c in concurrencies}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per configuration per round")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--items", type=int, default=512, help="download benchmark: items")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--out", default=os.path.join(HERE, "results", "ingest.json"))
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    import ray

    # Ray Data's tasks need CPUs beside the 2 workers' (logical CPUs: oversubscribed).
    ray.init(address="local", num_cpus=(os.cpu_count() or 1) + 2, include_dashboard=False,
             log_to_driver=False)
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "python": platform.python_version()},
              "config": vars(args), "date": time.strftime("%Y-%m-%d")}
    result["feeding"] = feeding_rounds(args.rounds, args.steps, args.batch_size)
    result["downloads"] = download_rates(args.items, 0.02, args.concurrency, 16)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"step_ms": {n: round(1000 * t, 2) for n, t in result["feeding"]["step_s"].items()},
                      "ratio_to_memory": result["feeding"]["ratio_to_memory"],
                      "items_per_s": result["downloads"]["items_per_s"]}))
    if not args.no_plot:
        sys.path.insert(0, HERE)
        import charts  # the chart code of every benchmark

        charts.draw_after_run(args.out)


if __name__ == "__main__":
    main()
