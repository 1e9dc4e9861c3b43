"""dsgd.Dataset over a ray.data.Dataset, the longer cases (`slow`): Ray Data's
streaming_split and iter_batches train a model to its closed-form result, a
worker killed mid-epoch restarts the split, one worker reads on into the next
epoch. Each starts its own workers, so that Ray Data's tasks find the CPUs
free. (Ray Data's exact epoch in the default run: test_data.py, on its shared
instance, which leaves 2 of the 4 CPUs to Ray Data as these do.)"""

import numpy as np
import pytest
import ray

import dsgd
from counting import N, Counter, counts, reset
from trainer_ops import Misbehave

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


class Linear(dsgd.Model):
    def __init__(self, worker_index, device_index):
        import keras

        self.model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        self.optimizer = keras.optimizers.SGD(0.1)

    def get_loss(self, batch):
        import tensorflow as tf

        return tf.reduce_mean(tf.square(self.model(batch["x"]) - batch["y"]))

    def get_optimizer(self):
        return self.optimizer


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_ray_data_trains_a_model_to_the_expected_result():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 4)).astype(np.float32)
    true_w = np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    ds = ray.data.from_items([{"x": a, "y": a @ true_w} for a in x])
    with dsgd.DistributedSGD(Linear, 2, 1, gpu=False) as sgd:
        dataset = dsgd.Dataset(ds, batch_size=16)
        first = sgd.train(dataset=dataset)["loss"]
        last = sgd.train(dataset=dataset, num_steps=40)["loss"]
        np.testing.assert_allclose(sgd.get_weights()[0], true_w, atol=0.05)
        assert last < 0.01 * first


def driver_state(sgd):
    """Every attribute of a DistributedSGD, by identity (it has no __dict__: its
    slots are all it can hold, each made in __init__)."""
    assert not hasattr(sgd, "__dict__")
    return {name: id(getattr(sgd, name)) for name in type(sgd).__slots__}


# ~13 s: `slow`. The default run keeps the engine's kill-and-replace tests
# (test_recovery.py) and Ray Data's exact epoch (test_ray_data_one_epoch_covers_every_row_once).
@pytest.mark.slow
def test_a_worker_killed_mid_epoch_restarts_the_split(tmp_path):
    """Also: the driver's state objects stay the ones __init__ made, through steps,
    train(dataset=...), a worker's death and recovery, and a checkpoint round trip."""
    ds = ray.data.range(N).map_batches(lambda b: {"x": np.eye(N, dtype=np.float32)[b["id"]]})
    with dsgd.DistributedSGD(Counter, 2, 1, gpu=False, step_timeout_s=120) as sgd:
        state = driver_state(sgd)
        reset(sgd)
        summary = sgd.train(dataset=dsgd.Dataset(ds, batch_size=4,
                                                 transform=Misbehave("kill", str(tmp_path / "k"), 3)),
                            num_steps=10)
        assert summary["steps"] == 10 and len(sgd.failures) == 1
        # Every applied step trained on one full batch per worker, whatever the epoch's
        # restart re-read: 10 steps x 2 workers x 4 rows.
        assert counts(sgd).sum() == 80 and counts(sgd).min() >= 0
        sgd.save_checkpoint(str(tmp_path / "ckpt"))
        weights = sgd.get_weights()
        sgd.train(dataset=dsgd.Dataset(ds, batch_size=4), num_steps=2)
        assert sgd.steps_done == 12
        sgd.restore_checkpoint(str(tmp_path / "ckpt"))
        assert sgd.steps_done == 10
        for got, want in zip(sgd.get_weights(), weights, strict=True):
            np.testing.assert_array_equal(got, want)
        assert driver_state(sgd) == state


# ~8 s: `slow` (the default run's time budget).
@pytest.mark.slow
def test_one_worker_reads_on_into_the_next_epoch_with_steps_queued_ahead():
    """One worker runs several steps per call and queues the next call ahead: a
    call queued before the epoch ended reads on into the next epoch."""
    ds = ray.data.range(N).map_batches(lambda b: {"x": np.eye(N, dtype=np.float32)[b["id"]]})
    with dsgd.DistributedSGD(Counter, 1, 1, gpu=False, local_steps_per_call=5) as sgd:
        reset(sgd)
        summary = sgd.train(20, dataset=dsgd.Dataset(ds, batch_size=4))
        trained = np.round(-sgd.get_weights()[0]).astype(int)
    assert summary["steps"] == 20 and summary["num_samples"] == 80
    # 12 steps are one epoch (48 rows): every row once, then 32 rows a second time.
    assert trained.sum() == 80 and set(np.unique(trained)) <= {1, 2}
    assert (trained == 2).sum() == 32
