"""Nothing outlives its instance: an instance whose call raised, or whose
constructor failed, and that the caller then drops without `shutdown()` leaves
no actor behind, so the next instance in the session gets the CPUs at once; and
one that cannot get them says who holds them within seconds.

The instances here take every CPU of the test cluster (2 workers x 2 of its 4),
as a notebook's session on a laptop would: one leaked worker is enough to keep
the next instance from starting. (3e8670b left the actors of a dropped instance
alive, the workers holding each other's handles once joined, and the next
instance waited `start_timeout_s` for CPUs with a stall message that never said
why.)
"""

import gc

import pytest
import ray

import dsgd
from dsgd import constants
from helpers import actors_gone, dsgd_actor_names
import tiny

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

CPUS = 2  # per worker: 2 workers take the test cluster's 4 CPUs


class VectorLoss(tiny.TinyModel):
    """A loss that is one value per output, not a scalar: its step raises."""

    def get_loss(self, batch):
        import tensorflow as tf

        return tf.reduce_mean(tf.square(self.model(batch[0]) - batch[1]), axis=0)


def vector_loss(w, d):
    return VectorLoss(w, d, 1, 4)


def fails_on_worker_1(w, d):
    if w == 1:
        raise RuntimeError("worker 1's model_creator fails on purpose")
    return tiny.TinyModel(w, d, 1, 4)


def fine(w, d):
    return tiny.TinyModel(w, d, 1, 4)


def make(creator, **kwargs):
    # start_timeout_s bounds how long a test on leaky code waits before failing.
    return dsgd.DistributedSGD(creator, 2, 1, gpu=False, num_cpus_per_worker=CPUS,
                               start_timeout_s=60, **kwargs)


@pytest.mark.timeout(300)
def test_instances_dropped_after_errors_leave_nothing_behind(monkeypatch):
    assert not dsgd_actor_names(), "another test left dsgd actors alive"
    # 1. A step raises; the caller drops the instance without shutdown().
    broken = make(vector_loss)
    broken_id = broken.instance_id
    with pytest.raises(Exception, match="scalar|shape|rank"):
        broken.step()
    del broken
    gc.collect()
    assert not actors_gone(broken_id), "a dropped instance kept its actors"

    # 2. A constructor that fails (worker 1's model_creator raises) leaves nothing either.
    with pytest.raises(Exception, match="fails on purpose"):
        make(fails_on_worker_1)
    gc.collect()
    assert not actors_gone(), "a failed constructor left actors"

    # 3. The next instance gets every CPU at once and trains; 4. while it holds them, one
    #    that cannot be placed says so within seconds, naming who holds the CPUs.
    monkeypatch.setattr(constants, "START_ROOM_WAIT_S", 2.0)
    with make(fine) as holder:
        assert holder.train(num_steps=2)["steps"] == 2
        with pytest.raises(dsgd.ResourceError) as raised:
            make(fine)
        message = str(raised.value)
        assert "cannot place 2 worker(s) x (2 CPU, 0 GPU) now" in message
        assert f"instance {holder.instance_id} (" in message
        assert f"dsgd-worker-0-{holder.instance_id}" in message and "shutdown()" in message
        assert ray.available_resources().get("CPU", 0) == 0  # (the holder has them all)
    assert not actors_gone(holder.instance_id)
