"""The public API on a real local Ray cluster: names, accessors, checkpoints,
`KerasModel`, resources and errors.

Three instances serve the module: `sgd2x2` (a TinyModel, 2 workers x 2 devices),
`keras_1x2` (a KerasModel, 1 worker x 2 devices; it also restores a checkpoint
of `sgd2x2`: another worker count) and the stuck step's own 2 x 1."""

import logging
import time

import numpy as np
import pytest
import ray

import dsgd
import tiny
from helpers import actors_gone, assert_replicas_identical, dsgd_actor_names, replica_weights

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

TOL = 1e-5  # float32 round-off of a few steps (as tests/test_exact.py)
CPUS_PER_WORKER = 0.5  # sgd2x2's: its 2 workers, keras_1x2 and the stuck step's fit in 4 CPUs


class Breakable(tiny.TinyModel):
    """tiny's model with Adam (batch 4) whose get_loss raises while `broken`."""

    def __init__(self, worker_index, device_index):
        super().__init__(worker_index, device_index, 2, 4, "adam")
        self.broken = False

    def get_loss(self, batch):
        if self.broken:
            raise ArithmeticError("loss exploded on purpose")
        return super().get_loss(batch)


@pytest.fixture(scope="module")
def sgd2x2():
    with dsgd.DistributedSGD(Breakable, num_workers=2, devices_per_worker=2, gpu=False,
                             strategy="ps", grad_shard_bytes=128,
                             num_cpus_per_worker=CPUS_PER_WORKER) as sgd:
        yield sgd


def test_actor_names(sgd2x2):
    names = sorted(dsgd_actor_names(instance_id=sgd2x2.instance_id))
    assert [n.rsplit("-", 1)[0] for n in names] == [
        "dsgd-ps-0", "dsgd-ps-1", "dsgd-worker-0", "dsgd-worker-1"]


def test_ps_processes_do_not_load_tensorflow(sgd2x2):
    """A PS sums numpy arrays: its process must not import TensorFlow (~0.6 GB and
    ~5 s of start-up, so of every PS replacement). The workers' do (control)."""
    def maps(actor) -> str:
        pid = ray.get(actor.ping.remote(), timeout=60).pid
        with open(f"/proc/{pid}/maps") as f:
            return f.read()

    assert all("tensorflow" not in maps(ps) for ps in sgd2x2.ps_actors)
    assert all("tensorflow" in maps(w) for w in sgd2x2.workers)


def test_a_download_task_does_not_load_tensorflow():
    """dsgd.Dataset's download tasks run dsgd's code (dsgd/data/stream.py), so their
    processes import dsgd: they must not import TensorFlow with it (~5 s of CPU per
    process, for a task that reads files). A fresh process (its own runtime_env)."""
    from dsgd.data import stream

    task = ray.remote(stream._download_block).options(
        num_returns=2, runtime_env={"env_vars": {"DSGD_TEST_FRESH_PROCESS": "1"}})

    def tensorflow_loaded(item):
        import sys

        return np.array(["tensorflow" in sys.modules, "dsgd" in sys.modules])

    _, block = task.remote(tensorflow_loaded, [0], [0])
    assert ray.get(block, timeout=120).tolist() == [[False, True]]


def test_replicas_start_from_worker0_replica0(sgd2x2):
    # tiny.TinyModel seeds each replica differently; the broadcast must erase that.
    fresh = [tiny.make_keras_model(r).get_weights()[0] for r in range(4)]
    assert not np.array_equal(fresh[0], fresh[1])
    for w in replica_weights(sgd2x2):
        np.testing.assert_array_equal(w[0], fresh[0])


def test_foreach_and_for_model(sgd2x2):
    assert sgd2x2.foreach_model(lambda m: m.replica) == [0, 1, 2, 3]
    assert sgd2x2.for_model(lambda m: m.replica) == 0
    assert sgd2x2.foreach_worker(lambda w: w.worker_index) == [0, 1]


def test_workers_hold_num_cpus_per_worker(sgd2x2):
    assigned = sgd2x2.foreach_worker(lambda w: ray.get_runtime_context().get_assigned_resources())
    assert assigned == [{"CPU": CPUS_PER_WORKER}] * 2


def test_num_cpus_per_worker_beyond_the_cluster_fails_before_any_actor():
    before = dsgd_actor_names()
    with pytest.raises(dsgd.ResourceError, match=r"asked for 2 worker\(s\) x \(3 CPU, 0 GPU\) = "
                                                  r"6 CPU.* fits only 1 worker\(s\)"):
        dsgd.DistributedSGD(tiny.creator(1, 4), 2, 1, gpu=False, num_cpus_per_worker=3)
    assert dsgd_actor_names() == before


def test_step_return_values(sgd2x2):
    assert sgd2x2.step() is None
    stats = sgd2x2.step(fetch_stats=True)
    assert set(stats) == {"loss", "compute_s", "exchange_s", "apply_s", "step_s", "step", "skipped",
                          "skipped_steps", "num_workers", "failures"}
    assert stats["skipped"] is False and stats["failures"] == 0 and stats["num_workers"] == 2
    assert np.isfinite(stats["loss"])
    assert 0 <= stats["compute_s"] <= stats["step_s"] and 0 <= stats["apply_s"] <= stats["step_s"]
    assert stats["step"] == sgd2x2.steps_done


def test_set_weights_broadcasts(sgd2x2):
    new = [np.full_like(w, 0.5) for w in sgd2x2.get_weights()]
    sgd2x2.set_weights(new)
    for weights in replica_weights(sgd2x2):
        for a, b in zip(weights, new, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("change,message", [
    (lambda new: new[:3], r"set_weights: got 3 arrays for 4 variables"),
    (lambda new: new + new[-1:], r"set_weights: got 5 arrays for 4 variables"),
    # Arrays 0 and 1 are right: a replica that took them would differ from the others.
    (lambda new: new[:2] + [new[2].T] + new[3:],
     r"set_weights: array 2 has shape \(3, 7\) but variable 2 \(.*dense_1/kernel\) has shape "
     r"\(7, 3\)"),
    (lambda new: new[:3] + [new[3][:, None]],
     r"set_weights: array 3 has shape \(3, 1\) but variable 3 \(.*dense_1/bias\) has shape \(3,\)"),
], ids=["too-few", "too-many", "shape-of-the-third", "shape-of-the-last"])
def test_set_weights_of_a_wrong_count_or_shape_names_it_and_changes_nothing(sgd2x2, change,
                                                                           message):
    before, steps = assert_replicas_identical(sgd2x2), sgd2x2.steps_done
    with pytest.raises(ValueError, match=message):
        sgd2x2.set_weights(change([w + 1 for w in before]))
    for got, want in zip(assert_replicas_identical(sgd2x2), before, strict=True):
        np.testing.assert_array_equal(got, want)
    sgd2x2.step()  # and it trains on
    assert sgd2x2.steps_done == steps + 1
    assert_replicas_identical(sgd2x2)


class WideModel(tiny.TinyModel):
    def __init__(self, worker_index, device_index):
        import keras

        super().__init__(worker_index, device_index, 1, 4)
        self.model = keras.Sequential([keras.Input((tiny.IN,)), keras.layers.Dense(9),
                                       keras.layers.Dense(tiny.OUT)])


def test_mismatched_checkpoint_changes_nothing(sgd2x2, tmp_path):
    # A checkpoint of another model, written in-process by the code a worker runs.
    path = str(tmp_path / "wide")
    wide = WideModel(0, 0)
    wide.optimizer.build(wide.get_variables())
    from dsgd.engine import checkpoints
    from dsgd.worker import checkpoint_files

    checkpoints.write(path, checkpoint_files.save_files(wide, wide.optimizer.variables, 0),
                      {"step": 0})
    before = sgd2x2.get_weights()
    with pytest.raises(dsgd.ModelMismatchError, match=r"another model: its weights\[0\] is float32\(5, 9\)"):
        sgd2x2.restore_checkpoint(path)
    for a, b in zip(sgd2x2.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_get_loss_error_surfaces_with_its_traceback(sgd2x2):
    def retrace(broken: bool):
        sgd2x2.foreach_model(lambda m: setattr(m, "broken", broken))
        sgd2x2.foreach_worker(lambda w: w.replicas.retrace())

    before, steps = sgd2x2.get_weights(), sgd2x2.steps_done
    retrace(True)
    try:
        # Raised while tracing the step, so TensorFlow wraps it (StagingError);
        # the message keeps the user's exception, its frame and its line.
        with pytest.raises(Exception, match="ArithmeticError: loss exploded on purpose") as info:
            sgd2x2.step()
        assert "in get_loss" in str(info.value) and "test_api.py" in str(info.value)
    finally:
        retrace(False)
    assert sgd2x2.steps_done == steps
    for a, b in zip(sgd2x2.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


# -- KerasModel -------------------------------------------------------------------------------
ROWS, BATCH, L2 = 32, 8, 0.1  # 4 batches of 8 per replica: steps_per_epoch 4


def keras_data(replica: int):
    rng = np.random.default_rng(100 + replica)
    return (rng.normal(size=(ROWS, tiny.IN)).astype(np.float32),
            rng.normal(size=(ROWS, tiny.OUT)).astype(np.float32))


def unbuilt_model():
    """tiny's layers (Adam as tiny's "adam") with an L2 penalty on the first
    kernel, and no keras.Input: built by KerasModel from the dataset."""
    import keras

    init = lambda k: keras.initializers.GlorotUniform(seed=k)  # noqa: E731
    return keras.Sequential([
        keras.layers.Dense(tiny.HIDDEN, activation="tanh", kernel_initializer=init(0),
                           kernel_regularizer=keras.regularizers.L2(L2)),
        keras.layers.Dense(tiny.OUT, kernel_initializer=init(1)),
    ])


def keras_creator(worker_index, device_index):
    import tensorflow as tf

    model = unbuilt_model()
    assert not model.built
    data = tf.data.Dataset.from_tensor_slices(keras_data(2 * worker_index + device_index))
    return dsgd.KerasModel(model, "mse", tiny.make_optimizer("adam"), data.batch(BATCH))


def keras_reference(initial, steps: int, regularised: bool = True):
    """One model in-process on both replicas' batches of each step, concatenated.
    Returns (weights, the mean replica loss of each step)."""
    import keras
    import tensorflow as tf

    model = unbuilt_model()
    model.build((None, tiny.IN))
    model.set_weights(initial)
    optimizer, data, losses = tiny.make_optimizer("adam"), [keras_data(r) for r in (0, 1)], []
    for t in range(steps):
        rows = slice(t * BATCH, (t + 1) * BATCH)
        x, y = (np.concatenate([d[k][rows] for d in data]) for k in (0, 1))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x, training=True)))
            if regularised:
                loss = loss + L2 * tf.reduce_sum(tf.square(model.layers[0].kernel))
        losses.append(float(loss))  # equal batches: the mean of the replicas' losses
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights(), losses


@pytest.fixture(scope="module")
def keras_1x2():
    with dsgd.DistributedSGD(keras_creator, 1, 2, gpu=False) as sgd:
        yield sgd


def test_keras_model_builds_trains_an_epoch_with_its_regularisation(keras_1x2):
    """An unbuilt model is built from the dataset's element spec; train() without
    arguments runs one epoch (steps_per_epoch: the dataset's 4 batches); the
    loss includes the model's regularisation losses, exactly as one model on
    the concatenated batches."""
    sgd = keras_1x2
    assert sgd.foreach_model(lambda m: (m.model.built, m.steps_per_epoch())) == [(True, 4)] * 2
    initial = sgd.get_weights()
    assert [w.shape for w in initial] == [(tiny.IN, tiny.HIDDEN), (tiny.HIDDEN,),
                                          (tiny.HIDDEN, tiny.OUT), (tiny.OUT,)]
    summary = sgd.train()
    assert summary["steps"] == 4 and sgd.steps_done == 4
    final = assert_replicas_identical(sgd)
    want, losses = keras_reference(initial, 4)
    for got, w in zip(final, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=0, atol=TOL)
    assert summary["loss"] == pytest.approx(float(np.mean(losses)), abs=TOL)
    # Without the penalty the first kernel would differ: the comparison can tell.
    unregularised, _ = keras_reference(initial, 4, regularised=False)
    assert np.abs(unregularised[0] - final[0]).max() > 100 * TOL


def test_keras_model_arguments():
    import keras
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices(keras_data(0)).batch(BATCH)
    with pytest.raises(ValueError, match="without a dataset the model must be built"):
        dsgd.KerasModel(unbuilt_model(), "mse", "sgd")
    with pytest.raises(TypeError, match="`model` must be a keras.Model, got function"):
        dsgd.KerasModel(unbuilt_model, "mse", "sgd", data)
    with pytest.raises(TypeError, match=r"`dataset` must be a tf.data.Dataset or None, got tuple"):
        dsgd.KerasModel(unbuilt_model(), "mse", "sgd", keras_data(0))
    with pytest.raises(TypeError, match="`loss_fn` must be callable or a Keras loss name, got 3"):
        dsgd.KerasModel(unbuilt_model(), 3, "sgd", data)
    # An epoch of unknown length (a filter) or no dataset: no default epoch.
    assert dsgd.KerasModel(unbuilt_model(), "mse", "sgd", data.filter(
        lambda x, y: True)).steps_per_epoch() is None
    built = keras.Sequential([keras.Input((tiny.IN,)), keras.layers.Dense(1)])
    assert dsgd.KerasModel(built, "mse", "sgd").steps_per_epoch() is None


def optimizer_state(sgd):
    return sgd.foreach_model(lambda m: [np.array(v.numpy()) for v in m.optimizer.variables])


def test_checkpoint_round_trip_to_other_worker_count(sgd2x2, keras_1x2, tmp_path):
    """sgd2x2's checkpoint (2 workers) restored into keras_1x2 (1 worker; a
    KerasModel of the same layers and optimizer), then read by plain Keras."""
    sgd2x2.step()
    path = str(tmp_path / "ckpt")
    assert sgd2x2.save_checkpoint(path) == path
    saved_weights, saved_opt, saved_step = sgd2x2.get_weights(), optimizer_state(sgd2x2)[0], sgd2x2.steps_done
    assert int(saved_opt[0]) == saved_step  # Adam's iteration count
    sgd2x2.step()
    other = keras_1x2
    other.restore_checkpoint(path)
    assert other.steps_done == saved_step
    for weights in replica_weights(other):
        for a, b in zip(weights, saved_weights, strict=True):
            np.testing.assert_array_equal(a, b)
    for state in optimizer_state(other):
        for a, b in zip(state, saved_opt, strict=True):
            np.testing.assert_array_equal(a, b)
    # ... and a plain Keras model reads the weights with TensorFlow alone.
    import tensorflow as tf

    plain = tiny.make_keras_model(seed=123)
    tf.train.Checkpoint(weights=plain.weights).read(dsgd.engine.checkpoints.tf_prefix(path)).expect_partial()
    for a, b in zip(plain.get_weights(), saved_weights, strict=True):
        np.testing.assert_array_equal(a, b)
    # Shutting down kills the instance's actors (the module's last use of keras_1x2).
    other.shutdown()
    assert not actors_gone(other.instance_id)


# -- time-outs --------------------------------------------------------------------------------
def sleeping_creator(worker_index, device_index):
    time.sleep(300)


def test_start_timeout_names_the_workers_and_leaves_no_actor():
    before = dsgd_actor_names()
    start = time.monotonic()
    with pytest.raises(dsgd.StepTimeoutError, match=r"^starting \(setup: import TensorFlow, build "
                                                     r"replicas\): no answer after 5\.0 s from "
                                                     r"dsgd-worker-0-\w+\."):
        dsgd.DistributedSGD(sleeping_creator, 1, 1, gpu=False, start_timeout_s=5)
    # At the 5 s start_timeout_s, not after the creator's 300 s (generous: a busy machine).
    assert time.monotonic() - start < 60
    assert not actors_gone(before=before)


def test_stuck_step_times_out_naming_the_worker(caplog):
    class Slow(tiny.TinyModel):
        def get_batch(self):
            if self.replica == 1 and self.steps >= 1:
                time.sleep(60)
            return super().get_batch()

    caplog.set_level(logging.WARNING, logger="dsgd")
    with dsgd.DistributedSGD(lambda w, d: Slow(w, d, 1, 4), 2, 1, gpu=False,
                             step_timeout_s=8, stall_warning_s=1) as sgd:
        sgd.step()
        start = time.monotonic()
        with pytest.raises(dsgd.StepTimeoutError, match=r"step 2.*dsgd-worker-1-"):
            sgd.step()
        # At the 8 s timeout, not after the hung get_batch's 60 s (generous: a busy machine).
        # (8, not less: step 1 traces the compiled step, ~3 s with a second pytest beside it.)
        assert time.monotonic() - start < 30
    # The stall report came first, naming the worker, while the step was still waiting.
    stalls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall:")]
    assert not [m for m in stalls if "starting" in m]  # start-up reports only after 30 s
    step2 = [m for m in stalls if "step 2" in m]
    assert step2 and "step 2: dsgd-worker-1-" in step2[0]
    assert "has not reached the exchange after 1 s (1 of 2 waiting in it)" in step2[0]
    assert "worker-0" not in step2[0]
