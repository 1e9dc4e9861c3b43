"""Failure recovery with real process kills (SIGKILL) on the local Ray cluster.

The data stream is keyed by the optimizer's iteration count (tiny.StepKeyedModel),
so a run that loses a worker or a PS actor and recovers must end with the same
weights as an uninterrupted run: no step lost, none applied twice.
"""

import logging
import os
import signal
import time

import numpy as np
import pytest
import ray

import dsgd
from dsgd import constants
import tiny

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

BATCH, STEPS = 4, 5


def killing_creator(kill_step, kill_replica, marker, target_pid_file=None, delay_s=0.0):
    return lambda w, d: tiny.KillAt(w, d, 1, BATCH, kill_step, kill_replica, marker,
                                    target_pid_file, delay_s)


def keyed_creator(w, d):
    return tiny.StepKeyedModel(w, d, 1, BATCH)


def make(creator, strategy="ps", **kwargs):
    return dsgd.DistributedSGD(creator, 2, 1, gpu=False, strategy=strategy, grad_shard_bytes=128,
                               num_ps=2, step_timeout_s=120, **kwargs)


UNINTERRUPTED: list = []  # keyed_creator's weights after STEPS uninterrupted steps


def run_uninterrupted(sgd) -> list:
    for _ in range(STEPS):
        sgd.step()
    return sgd.get_weights()


@pytest.fixture(scope="module")
def uninterrupted():
    """Taken from TestOneInstance's instance, which runs first; its own run otherwise."""
    if not UNINTERRUPTED:
        with make(keyed_creator) as sgd:
            UNINTERRUPTED.append(run_uninterrupted(sgd))
    return UNINTERRUPTED[0]


def assert_same_weights(sgd, expected):
    replicas = sgd.foreach_model(lambda m: m.get_weights())
    for weights in replicas:
        for got, want in zip(weights, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    for a, b in zip(*replicas, strict=True):
        np.testing.assert_array_equal(a, b)


def pid_of(handle):
    return ray.get(handle.ping.remote(), timeout=60)["pid"]


def fresh(keyed):
    """(the shared instance at step 0, the number of failures it has recorded so far)."""
    sgd, initial = keyed
    sgd.restore_checkpoint(initial)
    assert sgd.steps_done == 0
    return sgd, len(sgd.failures)


@pytest.fixture(scope="class")
def keyed(tmp_path_factory):
    """TestOneInstance's instance and the checkpoint of its initial state."""
    with make(keyed_creator) as sgd:
        initial = sgd.save_checkpoint(str(tmp_path_factory.mktemp("keyed") / "initial"))
        if not UNINTERRUPTED:
            UNINTERRUPTED.append(run_uninterrupted(sgd))
        yield sgd, initial


class TestOneInstance:
    """Tests that need only a fresh make(keyed_creator) share one instance, reset by
    restoring its initial checkpoint (`fresh`): its replaced workers and PS actors
    stay, failures count over the object's life. Runs first in the module and shuts
    its instance down before the others start theirs (2 of the cluster's 4 CPUs)."""

    def test_worker_killed_between_steps(self, keyed, uninterrupted):
        sgd, before = fresh(keyed)
        sgd.step()
        sgd.step()
        os.kill(pid_of(sgd.workers[1]), signal.SIGKILL)
        stats = [sgd.step(fetch_stats=True) for _ in range(STEPS - 2)]
        assert sgd.steps_done == STEPS and stats[-1]["failures"] == before + 1
        failure = sgd.failures[before]
        assert failure["recovery_s"] > 0 and "worker(s) 1 died" in failure["reason"]
        assert_same_weights(sgd, uninterrupted)

    def test_ps_killed_between_steps(self, keyed, uninterrupted):
        sgd, before = fresh(keyed)
        sgd.step()
        os.kill(pid_of(sgd.ps_actors[1]), signal.SIGKILL)
        for _ in range(STEPS - 1):
            sgd.step()
        assert len(sgd.failures) == before + 1
        assert "PS actor(s) 1 died" in sgd.failures[before]["reason"]
        assert len(sgd.ps_actors) == 2
        assert_same_weights(sgd, uninterrupted)

    def test_no_room_without_elastic_names_the_option(self, keyed):
        # The last test of the class: the shared instance is left with a dead worker.
        free = ray.cluster_resources()["CPU"]
        sgd, _ = fresh(keyed)
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


# "simple" (~11 s) is `slow`: the same retry as "ps", whole gradients through the driver.
@pytest.mark.parametrize("strategy", ["ps", pytest.param("simple", marks=pytest.mark.slow)])
def test_worker_killed_during_a_step(uninterrupted, tmp_path, strategy):
    marker = str(tmp_path / "killed")
    with make(killing_creator(2, 1, marker), strategy) as sgd:
        for _ in range(STEPS):
            sgd.step()
        assert os.path.exists(marker)  # worker 1 really died in step 3
        assert len(sgd.failures) == 1 and "retrying" in sgd.failures[0]["reason"]
        assert sgd.steps_done == STEPS
        assert_same_weights(sgd, uninterrupted)


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_worker_killed_while_applying_is_not_applied_twice(uninterrupted, tmp_path):
    """Worker 1 dies inside its optimizer update of step 3, after worker 0 has
    applied it: the step counts as done (worker 0's state is copied), not retried."""
    marker = str(tmp_path / "killed")
    with make(lambda w, d: tiny.KillDuringApply(w, d, 1, BATCH, 2, 1, marker)) as sgd:
        for _ in range(STEPS):
            sgd.step()
        assert os.path.exists(marker)
        assert len(sgd.failures) == 1 and "not retried" in sgd.failures[0]["reason"]
        assert sgd.steps_done == STEPS
        assert_same_weights(sgd, uninterrupted)


def test_ps_killed_during_a_step(uninterrupted, tmp_path):
    marker, pid_file = str(tmp_path / "killed"), str(tmp_path / "ps.pid")
    # Worker 0 kills PS 0 while computing step 3's gradients.
    with make(killing_creator(2, 0, marker, pid_file)) as sgd:
        with open(pid_file, "w") as f:
            f.write(str(pid_of(sgd.ps_actors[0])))
        for _ in range(STEPS):
            sgd.step()
        assert os.path.exists(marker)
        assert len(sgd.failures) == 1 and "PS actor(s) 0 died" in sgd.failures[0]["reason"]
        assert_same_weights(sgd, uninterrupted)


def test_beyond_max_failures_is_a_clear_error():
    with make(keyed_creator, max_failures=0) as sgd:
        sgd.step()
        os.kill(pid_of(sgd.workers[0]), signal.SIGKILL)
        with pytest.raises(dsgd.DsgdError, match=r"step 2: worker\(s\) 0 died.*max_failures=0"):
            sgd.step()


# ~12 s: `slow`. The default run keeps a checkpoint restore after one worker dies in a
# call of several steps (test_one_worker_killed_in_a_call_of_several_steps_...).
@pytest.mark.slow
def test_every_worker_dead_restores_the_last_checkpoint(tmp_path):
    with dsgd.DistributedSGD(keyed_creator, 1, 1, gpu=False) as sgd:
        sgd.step()
        os.kill(pid_of(sgd.workers[0]), signal.SIGKILL)
        with pytest.raises(dsgd.DsgdError, match="every worker died and there is no checkpoint"):
            sgd.step()
    with dsgd.DistributedSGD(keyed_creator, 1, 1, gpu=False) as sgd:
        sgd.step()
        sgd.save_checkpoint(str(tmp_path / "ckpt"))
        sgd.step()
        uninterrupted = sgd.get_weights()  # after steps 1 and 2
        os.kill(pid_of(sgd.workers[0]), signal.SIGKILL)
        stats = sgd.step(fetch_stats=True)  # restores step 1's checkpoint, then runs step 2 again
        assert stats["step"] == 2 and stats["failures"] == 1
        # The step-keyed data makes the redone step 2 the same step: same weights.
        for got, want in zip(sgd.get_weights(), uninterrupted, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


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
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


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
        a, b = sgd.foreach_model(lambda m: m.get_weights())
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


def keyed_examples(n, batch):
    """tiny's data as examples: replica r's batch at step t, row by row."""
    return [row for t in range(n) for r in range(2) for row in zip(*tiny.make_batch(r, t, batch))]


class KillInTransform:
    """A transform that SIGKILLs its worker once, when it sees `row`."""

    def __init__(self, marker, row):
        self.marker, self.row = marker, row

    def __call__(self, batch):
        x, y, index = batch
        if self.row in index and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return x, y


# Two instances (~18 s): `slow`. The default run keeps a worker killed inside
# train(dataset=...) (test_data_ray.py::test_a_worker_killed_mid_epoch_restarts_the_split).
@pytest.mark.slow
def test_worker_killed_mid_train_ends_with_the_same_weights(tmp_path):
    examples = [(x, y, i) for i, (x, y) in enumerate(keyed_examples(6, 4))]

    def run(transform):
        with make(tiny.creator(1, 4)) as sgd:
            sgd.train(dataset=dsgd.Dataset(examples, transform=transform, batch_size=4))
            return sgd.get_weights(), sgd.failures, sgd.foreach_model(lambda m: m.get_weights())

    expected, _, _ = run(KillInTransform(str(tmp_path / "never"), -1))
    marker = str(tmp_path / "killed")
    weights, failures, replicas = run(KillInTransform(marker, 4 * 8 + 5))  # worker 1, step 5
    assert os.path.exists(marker) and len(failures) == 1
    for got, want in zip(weights, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    for a, b in zip(*replicas, strict=True):
        np.testing.assert_array_equal(a, b)
