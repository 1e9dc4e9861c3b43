"""`DistributedSGD.train`: many steps at once, fed from a dataset (driver side).

A `dsgd.Dataset` is used through the small feed protocol of
dsgd/data/feeds.py (the engine does not import the data layer): the driver
sends each worker the feed's loader once, then asks the feed for each worker's
argument of every step, which the worker's loader turns into batches. Feeds
(and the workers' loaders) are kept for the last few datasets used, so
training on a dataset again continues where it stopped.
"""

from __future__ import annotations

import time

import numpy as np

from dsgd import constants, progress
from dsgd.engine import steps


def train(sgd, num_steps: int | None, dataset, desc: str = "train") -> dict:
    """See `DistributedSGD.train`. Returns {"loss": mean loss over the steps,
    "steps": steps run, "num_samples": examples trained on (every replica's
    batches; None when get_batch's batches have no leading dimension),
    "skipped_steps": steps skipped here (non-finite gradients), "epoch_ended":
    the dataset's epoch ended (Ray Data, num_steps=None), "train_s": wall time,
    "step_s": median seconds per step, "data_s": median seconds the slowest
    worker spent getting its step's batches, "samples_per_s", "step": steps applied
    in all, "failures": failures recovered in all, "mean_times": mean seconds per
    step of step_s/data_s/compute_s/apply_s/exchange_s, "workers": per worker
    (worker order) {"num_samples", "batch_count", "sums": {metric: sum over steps
    of value x samples}, "last": {metric: last step's value}}, the metrics being
    "loss" and any others get_loss returns}."""
    feed = _feed(sgd, dataset)
    until_epoch_end = False
    if num_steps is None:
        num_steps = feed.steps_per_epoch(sgd) if feed is not None else _model_epoch(sgd)
        if num_steps is None:
            if feed is None:
                raise ValueError("train() without a dataset needs num_steps: the replicas' "
                                 "steps_per_epoch() does not say how long one epoch of their "
                                 "own data (get_batch) is")
            if not getattr(feed, "reports_epoch_end", False):
                raise ValueError("dataset is streaming data of unknown length (a generator or "
                                 "iterator): pass num_steps")
            until_epoch_end = True
        elif num_steps < 1:
            raise ValueError(f"one epoch of {'the dataset' if feed else 'the replicas own data'} "
                             "is 0 steps (fewer batches than workers/replicas?): pass num_steps")
    elif isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) \
            or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int or None (one epoch), got {num_steps!r}")

    start = time.perf_counter()
    tally = Tally()
    ended_at = None
    with progress.bar(None if until_epoch_end else int(num_steps), desc) as bar:
        step_start = time.perf_counter()
        for infos, applied, was_skipped in steps.run(sgd, feed, None if until_epoch_end
                                                     else int(num_steps)):
            if infos is not None and infos[0].get("epoch_end"):
                if until_epoch_end and tally.steps:
                    break
                if ended_at == tally.steps:
                    raise ValueError(f"{dataset!r} has fewer rows than one step needs "
                                     f"({sgd.num_workers} worker(s) x batch_size="
                                     f"{dataset.batch_size})")
                ended_at = tally.steps
                continue  # the next step starts the next epoch
            tally.add(infos, applied, was_skipped, time.perf_counter() - step_start)
            step_start = time.perf_counter()
            if tally.losses:
                bar.set_postfix(loss=f"{tally.losses[-1]:.4f}",
                                samples_s=f"{tally.samples / (time.perf_counter() - start):.0f}",
                                refresh=False)
            bar.update()
    return tally.summary(sgd, until_epoch_end, time.perf_counter() - start)


class Tally:
    """What train() reports: per step the loss and timings, per worker (in
    worker order) its samples, batches, and for every metric (the loss too)
    the sum of value x samples and the last value; a worker's value of a step
    is the mean over its replicas."""

    def __init__(self):
        self.steps, self.skipped, self.samples = 0, 0, 0
        self.losses, self.times = [], {k: [] for k in ("step_s", "data_s", "compute_s",
                                                        "apply_s", "exchange_s")}
        self.workers: list[dict] = []

    def add(self, infos, applied, skipped: bool, step_s: float) -> None:
        self.steps += 1
        self.skipped += skipped
        # Steps that ran in one call (one worker) come together: their share of its time.
        step_s = next((a["step_s"] for a in applied if "step_s" in a), step_s)
        self.times["step_s"].append(step_s)
        if infos is None:  # the step was applied before a failure interrupted it
            return
        compute_s = max(info.get("compute_s", 0.0) for info in infos)
        apply_s = max((a.get("apply_s", 0.0) for a in applied), default=0.0)
        for key, value in (("data_s", max(info.get("data_s", 0.0) for info in infos)),
                           ("compute_s", compute_s), ("apply_s", apply_s),
                           ("exchange_s", max(0.0, step_s - compute_s - apply_s))):
            self.times[key].append(value)
        self.losses.append(float(np.mean([x for info in infos for x in info["losses"]])))
        while len(self.workers) < len(infos):
            self.workers.append({"num_samples": 0, "batch_count": 0, "sums": {}, "last": {}})
        for worker, info in zip(self.workers, infos):
            samples = int(info.get("samples", 0))
            values = {"loss": float(np.mean(info["losses"]))}
            values.update({k: float(np.mean(v)) for k, v in info.get("metrics", {}).items()})
            worker["num_samples"] += samples
            worker["batch_count"] += 1
            for key, value in values.items():
                worker["sums"][key] = worker["sums"].get(key, 0.0) + value * max(samples, 1)
                worker["last"][key] = value
            self.samples += samples

    def summary(self, sgd, epoch_ended: bool, train_s: float) -> dict:
        times = {k: float(np.mean(v)) if v else float("nan") for k, v in self.times.items()}
        return {"loss": float(np.nanmean(self.losses)) if self.losses else float("nan"),
                "steps": self.steps, "num_samples": self.samples,
                "skipped_steps": self.skipped, "epoch_ended": epoch_ended, "train_s": train_s,
                "step_s": float(np.median(self.times["step_s"])) if self.steps else float("nan"),
                "data_s": float(np.median(self.times["data_s"])) if self.times["data_s"]
                else float("nan"),
                "samples_per_s": self.samples / train_s if train_s > 0 else 0.0,
                "step": sgd.steps_done, "failures": len(sgd.failures),
                "mean_times": times, "workers": self.workers}


def _feed(sgd, dataset):
    """The feed of `dataset` for `sgd`, made once per dataset object; the
    DATA_FEEDS_KEPT most recently used are kept (with their workers' loaders)."""
    if dataset is None:
        return None
    if not hasattr(dataset, "_feed"):
        raise TypeError("dataset must be a dsgd.Dataset (wrap a ray.data.Dataset or an "
                        f"iterable: dsgd.Dataset(data, batch_size=...)), got {type(dataset).__name__}")
    for key, (known, feed) in sgd._feeds.items():
        if known is dataset:
            sgd._feeds[key] = sgd._feeds.pop(key)  # most recent last
            return feed
    feed = dataset._feed(sgd)
    if sgd.pending_data_position is not None and getattr(feed, "position", None) is not None:
        feed.position, sgd.pending_data_position = sgd.pending_data_position, None
    feed.key = sgd._next_feed_key = getattr(sgd, "_next_feed_key", -1) + 1
    feed.attached_membership = None  # loaders not sent yet
    sgd._feeds[feed.key] = (dataset, feed)
    while len(sgd._feeds) > constants.DATA_FEEDS_KEPT:
        oldest = next(iter(sgd._feeds))
        del sgd._feeds[oldest]
        sgd._call_all("detach_data", oldest)
    return feed


def _model_epoch(sgd) -> int | None:
    """Worker 0 / replica 0's `steps_per_epoch()`, if its Model defines one."""
    return sgd.for_model(lambda m: m.steps_per_epoch() if hasattr(m, "steps_per_epoch") else None)
