"""Bad input gets a named error, nothing changes, nothing hangs (issue 23, item 3).

Each case raises an error that names the argument, what is wrong and what is
accepted. One raised at run time leaves the object usable (the next call works)
and its weights as they were. Checks that need no worker run in-process; the
rest share one DistributedSGD (2 workers x 2 devices). Elsewhere: bad
constructor arguments and replicas sharing a model (test_errors.py), empty or
non-iterable data and Dataset arguments (test_data_unit.py), download and
transform errors (test_data.py), missing, truncated and corrupt checkpoints
(test_checkpoint.py).
"""

import threading

import numpy as np
import pytest
import ray

import dsgd
import tiny
import trainer_ops
from helpers import actors_gone, dsgd_actor_names
from counting import N, one_hot
from dsgd.data.feeds import finish
from dsgd.engine import checkpoints
from dsgd.engine.launch import check_signatures
from dsgd.trainer.replica import OperatorReplica
from dsgd.worker import checkpoint_files
from dsgd.worker.replicas import Replicas

LOCK = threading.Lock()  # what no pickle can carry


class Switch(dsgd.Model):
    """counting.Counter's loss (sum over rows of v . x, v of N zeros, SGD lr 1) on
    its own one-hot rows or a dataset's batches. `mode`, read when the step is
    traced, makes get_loss return something wrong. `size`, `dtype`, `extra`
    (a second variable) and `optimizer` make another model."""

    def __init__(self, worker_index=0, device_index=0, size=N, dtype="float32", extra=False,
                 optimizer="sgd"):
        import keras
        import tensorflow as tf

        self.worker_index, self.device_index = worker_index, device_index
        self.v = tf.Variable(tf.zeros([size], dtype))
        self.variables = [self.v] + ([tf.Variable(tf.zeros([2]))] if extra else [])
        self.optimizer = keras.optimizers.get(optimizer)
        self.mode, self.calls = "ok", 0

    def get_variables(self):
        return self.variables

    def get_optimizer(self):
        return self.optimizer

    def get_batch(self):
        self.calls += 1
        return one_hot(self.calls % N)[None]

    def get_loss(self, batch):
        import tensorflow as tf

        x = batch["x"] if isinstance(batch, dict) else batch
        per_row = tf.reduce_sum(tf.cast(x, tf.float32) * self.v, axis=-1)
        loss = tf.reduce_sum(per_row)
        if self.mode == "vector":
            return per_row
        if self.mode == "no loss":
            return {"total": loss}
        if self.mode == "metric names":
            return {"loss": loss, **({"extra": loss} if self.device_index == 1 else {})}
        if self.mode == "worker metric names":
            return {"loss": loss, **({"extra": loss} if self.worker_index == 1 else {})}
        return loss


def in_process(creator, devices=1, worker_index=0) -> Replicas:
    replicas = Replicas(creator, worker_index, devices, False, "simple")
    replicas.info = replicas.setup()
    return replicas


def assert_unchanged(sgd, weights, steps):
    assert sgd.steps_done == steps
    for replica in sgd.foreach_model(lambda m: m.get_weights()):
        for got, want in zip(replica, weights, strict=True):
            np.testing.assert_array_equal(got, want)


# -- no worker needed --------------------------------------------------------------------
@pytest.mark.parametrize("batch,transform,message", [
    (np.array(list("abcd")), None, r"rows 0\.\.3 of the data: it has dtype <U1 \(e\.g\. 'a'\), "
                                   r"not numbers: batches must hold bool/int/uint/float/complex"),
    ((np.zeros((4, 2)), np.array([object()] * 4)), None,
     r"rows 0\.\.3 of the data: its entry at position \[1\] has dtype object"),
    (np.zeros((4, 2)), lambda b: b[:3],
     r"transform changed the number of rows of rows 0\.\.3 of the data from 4 to 3: it must "
     r"return one row per row"),
    (np.zeros((4, 2)), lambda b: None,
     r"rows 0\.\.3 of the data after transform: it is a NoneType \(e\.g\. None\), not an array"),
    ({"x": np.zeros(4)}, lambda b: {**b, "y": "label"},
     r"after transform: its entry at position \['y'\] is a str"),
    (np.zeros((4, 2)), lambda b: np.float32(b.sum()),
     r"after transform: it is a scalar \(e\.g\. np\.float32\(0\.0\)\), not an array"),
], ids=["strings", "objects", "transform-rows", "transform-none", "transform-str",
        "transform-scalar"])
def test_a_batch_that_is_not_numeric_arrays_is_named_before_tensorflow(batch, transform, message):
    with pytest.raises(dsgd.DsgdError, match=message):
        finish(batch, transform, 2, "rows 0..3 of the data")


@pytest.mark.parametrize("data", [range(6), (i for i in range(6))], ids=["sequence", "generator"])
def test_python_data_shorter_than_one_step_is_an_error_not_repeated_rows(data):
    feed = dsgd.Dataset(data, batch_size=4)._feed(2)
    with pytest.raises(ValueError, match=r"\(6 items, .*\) has 6 item\(s\), fewer than one step "
                                         r"takes \(2 worker\(s\) x batch_size=4 = 8 rows\): the "
                                         r"step would repeat rows"):
        feed.step_args(2, 0, 10.0)


def test_functions_that_cannot_be_pickled_are_named_before_any_actor():
    def creator(w, d):
        return LOCK

    with pytest.raises(TypeError, match=r"model_creator cannot be pickled \(model_creator's "
                                        r"global 'LOCK' cannot be\): TypeError: cannot pickle "
                                        r"'_thread.lock'.*sends it to every worker"):
        dsgd.DistributedSGD(creator, 1, 1, gpu=False)
    with pytest.raises(TypeError, match=r"worker_init cannot be pickled \(worker_init's closure "
                                        r"variable 'lock'"):
        lock = threading.Lock()
        dsgd.DistributedSGD(tiny.creator(1, 4), 1, 1, gpu=False, worker_init=lambda: lock)
    with pytest.raises(TypeError, match=r"initialization_hook cannot be pickled "
                                        r"\(initialization_hook's global 'LOCK'"):
        dsgd.Trainer(trainer_ops.Classifier, initialization_hook=lambda: LOCK)
    with pytest.raises(TypeError, match=r"download_func cannot be pickled .*download tasks"):
        dsgd.Dataset(range(4), download_func=lambda i: LOCK)
    with pytest.raises(TypeError, match=r"transform cannot be pickled .*every worker"):
        dsgd.Dataset(range(4), transform=lambda b: LOCK)


@pytest.mark.parametrize("other,message", [
    (dict(size=N + 1), r"worker 1's replicas have 1 variables, worker 0's have 1; first "
                       r"difference at variable 0: .* float32\(49,\) vs .* float32\(48,\)"),
    (dict(dtype="float64"), r".*variable 0: .* float64\(48,\) vs .* float32\(48,\)"),
    (dict(extra=True), r"worker 1's replicas have 2 variables, worker 0's have 1; first "
                       r"difference at variable 1: .*\(2,\) vs \(missing\)"),
    (dict(optimizer="adam"), r"worker 1's replicas have optimizer\(s\) \['Adam'\], worker "
                             r"0's have \['SGD'\]"),
], ids=["shape", "dtype", "count", "optimizer"])
def test_workers_whose_models_disagree(other, message):
    infos = [in_process(Switch).info, in_process(lambda w, d: Switch(w, d, **other), 1, 1).info]
    with pytest.raises(dsgd.ModelMismatchError, match="model_creator disagrees across workers: "
                                                      + message):
        check_signatures(infos)


def test_workers_that_group_variables_differently():
    a = in_process(lambda w, d: tiny.TwoOptimizerModel(w, d, 1, 4)).info
    b = dict(a, groups=list(reversed(a["groups"])))
    with pytest.raises(dsgd.ModelMismatchError, match=r"worker 1's replicas have optimizer "
                                                      r"variable groups .* \[\[2, 3\], \[0, 1\]\]"):
        check_signatures([a, b])


class Disagreeing(tiny.TwoOptimizerModel):
    """Two optimizers, each with its group; replica 1 differs from replica 0 by
    `how`: "swap" (its groups and optimizers in the other order), "share"
    (replica 0's optimizers) or "type" (Adam for the first group)."""

    made: list = []

    def __init__(self, worker_index, device_index, how):
        super().__init__(worker_index, device_index, 2, 4)
        self.swap = device_index == 1 and how == "swap"
        if self.swap:
            self.optimizers.reverse()
        if device_index == 1 and how == "share":
            self.optimizers = Disagreeing.made[0].optimizers
        if device_index == 1 and how == "type":
            self.optimizers[0] = tiny.make_optimizer("adam")
        Disagreeing.made.append(self)

    def get_variable_groups(self):
        groups = super().get_variable_groups()
        return groups[::-1] if self.swap else groups


@pytest.mark.parametrize("how,message", [
    ("swap", r"replica 1 groups its variables among optimizers differently from replica 0: "
             r"\[\[2, 3\], \[0, 1\]\] vs \[\[0, 1\], \[2, 3\]\]"),
    ("share", r"replica 1 shares its optimizer with another replica"),
    ("type", r"replica 1 has optimizer\(s\) \['Adam', 'Adam'\] but replica 0 has "
             r"\['SGD', 'Adam'\]"),
], ids=["groups", "shared-optimizer", "optimizer-type"])
def test_replicas_of_one_worker_that_disagree(how, message):
    Disagreeing.made.clear()
    with pytest.raises(dsgd.ModelMismatchError, match="worker 0: " + message):
        in_process(lambda w, d: Disagreeing(w, d, how), 2)


@pytest.mark.parametrize("other,message", [
    (dict(size=N + 1), r"its weights\[0\] is float32\(49,\), this model's variable .* is "
                       r"float32\(48,\)"),
    (dict(dtype="float64"), r"its weights\[0\] is float64\(48,\), this model's variable .* is "
                            r"float32\(48,\)"),
    (dict(extra=True), r"it holds 2 model state variables \(weights\), this model has 1"),
    (dict(optimizer="adam"), r"it holds 4 optimizer variables \(optimizer_variables\), this "
                             r"model has 2"),
], ids=["shape", "dtype", "count", "optimizer"])
def test_a_checkpoint_of_another_model_changes_nothing(other, message):
    source = in_process(lambda w, d: Switch(w, d, **other))
    files = checkpoint_files.save_files(source.replicas[0], source.optimizer_variables(0), 3)
    target = in_process(Switch, 2)
    for replica in target.replicas:
        replica.v.assign(np.arange(N, dtype=np.float32))
    with pytest.raises(dsgd.ModelMismatchError, match="the checkpoint is of another model: "
                                                      + message):
        checkpoint_files.restore_files(target.replicas, [target.optimizer_variables(i)
                                                         for i in range(2)], files)
    for replica in target.replicas:
        np.testing.assert_array_equal(replica.v.numpy(), np.arange(N))
        assert int(replica.optimizer.iterations.numpy()) == 0


# -- TrainingOperator misuse ---------------------------------------------------------------
def operator(cls=dsgd.TrainingOperator):
    return cls({}, 0, 1, "/device:CPU:0")


def test_register_twice_or_with_wrong_types():
    import keras

    op = operator()
    with pytest.raises(AttributeError, match=r"self\.model is set by self\.register\(models=\.\.\., "
                                             r"optimizers=\.\.\.\): call register in setup"):
        op.model
    with pytest.raises(AttributeError, match=r"self\.optimizer is set by self\.register"):
        op.optimizer
    model, sgd = trainer_ops.build_model(), keras.optimizers.SGD(0.1)
    for kwargs, error, message in [
        (dict(models="model", optimizers=sgd), TypeError,
         r"register: models\[0\] must be a keras\.Model, got str"),
        (dict(models=model, optimizers=[sgd, "adam"]), TypeError,
         r"register: optimizers\[1\] must be a Keras optimizer, got str"),
        (dict(models=(model, model), optimizers=(sgd, sgd, sgd)), ValueError,
         r"register: 3 optimizers for 2 models"),
        (dict(models=[], optimizers=sgd), ValueError,
         r"register: models and optimizers must each hold at least one"),
        (dict(models=model, optimizers=sgd, loss=5), TypeError,
         r"register: loss must be a Keras loss, a name or a callable, got 5"),
        (dict(models=model, optimizers=sgd, metrics=["accuracy"]), TypeError,
         r"register: metrics must be keras\.metrics\.Metric objects, got str"),
        (dict(models=keras.Sequential([keras.layers.Dense(2)]), optimizers=sgd), ValueError,
         r"register: models\[0\] \(.*\) is not built"),
    ]:
        with pytest.raises(error, match=message):
            op.register(**kwargs)
        assert op.models == [] and op.optimizers == []  # a failed register keeps nothing
    assert op.register(models=model, optimizers=sgd) == (model, sgd)
    with pytest.raises(RuntimeError, match=r"TrainingOperator\.register was called twice: call "
                                           r"it once in setup"):
        op.register(models=model, optimizers=sgd)
    assert op.model is model and op.optimizer is sgd


class NeverRegisters(dsgd.TrainingOperator):
    def setup(self, config):
        self.register_data(train_data=dsgd.Dataset(range(4)))


class RegistersTwice(trainer_ops.Classifier):
    def setup(self, config):
        super().setup(config)
        self.register(models=self.model, optimizers=self.optimizer)


@pytest.mark.parametrize("cls,error,message", [
    (NeverRegisters, ValueError, r"NeverRegisters\.setup must call self\.register\(models=\.\.\., "
                                 r"optimizers=\.\.\.\)"),
    (dsgd.TrainingOperator, NotImplementedError, r"TrainingOperator subclasses must implement "
                                                 r"setup\(config\)"),
    (RegistersTwice, RuntimeError, r"RegistersTwice\.register was called twice"),
])
def test_a_setup_that_does_not_register_once(cls, error, message):
    with pytest.raises(error, match=message):
        OperatorReplica(cls, {}, 0, 1, "/device:CPU:0", False)


def test_from_creators_with_a_non_callable():
    def f(*args):
        return None

    for kwargs, message in [
        (dict(model_creator=None, optimizer_creator=f, data_creator=f),
         r"from_creators: model_creator must be callable, got NoneType"),
        (dict(model_creator=f, optimizer_creator="sgd", data_creator=f),
         r"from_creators: optimizer_creator must be callable, got str"),
        (dict(model_creator=f, optimizer_creator=f, data_creator=[1]),
         r"from_creators: data_creator must be callable, got list"),
        (dict(model_creator=f, optimizer_creator=f, data_creator=f, loss_creator="mse"),
         r"from_creators: loss_creator must be callable or None, got str"),
        (dict(model_creator=f, optimizer_creator=f, data_creator=f, metrics_creator=3),
         r"from_creators: metrics_creator must be callable or None, got int"),
    ]:
        with pytest.raises(TypeError, match=message):
            dsgd.TrainingOperator.from_creators(**kwargs)


# -- on the cluster ------------------------------------------------------------------------
def x_column(batch):
    return {"x": np.eye(N, dtype=np.float32)[batch["id"] % N]}


# Each dataset is bad in one way; raised by train() at the first batch that needs it.
BAD_DATASETS = {
    "strings": (lambda: dsgd.Dataset(list("abcdefgh") * 6, batch_size=4), dsgd.DsgdError,
                r"the batch of rows (0\.\.3|4\.\.7) of the data: it has dtype <U1 \(e\.g\. '[a-h]'\), "
                r"not numbers"),
    "objects": (lambda: dsgd.Dataset([(one_hot(i), object()) for i in range(N)], batch_size=4),
                dsgd.DsgdError, r"its entry at position \[1\] has dtype object"),
    "ragged-lists": (lambda: dsgd.Dataset([[1.0, 2.0], [3.0]] * 24, batch_size=4), ValueError,
                     r"item 1 \(\[3\.0\]\) has structure .* but item 0 \(\[1\.0, 2\.0\]\) has "
                     r".*: every example must have the same one"),
    "transform-rows": (lambda: dsgd.Dataset(range(N), download_func=one_hot, batch_size=4,
                                            transform=lambda b: b[:2]), dsgd.DsgdError,
                       r"transform changed the number of rows of rows (0\.\.3|4\.\.7) of the "
                       r"data from 4 to 2"),
    "transform-list": (lambda: dsgd.Dataset(range(N), download_func=one_hot, batch_size=4,
                                            transform=lambda b: b.tolist()), dsgd.DsgdError,
                       r"after transform: its entry at position \[0, 0\] is a float"),
    "shorter-than-a-step": (lambda: dsgd.Dataset(range(6), download_func=one_hot, batch_size=4),
                            ValueError, r"has 6 item\(s\), fewer than one step takes"),
    "download-shapes-in-a-block": (
        lambda: dsgd.Dataset(range(N), batch_size=4,
                             download_func=lambda i: np.zeros(N + (i == 2), np.float32)),
        ValueError, r"examples item 0 \(0\)\.\.item 3 \(3\) cannot be stacked at position \[\]: "
                    r"shapes \[\(48,\), \(49,\)\]"),
    "download-shapes-across-blocks": (
        lambda: dsgd.Dataset(range(N), batch_size=4,
                             download_func=lambda i: np.zeros(N + (i >= 4), np.float32)),
        ValueError, r"download_func returned examples of different shapes: items 4\.\.7 have "
                    r"arrays of shape \(49,\) per example, items 0\.\.3 \(48,\)"),
    "empty-ray-data": (lambda: dsgd.Dataset(ray.data.range(0).map_batches(x_column), batch_size=4),
                       ValueError, r"has fewer rows than one step needs \(2 worker\(s\) x "
                                   r"batch_size=4\)"),
    "ray-data-shorter-than-a-step": (
        lambda: dsgd.Dataset(ray.data.range(6).map_batches(x_column), batch_size=4),
        ValueError, r"has fewer rows than one step needs"),
}


@pytest.fixture(scope="class")
def sgd(ray_local):
    """TestOnCluster's instance: 2 workers x 2 devices of Switch."""
    with dsgd.DistributedSGD(Switch, 2, 2, gpu=False, step_timeout_s=60) as sgd:
        yield sgd


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
class TestOnCluster:
    @pytest.fixture
    def state(self, sgd):
        """Non-zero weights and the step count; the replicas back to "ok"."""
        set_mode(sgd, "ok")
        sgd.set_weights([np.linspace(-1, 1, N, dtype=np.float32)])
        return sgd.get_weights(), sgd.steps_done

    @pytest.mark.parametrize("mode,message", [
        ("vector", r"get_loss must return scalars, but the loss has shape \(\w*,?\): reduce it"),
        ("no loss", r"get_loss returned a dict without 'loss': keys \['total'\]"),
        ("metric names", r"get_loss must return the same metric names on every replica: worker "
                         r"\d's replica 1 returns \['extra'\], its replica 0 \[\]"),
        ("worker metric names", r"get_loss must return the same metric names on every replica: "
                                r"worker 0 returns \[\]; worker 1 returns \['extra'\]\. No weights"),
    ], ids=["non-scalar", "no-loss", "metric-names", "metric-names-across-workers"])
    def test_a_bad_get_loss_changes_nothing(self, sgd, state, mode, message):
        set_mode(sgd, mode)
        with pytest.raises(ValueError, match=message):
            sgd.step()
        assert_unchanged(sgd, *state)
        set_mode(sgd, "ok")
        sgd.step()
        assert sgd.steps_done == state[1] + 1

    @pytest.mark.parametrize("case", list(BAD_DATASETS))
    def test_bad_data_changes_nothing(self, sgd, state, case):
        make, error, message = BAD_DATASETS[case]
        with pytest.raises(error, match=message):
            sgd.train(dataset=make())
        assert_unchanged(sgd, *state)
        good = dsgd.Dataset(range(N), download_func=one_hot, batch_size=4)
        assert sgd.train(dataset=good, num_steps=1)["steps"] == 1

    def test_a_checkpoint_of_another_model_changes_nothing(self, sgd, state, tmp_path):
        other = in_process(lambda w, d: Switch(w, d, size=N + 1))
        path = checkpoints.write(str(tmp_path / "other"), checkpoint_files.save_files(
            other.replicas[0], other.optimizer_variables(0), 7), {"step": 7})
        with pytest.raises(dsgd.ModelMismatchError, match=r"the checkpoint is of another model: "
                                                          r"its weights\[0\] is float32\(49,\)"):
            sgd.restore_checkpoint(path)
        assert_unchanged(sgd, *state)
        sgd.step()

    def test_trainer_load_of_a_missing_or_foreign_checkpoint(self, sgd, tmp_path):
        foreign = sgd.save_checkpoint(str(tmp_path / "switch"))
        with dsgd.Trainer(trainer_ops.Classifier, config={dsgd.BATCH_SIZE: 16}) as trainer:
            trainer.train()
            weights = trainer.get_model().get_weights()
            with pytest.raises(FileNotFoundError, match=r"no checkpoint at '.*nothing'"):
                trainer.load(str(tmp_path / "nothing"))
            with pytest.raises(dsgd.ModelMismatchError, match=r"the checkpoint is of another "
                                                              r"model: it holds 1 model state"):
                trainer.load(foreign)
            assert trainer.epoch == 1
            for got, want in zip(trainer.get_model().get_weights(), weights, strict=True):
                np.testing.assert_array_equal(got, want)
            assert trainer.train()["epoch"] == 2

    def test_workers_whose_models_disagree_stop_the_constructor(self):
        before = dsgd_actor_names()
        with pytest.raises(dsgd.ModelMismatchError, match=r"model_creator disagrees across "
                                                          r"workers: worker 1's replicas have 1 "
                                                          r"variables, worker 0's have 1"):
            dsgd.DistributedSGD(lambda w, d: Switch(w, d, size=N + w), 2, 1, gpu=False)
        assert not actors_gone(before=before)  # killed actors leave the name list


def set_mode(sgd, mode: str) -> None:
    sgd.foreach_model(lambda m: setattr(m, "mode", mode))
    sgd.foreach_worker(lambda w: w.replicas.retrace())
