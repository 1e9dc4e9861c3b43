"""Custom epochs: an operator's own train_epoch (steps through train_step, all
workers at once through the PS actors) and validate, exact against a
single-process Keras loop; a worker lost inside a custom epoch is replaced and
the epoch run again from its start."""

import os

import numpy as np
import pytest

import dsgd
import trainer_ops
from helpers import assert_replicas_identical
from trainer_ops import (CustomEpochClassifier, CustomEpochGan, CustomEpochTfData,
                         FlakyCustomEpoch, reference)

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


def assert_weights(got, want, atol=1e-5):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol)


class CustomEpochAndValidate(CustomEpochClassifier):
    """A custom train_epoch, and a validate override that returns its own loss
    (CustomEpochClassifier's) beside the default validate's values (compiled
    validate_batch, registered metrics), over the same batches."""

    def validate(self, iterator, info):
        batches = list(iterator)
        default = dsgd.TrainingOperator.validate(self, iter(batches), info)
        return dict(default, **CustomEpochClassifier.validate(self, iter(batches), info), extra=1.0)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One 2-worker Trainer of CustomEpochAndValidate (global batch 16) for this
    module, and a checkpoint of its initial state."""
    with dsgd.Trainer(CustomEpochAndValidate, num_workers=2,
                      config={dsgd.BATCH_SIZE: 16}) as trainer:
        yield trainer, trainer.save(str(tmp_path_factory.mktemp("initial") / "ckpt"))


def check_custom_epochs(trainer, per_worker_validation: bool):
    """Two custom epochs and a validation, against Keras in one process."""
    results = [trainer.train() for _ in range(2)]
    val = trainer.validate()
    per_worker = trainer.validate(reduce_results=False)
    model = trainer.get_model()
    assert_replicas_identical(trainer)  # every worker applied the same means
    losses, weights, _, _ = reference(2, 16)
    assert [r["epoch_seen"] for r in results] == [1, 2]
    assert all(r["num_samples"] == 64 and r["batch_count"] == 4 for r in results)
    np.testing.assert_allclose([r["loss"] for r in results], losses, rtol=0, atol=1e-5)
    assert_weights(model.get_weights(), weights)
    if per_worker_validation:  # each worker validated its share: 15 + 15
        assert [r["num_samples"] for r in per_worker] == [15, 15]
        assert val["num_samples"] == 30
        assert val["val_loss_custom"] == pytest.approx(trainer_ops.validation_loss(model), abs=1e-5)


def test_custom_train_epoch_equals_a_single_process_loop(shared):
    trainer, initial = shared
    trainer.load(initial)
    check_custom_epochs(trainer, per_worker_validation=True)


@pytest.mark.slow  # as before: a second construction, for the tf.data shards
def test_custom_train_epoch_on_tf_data_equals_a_single_process_loop():
    with dsgd.Trainer(CustomEpochTfData, num_workers=2, config={dsgd.BATCH_SIZE: 16}) as trainer:
        check_custom_epochs(trainer, per_worker_validation=False)


@pytest.mark.slow
def test_custom_epoch_trains_two_models_as_one_process():
    """CustomEpochGan's train_epoch (train_step per batch) gives Gan's weights of
    one process averaging the two replicas' losses (trainer_ops.gan_reference)."""
    with dsgd.Trainer(CustomEpochGan, num_workers=2) as trainer:
        initial = [m.get_weights() for m in trainer.get_model()]
        result = trainer.train()
        after = [m.get_weights() for m in trainer.get_model()]
        assert_replicas_identical(trainer)
    want_d, want_g, losses_d, losses_g = trainer_ops.gan_reference(initial, 1, 2)
    assert result["batch_count"] == 4 and {"loss_d", "loss_g", "last_loss_d"} <= set(result)
    assert result["loss_d"] == pytest.approx(losses_d[0], abs=1e-5)
    assert result["loss_g"] == pytest.approx(losses_g[0], abs=1e-5)
    assert_weights(after[0], want_d)
    assert_weights(after[1], want_g)


def test_train_step_outside_train_epoch_is_refused():
    with dsgd.Trainer(CustomEpochClassifier, num_workers=1, local=True) as trainer:
        with pytest.raises(RuntimeError, match="call it inside train_epoch"):
            trainer.sgd.for_model(lambda m: m.operator.train_step(None))
        assert trainer.train()["num_samples"] == 64  # one worker: local steps, no exchange


def test_average_meter_collection():
    meters = dsgd.AverageMeterCollection()
    meters.update({"loss": 2.0}, n=4)
    meters.update({"loss": 1.0, "num_samples": 2})
    assert meters.summary() == {"batch_count": 2, "num_samples": 6, "loss": pytest.approx(10 / 6),
                                "last_loss": 1.0}
    with pytest.raises(TypeError, match=r"metrics\['loss'\] must be a number"):
        meters.update({"loss": "x"})


@pytest.mark.slow
@pytest.mark.parametrize("action", ["kill", "hang"])
def test_worker_lost_in_a_custom_epoch_is_replaced_and_the_epoch_rerun(action, tmp_path):
    config = {dsgd.BATCH_SIZE: 16, "action": action, "marker": str(tmp_path / "once")}
    with dsgd.Trainer(FlakyCustomEpoch, num_workers=2, config=config, step_timeout_s=8) as trainer:
        result = trainer.train()
        failures = trainer.sgd.failures
        weights = trainer.get_model().get_weights()
    assert os.path.exists(tmp_path / "once")
    assert len(failures) == 1 and "train_epoch" in failures[0].get("call", "")
    assert result["num_samples"] == 64
    _, want, _, _ = reference(1, 16)
    assert_weights(weights, want)


def test_a_validate_override_can_extend_the_default(shared):
    """The default validate (compiled validate_batch, registered metrics) under an
    override: its averages over samples, weighted over workers, equal the built-in
    validation's."""
    trainer, _ = shared
    trainer.train()
    custom = trainer.validate()
    trainer._custom_validate = False  # the built-in path, on the same weights
    try:
        builtin = trainer.validate()
    finally:
        trainer._custom_validate = True
    assert custom["extra"] == 1.0 and custom["num_samples"] == builtin["num_samples"] == 30
    assert custom["val_loss"] == pytest.approx(builtin["val_loss"], abs=1e-6)
    assert custom["val_accuracy"] == pytest.approx(builtin["val_accuracy"], abs=1e-6)
