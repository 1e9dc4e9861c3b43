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


def train(sgd, num_steps: int | None, dataset) -> dict:
    """See `DistributedSGD.train`. Returns {"loss": mean loss over the steps,
    "steps": steps run, "num_samples": examples trained on (every replica's
    batches; None when get_batch's batches have no leading dimension),
    "skipped_steps": steps skipped here (non-finite gradients), "epoch_ended":
    the dataset's epoch ended (Ray Data, num_steps=None), "train_s": wall time,
    "step_s": median seconds per step, "data_s": median seconds the slowest
    worker spent getting its step's batches, "samples_per_s", "step": steps applied
    in all, "failures": failures recovered in all}."""
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
    elif isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) \
            or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int or None (one epoch), got {num_steps!r}")

    start = time.perf_counter()
    losses, samples, skipped, steps, ended_at, step_times, data_times = [], 0, 0, 0, None, [], []
    with progress.bar(None if until_epoch_end else int(num_steps), "train") as bar:
        while until_epoch_end or steps < num_steps:
            step_start = time.perf_counter()
            infos, _, was_skipped = sgd._run_step(feed)
            if infos is not None and infos[0].get("epoch_end"):
                if until_epoch_end and steps:
                    break
                if ended_at == steps:
                    raise ValueError(f"{dataset!r} has fewer rows than one step needs "
                                     f"({sgd.num_workers} worker(s) x batch_size="
                                     f"{dataset.batch_size})")
                ended_at = steps
                continue  # the next call starts the next epoch
            steps += 1
            step_times.append(time.perf_counter() - step_start)
            skipped += was_skipped
            if infos is not None:
                data_times.append(max(info.get("data_s", 0.0) for info in infos))
                losses.append(float(np.mean([x for info in infos for x in info["losses"]])))
                samples += sum(info.get("samples", 0) for info in infos)
            if losses:
                bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
            bar.update()
    train_s = time.perf_counter() - start
    return {"loss": float(np.nanmean(losses)) if losses else float("nan"), "steps": steps,
            "num_samples": samples, "skipped_steps": skipped,
            "epoch_ended": until_epoch_end, "train_s": train_s,
            "step_s": float(np.median(step_times)) if step_times else float("nan"),
            "data_s": float(np.median(data_times)) if data_times else float("nan"),
            "samples_per_s": samples / train_s if train_s > 0 else 0.0,
            "step": sgd.steps_done, "failures": len(sgd.failures)}


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
