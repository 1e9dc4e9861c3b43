"""A Trainer whose worker is SIGKILLed or hangs mid-epoch: the engine replaces it
(replace_hung, which the Trainer turns on) and the epoch completes with the
weights of one process that never failed."""

import os

import numpy as np
import pytest

import dsgd
from helpers import assert_replicas_identical
from trainer_ops import FlakyClassifier, reference

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


# `slow` (~13-20 s each): the engine's kill tests (test_recovery.py) cover the replacement,
# test_hung.py replace_hung in steps and in the Trainer's calls.
@pytest.mark.slow
@pytest.mark.parametrize("action", ["kill", "hang"])
def test_a_dead_or_hung_worker_is_replaced_and_the_epoch_completes(action, tmp_path):
    config = {dsgd.BATCH_SIZE: 16, "action": action, "marker": str(tmp_path / "marker")}
    with dsgd.Trainer(FlakyClassifier, num_workers=2, config=config, step_timeout_s=10) as trainer:
        result = trainer.train()
        assert os.path.exists(config["marker"]) and len(trainer.sgd.failures) == 1
        assert result["num_samples"] == 64 and result["batch_count"] == 4
        assert_replicas_identical(trainer)
        weights = trainer.get_model().get_weights()
    # The failed step was retried on the same rows: one epoch of one process, batch 16.
    losses, want, _, _ = reference(1, 16)
    assert result["train_loss"] == pytest.approx(losses[0], abs=1e-5)
    for got, w in zip(weights, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-5)
