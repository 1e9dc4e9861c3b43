"""The Trainer's averaging rules (dsgd/trainer/results.py), without a cluster."""

import pytest

from dsgd.trainer import results


def test_workers_are_weighted_by_samples_and_keys_come_from_every_worker():
    rows = [{"num_samples": 10, "batch_count": 1, "val_loss": 1.0},
            {"num_samples": 30, "batch_count": 3, "val_loss": 2.0, "val_extra": 4.0},
            {"num_samples": 0, "batch_count": 0}]  # a worker whose share was empty
    merged = results.reduce(rows, None)
    assert merged["num_samples"] == 40 and merged["batch_count"] == pytest.approx(4 / 3)
    assert merged["val_loss"] == pytest.approx((10 * 1.0 + 30 * 2.0) / 40)
    assert merged["val_extra"] == 4.0


def test_batches_without_samples_are_averaged_per_batch():
    worker = {"num_samples": 0, "batch_count": 4, "sums": {"loss": 8.0}, "last": {}}
    assert results.worker_means(worker) == {"loss": 2.0}
