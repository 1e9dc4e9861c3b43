"""Trainer learning-rate schedulers (per epoch, per batch, manual, on a plateau of
a validation metric) exact against a single-process Keras loop with the same
schedule, surviving save/load; local mode (the operator in this process)
against one worker actor."""

import numpy as np
import pytest

import dsgd
import trainer_ops
from trainer_ops import ScheduledClassifier, scheduled_reference

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

CONFIG = {dsgd.BATCH_SIZE: 16}


def assert_weights(got, want, atol=1e-5):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol)


def halve_after_the_first_epoch(epoch, optimizer):
    """scheduled_reference's before_epoch for trainer_ops.step_decay."""
    optimizer.learning_rate = trainer_ops.halve_after_first(
        epoch, float(optimizer.learning_rate.numpy()))


@pytest.fixture(scope="module")
def per_epoch(tmp_path_factory):
    """A 2-worker Trainer with trainer_ops.step_decay (per epoch) shared by this
    module's tests, and a checkpoint of its initial state."""
    config = dict(CONFIG, make_scheduler=trainer_ops.step_decay)
    with dsgd.Trainer(ScheduledClassifier, num_workers=2, config=config) as trainer:
        yield trainer, trainer.save(str(tmp_path_factory.mktemp("initial") / "ckpt"))


def test_per_epoch_callable_is_exact_and_survives_save_load(per_epoch, tmp_path):
    """f(epoch, lr) at each epoch start, as keras.callbacks.LearningRateScheduler:
    three epochs; then the checkpoint saved after the second, loaded over the
    third's state, restores the rate and the scheduler's last count, and the
    third epoch trains again to the same weights."""
    trainer, initial = per_epoch
    trainer.load(initial)
    first = [trainer.train() for _ in range(2)]
    path = trainer.save(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match=r"update_scheduler\(\) is for scheduler_step_freq"):
        trainer.update_scheduler()
    third = trainer.train()
    weights = trainer.get_model().get_weights()
    trainer.load(path)
    assert trainer.epoch == 2 and trainer.learning_rates() == pytest.approx([0.05])
    again = trainer.train()
    want, rates = scheduled_reference(3, 16, before_epoch=halve_after_the_first_epoch)
    assert [r["lr"] for r in first + [third]] == pytest.approx(rates)
    assert rates == pytest.approx([0.1, 0.05, 0.025])
    assert again["lr"] == pytest.approx(0.025)
    assert_weights(weights, want)
    assert_weights(trainer.get_model().get_weights(), want)


def test_per_batch_schedule_matches_a_keras_optimizer_with_it():
    """A LearningRateSchedule stepped per batch reads the optimizer's applied
    steps, as a Keras optimizer built with that schedule does."""
    import keras

    config = dict(CONFIG, make_scheduler=trainer_ops.exponential_decay)
    with dsgd.Trainer(ScheduledClassifier, num_workers=2, config=config,
                      scheduler_step_freq="batch") as trainer:
        results = [trainer.train() for _ in range(2)]
        weights = trainer.get_model().get_weights()
        rates = trainer.learning_rates()
    schedule = trainer_ops.exponential_decay()

    def before_step(optimizer):  # what SGD(learning_rate=schedule) computes
        optimizer.learning_rate = float(schedule(optimizer.iterations))

    want, _ = scheduled_reference(2, 16, before_step=before_step)
    assert_weights(weights, want)
    # 4 steps an epoch: the last step of epoch e ran with 0.2 * 0.8 ** (4e + 3).
    assert [r["lr"] for r in results] == pytest.approx([0.2 * 0.8 ** 3, 0.2 * 0.8 ** 7])
    assert rates == pytest.approx([0.2 * 0.8 ** 7])  # not stepped again until the next step
    with keras.device("cpu"):
        assert float(schedule(7)) == pytest.approx(rates[0])


@pytest.mark.slow
def test_manual_steps_only_at_update_scheduler():
    config = dict(CONFIG, make_scheduler=trainer_ops.step_decay)
    with dsgd.Trainer(ScheduledClassifier, num_workers=2, config=config,
                      scheduler_step_freq="manual") as trainer:
        trainer.train()
        trainer.update_scheduler()  # count 1: halved
        trainer.update_scheduler()  # count 2: halved
        result = trainer.train()
        weights = trainer.get_model().get_weights()

    def before_epoch(epoch, optimizer):
        if epoch == 1:
            optimizer.learning_rate = 0.025

    want, rates = scheduled_reference(2, 16, before_epoch=before_epoch)
    assert result["lr"] == pytest.approx(0.025)
    assert_weights(weights, want)


def test_reduce_on_plateau_follows_keras_callback(tmp_path):
    """dsgd.ReduceLROnPlateau on val_loss against keras.callbacks.ReduceLROnPlateau
    fed the same single-process validation losses; its counters are saved."""
    import keras

    config = dict(CONFIG, make_scheduler=trainer_ops.plateau)
    seen = []
    with dsgd.Trainer(ScheduledClassifier, num_workers=2, config=config) as trainer:
        for _ in range(3):
            trainer.train()
            seen.append(trainer.validate()["val_loss"])
        rates = trainer.learning_rates()
        weights = trainer.get_model().get_weights()
        path = trainer.save(str(tmp_path / "ckpt"))
        trainer._plateaus[0].wait = 99  # overwritten by load
        trainer.load(path)
        assert trainer._plateaus[0].state_dict()["wait"] == 0

    model = trainer_ops.build_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    callback = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1,
                                                 min_delta=10.0, verbose=0)
    callback.set_model(model)
    keras_losses = []

    def after_epoch(epoch, optimizer, reference_model):
        value = trainer_ops.validation_loss(reference_model)
        keras_losses.append(value)
        model.optimizer.learning_rate = float(optimizer.learning_rate.numpy())
        callback.on_epoch_end(epoch, {"val_loss": value})
        optimizer.learning_rate = float(model.optimizer.learning_rate.numpy())

    want, _ = scheduled_reference(3, 16, after_epoch=after_epoch)
    np.testing.assert_allclose(seen, keras_losses, rtol=0, atol=1e-5)
    assert rates == pytest.approx([float(model.optimizer.learning_rate.numpy())])
    assert rates == pytest.approx([0.025])  # reduced after the 2nd and 3rd checks
    assert_weights(weights, want)


def test_scheduler_errors_name_the_argument():
    with pytest.raises(ValueError, match="scheduler_step_freq must be one of"):
        dsgd.Trainer(ScheduledClassifier, scheduler_step_freq="step")
    with pytest.raises(ValueError, match="factor must be in"):
        dsgd.ReduceLROnPlateau(factor=2.0)
    with pytest.raises(ValueError, match="num_workers must be 1"):
        dsgd.Trainer(ScheduledClassifier, num_workers=2, local=True)
    config = dict(CONFIG, make_scheduler=lambda: "not a scheduler")
    with pytest.raises(TypeError, match=r"schedulers\[0\] must be a keras"):
        dsgd.Trainer(ScheduledClassifier, num_workers=1, config=config, local=True)


def test_local_mode_trains_the_weights_of_worker_actors(per_epoch, tmp_path):
    """The operator in this process (eager steps, a debugger stops here) gives the
    weights, results, schedulers and checkpoints of worker actors (the module's
    2-worker Trainer, global batch 16 either way)."""
    import os

    config = dict(CONFIG, make_scheduler=trainer_ops.step_decay)
    with dsgd.Trainer(ScheduledClassifier, num_workers=1, config=config, local=True) as trainer:
        # the operator lives here: its process is this one
        assert trainer.sgd.for_model(lambda m: os.getpid()) == os.getpid()
        local = [trainer.train() for _ in range(2)]
        local_val = trainer.validate()
        local_weights = trainer.get_model().get_weights()
        path = trainer.save(str(tmp_path / "local"))
    trainer, initial = per_epoch
    trainer.load(initial)
    assert trainer.sgd.for_model(lambda m: os.getpid()) != os.getpid()
    remote = [trainer.train() for _ in range(2)]
    remote_val = trainer.validate()
    remote_weights = trainer.get_model().get_weights()
    trainer.load(path)  # a local checkpoint loads in worker actors
    assert_weights(trainer.get_model().get_weights(), local_weights, atol=0)
    assert_weights(local_weights, remote_weights, atol=1e-6)
    for a, b in zip(local, remote):
        assert a["lr"] == b["lr"] and a["num_samples"] == b["num_samples"] == 64
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-6)
    assert local_val["val_loss"] == pytest.approx(remote_val["val_loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["subclass", "from_creators"])
def test_the_seeds_first_example_in_keras(how):
    """The seed's MyTrainingOperator (LinearDataset, SGD, StepLR(step_size=5,
    gamma=0.9), scheduler_step_freq="epoch"), and its from_creators form."""
    operator = trainer_ops.SeedLinearOperator if how == "subclass" else \
        dsgd.TrainingOperator.from_creators(
            model_creator=trainer_ops.seed_model_creator,
            optimizer_creator=trainer_ops.seed_optimizer_creator,
            data_creator=trainer_ops.seed_data_creator, loss_creator=trainer_ops.seed_loss_creator,
            scheduler_creator=trainer_ops.seed_scheduler_creator)
    with dsgd.Trainer(operator, num_workers=2, scheduler_step_freq="epoch",
                      config={"lr": 0.01, dsgd.BATCH_SIZE: 64}) as trainer:
        results = [trainer.train() for _ in range(6)]
        validation = trainer.validate()
    # StepLR: 0.01 for epochs 0-4, 0.009 from epoch 5 on.
    assert [r["lr"] for r in results] == pytest.approx([0.01] * 5 + [0.009])
    assert results[-1]["train_loss"] < results[0]["train_loss"]
    assert validation["num_samples"] == 256 and validation["val_loss"] < results[0]["train_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("freq", ["epoch", "batch"])
def test_schedulers_survive_a_worker_replacement(freq, tmp_path):
    """A worker SIGKILLed mid-epoch: its replacement copies the learning rate, the
    optimizer's steps and the schedulers' last counts; the step is retried and the
    weights equal one process with the same schedule."""
    make = trainer_ops.step_decay if freq == "epoch" else trainer_ops.exponential_decay
    config = dict(CONFIG, make_scheduler=make, action="kill", marker=str(tmp_path / "once"))
    with dsgd.Trainer(trainer_ops.FlakyScheduled, num_workers=2, config=config,
                      scheduler_step_freq=freq) as trainer:
        results = [trainer.train() for _ in range(2)]
        failures = trainer.sgd.failures
        weights = trainer.get_model().get_weights()
    assert len(failures) == 1
    if freq == "epoch":
        def before_epoch(epoch, optimizer):
            optimizer.learning_rate = trainer_ops.halve_after_first(
                epoch, float(optimizer.learning_rate.numpy()))
        want, rates = scheduled_reference(2, 16, before_epoch=before_epoch)
    else:
        schedule = trainer_ops.exponential_decay()

        def before_step(optimizer):
            optimizer.learning_rate = float(schedule(optimizer.iterations))
        want, rates = scheduled_reference(2, 16, before_step=before_step)
    assert [r["lr"] for r in results] == pytest.approx(rates)
    assert_weights(weights, want)


@pytest.mark.slow
def test_manual_count_survives_save_and_load(tmp_path):
    config = dict(CONFIG, make_scheduler=trainer_ops.step_decay)
    with dsgd.Trainer(ScheduledClassifier, num_workers=1, config=config,
                      scheduler_step_freq="manual") as trainer:
        trainer.update_scheduler()
        trainer.update_scheduler()
        path = trainer.save(str(tmp_path / "ckpt"))
    with dsgd.Trainer(ScheduledClassifier, num_workers=1, config=config,
                      scheduler_step_freq="manual") as trainer:
        trainer.load(path)
        assert trainer.learning_rates() == pytest.approx([0.025])
        trainer.update_scheduler()  # the third call: count 3, halved again
        assert trainer.learning_rates() == pytest.approx([0.0125])
