"""The overlapped exchange (issue 35): on the workers' own exchange each bucket of
the gradient leaves from inside the compiled step as soon as the backward pass
has made it (Replicas.compute_sending), the step is decided from every worker's
meta, and the means are applied as they arrive (Worker._apply_arriving), exactly
one update; a bucket whose PS died is averaged by the workers themselves from
each other's parts (StepExchange.fallback)."""

import os
import time

import numpy as np
import pytest
import ray

import dsgd
from dsgd.comm.sharding import bucket_layout, exchange_layout, plan_shards
import tiny
from helpers import (Reset, assert_replicas_identical, kill_ps_before_sending, ready_patch,
                     unpatch)

BATCH, STEPS = 4, 4
TOL = 1e-5  # float32 round-off of 4 steps (as tests/test_exact.py)


# -- buckets -----------------------------------------------------------------------------
def test_buckets_are_consecutive_shards_in_backward_order_spread_over_the_ps():
    plan = plan_shards([(256, 256)] * 8, ["float32"] * 8, 256 * 256 * 4)  # 8 shards of 256 KiB
    layout = exchange_layout(plan, 2)
    buckets = bucket_layout(layout, 512 * 1024)
    # The plan packs the last variable first: bucket 0 is what the backward pass makes first.
    assert [[p.var_index for j in b for p in plan.shards[j].pieces] for b in buckets.groups] == \
        [[7, 6], [5, 4], [3, 2], [1, 0]]
    assert buckets.ps_of_group == (0, 1, 0, 1)  # one after the other to different PS
    assert sorted(j for b in buckets.groups for j in b) == list(range(plan.num_shards))


def test_no_more_buckets_per_ps_than_its_threads_take():
    from dsgd import constants
    from dsgd.comm.param_server import rendezvous_concurrency

    plan = plan_shards([(256, 256)] * 40, ["float32"] * 40, 256 * 256 * 4)  # 40 shards
    buckets = bucket_layout(exchange_layout(plan, 2), 256 * 256 * 4)
    per_ps = [buckets.ps_of_group.count(p) for p in (0, 1)]
    assert max(per_ps) <= constants.MAX_BUCKETS_PER_PS and sum(per_ps) == len(buckets.groups)
    # Every worker's calls of one step (each bucket, and the metas) wait at once.
    for world in (2, 8, 64):
        assert rendezvous_concurrency(world) >= world * (constants.MAX_BUCKETS_PER_PS + 1) + 4


def test_small_gradients_still_give_every_ps_a_bucket():
    plan = plan_shards([(10,)] * 6, ["float32"] * 6, 40)  # 6 shards of 40 bytes
    buckets = bucket_layout(exchange_layout(plan, 3), 4 * 2**20)
    assert len(buckets.groups) == 3 and sorted(buckets.ps_of_group) == [0, 1, 2]


def test_shards_of_one_ps_share_each_stay_one_bucket_per_ps():
    # shard_bytes = G / num_ps (the layout for one PS per node): the shards come out a
    # little under one PS's share; pairing them would leave half of the PS idle.
    shapes = [(100_000 + 37 * k,) for k in range(8)]  # large tensors, cut at byte ranges
    total = 4 * sum(s[0] for s in shapes)
    plan = plan_shards(shapes, ["float32"] * len(shapes), -(-total // 16))
    buckets = bucket_layout(exchange_layout(plan, 16), 4 * 2**20)
    assert len(set(buckets.ps_of_group)) == 16
    assert len(buckets.groups) == 16  # (the last holds the 256-byte tail shard too)


def test_buckets_never_exceed_the_ps_threads_whatever_the_shard_sizes():
    import random

    from dsgd import constants
    from dsgd.comm.sharding import ReadyProfile

    rng = random.Random(7)
    for _ in range(200):
        shapes = [(rng.choice([10, 1000, 50_000, 400_000, 2_000_000]),)
                  for _ in range(rng.randint(1, 60))]
        shard_bytes = rng.choice([64 * 1024, 1 << 20, 4 << 20, 10_000_000])
        num_ps = rng.randint(1, 16)
        plan = plan_shards(shapes, ["float32"] * len(shapes), shard_bytes)
        layout = exchange_layout(plan, min(num_ps, plan.num_shards))
        ready = sorted(rng.random() for _ in range(plan.num_shards))  # (buckets by deadline)
        profile = ReadyProfile(tuple(ready), 1.0, rng.choice([1e8, 1e9, 1e10]), num_ps + 1)
        for buckets in (bucket_layout(layout, constants.BUCKET_MIN_BYTES),
                        bucket_layout(layout, 64 * 1024, profile)):
            assert len(buckets.groups) <= constants.MAX_BUCKETS_PER_PS * layout.num_ps + 1
            assert sorted(j for b in buckets.groups for j in b) == list(range(plan.num_shards))


def test_deadline_buckets_are_large_early_and_small_as_the_backward_pass_ends():
    from dsgd.comm.sharding import ReadyProfile

    plan = plan_shards([(65536,)] * 16, ["float32"] * 16, 256 * 1024)  # 16 shards of 256 KiB
    layout = exchange_layout(plan, 4)  # one PS's share: 1 MiB; the floor: 4 MiB / (4 x 4)
    # Shard j made at 10 j ms, the backward pass ends at 160 ms; a 256 KiB bucket's fan-in
    # and fan-out through its PS (5 workers) take 10 ms.
    profile = ReadyProfile(tuple(0.01 * j for j in range(16)), 0.16, 8 * 256 * 1024 / 0.01, 5)
    assert profile.exchange_s(256 * 1024) == pytest.approx(0.01)
    buckets = bucket_layout(layout, 256 * 1024, profile)
    assert [len(b) for b in buckets.groups] == [4, 4, 4, 2, 1, 1]  # closed at one share, then
    # when the next shard would end its exchange after 160 ms (shards 12-13: 130 + 20 ms)
    for b in buckets.groups[:-2]:
        nbytes = sum(plan.shards[j].nbytes for j in b)
        assert profile.ready_s[b[-1]] + profile.exchange_s(nbytes) <= profile.end_s
    assert buckets.ps_of_group == (0, 1, 2, 3, 3, 3)  # each on the PS least loaded so far
    # Without a profile: the rule by size (at least 256 KiB: one shard each; 1 MiB: one share).
    assert [len(b) for b in bucket_layout(layout, 256 * 1024).groups] == [1] * 16
    assert [len(b) for b in bucket_layout(layout, 1 << 20).groups] == [4, 4, 4, 4]


class _Client:
    """A PSClient stand-in for StepExchange.read (unit test: no cluster): its wait raises."""

    rank, world, timeout_s, what, choosing = 0, 2, 1.0, "worker 0", False

    def __init__(self, error):
        self.error = error

    def _wait(self, refs, owners, seq, label, **kwargs):
        raise self.error


def test_read_leaves_dead_groups_to_mean_and_raises_a_timeout():
    from ray.exceptions import ActorDiedError

    from dsgd.comm.ps_client import StepExchange
    from dsgd.errors import StepTimeoutError

    plan = plan_shards([(256, 256)] * 4, ["float32"] * 4, 256 * 256 * 4)
    buckets = bucket_layout(exchange_layout(plan, 2), 256 * 256 * 4)
    dead = StepExchange(_Client(ActorDiedError()), buckets, 7, "step 1")
    dead.answers = ["answer"] * len(buckets.groups)
    dead.read(range(len(buckets.groups)))  # a dead PS: nothing read, each group to `mean`
    assert dead._means == {}
    late = StepExchange(_Client(StepTimeoutError("PS 1 did not answer")), buckets, 7, "step 1")
    late.answers = ["answer"] * len(buckets.groups)
    with pytest.raises(StepTimeoutError, match="PS 1 did not answer"):
        late.read(range(len(buckets.groups)))  # not waited for a second time by `mean`


def test_overlap_is_on_with_gpus_by_default_and_refuses_a_non_bool():
    from dsgd.config import Config

    def creator(w, d):
        return None

    assert not Config(creator, 2, 1, gpu=False).during_backward
    assert Config(creator, 2, 1, gpu=True).during_backward
    assert Config(creator, 2, 1, gpu=False, overlap=True).during_backward
    assert not Config(creator, 2, 1, gpu=True, overlap=False).during_backward
    with pytest.raises((TypeError, ValueError), match="overlap"):
        dsgd.DistributedSGD(creator, 2, 1, gpu=False, overlap="yes")


# -- on a cluster ------------------------------------------------------------------------
def keyed(w, d):
    """Adam with a schedule (rate and bias correction read the iteration count);
    batches keyed by that count (tests/tiny.py)."""
    return tiny.StepKeyedModel(w, d, 1, BATCH, "adam_schedule")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """2 workers, 2 PS, 100-byte shards (2 buckets, a variable split across them)."""
    with dsgd.DistributedSGD(keyed, 2, 1, gpu=False, grad_shard_bytes=100, num_ps=2,
                             step_timeout_s=120, overlap=True) as sgd:
        reset = Reset(sgd, str(tmp_path_factory.mktemp("overlap") / "start"))
        yield sgd, reset, sgd.get_weights()


def _ready_says(ready):
    """(`ready`: an int, or a function of the worker's index)"""
    return lambda worker: ready_patch(ready(worker.worker_index) if callable(ready)
                                       else ready)(worker)


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("ready", [0, 1])
def test_applied_as_the_buckets_arrive_equals_single_process_training(shared, ready):
    """Adam with a schedule, a variable split across the 2 buckets: applied at
    once or in two updates (bucket 0 before bucket 1's mean is read), the
    weights are those of single-process training."""
    sgd, reset, initial = shared
    reset()
    sgd.foreach_worker(_ready_says(ready))
    try:
        sgd.train(num_steps=STEPS)
        applies = sgd.foreach_worker(lambda w: w.applies)
    finally:
        sgd.foreach_worker(unpatch)
    got = assert_replicas_identical(sgd)
    expected, _ = tiny.reference_run(initial, 2, BATCH, STEPS, "adam_schedule")
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
    # Sent from inside the step in 2 buckets; applied at once, or in two updates a step.
    facts = sgd.foreach_worker(lambda w: (w.plan.during_backward, len(w._buckets.groups),
                                          len(w.replicas._sending_fns)))
    assert facts == [(True, 2, 1)] * 2
    want = {"whole": 0, "part": 2 * STEPS} if ready else {"whole": STEPS, "part": 0}
    assert applies == [want] * 2


def _rows(count: int = 64) -> list:
    rng = np.random.default_rng(7)
    return [(rng.normal(size=tiny.IN).astype(np.float32),
             rng.normal(size=tiny.OUT).astype(np.float32)) for _ in range(count)]


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
def test_applied_in_the_next_steps_call_equals_applied_before_it(shared):
    """Batches from a dataset: every step but a call's last is applied inside the
    next step's compiled call, beside its forward pass (issue 35, item 3). Adam
    with a schedule: the weights and optimizer state are those of applying each
    step before the next begins, bit for bit, and those of the exchange after
    the backward pass (within round-off); the replicas agree."""
    sgd, reset, _ = shared
    steps = 2 * STEPS
    got, deferred = {}, {}
    try:
        for mode in ("after backward", "before the next", "in the next"):
            reset()
            sgd._loop.replan(mode != "after backward", {"after backward": "now",
                                                         "before the next": "in stages",
                                                         "in the next": "in the next call"}[mode])
            before = sgd.foreach_worker(lambda w: w.deferred_applies)
            sgd.train(num_steps=steps, dataset=dsgd.Dataset(_rows(), batch_size=BATCH))
            after = sgd.foreach_worker(lambda w: w.deferred_applies)
            deferred[mode] = [a - b for a, b in zip(after, before)]
            assert_replicas_identical(sgd)
            got[mode] = sgd.get_weights() + [v.numpy() for v in sgd.foreach_model(
                lambda m: m.optimizer.variables)[0]]
    finally:
        sgd._loop.replan(True)
    # (one call of `steps` steps: each step but the last applied in the next one's call)
    assert deferred == {"after backward": [0, 0], "before the next": [0, 0],
                        "in the next": [steps - 1] * 2}
    for a, b in zip(got["in the next"], got["before the next"], strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got["in the next"], got["after backward"], strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


class FailsOnRow(tiny.TinyModel):
    """Worker 0's get_loss fails (InvalidArgumentError "fails on row") on a
    batch with a row >= 16 (its step 3 of `_index_rows()`); its optimizer
    sleeps `sleep_s` in the update of its last variable, so that the failure
    comes while the update runs."""

    def __init__(self, worker_index, device_index, sleep_s):
        super().__init__(worker_index, device_index, 1, BATCH, "sgdm", seed=0)
        self.fails = worker_index == 0
        self.optimizer = _SlowSGD(sleep_s, learning_rate=0.1)

    def get_loss(self, batch):
        import tensorflow as tf

        if not self.fails:
            return super().get_loss(batch)
        check = tf.debugging.assert_less(tf.reduce_max(batch[0]), 16.0, message="fails on row")
        with tf.control_dependencies([check]):
            return super().get_loss(batch)


def _SlowSGD(sleep_s, fail_marker=None, **kwargs):
    """SGD sleeping `sleep_s` in the update of the last layer's bias; with
    `fail_marker`, that update fails (RuntimeError "update fails once") if the
    file exists, deleting it."""
    import keras
    import tensorflow as tf

    def slow(g):
        time.sleep(sleep_s)
        if fail_marker is not None and os.path.exists(fail_marker):
            os.remove(fail_marker)
            raise RuntimeError("update fails once")
        return g

    class SlowSGD(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            if tuple(variable.shape) == (tiny.OUT,):  # (the last layer's bias)
                gradient = tf.ensure_shape(tf.numpy_function(
                    slow, [gradient], gradient.dtype, stateful=False), gradient.shape)
            super().update_step(gradient, variable, learning_rate)

    return SlowSGD(**kwargs)


def _own_instance(creator):
    """2 workers, 2 PS, 100-byte shards, overlapped: as `shared`, for a model of its own."""
    return dsgd.DistributedSGD(creator, 2, 1, gpu=False, grad_shard_bytes=100, num_ps=2,
                               step_timeout_s=60, overlap=True)


def _index_rows() -> list:
    """64 rows whose x is their index (worker w's step t reads rows 8t + 4w to 8t + 4w + 3)."""
    return [(np.full(tiny.IN, i, np.float32), np.zeros(tiny.OUT, np.float32)) for i in range(64)]


@pytest.mark.slow  # its own 2-worker instance (~10-15 s): CI runs it (.ci/run)
@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
def test_a_step_failing_while_the_last_step_is_applied_in_its_call_leaves_it_applied(tmp_path):
    """Worker 0's step 3 fails in its forward pass while the same compiled call
    is still applying step 2 (the update of one variable sleeps): TensorFlow
    finishes what does not depend on the failed op, so step 2's update runs
    whole, the worker goes on and the error reaches the caller; the weights
    are those of two steps, bit for bit, on both workers, and no worker died."""
    with _own_instance(lambda w, d: FailsOnRow(w, d, 0.5)) as sgd:
        reset = Reset(sgd, str(tmp_path / "start"))
        sgd.train(num_steps=2, dataset=dsgd.Dataset(_index_rows(), batch_size=BATCH))
        two_steps = assert_replicas_identical(sgd)
        reset()
        with pytest.raises(Exception, match="fails on row"):
            sgd.train(num_steps=4, dataset=dsgd.Dataset(_index_rows(), batch_size=BATCH))
        for a, b in zip(assert_replicas_identical(sgd), two_steps, strict=True):
            np.testing.assert_array_equal(a, b)
        assert sgd.failures == []
        assert sgd.foreach_worker(lambda w: w.deferred_applies) == [1 + 2, 1 + 2]


class FailsApplyOnce(tiny.TinyModel):
    """Worker 0's optimizer fails the update of its last variable once, when
    `marker` exists (see _SlowSGD)."""

    def __init__(self, worker_index, device_index, marker):
        super().__init__(worker_index, device_index, 1, BATCH, "sgdm", seed=0)
        self.optimizer = _SlowSGD(0.0, marker if worker_index == 0 else None,
                                  learning_rate=0.1, momentum=0.9)


@pytest.mark.slow  # its own 2-worker instance (~10-15 s): CI runs it (.ci/run)
@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
def test_a_worker_whose_update_fails_in_the_next_steps_call_exits_and_is_recovered(tmp_path):
    """Worker 0's update of step 2, run in step 3's compiled call, fails: part
    of step 2 may be applied, so the worker exits (its weights would be
    neither step's); the driver recovers it like any dead worker and the
    weights are those of an uninterrupted run, bit for bit."""
    marker = str(tmp_path / "fail")
    with _own_instance(lambda w, d: FailsApplyOnce(w, d, marker)) as sgd:
        reset = Reset(sgd, str(tmp_path / "start"))
        sgd.train(num_steps=4, dataset=dsgd.Dataset(_index_rows(), batch_size=BATCH))
        uninterrupted = assert_replicas_identical(sgd)
        reset()
        dataset = dsgd.Dataset(_index_rows(), batch_size=BATCH)
        sgd.train(num_steps=1, dataset=dataset)
        open(marker, "w").close()
        sgd.train(num_steps=3, dataset=dataset)
        assert not os.path.exists(marker)  # (it failed once)
        assert len(sgd.failures) == 1 and "worker(s) 0 died" in sgd.failures[0]["reason"], \
            sgd.failures
        for a, b in zip(assert_replicas_identical(sgd), uninterrupted, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
def test_one_worker_applying_in_two_updates_and_one_at_once_stay_bit_identical(shared):
    """Worker 0 applies each step in two updates, worker 1 at once: the replicas
    agree bit for bit after every step (applying in parts is exactly one apply)."""
    sgd, reset, _ = shared
    reset()
    sgd.foreach_worker(_ready_says(lambda index: 1 if index == 0 else 0))
    try:
        for _ in range(STEPS):
            sgd.step()
            assert_replicas_identical(sgd)
        applies = sgd.foreach_worker(lambda w: w.applies)
    finally:
        sgd.foreach_worker(unpatch)
    assert applies == [{"whole": 0, "part": 2 * STEPS}, {"whole": STEPS, "part": 0}]


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("data", ["get_batch", "dataset"])
def test_a_ps_dead_after_the_step_is_decided_the_workers_average_its_bucket(shared, data):
    """The PS of the last bucket dies as step 3's last bucket leaves: every worker
    has decided step 3 (PS 0 gathers the metas), applies bucket 0, then averages
    the last bucket itself from both workers' parts, exactly as the PS would;
    step 4 then stops at its start naming the dead PS, which the driver
    replaces, and step 4 is run again. The weights are those of an
    uninterrupted run, bit for bit. With a dataset, step 3 is applied when step
    4 stops (it was to be applied in step 4's compiled call)."""
    sgd, reset, _ = shared
    reset()
    dataset = dsgd.Dataset(_rows(), batch_size=BATCH) if data == "dataset" else None
    sgd.train(num_steps=STEPS, dataset=dataset)
    uninterrupted = sgd.get_weights()
    reset()
    dataset = dsgd.Dataset(_rows(), batch_size=BATCH) if data == "dataset" else None
    sgd.train(num_steps=2, dataset=dataset)
    failures = len(sgd.failures)
    last = len(sgd.foreach_worker(lambda w: w._buckets.groups)[0]) - 1
    ps = sgd.foreach_worker(lambda w: w._buckets.ps_of_group[-1])[0]
    assert ps != 0  # (PS 0 gathers the metas: it must live for the step to be decided)
    pid = ray.get(sgd.ps_actors[ps].ping.remote(), timeout=60).pid
    sgd.foreach_worker(kill_ps_before_sending(last, pid))
    deferred = sgd.foreach_worker(lambda w: w.deferred_applies)
    try:
        sgd.train(num_steps=2, dataset=dataset)
        deferred = [a - b for a, b in zip(sgd.foreach_worker(lambda w: w.deferred_applies),
                                          deferred)]
        flushes = sgd.foreach_worker(lambda w: w.flushes)
    finally:
        sgd.foreach_worker(unpatch)
    fell_back = sgd.foreach_worker(lambda w: w.buckets_averaged_here - w.buckets_averaged_before)
    assert fell_back == [1, 1], sgd.failures  # step 3's last bucket, on each worker
    assert len(sgd.failures) == failures + 1, sgd.failures
    assert f"PS actor(s) {ps} died" in sgd.failures[-1]["reason"]
    assert sgd.steps_done == STEPS and len(sgd.ps_actors) == 2
    # With a dataset step 3 was kept for step 4's call, and applied when step 4 stopped
    # at its start; step 4, run again, was its call's last.
    assert deferred == [0, 0]
    assert flushes == [[data == "dataset", False]] * 2
    for got, want in zip(assert_replicas_identical(sgd), uninterrupted, strict=True):
        np.testing.assert_array_equal(got, want)
