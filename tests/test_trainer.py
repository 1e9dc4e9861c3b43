"""dsgd.Trainer and TrainingOperator on the local Ray cluster: results equal a
single-process Keras loop, per-worker results, save/load, get_model, TensorBoard,
mixed precision, several models, creators, Ray Tune. (Failures:
test_trainer_failures.py, without this module's long-lived workers, so that
replacements find room.)"""

import numpy as np
import pytest

import dsgd
import trainer_ops
from helpers import assert_replicas_identical
from trainer_ops import Classifier, Gan, TfDataClassifier, reference

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


def check_against_keras(trainer, results, val):
    """train() twice and validate() of a 2-worker Trainer with global batch 16,
    against Keras in one process."""
    model = trainer.get_model()
    losses, weights, val_loss, val_accuracy = reference(2, 16)
    assert [r["epoch"] for r in results] == [1, 2]
    assert all(r["num_samples"] == 64 and r["batch_count"] == 4 for r in results)
    np.testing.assert_allclose([r["train_loss"] for r in results], losses, rtol=0, atol=1e-5)
    assert val["num_samples"] == 30  # every validation example exactly once
    np.testing.assert_allclose(val["val_loss"], val_loss, rtol=0, atol=1e-5)
    assert val["val_accuracy"] == pytest.approx(val_accuracy, abs=1e-6)
    for got, want in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    vx, vy = trainer_ops.classification(30, 1)  # get_model()'s accuracy is the workers'
    assert np.mean(np.argmax(model(vx), axis=1) == vy) == pytest.approx(val["val_accuracy"])


def mark_process():
    import os

    os.environ["DSGD_TEST_HOOK"] = "ran before setup"


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One 2-worker Classifier Trainer (global batch 16, lr 0.1, TensorBoard, an
    initialization hook) for this module, and a checkpoint of its initial state."""
    logdir = tmp_path_factory.mktemp("tensorboard")
    with dsgd.Trainer(Classifier, num_workers=2, config={dsgd.BATCH_SIZE: 16},
                      logdir=str(logdir), initialization_hook=mark_process) as trainer:
        yield trainer, trainer.save(str(tmp_path_factory.mktemp("initial") / "ckpt"))


@pytest.fixture
def trainer(shared):
    return shared[0]


def test_results_equal_a_single_process_keras_loop(shared):
    """2 workers, global batch 16: train() twice, validate(), against Keras in one
    process (from the initial state: weights, optimizer and epoch restored)."""
    trainer, initial = shared
    trainer.load(initial)
    results = [trainer.train() for _ in range(2)]
    check_against_keras(trainer, results, trainer.validate())


@pytest.mark.slow  # as before: a second construction, for the tf.data shards
def test_results_equal_a_single_process_keras_loop_with_tf_data():
    with dsgd.Trainer(TfDataClassifier, num_workers=2, config={dsgd.BATCH_SIZE: 16}) as trainer:
        results = [trainer.train() for _ in range(2)]
        check_against_keras(trainer, results, trainer.validate())


def test_initialization_hook_ran_in_every_worker(trainer):
    import os

    assert trainer.sgd.foreach_worker(lambda w: os.environ.get("DSGD_TEST_HOOK")) == \
        ["ran before setup"] * 2
    assert os.environ.get("DSGD_TEST_HOOK") is None  # not in the driver


def test_per_worker_results_and_profile(trainer):
    per_worker = trainer.train(reduce_results=False, profile=True)
    assert len(per_worker) == 2 and [r["num_samples"] for r in per_worker] == [32, 32]
    for r in per_worker:
        assert r["batch_count"] == 4 and r["epoch"] == trainer.epoch
        assert r["mean_step_s"] > 0 and r["mean_compute_s"] > 0 and "mean_exchange_s" in r
    reduced = trainer.train()
    assert reduced["train_loss"] < np.mean([r["train_loss"] for r in per_worker])
    val = trainer.validate(reduce_results=False)
    assert sum(r["num_samples"] for r in val) == 30


def test_save_then_load_in_a_new_trainer_validates_identically(trainer, tmp_path):
    trainer.train()
    path = trainer.save(str(tmp_path / "ckpt"))
    before = trainer.validate()
    with dsgd.Trainer(Classifier, num_workers=2, config={dsgd.BATCH_SIZE: 16}) as other:
        other.load(path)
        assert other.epoch == trainer.epoch
        assert other.validate() == before
        assert other.sgd.for_model(lambda m: m.operator.loaded) == trainer_ops.Classifier.state_dict(
            trainer.sgd.for_model(lambda m: m.operator))


def test_tensorboard_scalars_are_read_back(trainer):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = trainer.train()
    val = trainer.validate()
    events = EventAccumulator(trainer.logdir)
    events.Reload()
    tags = set(events.Tags()["tensors"])
    assert {"train_loss", "samples_per_s", "val_loss", "val_accuracy"} <= tags
    import tensorflow as tf

    def last(tag):
        event = events.Tensors(tag)[-1]
        return event.step, float(tf.make_ndarray(event.tensor_proto))

    assert last("train_loss") == (trainer.epoch, pytest.approx(train["train_loss"], rel=1e-6))
    assert last("val_accuracy") == (trainer.epoch, pytest.approx(val["val_accuracy"], rel=1e-6))


# mixed_bfloat16 (~6 s) is `slow`: the same Keras mixed-precision path as mixed_float16.
@pytest.mark.parametrize("use_fp16", [True, pytest.param("bfloat16", marks=pytest.mark.slow)],
                         ids=["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_trains_and_keeps_replicas_identical(use_fp16):
    config = {dsgd.BATCH_SIZE: 32, "lr": 0.5, "train_n": 512}
    with dsgd.Trainer(Classifier, num_workers=1, devices_per_worker=2, use_fp16=use_fp16,
                      config=config) as trainer:
        for _ in range(4):
            trainer.train()
        val = trainer.validate()
        dtypes = trainer.sgd.for_model(
            lambda m: (m.operator.model.layers[0].compute_dtype,
                       [str(v.dtype) for v in m.get_variables()]))
        assert_replicas_identical(trainer)
    assert dtypes[0] == ("float16" if use_fp16 is True else "bfloat16")  # compute dtype
    assert set(dtypes[1]) == {"float32"}
    assert val["val_accuracy"] > 0.75


def test_two_models_two_optimizers():
    """The tiny GAN on 2 workers: one epoch equals one process that averages the
    two replicas' losses, differentiates loss_d for the discriminator and
    loss_g for the generator, and applies each with its own Adam."""
    with dsgd.Trainer(Gan, num_workers=2) as trainer:
        initial = [m.get_weights() for m in trainer.get_model()]
        result = trainer.train()
        after = [m.get_weights() for m in trainer.get_model()]
        assert_replicas_identical(trainer)
    want_d, want_g, losses_d, losses_g = trainer_ops.gan_reference(initial, 1, 2)
    assert result["num_samples"] == 64 and result["batch_count"] == 4
    assert result["loss_d"] == pytest.approx(losses_d[0], abs=1e-5)
    assert result["loss_g"] == pytest.approx(losses_g[0], abs=1e-5)
    assert result["train_loss"] == pytest.approx(losses_d[0] + losses_g[0], abs=2e-5)
    for got, want in zip(after, (want_d, want_g), strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    for old, new in zip(initial, after, strict=True):  # both models moved (Adam: by ~lr)
        assert all(np.abs(x - y).max() > 1e-3 for x, y in zip(old, new, strict=True))


def creators_model(config):
    import keras

    return keras.Sequential([trainer_ops.build_model(), keras.layers.Softmax()])


def creators_reference(epochs: int, global_batch: int, lr: float):
    """One process: the creators' model, the loss by name, SGD, batches in order."""
    import keras
    import tensorflow as tf

    model, loss_fn = creators_model({}), keras.losses.get("sparse_categorical_crossentropy")
    optimizer = keras.optimizers.SGD(lr)
    x, y = trainer_ops.classification(64, 0)
    losses = []
    for _ in range(epochs):
        for start in range(0, 64, global_batch):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(y[start:start + global_batch],
                                              model(x[start:start + global_batch], training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
    return model.get_weights(), float(np.mean(losses))


def test_from_creators():
    """The seed's creator functions (a loss given by name) make the operator;
    local=True (one worker, in this process: the same driver path) trains it
    as one process does."""
    def optimizer_creator(model, config):
        import keras

        return keras.optimizers.SGD(config["lr"])

    def data_creator(config):
        x, y = trainer_ops.classification(64, 0)
        return dsgd.Dataset(list(zip(x, y))), None

    operator = dsgd.TrainingOperator.from_creators(
        creators_model, optimizer_creator, data_creator,
        loss_creator=lambda c: "sparse_categorical_crossentropy")
    with dsgd.Trainer(operator, num_workers=1, local=True,
                      config={"lr": 0.1, dsgd.BATCH_SIZE: 16}) as trainer:
        result = trainer.train()
        weights = trainer.get_model().get_weights()
    want, loss = creators_reference(1, 16, 0.1)
    assert result["num_samples"] == 64 and result["batch_count"] == 4
    assert result["train_loss"] == pytest.approx(loss, abs=1e-5)
    for got, w in zip(weights, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-5)


def test_bad_arguments_fail_before_any_worker():
    with pytest.raises(ValueError, match=r"BATCH_SIZE\]=10 \(the global batch\) does not divide "
                                         r"among 2 worker\(s\) x 2 device\(s\) = 4 replicas"):
        dsgd.Trainer(Classifier, num_workers=2, devices_per_worker=2, config={dsgd.BATCH_SIZE: 10})
    with pytest.raises(TypeError, match="training_operator_cls must be a dsgd.TrainingOperator"):
        dsgd.Trainer(object)
    with pytest.raises(ValueError, match="use_fp16 must be one of"):
        dsgd.Trainer(Classifier, use_fp16="int8")


def test_a_trials_gpus_follow_the_engines_rule(monkeypatch):
    """use_gpu=None asks Tune for GPUs only when the cluster's could hold every
    worker (each worker's devices_per_worker GPUs on one node), as gpu=None does
    for the engine; a cluster with some GPUs but too few gets a CPU-only trial
    (3e8670b asked for GPUs whenever the cluster had any: such a trial is never
    placed)."""
    import ray

    from dsgd.engine.resources import workers_on_gpus

    assert workers_on_gpus([1, 1], 2) == 0 and workers_on_gpus([4, 1], 2) == 2
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    for gpus_per_node, want in (([1], False), ([1, 1], True), ([0], False)):
        monkeypatch.setattr(ray, "nodes", lambda g=gpus_per_node: [
            {"Alive": True, "Resources": {"CPU": 4, "GPU": n}} for n in g])
        trainable = dsgd.Trainer.as_trainable(Classifier, num_workers=2)
        bundles = trainable.default_resource_request({}).bundles
        assert [("GPU" in b) for b in bundles[1:]] == [want, want], (gpus_per_node, bundles)


# ~11 s: `slow` (keeps the default run under 8 minutes); Tune's own integration is
# exercised by the tune_mnist example in the slow run as well.
@pytest.mark.slow
def test_ray_tune_runs_two_trials(tmp_path):
    from ray import tune

    trainable = dsgd.Trainer.as_trainable(Classifier, num_workers=1,
                                          config={dsgd.BATCH_SIZE: 16})
    tuner = tune.Tuner(trainable, param_space={"lr": tune.grid_search([0.0, 0.5])},
                       run_config=tune.RunConfig(stop={"training_iteration": 2},
                                                 storage_path=str(tmp_path), verbose=0))
    results = tuner.fit()
    assert len(results) == 2 and not results.errors
    by_lr = {result.config["lr"]: result for result in results}
    for result in results:
        assert result.metrics["training_iteration"] == 2 and result.metrics["epoch"] == 2
        assert result.metrics["num_samples"] == 30
        correct = result.metrics["val_accuracy"] * 30  # an accuracy over 30 examples
        assert abs(correct - round(correct)) < 1e-4, result.metrics["val_accuracy"]
    # lr 0 learns nothing: both iterations validate the initial model identically;
    # lr 0.5 learns, and Tune picks it.
    frozen = by_lr[0.0].metrics_dataframe["val_loss"].tolist()
    assert len(frozen) == 2 and frozen[0] == frozen[1]
    assert by_lr[0.5].metrics["val_loss"] < 0.9 * frozen[-1]
    assert results.get_best_result(metric="val_loss", mode="min").config["lr"] == 0.5
