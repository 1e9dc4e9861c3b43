"""The public API on a real local Ray cluster: names, accessors, checkpoints, errors."""

import logging
import time

import numpy as np
import pytest
import ray

import dsgd
import tiny

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


def dsgd_actor_names():
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("dsgd-"))


def wait_until(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def sgd2x2(ray_local):
    sgd = dsgd.DistributedSGD(tiny.creator(2, 4, "adam"), num_workers=2, devices_per_worker=2,
                              gpu=False, strategy="ps", grad_shard_bytes=128)
    yield sgd
    sgd.shutdown()


def test_actor_names_and_shutdown(sgd2x2):
    names = [n for n in dsgd_actor_names() if n.endswith(sgd2x2.instance_id)]
    assert [n.rsplit("-", 1)[0] for n in names] == [
        "dsgd-ps-0", "dsgd-ps-1", "dsgd-worker-0", "dsgd-worker-1"]


def test_ps_processes_do_not_load_tensorflow(sgd2x2):
    """A PS sums numpy arrays: its process must not import TensorFlow (~0.6 GB and
    ~5 s of start-up, so of every PS replacement). The workers' do (control)."""
    def maps(actor) -> str:
        pid = ray.get(actor.ping.remote(), timeout=60)["pid"]
        with open(f"/proc/{pid}/maps") as f:
            return f.read()

    assert all("tensorflow" not in maps(ps) for ps in sgd2x2.ps_actors)
    assert all("tensorflow" in maps(w) for w in sgd2x2.workers)


def test_replicas_start_from_worker0_replica0(sgd2x2):
    # tiny.TinyModel seeds each replica differently; the broadcast must erase that.
    weights = sgd2x2.foreach_model(lambda m: m.get_weights())
    fresh = [tiny.make_keras_model(r).get_weights()[0] for r in range(4)]
    assert not np.array_equal(fresh[0], fresh[1])
    for w in weights:
        np.testing.assert_array_equal(w[0], fresh[0])


def test_foreach_and_for_model(sgd2x2):
    assert sgd2x2.foreach_model(lambda m: m.replica) == [0, 1, 2, 3]
    assert sgd2x2.for_model(lambda m: m.replica) == 0
    assert sgd2x2.foreach_worker(lambda w: w.worker_index) == [0, 1]


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
    for weights in sgd2x2.foreach_model(lambda m: m.get_weights()):
        for a, b in zip(weights, new, strict=True):
            np.testing.assert_array_equal(a, b)


def optimizer_state(sgd):
    return sgd.foreach_model(lambda m: [np.array(v.numpy()) for v in m.optimizer.variables])


def test_checkpoint_round_trip_to_other_worker_count(sgd2x2, tmp_path):
    sgd2x2.step()
    path = str(tmp_path / "ckpt")
    assert sgd2x2.save_checkpoint(path) == path
    saved_weights, saved_opt, saved_step = sgd2x2.get_weights(), optimizer_state(sgd2x2)[0], sgd2x2.steps_done
    assert int(saved_opt[0]) == saved_step  # Adam's iteration count
    sgd2x2.step()
    with dsgd.DistributedSGD(tiny.creator(2, 4, "adam"), 1, 2, gpu=False) as other:
        suffix = other.instance_id
        other.restore_checkpoint(path)
        assert other.steps_done == saved_step
        for weights in other.foreach_model(lambda m: m.get_weights()):
            for a, b in zip(weights, saved_weights, strict=True):
                np.testing.assert_array_equal(a, b)
        for state in optimizer_state(other):
            for a, b in zip(state, saved_opt, strict=True):
                np.testing.assert_array_equal(a, b)
    # Leaving the `with` block killed its actors.
    assert wait_until(lambda: not [n for n in dsgd_actor_names() if n.endswith(suffix)])
    # ... and a plain Keras model reads the weights with TensorFlow alone.
    import tensorflow as tf

    plain = tiny.make_keras_model(seed=123)
    tf.train.Checkpoint(weights=plain.weights).read(dsgd.engine.checkpoints.tf_prefix(path)).expect_partial()
    for a, b in zip(plain.get_weights(), saved_weights, strict=True):
        np.testing.assert_array_equal(a, b)


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


def test_keras_model_on_tf_data_learns():
    def creator(worker_index, device_index):
        import keras
        import tensorflow as tf

        rng = np.random.default_rng(worker_index)
        x = rng.normal(size=(64, 4)).astype(np.float32)
        y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)).astype(np.float32)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        model = keras.Sequential([keras.layers.Dense(1)])
        return dsgd.KerasModel(model, "mse", keras.optimizers.SGD(0.05), data)

    with dsgd.DistributedSGD(creator, 2, 1, gpu=False, strategy="ps") as sgd:
        losses = [sgd.step(fetch_stats=True)["loss"] for _ in range(40)]
        assert losses[-1] < 0.1 * losses[0]
        a, b = sgd.foreach_model(lambda m: m.get_weights())
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_get_loss_error_surfaces_with_its_traceback():
    class Broken(tiny.TinyModel):
        def get_loss(self, batch):
            raise ArithmeticError("loss exploded on purpose")

    with dsgd.DistributedSGD(lambda w, d: Broken(w, d, 1, 4), 2, 1, gpu=False) as sgd:
        # Raised while tracing the step, so TensorFlow wraps it (StagingError);
        # the message keeps the user's exception, its frame and its line.
        with pytest.raises(Exception, match="ArithmeticError: loss exploded on purpose") as info:
            sgd.step()
        assert "in get_loss" in str(info.value) and "test_api.py" in str(info.value)


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
    assert step2 and "step 2: computing gradients: dsgd-worker-1-" in step2[0]
    assert "has not answered after 1 s (1 answered)" in step2[0] and "worker-0" not in step2[0]
