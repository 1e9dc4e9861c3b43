"""No object-store leaks: usage after 50 (default run) or 160 steps (`slow`, with
failures) equals usage after 10."""

import os
import signal

import numpy as np
import pytest
import ray

import dsgd
from dsgd.comm import store
import helpers as store_usage

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


class MidModel(dsgd.Model):
    """~0.5 MB of gradients in 4 shards of ~130 KB: above Ray's 100 KB inline
    limit, so every shard and every mean really goes through the store."""

    def __init__(self, worker_index, device_index):
        import keras

        self.model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256),
                                       keras.layers.Dense(256)])
        self.optimizer = keras.optimizers.SGD(1e-4)
        rng = np.random.default_rng(worker_index)
        self.batch = rng.normal(size=(8, 256)).astype(np.float32)

    def get_loss(self, batch):
        import tensorflow as tf

        return tf.reduce_mean(tf.square(self.model(batch)))

    def get_optimizer(self):
        return self.optimizer

    def get_batch(self):
        return self.batch


STEPS = 160  # a leak of one object per step would show ~8x the peak bound below
FAST_STEPS = 50  # the default run's: a leak of one object per step shows as 40 at the end


def train_many_steps(sgd, baseline, kill_at=(), steps=STEPS, kept_per_worker_death=(0, 0)):
    """10 steps, the drained store usage, `steps` - 10 more (killing, before step 10 + i
    for i in `kill_at`, a worker then PS actors), the peak object count while
    training and the drained usage at the end; both must equal `baseline`, the
    store's settled usage before `sgd` existed, but for `kept_per_worker_death`
    (objects, bytes) left per worker killed (a known leak, below)."""
    objects_per_step = (sgd.num_workers + 1) * len(sgd.shard_groups)
    for _ in range(10):
        sgd.step()
    after_10 = store_usage.drained_usage(baseline=baseline)
    peak = 0
    for i in range(steps - 10):
        if i in kill_at:
            victim = sgd.workers[1] if i == kill_at[0] else sgd.ps_actors[0]
            os.kill(ray.get(victim.ping.remote(), timeout=60).pid, signal.SIGKILL)
        sgd.step()
        if i % 10 == 9:
            peak = max(peak, store_usage.usage()["num_objects"])
    # (drained down to what may be left, not to `baseline`: objects of earlier tests freed
    # meanwhile leave `baseline` too high to wait for anything)
    kept = [n * (1 if kill_at else 0) for n in kept_per_worker_death]  # one worker killed
    after_all = store_usage.drained_usage(
        baseline={"num_objects": min(after_10["num_objects"], baseline["num_objects"]) + kept[0]})
    assert sgd.steps_done == steps
    # While training, only the last few steps' objects are in the store (Ray frees
    # in batches, a few steps behind); a leak would hold ~STEPS steps' ...
    # (the peak counts what was there before: other tests' objects in this cluster)
    assert peak - baseline["num_objects"] <= 20 * objects_per_step, \
        (peak, baseline, objects_per_step)
    # ... and when nobody holds a reference, everything is freed, after 10 steps as after
    # STEPS: the store holds what it held before this DistributedSGD existed (other
    # tests' Ray Data datasets may keep blocks there), or less: objects of earlier tests
    # may be freed while this one runs (in the slow run, 25 such objects were).
    # (the message is a string: pytest shortens a tuple's repr, and `ray memory`'s
    # table, which names each object's holder, is what a failure here needs)
    assert after_all["num_objects"] - after_10["num_objects"] <= kept[0], \
        f"{baseline=} {after_10=} {after_all=}\n{store_usage.holders()}"
    assert after_all["bytes_used"] - after_10["bytes_used"] <= kept[1], \
        f"{baseline=} {after_10=} {after_all=}\n{store_usage.holders()}"
    if not kill_at:
        assert after_all == after_10, (baseline, after_10, after_all)
        assert after_all["num_objects"] <= baseline["num_objects"], (baseline, after_all)
        if after_all["num_objects"] == baseline["num_objects"]:
            assert after_all == baseline, (baseline, after_all)


def check_ps_store_usage(kill_at=(), steps=STEPS):
    """Also: every worker and PS actor warmed its store mapping, replacements too."""
    baseline = store_usage.settled_usage()
    with dsgd.DistributedSGD(MidModel, 2, 1, gpu=False, strategy="ps", grad_shard_bytes=140_000,
                             step_timeout_s=120) as sgd:
        assert sgd.plan.num_shards == 4 and all(s.nbytes > 100_000 for s in sgd.plan.shards)
        want = store.warm_bytes(sgd.plan, 2)
        assert want == 8 * 3 * sum(s.nbytes for s in sgd.plan.shards)
        # Known leak (found 2026-11-26, not fixed): after a worker dies, the PS actors
        # keep means they put and returned by reference to the dead worker (a borrower
        # that never reports) in the store until they are replaced: the last step's
        # (one object per group, about the gradient's bytes), and under load the step
        # before it too, whose release the worker had not reported yet (CI, 2026-11-28:
        # 3 objects, 807 KB, 2 groups). Run alone: 1 object, held by the surviving PS
        # (`ray memory`: PINNED_IN_MEMORY in its process; the killed PS's went with it).
        # Bounded per worker death, not per step: the check below allows two steps'.
        groups = len(sgd.shard_groups)
        step_bytes = sum(s.nbytes for s in sgd.plan.shards) + 8192 * groups
        train_many_steps(sgd, baseline, kill_at=kill_at, steps=steps,
                         kept_per_worker_death=(2 * groups, 2 * step_bytes))
        assert len(sgd.failures) == len(kill_at)
        assert sgd.foreach_worker(lambda w: w.warmed_store_bytes) == [want, want]
        ps = ray.get([p.__ray_call__.remote(lambda p: p.warmed_store_bytes)
                      for p in sgd.ps_actors], timeout=60)
        assert ps == [want] * len(sgd.ps_actors)


def test_ps_store_usage_is_flat_over_50_steps():
    """The default run's "ps" leak check: the same path as below, no failures."""
    check_ps_store_usage(steps=FAST_STEPS)


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_ps_store_usage_is_flat_over_160_steps_with_failures_in_between():
    check_ps_store_usage(kill_at=(50, 100))  # a worker, then a PS actor


# ~11 s: `slow`. The default run keeps a "ps" leak test (above, 50 steps);
# "simple" passes whole gradients through the driver.
@pytest.mark.slow
def test_simple_store_usage_is_flat_over_160_steps():
    baseline = store_usage.settled_usage()
    with dsgd.DistributedSGD(MidModel, 2, 1, gpu=False, strategy="simple") as sgd:
        train_many_steps(sgd, baseline)


def test_warm_faults_in_the_store_mapping_without_touching_data():
    import resource

    kept = ray.put(np.arange(1000, dtype=np.int64))  # an object warming must not change
    warmed = store.warm(1 << 40)
    mappings = store.store_mappings(shared_memory_only=True)
    assert mappings, "this process has no object-store mapping in /dev/shm"
    assert mappings == store.store_mappings()  # the test cluster's store is in /dev/shm
    assert warmed == sum(length for _, length in mappings) > 0
    np.testing.assert_array_equal(ray.get(kept), np.arange(1000))
    data = np.ones(8 * 2**20 // 4, np.float32)  # 2,048 pages, made before counting
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ref = ray.put(data)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 500, f"{faults} page faults writing 2,048 pages of a warmed store"
    np.testing.assert_array_equal(ray.get(ref)[::4096], data[::4096])
    assert store.warm(0) == 0


def test_warm_bytes_covers_8_steps_up_to_a_bound():
    from dsgd import constants
    from dsgd.comm.sharding import plan_shards

    small = plan_shards([(1000,)], ["float32"], 10_000_000)
    assert store.warm_bytes(small, 2) == 8 * 3 * 4000
    assert store.warm_bytes(small, 1) == 0  # one worker exchanges nothing
    huge = plan_shards([(2**30,)], ["float32"], 10_000_000)  # 4 GiB of gradients
    assert store.warm_bytes(huge, 4) == constants.STORE_WARM_MAX_BYTES


def test_one_worker_warms_nothing():
    with dsgd.DistributedSGD(MidModel, 1, 1, gpu=False) as sgd:  # no exchange, no store use
        assert sgd.foreach_worker(lambda w: w.warmed_store_bytes) == [0]

