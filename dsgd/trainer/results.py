"""How the Trainer reports: per-batch values averaged over the batches of a
worker weighted by samples, then over workers weighted by samples (Ray 1.x
averaged workers unweighted, ray#21849, and its TFTrainer returned worker 0's
only). Pure functions over the engine's and the workers' tallies."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsgd.trainer.replica import ValidationTally

# Keys of the engine's per-step tally that are not train_batch metrics.
_ENGINE_KEYS = ("loss", "train_loss")
# Counts that add up over workers (backup workers: batches and rows left out of the means).
_SUMMED = ("dropped_batches", "dropped_samples")


def _is_lr(key: str) -> bool:
    """A learning rate the step reports ("lr", "lr_1", ...): the epoch's last, not a mean."""
    return key == "lr" or (key.startswith("lr_") and key[3:].isdigit())


def worker_means(worker: dict) -> dict[str, float]:
    """A worker's sample-weighted means of its per-batch values (batches counted
    as one sample each when they report no samples, as the engine then weighs them)."""
    return _means(worker["sums"], worker["num_samples"], worker["batch_count"])


def _means(sums: dict, num_samples: int, batch_count: int) -> dict[str, float]:
    samples = num_samples or max(batch_count, 1)
    return {k: v / samples for k, v in sums.items()}


def train_results(summary: dict, epoch: int, reduce_results: bool, profile: bool):
    """Trainer.train's result from `DistributedSGD.train`'s summary."""
    per_worker = []
    for worker in summary["workers"]:
        means = worker_means(worker)
        row = {"epoch": epoch, "batch_count": worker["batch_count"],
               "num_samples": worker["num_samples"],
               "dropped_batches": worker.get("dropped_batches", 0),
               "dropped_samples": worker.get("dropped_samples", 0),
               "train_loss": means.get("train_loss", means.get("loss")),
               "last_train_loss": worker["last"].get("train_loss", worker["last"].get("loss"))}
        row.update({k: v for k, v in means.items() if k not in _ENGINE_KEYS and not _is_lr(k)})
        row.update({k: v for k, v in worker["last"].items() if _is_lr(k)})
        per_worker.append(row)
    extra = {}
    if profile:
        extra = {f"mean_{k}": v for k, v in summary["mean_times"].items()}
        extra["train_epoch_s"] = summary["train_s"]
    if not reduce_results:
        return [dict(row, **extra) for row in per_worker]
    return dict(reduce(per_worker, epoch), **extra)


def validation_results(tallies: list[ValidationTally], metric_results: dict, reduce_results: bool,
                       elapsed_s: float, profile: bool):
    """Trainer.validate's result from every worker's `validate_share` tally and
    the registered metrics' results over the summed states."""
    per_worker = []
    for tally in tallies:
        row = {"batch_count": tally.batch_count, "num_samples": tally.num_samples}
        row.update(_means(tally.sums, tally.num_samples, tally.batch_count))
        row.update({f"last_{k}": v for k, v in tally.last.items()})
        per_worker.append(row)
    extra = {"validation_s": elapsed_s} if profile else {}
    if not reduce_results:
        return [dict(row, **extra) for row in per_worker]
    result = reduce(per_worker, None)
    result.update(metric_results)  # exact over the whole set, not an average of averages
    return dict(result, **extra)


def reduce(rows: list[dict], epoch) -> dict:
    """Workers' rows merged: num_samples and dropped_* summed, batch_count
    averaged, every other number averaged weighted by the workers' samples."""
    total = sum(r["num_samples"] for r in rows)
    merged = {"num_samples": total,
              "batch_count": sum(r["batch_count"] for r in rows) / max(len(rows), 1)}
    for key in _SUMMED:
        if any(key in r for r in rows):
            merged[key] = sum(r.get(key, 0) for r in rows)
    if epoch is not None:
        merged = {"epoch": epoch, **merged}
    keys = list(dict.fromkeys(k for r in rows for k in r
                              if k not in ("epoch", "num_samples", "batch_count") + _SUMMED))
    for key in keys:
        if _is_lr(key):  # the same on every worker
            merged[key] = next((r[key] for r in rows if r.get(key) is not None), None)
            continue
        weighted = [(r[key], r["num_samples"]) for r in rows if r.get(key) is not None]
        weight = sum(n for _, n in weighted)
        merged[key] = (sum(v * n for v, n in weighted) / weight if weight
                       else (sum(v for v, _ in weighted) / len(weighted) if weighted else None))
    return merged
