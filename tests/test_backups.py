"""Backup workers (`backup_workers=b`): each step averages the first N-b workers'
gradients; late workers never set the pace and stay bit-identical; a run
replays exactly from its recorded contributor sets.

Batches are keyed by (replica, optimizer iteration) (tiny.StepKeyedModel), so
a step's gradient of worker w is a pure function of (w, step) wherever and
whenever it is computed: the replay in this process recomputes each step's
mean over exactly the recorded contributors.
"""

import os
import time

import numpy as np
import pytest

import dsgd
import counting
from helpers import assert_replicas_identical
import tiny

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

BATCH = 4
SLOW_S = 1.0  # the straggler's pause per step: far above a tiny step (tens of ms)


class Straggler(tiny.StepKeyedModel):
    """Worker `slow_worker` pauses `slow_s` seconds in every get_batch."""

    def __init__(self, w, d, slow_worker, slow_s, optimizer="sgdm"):
        super().__init__(w, d, 1, BATCH, optimizer=optimizer)
        self.slow = w == slow_worker
        self.slow_s = slow_s

    def get_batch(self):
        if self.slow:
            time.sleep(self.slow_s)
        return super().get_batch()


def straggler_creator(slow_worker=2, slow_s=SLOW_S, optimizer="sgdm"):
    return lambda w, d: Straggler(w, d, slow_worker, slow_s, optimizer)


def make(creator, num_workers=3, backup_workers=1, **kwargs):
    kwargs.setdefault("grad_shard_bytes", 128)
    kwargs.setdefault("num_ps", 2)
    kwargs.setdefault("step_timeout_s", 60)
    return dsgd.DistributedSGD(creator, num_workers, 1, gpu=False,
                               backup_workers=backup_workers, **kwargs)


def replay(contributor_sets: list[list[int]], optimizer="sgdm", devices: int = 1
           ) -> list[np.ndarray]:
    """One process: step t applies the mean over the recorded contributors w of
    their gradient on step t's batches (make_batch(w * devices + d, t), averaged
    over the worker's `devices` replicas, as its local allreduce does), from
    worker 0's initial weights. Compiled, as the workers' steps are (eager and
    graph gradients differ in the last bit, and over hundreds of steps such
    differences grow past 1e-6)."""
    import tensorflow as tf

    model = tiny.make_keras_model(0)  # replica 0's initialisation, broadcast at start
    opt = tiny.make_optimizer(optimizer)

    @tf.function
    def gradient(x, y):
        with tf.GradientTape() as tape:
            loss = tiny.mse(model, x, y)
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def apply(mean):
        opt.apply_gradients(zip(mean, model.trainable_variables))

    def mean(grads):
        # dsgd's kernel: the gradients summed in order, times 1/n.
        if len(grads) == 1:
            return grads[0]
        return [tf.add_n([g[k] for g in grads]) * (1.0 / len(grads)) for k in range(len(grads[0]))]

    for t, contributors in enumerate(contributor_sets):
        apply(mean([mean([gradient(*tiny.make_batch(w * devices + d, t, BATCH))
                          for d in range(devices)]) for w in contributors]))
    return [v.numpy() for v in model.trainable_variables]


@pytest.mark.parametrize("bad", [-1, 3, 4, 1.0, True, "1", None])
def test_bad_backup_workers_raise_before_any_actor(bad):
    with pytest.raises(ValueError, match=r"backup_workers must be an int with 0 <= "
                                         r"backup_workers < num_workers=3"):
        dsgd.DistributedSGD(lambda w, d: None, 3, 1, gpu=False, backup_workers=bad)


def test_one_worker_takes_no_backup():
    with pytest.raises(ValueError, match="backup_workers"):
        dsgd.DistributedSGD(lambda w, d: None, 1, 1, gpu=False, backup_workers=1)


@pytest.fixture(scope="module")
def straggler_run():
    """3 workers, backup_workers=1, worker 2 pausing SLOW_S in every batch, 10 steps."""
    with make(straggler_creator()) as sgd:
        stats = [sgd.step(fetch_stats=True) for _ in range(10)]
        weights = assert_replicas_identical(sgd)
    return stats, weights


def test_a_recovery_forgets_the_late_and_the_dead():
    """Recovery replaced every dead worker already: the next step must not
    replace (kill) them again."""
    from dsgd.engine.stragglers import Stragglers

    stragglers = Stragglers(1)
    handle = object()
    stragglers.dead(handle, 2)
    stragglers.owe(handle, "ref")
    stragglers.reset()
    assert stragglers.take_dead() == [] and stragglers.owed(handle) == []
    assert stragglers.free([handle], [2]) == [0]


def test_a_worker_hung_under_backup_workers_is_a_step_timeout_naming_it():
    """Without replace_hung, a worker late for more than step_timeout_s raises
    StepTimeoutError (a DsgdError and a TimeoutError) naming it and carrying
    its handle in `late`, as every step timeout does; a worker late for less
    is not named."""
    from dsgd.engine.stragglers import Stragglers

    stragglers = Stragglers(1, step_timeout_s=0.05)
    hung, slow = object(), object()
    stragglers.late(hung, 2, "its compute")
    time.sleep(0.1)
    stragglers.late(slow, 1, "its compute")
    with pytest.raises(dsgd.StepTimeoutError, match=r"^worker 2: late for more than "
                       r"step_timeout_s=0 s under backup_workers .*replace_hung=True") as e:
        stragglers._hung()
    assert e.value.late == [hung]
    assert isinstance(e.value, dsgd.DsgdError) and isinstance(e.value, TimeoutError)


class TestStraggler:
    @pytest.fixture
    def run(self, straggler_run):
        return straggler_run

    def test_contributors_are_n_minus_b_every_step(self, run):
        stats, _ = run
        for s in stats:
            assert len(s["contributors"]) == 2 and s["contributors"] == sorted(s["contributors"])
            assert sorted(s["contributors"] + s["dropped"]) == [0, 1, 2]

    def test_the_straggler_does_not_set_the_pace(self, run):
        stats, _ = run
        # Worker 2 needs SLOW_S for every batch it draws; the steps do not wait for it.
        assert sum(2 in s["contributors"] for s in stats) <= 1
        step_s = sorted(s["step_s"] for s in stats)
        assert step_s[len(step_s) // 2] < SLOW_S / 2, step_s

    def test_replay_from_contributor_sets_gives_the_same_weights(self, run):
        stats, weights = run
        expected = replay([s["contributors"] for s in stats])
        for a, b in zip(weights, expected):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


# The slow run covers the other paths (each ~8-13 s): the default run keeps the
# straggler and kill tests within its time budget.
@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {"strategy": "simple"},
    {"optimizer": "adam"},
])
def test_simple_strategy_and_whole_step_apply_replay_exactly(options):
    options = dict(options)
    optimizer = options.pop("optimizer", "sgdm")
    with make(straggler_creator(slow_s=0.6, optimizer=optimizer), **options) as sgd:
        stats = [sgd.step(fetch_stats=True) for _ in range(6)]
        weights = assert_replicas_identical(sgd)
    assert all(len(s["contributors"]) == 2 for s in stats)
    for a, b in zip(weights, replay([s["contributors"] for s in stats], optimizer)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_compression_keeps_replicas_identical():
    with make(straggler_creator(slow_s=0.6), compression="bf16") as sgd:
        summary = sgd.train(6)
        assert_replicas_identical(sgd)
    # Each step averages 2 workers; worker 2 sits out the steps it fell behind on
    # (get_batch: no batch drawn). A batch it computed is dropped, counted once its
    # report arrives (the one in flight when train() returns: by the next call).
    assert summary["steps"] == 6
    assert sum(w["batch_count"] for w in summary["workers"]) == 12
    assert summary["dropped_samples"] == BATCH * summary["dropped_batches"]


class SlowCounter(counting.Counter):
    """Worker 2 pauses 0.5 s in every step (inside the compiled loss)."""

    def __init__(self, w, d):
        super().__init__(w, d)
        self.slow = w == 2

    def get_loss(self, batch):
        import tensorflow as tf

        loss = super().get_loss(batch)
        if self.slow:
            pause = tf.numpy_function(lambda: np.float32(time.sleep(0.5) or 0.0), [], tf.float32)
            loss = loss + 0.0 * tf.reshape(pause, [])
        return loss


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_dataset_rows_are_seen_at_most_once_and_dropped_rows_are_counted(overlap,
                                                                          record_property):
    """Counter: after an epoch, -(contributors) x v counts how often each item
    went into a mean; with backups every row is trained on at most once, the
    dropped rows are reported and the replicas agree, whatever the schedule.
    overlap=True: a step may also be applied in the next step's compiled call
    (dataset batches) when its worker contributes to both; how often depends on
    which workers are late, so the count is reported (`deferred_applies`), not
    asserted (a worker late at every step never defers: 3e8670b's CI failed on
    `deferred = [3, 3, 0]`)."""

    rows_per_step = 3 * 4
    n_steps = counting.N // rows_per_step
    data = dsgd.Dataset(range(counting.N), download_func=counting.one_hot, batch_size=4)
    with make(lambda w, d: SlowCounter(w, d), num_ps=1, grad_shard_bytes=2**20,
              overlap=overlap) as sgd:
        summary = sgd.train(dataset=data)
        counts = np.round(-2 * sgd.get_weights()[0]).astype(int)
        deferred = sgd.foreach_worker(lambda w: w.deferred_applies)
        assert_replicas_identical(sgd)
    record_property("deferred_applies", deferred)
    print(f"deferred applies per worker (overlap={overlap}): {deferred}")
    if not overlap:
        assert deferred == [0, 0, 0]  # (only the overlapped path defers an apply)
    assert summary["steps"] == n_steps
    assert set(np.unique(counts)) <= {0, 1}
    # Every step drops one worker's 4 rows: exactly what the counts miss.
    assert summary["dropped_batches"] == n_steps
    assert summary["dropped_samples"] + counts.sum() == counting.N


@pytest.mark.slow
def test_ray_data_ingest_with_a_straggler_over_two_epochs():
    import ray

    ds = ray.data.range(counting.N).map_batches(
        lambda b: {"x": np.eye(counting.N, dtype=np.float32)[b["id"]]})
    data = dsgd.Dataset(ds, batch_size=4)
    with make(lambda w, d: SlowCounter(w, d), num_ps=1, grad_shard_bytes=2**20) as sgd:
        first = sgd.train(dataset=data)
        counts = np.round(-2 * sgd.get_weights()[0]).astype(int)
        second = sgd.train(dataset=data)
        assert_replicas_identical(sgd)
    for summary in (first, second):
        assert summary["epoch_ended"] and summary["steps"] == counting.N // 12
        assert summary["dropped_batches"] == summary["steps"]
    assert set(np.unique(counts)) <= {0, 1}
    assert first["dropped_samples"] + counts.sum() == counting.N


class KillFrom(tiny.StepKeyedModel):
    """Worker 2 SIGKILLs its own process reading its first batch of a step >= 3
    (a late worker may sit step 3 out), once (`marker`)."""

    def __init__(self, w, d, marker):
        super().__init__(w, d, 1, BATCH)
        self.marker = marker

    def get_batch(self):
        import signal

        if self.replica == 2 and not os.path.exists(self.marker) \
                and int(self.optimizer.iterations.numpy()) >= 3:
            with open(self.marker, "w") as f:
                f.write("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().get_batch()


# ~19 s (a 3-worker start, then a replacement's): `slow`, which CI runs too; the
# default run's budget keeps the straggler test above.
@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_a_worker_killed_mid_run_costs_no_step_a_wait_for_its_replacement(tmp_path, overlap):
    """Worker 2 SIGKILLs itself reading a batch (step >= 3). The steps go on
    with workers 0 and 1 while its replacement starts (seconds: TensorFlow's
    import); none of them waits for it, and the run replays exactly. Overlapped:
    the contributors' waits for their buckets' means watch only the contributors."""
    marker = str(tmp_path / "killed")
    creator = lambda w, d: KillFrom(w, d, marker)  # noqa: E731
    stats, deadline = [], time.monotonic() + 180
    with make(creator, overlap=overlap) as sgd:
        # (the failure is recorded when the worker is found dead; its recovery_s once
        # the replacement has joined)
        while not (sgd.failures and sgd.failures[0]["recovery_s"] is not None) \
                and time.monotonic() < deadline:
            stats.append(sgd.step(fetch_stats=True))
        assert sgd.failures and sgd.failures[0]["recovery_s"], "the replacement never joined"
        joined_after = len(stats)
        # Until the replacement has contributed to a step (its first compute traces
        # the step function: it is late for a while).
        while time.monotonic() < deadline + 60:
            stats.append(sgd.step(fetch_stats=True))
            if 2 in stats[-1]["contributors"]:
                break
        weights = assert_replicas_identical(sgd)
        failure = sgd.failures[0]
        iterations = sgd.foreach_model(lambda m: int(m.optimizer.iterations.numpy()))
        # The PS actors did not keep the means of the steps made while worker 2 was
        # being replaced for it (ParameterServer.gone): a step's few meetings at most.
        import ray

        pending = [ray.get(ps.ping.remote(), timeout=60).pending for ps in sgd.ps_actors]
        assert max(pending) <= 4, (pending, len(stats))
    assert os.path.exists(marker)
    assert 2 in stats[-1]["contributors"]
    killed_at = failure["step"] - 1  # the step it died in, 0-based
    during = stats[killed_at:joined_after]
    assert len(during) >= 5, (failure, len(stats))
    assert all(s["contributors"] == [0, 1] for s in during)
    # No step waited for the replacement's start-up.
    assert max(s["step_s"] for s in during) < failure["recovery_s"] / 2, (failure, during)
    assert all(s["failures"] <= 1 for s in stats)
    # Every replica applied exactly the steps recorded (the replay keys batches by step).
    assert iterations == [len(stats)] * 3, (iterations, len(stats))
    for a, b in zip(weights, replay([s["contributors"] for s in stats])):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_trainer_reports_dropped_batches_and_validates_unaffected():
    import trainer_ops

    trainer = dsgd.Trainer(trainer_ops.Classifier, num_workers=2, backup_workers=1,
                           config={dsgd.BATCH_SIZE: 16})
    try:
        result = trainer.train()
        validation = trainer.validate()
        per_worker = trainer.train(reduce_results=False)
    finally:
        trainer.shutdown()
    steps = 64 // 16
    assert result["dropped_batches"] == steps and result["dropped_samples"] == steps * 8
    assert result["num_samples"] == steps * 8
    assert validation["num_samples"] == 30
    assert sum(r["dropped_batches"] for r in per_worker) == steps


class DeviceStraggler(tiny.StepKeyedModel):
    """devices_per_worker=2; worker 1's replicas pause 0.4 s in every batch."""

    def __init__(self, w, d):
        super().__init__(w, d, 2, BATCH)
        self.slow = w == 1

    def get_batch(self):
        if self.slow:
            time.sleep(0.4)
        return super().get_batch()


@pytest.mark.slow
def test_devices_per_worker_contribute_all_replicas_or_none_and_elastic():
    with dsgd.DistributedSGD(DeviceStraggler, 2, 2, gpu=False, backup_workers=1,
                             elastic=True, grad_shard_bytes=128, num_ps=2,
                             step_timeout_s=60) as sgd:
        stats = [sgd.step(fetch_stats=True) for _ in range(6)]
        weights = assert_replicas_identical(sgd)
    assert all(len(s["contributors"]) == 1 for s in stats)
    assert sum(s["contributors"] == [0] for s in stats) >= 5
    for a, b in zip(weights, replay([s["contributors"] for s in stats], devices=2)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


class HangsOnce(tiny.StepKeyedModel):
    """Worker 2 stops answering (a 600 s sleep) reading a batch of a step >= 2, once."""

    def __init__(self, w, d, marker):
        super().__init__(w, d, 1, BATCH)
        self.marker = marker

    def get_batch(self):
        if self.replica == 2 and not os.path.exists(self.marker) \
                and int(self.optimizer.iterations.numpy()) >= 2:
            with open(self.marker, "w") as f:
                f.write("hung")
            time.sleep(600)
        return super().get_batch()


@pytest.mark.slow
def test_a_worker_late_past_the_step_timeout_is_replaced_in_the_background(tmp_path):
    marker = str(tmp_path / "hung")
    with make(lambda w, d: HangsOnce(w, d, marker), step_timeout_s=8,
              replace_hung=True) as sgd:
        stats, deadline = [], time.monotonic() + 120
        while not sgd.failures and time.monotonic() < deadline:
            stats.append(sgd.step(fetch_stats=True))
        assert sgd.failures and "replaced in the background" in sgd.failures[0]["reason"]
        assert_replicas_identical(sgd)
    assert os.path.exists(marker)
    # Nothing waited for the hung worker: the steps went on at their own pace.
    assert max(s["step_s"] for s in stats[3:]) < 2.0


@pytest.mark.slow
def test_a_worker_late_past_the_step_timeout_without_replace_hung_is_a_step_timeout(tmp_path):
    """Without replace_hung, train() raises StepTimeoutError naming the hung
    worker (its handle in `late`); the steps applied before it are counted:
    worker 0's optimizer has applied exactly `steps_done` steps."""
    marker = str(tmp_path / "hung")
    # 15 s: the first step (tracing) must fit in it on a busy 2-core machine.
    with make(lambda w, d: HangsOnce(w, d, marker), step_timeout_s=15) as sgd:
        hung = sgd.workers[2]
        with pytest.raises(dsgd.StepTimeoutError, match=r"worker 2: late for more than "
                           r"step_timeout_s=15 s under backup_workers") as e:
            sgd.train(num_steps=100_000)
        assert e.value.late == [hung] and not sgd.failures
        assert sgd.for_model(lambda m: int(m.optimizer.iterations.numpy())) == sgd.steps_done
    assert os.path.exists(marker)


class NanOnce(tiny.StepKeyedModel):
    """Every worker's first batch drawn at optimizer iteration 2 holds a NaN (the
    next one drawn there, after a skipped step, is clean)."""

    def __init__(self, w, d):
        super().__init__(w, d, 1, BATCH)
        self.poisoned = False

    def get_batch(self):
        x, y = super().get_batch()
        if int(self.optimizer.iterations.numpy()) == 2 and not self.poisoned:
            self.poisoned = True
            x = x.copy()
            x[0, 0] = np.nan
        return x, y


@pytest.mark.slow  # ~10 s each (a 3-worker start): the default budget keeps the straggler test
@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_a_nonfinite_contributor_stops_or_skips_the_step_before_any_apply(on_nonfinite):
    """Whichever workers PS 0 chooses, a NaN among them decides the step on every
    worker alike: "raise" changes no weight, "skip" skips it; replicas agree."""
    with make(NanOnce, on_nonfinite=on_nonfinite) as sgd:
        if on_nonfinite == "raise":
            with pytest.raises(dsgd.NonFiniteError, match=r"step 3: non-finite gradient .*no "
                                                          r"weights were changed"):
                sgd.train(6)
            assert sgd.steps_done == 2
            assert sgd.for_model(lambda m: int(m.optimizer.iterations.numpy())) == 2
        else:
            summary = sgd.train(6)
            assert summary["steps"] == 6 and summary["skipped_steps"] >= 1
            assert sgd.for_model(lambda m: int(m.optimizer.iterations.numpy())) == \
                6 - summary["skipped_steps"]
        weights = assert_replicas_identical(sgd)
    assert all(np.isfinite(w).all() for w in weights)


@pytest.mark.slow  # its own 3-worker instance (~12 s): the default run keeps TestStraggler
def test_overlapped_steps_with_a_straggler_replay_exactly():
    """overlap=True (each bucket leaves during the backward pass, before PS 0
    has chosen the step's contributors; each PS sums the chosen parts only):
    N-b contributors a step, the straggler does not set the pace, and the
    weights are the replay's over the recorded contributor sets."""
    with make(straggler_creator(), overlap=True) as sgd:
        stats = [sgd.step(fetch_stats=True) for _ in range(8)]
        weights = assert_replicas_identical(sgd)
        # (the overlapped path, two buckets on two PS: each settled by one contributor)
        assert sgd.foreach_worker(lambda w: (w.plan.during_backward, w.plan.chosen,
                                             w._buckets.ps_of_group)) == [(True, True, (0, 1))] * 3
    assert all(len(s["contributors"]) == 2 for s in stats)
    assert sum(2 in s["contributors"] for s in stats) <= 1
    step_s = sorted(s["step_s"] for s in stats)
    assert step_s[len(step_s) // 2] < SLOW_S / 2, step_s
    for a, b in zip(weights, replay([s["contributors"] for s in stats])):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.slow  # its own 3-worker instance and a PS replacement (~20 s)
def test_overlapped_steps_with_a_dead_ps_average_the_contributors_parts_exactly():
    """overlap=True: the PS of the last bucket dies as a step's last bucket
    leaves; the workers average that bucket themselves from the chosen
    contributors' parts only (StepExchange.fallback), the driver replaces the PS,
    and the weights are still the replay's over the recorded contributors."""
    from helpers import kill_ps_before_sending, unpatch
    import ray

    with make(straggler_creator(slow_s=0.6), overlap=True) as sgd:
        stats = [sgd.step(fetch_stats=True) for _ in range(3)]
        pid = ray.get(sgd.ps_actors[1].ping.remote(), timeout=60).pid
        sgd.foreach_worker(kill_ps_before_sending(1, pid))
        try:
            stats += [sgd.step(fetch_stats=True) for _ in range(3)]
        finally:
            sgd.foreach_worker(unpatch)
        fell_back = sgd.foreach_worker(lambda w: w.buckets_averaged_here - w.buckets_averaged_before)
        weights = assert_replicas_identical(sgd)
        failures = sgd.failures
    assert len(failures) == 1 and "PS actor(s) 1 died" in failures[0]["reason"], failures
    assert sum(fell_back) >= 2, fell_back  # (every worker that read the bucket after it died)
    assert all(len(s["contributors"]) == 2 for s in stats)
    for a, b in zip(weights, replay([s["contributors"] for s in stats])):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
