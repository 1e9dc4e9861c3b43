"""Failure recovery with real process kills (SIGKILL) on the local Ray cluster.

The data stream is keyed by the optimizer's iteration count (tiny.StepKeyedModel),
so a run that loses a worker or a PS actor and recovers must end with the same
weights as an uninterrupted run: no step lost, none applied twice. The kills of
the default run take turns on one instance (TestOneInstance), whose model also
carries BatchNorm statistics (non-trainable state, per replica) that a
replacement must copy.
"""

import logging
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray

import dsgd
from dsgd import constants
from helpers import assert_replicas_identical
import tiny

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

BATCH, STEPS = 4, 5
BN_MOMENTUM = 0.5  # far from Keras' 0.99, so that a step's statistics move the averages
# Weights against a single-process reference, and BatchNorm statistics against their closed
# form in float64: float32 round-off of 5 steps (6e-8 and 1.2e-7 measured), with room.
TOL = 1e-6


def killing_creator(kill_step, kill_replica, marker, target_pid_file=None, delay_s=0.0):
    return lambda w, d: tiny.KillAt(w, d, 1, BATCH, kill_step, kill_replica, marker,
                                    target_pid_file, delay_s)


def keyed_creator(w, d):
    return tiny.StepKeyedModel(w, d, 1, BATCH)


def make(creator, strategy="ps", **kwargs):
    return dsgd.DistributedSGD(creator, 2, 1, gpu=False, strategy=strategy, grad_shard_bytes=128,
                               num_ps=2, step_timeout_s=120, **kwargs)


# -- a step-keyed model with BatchNorm and a kill the test arms --------------------------------
def bn_keras_model(seed: int):
    """tiny's model behind a BatchNormalization of its input: the moving mean and
    variance are non-trainable state, updated by every replica from its own
    batches; they depend on the data only (not on the weights), so they have a
    closed form (`bn_statistics`)."""
    import keras

    init = lambda k: keras.initializers.GlorotUniform(seed=seed + k)  # noqa: E731
    return keras.Sequential([
        keras.Input((tiny.IN,)),
        keras.layers.BatchNormalization(momentum=BN_MOMENTUM),
        keras.layers.Dense(tiny.HIDDEN, activation="tanh", kernel_initializer=init(0)),
        keras.layers.Dense(tiny.OUT, kernel_initializer=init(1)),
    ])


class Keyed(tiny.StepKeyedModel):
    """StepKeyedModel with `bn_keras_model`, and a kill that a test arms
    (`foreach_model(arm(...))`): replica `replica` SIGKILLs its own process (or
    process `pid`) when it reads its batch for step `step` (0-based), once. A
    replacement is built unarmed."""

    def __init__(self, worker_index, device_index):
        super().__init__(worker_index, device_index, 1, BATCH)
        self.model = bn_keras_model(self.replica)
        self.kill = None

    def get_batch(self):
        if self.kill is not None and int(self.optimizer.iterations.numpy()) == self.kill[0]:
            pid = self.kill[1] or os.getpid()
            self.kill = None
            if pid == "raise":  # an actor death reported while every actor lives
                raise ray.exceptions.ActorDiedError()
            os.kill(pid, signal.SIGKILL)
        return super().get_batch()


def arm(replica, step, pid=None):
    def set_kill(m):
        m.kill = (step, pid) if m.replica == replica else None
    return set_kill


def disarm(m):
    m.kill = None


def bn_statistics(m) -> list[np.ndarray]:
    """A replica's BatchNorm moving mean and variance."""
    bn = m.model.layers[0]
    return [np.array(bn.moving_mean.numpy()), np.array(bn.moving_variance.numpy())]


def expected_statistics(replica, steps, start=None, first_step=0) -> list[np.ndarray]:
    """Keras' update moving = moving * momentum + batch statistic * (1 - momentum)
    (the biased variance), over `replica`'s batches of steps first_step.. in float64,
    from `start` (default: Keras' initial mean 0, variance 1)."""
    mean, var = ([np.zeros(tiny.IN), np.ones(tiny.IN)] if start is None
                 else [s.astype(np.float64) for s in start])
    for t in range(first_step, first_step + steps):
        x = tiny.make_batch(replica, t, BATCH)[0].astype(np.float64)
        mean = mean * BN_MOMENTUM + x.mean(axis=0) * (1 - BN_MOMENTUM)
        var = var * BN_MOMENTUM + x.var(axis=0) * (1 - BN_MOMENTUM)
    return [mean, var]


def one_process_reference(initial, steps) -> list[np.ndarray]:
    """Keyed's two replicas in one process: each step's update is the gradient of
    the mean of the replicas' losses, each replica normalised over its own batch
    (BatchNorm in training mode), which is the mean of the replicas' gradients."""
    import tensorflow as tf

    model = bn_keras_model(0)
    for variable, value in zip(model.trainable_variables, initial, strict=True):
        variable.assign(value)
    opt = tiny.make_optimizer("sgdm")
    for t in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tiny.mse(model, *tiny.make_batch(r, t, BATCH)) for r in range(2)]) / 2
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return [v.numpy() for v in model.trainable_variables]


def assert_weights(sgd, expected):
    """Every replica bit-identical, and equal to `expected` within TOL."""
    for got, want in zip(assert_replicas_identical(sgd), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


def pid_of(handle):
    return ray.get(handle.ping.remote(), timeout=60).pid


@pytest.fixture(scope="class")
def shared(tmp_path_factory):
    """TestOneInstance's instance of make(Keyed): its initial checkpoint, initial
    weights, and its weights and BatchNorm statistics after STEPS uninterrupted
    steps (then restored to the start)."""
    with make(Keyed, max_failures=20) as sgd:
        initial = sgd.save_checkpoint(str(tmp_path_factory.mktemp("keyed") / "initial"))
        initial_weights = sgd.get_weights()
        for _ in range(STEPS):
            sgd.step()
        yield SimpleNamespace(sgd=sgd, initial=initial, initial_weights=initial_weights,
                              uninterrupted=sgd.get_weights(),
                              statistics=sgd.foreach_model(bn_statistics))


def fresh(shared):
    """(the shared instance at step 0, unarmed, the number of failures it has recorded so far)."""
    sgd = shared.sgd
    sgd.restore_checkpoint(shared.initial)
    sgd.foreach_model(disarm)
    assert sgd.steps_done == 0
    return sgd, len(sgd.failures)


class TestOneInstance:
    """Every kill on make(Keyed) takes its turn on one instance, reset by restoring
    its initial checkpoint (`fresh`): recovery replaces what each test kills, the
    replacements stay, failures count over the object's life (each test checks
    its own). Runs first in the module and shuts its instance down before the
    others start theirs (2 of the cluster's 4 CPUs)."""

    def test_uninterrupted_run_is_one_process_training(self, shared):
        """What the kill tests compare with: the weights of one process training
        on both replicas' batches, and per-replica BatchNorm statistics."""
        for got, want in zip(shared.uninterrupted, one_process_reference(
                shared.initial_weights, STEPS), strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
        assert max(np.abs(a - b).max() for a, b in zip(
            shared.uninterrupted, shared.initial_weights)) > 1e-2  # the weights moved
        for replica, statistics in enumerate(shared.statistics):
            for got, want in zip(statistics, expected_statistics(replica, STEPS)):
                np.testing.assert_allclose(got, want, rtol=0, atol=TOL)

    def test_worker_killed_between_steps(self, shared):
        sgd, before = fresh(shared)
        sgd.step()
        sgd.step()
        os.kill(pid_of(sgd.workers[1]), signal.SIGKILL)
        stats = [sgd.step(fetch_stats=True) for _ in range(STEPS - 2)]
        assert sgd.steps_done == STEPS and stats[-1]["failures"] == before + 1
        failure = sgd.failures[before]
        assert failure["recovery_s"] > 0 and "worker(s) 1 died" in failure["reason"]
        assert_weights(sgd, shared.uninterrupted)

    def test_ps_killed_between_steps(self, shared):
        sgd, before = fresh(shared)
        sgd.step()
        os.kill(pid_of(sgd.ps_actors[1]), signal.SIGKILL)
        for _ in range(STEPS - 1):
            sgd.step()
        assert len(sgd.failures) == before + 1
        assert "PS actor(s) 1 died" in sgd.failures[before]["reason"]
        assert len(sgd.ps_actors) == 2
        assert_weights(sgd, shared.uninterrupted)

    def test_worker_killed_during_a_step(self, shared):
        sgd, before = fresh(shared)
        sgd.foreach_model(arm(1, 2))  # worker 1 dies reading its batch of step 3
        for _ in range(STEPS):
            sgd.step()
        assert len(sgd.failures) == before + 1
        failure = sgd.failures[before]
        assert failure["step"] == 3 and "worker(s) 1 died; retrying" in failure["reason"]
        assert sgd.steps_done == STEPS
        assert_weights(sgd, shared.uninterrupted)

    def test_ps_killed_during_a_step(self, shared):
        sgd, before = fresh(shared)
        # Worker 0 kills PS 0 while reading its batch of step 3.
        sgd.foreach_model(arm(0, 2, pid_of(sgd.ps_actors[0])))
        for _ in range(STEPS):
            sgd.step()
        assert len(sgd.failures) == before + 1
        failure = sgd.failures[before]
        assert failure["step"] == 3 and "PS actor(s) 0 died" in failure["reason"]
        assert sgd.steps_done == STEPS
        assert_weights(sgd, shared.uninterrupted)

    @pytest.mark.timeout(180)
    def test_an_actor_death_with_every_actor_alive_is_raised_at_once_not_looped(self, shared,
                                                                                 caplog):
        """A step fails with Ray's ActorDiedError while every dsgd actor lives (here
        worker 1's get_batch raises it; in the suite a worker's stale PS handle
        did). The probe finds nobody dead, so the error is raised to the caller
        at once, with a note saying why, logged once and charged to nothing.
        (3e8670b re-raised it into the recovery's own retry, which caught it
        again: 200,810 times in the issue's run, a hang until pytest's timeout.)"""
        sgd, before = fresh(shared)
        caplog.set_level(logging.WARNING, logger="dsgd")
        sgd.foreach_model(arm(1, 2, "raise"))
        sgd.step()
        sgd.step()
        with pytest.raises(ray.exceptions.ActorDiedError) as raised:
            sgd.step()
        assert "none died" in " ".join(getattr(raised.value, "__notes__", []))
        assert len(sgd.failures) == before and sgd.steps_done == 2
        assert caplog.text.count("recovering again") == 0
        sgd.foreach_model(disarm)
        for _ in range(STEPS - 2):  # the instance goes on: nothing was applied of step 3
            sgd.step()
        assert_weights(sgd, shared.uninterrupted)

    def test_replacement_copies_the_batchnorm_statistics(self, shared):
        """Non-trainable state travels with a replacement's copied state: worker 1,
        killed after 2 steps, is replaced by a worker holding worker 0's moving
        mean and variance exactly (not Keras' initial ones, not its own, which
        differ: each replica averages its own batches); training then goes on as
        if uninterrupted, and the replacement's statistics from the copied ones."""
        sgd, before = fresh(shared)
        sgd.step()
        sgd.step()
        statistics = sgd.foreach_model(bn_statistics)
        for replica in (0, 1):
            for got, want in zip(statistics[replica], expected_statistics(replica, 2)):
                np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
        assert max(np.abs(a - b).max() for a, b in zip(*statistics)) > 1e-2
        pid = pid_of(sgd.workers[1])
        os.kill(pid, signal.SIGKILL)
        copied = sgd.foreach_model(bn_statistics)  # finds worker 1 dead: replaced, run again
        assert len(sgd.failures) == before + 1 and pid_of(sgd.workers[1]) != pid
        failure = sgd.failures[before]
        assert failure["call"] == "foreach_model" and "worker(s) 1 died" in failure["reason"]
        for replica in (0, 1):
            for got, want in zip(copied[replica], statistics[0], strict=True):
                np.testing.assert_array_equal(got, want)
        for _ in range(STEPS - 2):
            sgd.step()
        assert_weights(sgd, shared.uninterrupted)
        final = sgd.foreach_model(bn_statistics)
        for got, want in zip(final[0], shared.statistics[0], strict=True):
            np.testing.assert_array_equal(got, want)  # worker 0: as uninterrupted
        for got, want in zip(final[1], expected_statistics(1, STEPS - 2, statistics[0], 2)):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOL)

    def test_worker_killed_mid_train_on_a_dataset(self, shared, tmp_path):
        """train(dataset=...): worker 1 dies in its transform of step 3's batch; the
        step is retried on the same rows (the batch is a function of the data
        position) and the replacement continues the feed. The rows of step t are
        tiny's batches of step t, so the weights are the uninterrupted run's."""
        sgd, before = fresh(shared)
        examples = [(x, y, i) for i, (x, y) in enumerate(keyed_examples(STEPS, BATCH))]
        marker = str(tmp_path / "killed")
        summary = sgd.train(dataset=dsgd.Dataset(
            examples, transform=KillInTransform(marker, 2 * 2 * BATCH + BATCH + 1),
            batch_size=BATCH))
        assert os.path.exists(marker)
        assert summary["steps"] == STEPS and sgd.steps_done == STEPS
        assert len(sgd.failures) == before + 1
        assert sgd.failures[before]["step"] == 3
        assert "worker(s) 1 died" in sgd.failures[before]["reason"]
        assert_weights(sgd, shared.uninterrupted)

    def test_every_worker_killed_mid_train_on_a_dataset_replays_from_the_snapshot(
            self, shared, tmp_path):
        """train(dataset, num_steps=2), then the other 3 steps: both workers die
        while reading the last step's rows (worker 0's transform kills them
        both: a node lost). No checkpoint is newer than the automatic snapshot
        taken before step 1 (a new dataset makes one due): every replica takes
        it, the dataset goes back to its position then, and steps 1-2 (counted
        by the first call) are run again on the same rows, so the second call
        applies 3 + 2 steps, and the weights are the uninterrupted run's."""
        sgd, before = fresh(shared)
        examples = [(x, y, i) for i, (x, y) in enumerate(keyed_examples(STEPS, BATCH))]
        marker = str(tmp_path / "killed")
        kill = KillInTransform(marker, (STEPS - 1) * 2 * BATCH + 1,  # the last step, slot 0
                               pids=[pid_of(w) for w in sgd.workers])
        dataset = dsgd.Dataset(examples, transform=kill, batch_size=BATCH)
        assert sgd.train(dataset=dataset, num_steps=2)["steps"] == 2
        summary = sgd.train(dataset=dataset, num_steps=STEPS - 2)
        assert os.path.exists(marker)
        record = sgd.failures[before]
        assert len(sgd.failures) == before + 1, sgd.failures[before:]
        assert record["step"] == 3 and "worker(s) 0, 1 died" in record["reason"]
        assert "every worker died: restoring the automatic snapshot of step 0" in record["reason"]
        assert record["replayed_steps"] == 2
        assert sgd.steps_done == STEPS and summary["steps"] == STEPS
        assert_weights(sgd, shared.uninterrupted)

    def test_no_room_without_elastic_names_the_option(self, shared, monkeypatch):
        # The last test of the class: the shared instance is left with a dead worker.
        # The test waits for the dead worker's CPU itself (then blocks it): recovery need
        # not wait RESOURCE_RELEASE_S more for it.
        monkeypatch.setattr(constants, "RESOURCE_RELEASE_S", 0.0)
        free = ray.cluster_resources()["CPU"]
        sgd, _ = fresh(shared)
        sgd.step()
        os.kill(pid_of(sgd.workers[1]), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while ray.available_resources().get("CPU", 0) < free - 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        blocker = block_free_cpus()
        try:
            with pytest.raises(dsgd.DsgdError, match="no free resources.*elastic=True"):
                sgd.step()
        finally:
            ray.kill(blocker)


@pytest.fixture(scope="class")
def one_worker(tmp_path_factory):
    """TestOneWorker's instance (one worker, max_failures=1), its initial checkpoint
    and weights."""
    with dsgd.DistributedSGD(keyed_creator, 1, 1, gpu=False, max_failures=1) as sgd:
        path = str(tmp_path_factory.mktemp("one") / "initial")
        yield SimpleNamespace(sgd=sgd, initial=sgd.save_checkpoint(path),
                              initial_weights=sgd.get_weights())


class TestOneWorker:
    """One worker: its death is every worker's. Runs after TestOneInstance's
    instance is shut down."""

    def test_every_worker_dead_restores_the_last_checkpoint(self, one_worker, tmp_path):
        sgd = one_worker.sgd
        sgd.restore_checkpoint(one_worker.initial)
        before = len(sgd.failures)
        sgd.step()
        sgd.save_checkpoint(str(tmp_path / "ckpt"))
        sgd.step()
        uninterrupted = sgd.get_weights()  # after steps 1 and 2
        os.kill(pid_of(sgd.workers[0]), signal.SIGKILL)
        stats = sgd.step(fetch_stats=True)  # restores step 1's checkpoint, then runs step 2 again
        assert stats["step"] == 2 and stats["failures"] == before + 1
        assert "every worker died: restoring the last checkpoint" in sgd.failures[before]["reason"]
        # The step-keyed data makes the redone step 2 the same step: same weights.
        assert_weights(sgd, uninterrupted)
        want, _ = tiny.reference_run(one_worker.initial_weights, 1, BATCH, 2, "sgdm")
        assert_weights(sgd, want)

    def test_beyond_max_failures_is_a_clear_error(self, one_worker):
        sgd = one_worker.sgd
        if not sgd.failures:  # run alone: the one failure allowed first, from the checkpoint
            sgd.restore_checkpoint(one_worker.initial)
            os.kill(pid_of(sgd.workers[0]), signal.SIGKILL)
            sgd.step()
        assert len(sgd.failures) == 1
        step = sgd.steps_done + 1
        os.kill(pid_of(sgd.workers[0]), signal.SIGKILL)
        with pytest.raises(dsgd.DsgdError, match=rf"step {step}: worker\(s\) 0 died: failure 2 "
                                                 r"exceeds max_failures=1"):
            sgd.step()


class DiesAsAReplacement(tiny.StepKeyedModel):
    """StepKeyedModel whose first `times` replacements (built once `armed` exists)
    SIGKILL themselves while they start (each leaves a file `armed`.<k>): faults
    during a recovery, repeated."""

    def __init__(self, worker_index, device_index, armed, times):
        super().__init__(worker_index, device_index, 1, BATCH)
        if not os.path.exists(armed):
            return
        for k in range(times):
            try:
                os.close(os.open(f"{armed}.{k}", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(240)
def test_faults_while_recovering_are_charged_backed_off_and_bounded(tmp_path, caplog):
    """Worker 1 is killed; its first two replacements die as they start (faults
    inside the recovery). Each fault is charged to the one budget in the order
    found, each recovery after the first waits longer (0.5 s, then 1 s:
    RECOVERY_BACKOFF_S doubling), the third replacement joins and the weights
    are those of uninterrupted steps. The next death is failure 4 of
    max_failures=3: DsgdError naming the step, the actor and the cause. Each
    distinct event is logged once."""
    armed = str(tmp_path / "armed")
    caplog.set_level(logging.INFO, logger="dsgd")
    with make(lambda w, d: DiesAsAReplacement(w, d, armed, 2), max_failures=3) as sgd:
        initial = sgd.get_weights()
        sgd.step()
        open(armed, "w").close()
        os.kill(pid_of(sgd.workers[1]), signal.SIGKILL)
        for _ in range(2):
            sgd.step()
        assert os.path.exists(f"{armed}.1")
        assert len(sgd.failures) == 3, sgd.failures
        assert "worker(s) 1 died; retrying the step" in sgd.failures[0]["reason"]
        for failure in sgd.failures[1:]:
            assert "worker(s) 1 died; retrying the step (while recovering from " \
                in failure["reason"]
        assert all(f["recovery_s"] > 0 for f in sgd.failures)
        assert sgd.steps_done == 3
        want, _ = tiny.reference_run(initial, 2, BATCH, 3, "sgdm")
        assert_weights(sgd, want)
        os.kill(pid_of(sgd.workers[1]), signal.SIGKILL)
        with pytest.raises(dsgd.DsgdError, match=r"^step 4: worker\(s\) 1 died: failure 4 "
                                                 r"exceeds max_failures=3 \(cause: "):
            sgd.step()
        assert len(sgd.failures) == 3
    waits = [r.getMessage() for r in caplog.records if "in a row without" in r.getMessage()]
    assert [w.split("waiting ")[1] for w in waits] == ["0.5 s", "1.0 s"], waits
    said = [r.getMessage() for r in caplog.records
            if r.name == "dsgd" and r.levelno >= logging.WARNING]
    assert len(said) == len(set(said)), said


# "simple" (~11 s) is `slow`: the same retry as TestOneInstance's "ps" test
# (test_worker_killed_during_a_step), whole gradients through the driver.
@pytest.mark.slow
def test_worker_killed_during_a_step_simple_strategy():
    with make(Keyed, "simple") as sgd:
        initial = sgd.get_weights()
        sgd.foreach_model(arm(1, 2))
        for _ in range(STEPS):
            sgd.step()
        assert len(sgd.failures) == 1
        assert sgd.failures[0]["step"] == 3 and "retrying" in sgd.failures[0]["reason"]
        assert sgd.steps_done == STEPS
        assert_weights(sgd, one_process_reference(initial, STEPS))


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_worker_killed_while_applying_is_not_applied_twice(tmp_path):
    """Worker 1 dies inside its optimizer update of step 3, after worker 0 has
    applied it: the step counts as done (worker 0's state is copied), not retried."""
    marker = str(tmp_path / "killed")
    with make(lambda w, d: tiny.KillDuringApply(w, d, 1, BATCH, 2, 1, marker)) as sgd:
        initial = sgd.get_weights()
        for _ in range(STEPS):
            sgd.step()
        assert os.path.exists(marker)
        # The relayed step counts step 3 at the recovery ("not retried"); the workers'
        # own exchange counts it from worker 0's report, and the failure is then
        # found in step 4, retried from worker 0's state: step 3 applied once either way.
        failure = sgd.failures[0] if len(sgd.failures) == 1 else sgd.failures
        assert (failure["step"] == 3 and "not retried" in failure["reason"]) or \
            (failure["step"] == 4 and "retrying the step" in failure["reason"]), failure
        assert sgd.steps_done == STEPS
        want, _ = tiny.reference_run(initial, 2, BATCH, STEPS, "sgdm")
        assert_weights(sgd, want)


# The default run restores the last checkpoint after every worker died
# (TestOneWorker), or the automatic snapshot (below); the decision without either
# is tested in-process (test_failures.py::test_every_worker_dead_needs_a_checkpoint).
@pytest.mark.slow
def test_every_worker_dead_without_a_checkpoint_or_snapshot_is_an_error():
    with dsgd.DistributedSGD(keyed_creator, 1, 1, gpu=False, snapshot_interval_s=None) as sgd:
        sgd.step()
        os.kill(pid_of(sgd.workers[0]), signal.SIGKILL)
        with pytest.raises(dsgd.DsgdError, match="every worker died and there is no checkpoint"):
            sgd.step()


def test_every_worker_dead_without_a_checkpoint_restores_the_snapshot_and_counts_lost_steps():
    """No checkpoint: the automatic snapshot (taken before step 1) is restored, and
    the two steps applied since, whose batches came from get_batch, are lost
    and counted as such (get_batch cannot be replayed)."""
    with dsgd.DistributedSGD(keyed_creator, 1, 1, gpu=False) as sgd:
        initial = sgd.get_weights()
        sgd.step()
        sgd.step()
        os.kill(pid_of(sgd.workers[0]), signal.SIGKILL)
        stats = sgd.step(fetch_stats=True)
        record = sgd.failures[0]
        assert "every worker died: restoring the automatic snapshot of step 0" in record["reason"]
        assert record["lost_steps"] == 2 and "replayed_steps" not in record
        assert stats["step"] == 1 and sgd.steps_done == 1
        # StepKeyedModel keys its batches by the iteration count (restored with the
        # state): the step after the restore is step 1 again.
        want, _ = tiny.reference_run(initial, 1, BATCH, 1, "sgdm")
        assert_weights(sgd, want)


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_one_worker_killed_in_a_call_of_several_steps_restores_the_checkpoint(tmp_path):
    """One worker runs train()'s steps 3 per call: it dies inside the second call
    (step 5); recovery restores the step-1 checkpoint and the remaining steps run
    from there, so the weights are those of 4 uninterrupted steps. The kill waits
    2 s: the first call's reply (sent from another thread as the second call
    starts) must reach the driver first, or that call is lost with the worker too
    (CI saw it: steps_done 7, every step redone from the checkpoint)."""
    marker = str(tmp_path / "killed")
    with dsgd.DistributedSGD(killing_creator(4, 0, marker, delay_s=2.0), 1, 1, gpu=False,
                             local_steps_per_call=3) as sgd:
        initial = sgd.get_weights()
        sgd.step()
        sgd.save_checkpoint(str(tmp_path / "ckpt"))
        summary = sgd.train(num_steps=6)
        assert os.path.exists(marker)
        assert summary["steps"] == 6 and summary["failures"] == 1
        assert sgd.steps_done == 4  # 1, the checkpoint; 2-4 lost with the worker; 2-4 again
        final = sgd.get_weights()
    expected, _ = tiny.reference_run(initial, 1, BATCH, 4, "sgdm")
    for got, want in zip(final, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


class Blocker:
    def ready(self):
        return True


def block_free_cpus():
    """An actor holding every free CPU, once the per-node view that recovery
    consults (GCS, updated by the raylet a little later) shows them taken:
    otherwise recovery can see a stale free CPU and wait for a worker that never
    gets placed."""
    from dsgd.ray_private import available_resources_per_node

    blocker = ray.remote(Blocker).options(num_cpus=ray.available_resources()["CPU"]).remote()
    ray.get(blocker.ready.remote(), timeout=60)
    deadline = time.monotonic() + 30
    while any(free.get("CPU", 0) >= 1 for free in available_resources_per_node().values()):
        assert time.monotonic() < deadline, "the blocker's CPUs never showed as taken"
        time.sleep(0.1)
    return blocker


# ~10 s: `slow` (keeps the default run under 8 minutes); test_failures covers the
# elastic decisions in-process.
@pytest.mark.slow
def test_elastic_shrinks_when_no_room_and_grows_back(monkeypatch, caplog):
    monkeypatch.setattr(constants, "GROW_CHECK_INTERVAL_S", 0.0)
    monkeypatch.setattr(constants, "RESOURCE_RELEASE_S", 0.0)  # the test waits for the CPU itself
    caplog.set_level(logging.WARNING, logger="dsgd")
    free = ray.cluster_resources()["CPU"]
    with make(keyed_creator, elastic=True) as sgd:
        sgd.step()
        os.kill(pid_of(sgd.workers[1]), signal.SIGKILL)
        deadline = time.monotonic() + 60  # the dead worker's CPU returns to the pool
        while ray.available_resources().get("CPU", 0) < free - 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        blocker = block_free_cpus()
        try:
            stats = sgd.step(fetch_stats=True)
            assert stats["num_workers"] == 1 and stats["step"] == 2
            assert "continuing with 1 worker(s)" in caplog.text
            sgd.step()  # one worker, no exchange
        finally:
            ray.kill(blocker)
        deadline = time.monotonic() + 60
        while sgd.num_workers < 2 and time.monotonic() < deadline:
            sgd.step()
        assert sgd.num_workers == 2 and "elastic: added worker(s) 1" in caplog.text
        sgd.step()
        assert_replicas_identical(sgd)


def keyed_examples(n, batch):
    """tiny's data as examples: replica r's batch at step t, row by row."""
    return [row for t in range(n) for r in range(2) for row in zip(*tiny.make_batch(r, t, batch))]


class KillInTransform:
    """A transform that SIGKILLs its worker once, when it sees `row` (and first the
    processes `pids`, e.g. every other worker: a node lost at once)."""

    def __init__(self, marker, row, pids=()):
        self.marker, self.row, self.pids = marker, row, list(pids)

    def __call__(self, batch):
        x, y, index = batch
        if self.row in index and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write("killed")
            for pid in self.pids:
                if pid != os.getpid():
                    os.kill(pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return x, y
