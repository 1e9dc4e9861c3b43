"""A hung (SIGSTOP) or dead (SIGKILL) actor in any driver call, not only inside
steps, is replaced (replace_hung) and the call run again on the new group
(DriverCalls.retried in dsgd/engine/calls.py, Recovery.recover(call=...)).

Real processes on the local Ray cluster: a SIGSTOPped actor answers nothing, the
driver's wait times out after step_timeout_s, kills it and starts a replacement
that copies a survivor's state."""

import itertools
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray

import dsgd
from helpers import actors_gone, assert_replicas_identical, dsgd_actor_names
import tiny
import trainer_ops

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

TIMEOUT_S = 5.0


def pid_of(handle) -> int:
    return ray.get(handle.ping.remote(), timeout=60).pid


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def reap(pid: int) -> None:
    """A stopped process the test left behind (the call failed): kill it."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def keyed_creator(w, d):
    return tiny.StepKeyedModel(w, d, 1, 4)


def make(**kwargs):
    return dsgd.DistributedSGD(keyed_creator, 2, 1, gpu=False, strategy="ps", grad_shard_bytes=128,
                               num_ps=2, step_timeout_s=TIMEOUT_S, replace_hung=True,
                               max_failures=50, **kwargs)


def last_failure(sgd, before):
    assert len(sgd.failures) == before + 1, sgd.failures
    return sgd.failures[-1]


def assert_weights(weights, expected):
    for got, want in zip(weights, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -- one Trainer takes every hang in turn ------------------------------------------------------
@pytest.fixture(scope="class")
def shared_trainer(tmp_path_factory):
    """TestOneTrainer's Trainer (trainer_ops.Classifier, 2 workers, 4 steps an epoch,
    replace_hung as every Trainer) and its initial checkpoint."""
    with dsgd.Trainer(trainer_ops.Classifier, num_workers=2, config={dsgd.BATCH_SIZE: 16},
                      step_timeout_s=TIMEOUT_S, max_failures=50) as trainer:
        yield SimpleNamespace(trainer=trainer, initial=trainer.save(
            str(tmp_path_factory.mktemp("hung") / "initial")))


def fresh(shared):
    """The shared Trainer at epoch 0 (its initial checkpoint loaded), and the number
    of failures it has recorded so far (they count over its life)."""
    shared.trainer.load(shared.initial)
    assert shared.trainer.epoch == 0 and shared.trainer.sgd.steps_done == 0
    return shared.trainer, len(shared.trainer.sgd.failures)


class TestOneTrainer:
    """The hangs that a Trainer of the same configuration can take one after the
    other: each test starts from the initial checkpoint, the replacements stay.
    Its instance is shut down (the last test checks that nothing of it is left)
    before the module's other instances start."""

    def test_trainer_worker_hung_between_epochs_completes_the_epoch_with_a_new_worker(
            self, shared_trainer):
        """The issue's case: a worker SIGSTOPped between two epochs; the next train()
        replaces it in the epoch's setup call and trains the whole epoch, exactly."""
        trainer, before = fresh(shared_trainer)
        trainer.train()
        pid = trainer.sgd.worker_info[1]["pid"]
        stop(pid)
        try:
            result = trainer.train()
        finally:
            reap(pid)
        assert result["epoch"] == 2 and result["num_samples"] == 64
        failure = last_failure(trainer.sgd, before)
        assert failure["call"] == "foreach_worker" and "worker(s) 1 died" in failure["reason"]
        assert trainer.sgd.worker_info[1]["pid"] != pid
        assert_replicas_identical(trainer)
        assert_weights(trainer.get_model().get_weights(), trainer_ops.reference(2, 16)[1])

    def test_hung_ps_in_a_step_is_replaced_like_a_dead_one(self, shared_trainer):
        """The PS SIGSTOPped between epochs: the next epoch's first step times out
        waiting for it; it is killed, replaced, and the step retried."""
        trainer, before = fresh(shared_trainer)
        sgd = trainer.sgd
        trainer.train()
        pid = ray.get(sgd.ps_actors[0].ping.remote(), timeout=60).pid
        stop(pid)
        try:
            trainer.train()
        finally:
            reap(pid)
        failure = last_failure(sgd, before)
        assert sgd.steps_done == 8 and "call" not in failure and failure["step"] == 5
        assert failure["error"] == "StepTimeoutError" and "PS actor(s) 0 died" in failure["reason"]
        assert ray.get(sgd.ps_actors[0].ping.remote(), timeout=60).pid != pid
        assert_replicas_identical(trainer)
        assert_weights(trainer.get_model().get_weights(), trainer_ops.reference(2, 16)[1])

    def test_driver_time_between_steps_is_not_the_next_steps(self, shared_trainer, monkeypatch):
        """Step 2 was submitted ahead of step 1's count; the driver then spends longer
        than step_timeout_s before it waits for it (here: counting step 1; in CI's
        chaos run: replacing a PS). That time is the driver's: the step is not
        called hung, no worker is killed (replace_hung), and the weights are
        those of one process."""
        from dsgd.engine.loop import StepLoop

        trainer, before = fresh(shared_trainer)
        count = StepLoop._count
        slept = []

        def slow_count(self, result, entry):
            error = count(self, result, entry)
            if self.progress.steps_done == 1:
                slept.append(True)
                time.sleep(TIMEOUT_S + 1)
            return error

        monkeypatch.setattr(StepLoop, "_count", slow_count)
        trainer.train()
        trainer.train()
        assert slept and trainer.sgd.failures[before:] == [] and trainer.sgd.steps_done == 8
        assert_replicas_identical(trainer)
        assert_weights(trainer.get_model().get_weights(), trainer_ops.reference(2, 16)[1])

    @pytest.mark.slow
    @pytest.mark.parametrize("call", ["validate", "save", "load", "get_model"])
    def test_trainer_calls_survive_a_lost_worker(self, shared_trainer, call, tmp_path):
        """A hung worker (SIGSTOP); in validate() a dead one (SIGKILL): validation
        allows VALIDATION_TIMEOUT_STEPS step timeouts before a hang is called one
        (a minute here), the same replacement follows."""
        trainer, before = fresh(shared_trainer)
        trainer.train()
        path = trainer.save(str(tmp_path / "epoch1")) if call == "load" else None
        pid = trainer.sgd.worker_info[0]["pid"]
        (kill if call == "validate" else stop)(pid)
        try:
            if call == "validate":
                assert trainer.validate()["num_samples"] == 30
            elif call == "save":
                trainer.save(str(tmp_path / "saved"))
                trainer.load(str(tmp_path / "saved"))
            elif call == "load":
                trainer.load(path)
                assert trainer.epoch == 1
            else:
                assert len(trainer.get_model().get_weights()) == 4
        finally:
            reap(pid)
        assert len(trainer.sgd.failures) == before + 1
        assert trainer.sgd.worker_info[0]["pid"] != pid
        assert trainer.train()["num_samples"] == 64
        assert_replicas_identical(trainer)
        if call == "save":  # the checkpoint written across the replacement loads
            trainer.load(str(tmp_path / "saved"))

    def test_shutdown_leaves_no_actor_of_the_trainer_or_its_replacements(self, shared_trainer):
        # The last test of the class: it shuts the shared Trainer down.
        sgd = shared_trainer.trainer.sgd
        assert dsgd_actor_names(instance_id=sgd.instance_id)
        shared_trainer.trainer.shutdown()
        assert actors_gone(sgd.instance_id) == set()


# -- the engine: one instance of make() for the driver's calls (`slow`) --------------------------
@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """The module's instance, its initial checkpoint, and StepKeyedModel's weights
    after 1, 2, ... 4 uninterrupted steps (taken from it, then restored)."""
    with make() as sgd:
        initial = sgd.save_checkpoint(str(tmp_path_factory.mktemp("hung") / "initial"))
        weights = []
        for _ in range(4):
            sgd.step()
            weights.append(sgd.get_weights())
        sgd.restore_checkpoint(initial)
        yield sgd, initial, weights


@pytest.fixture
def shared(keyed):
    return keyed[0]


@pytest.fixture
def uninterrupted(keyed):
    return keyed[2]


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_a_replacement_slower_than_step_timeout_to_its_first_step_is_not_taken_for_hung(
        tmp_path):
    """A replacement traces its compiled step alone while the other worker waits for it
    in the exchange: its first call of steps is part of its start (start_timeout_s),
    not judged by step_timeout_s. Judged by that, it would be killed as hung, and its
    replacement too, step after step (here max_failures=3 would end it)."""
    marker = str(tmp_path / "killed")

    def creator(w, d):
        return tiny.SlowReplacement(w, d, 1, 4, kill_step=2, kill_replica=1, marker=marker,
                                    delay_s=0.5, slow_s=2 * TIMEOUT_S)

    with dsgd.DistributedSGD(creator, 2, 1, gpu=False, strategy="ps", grad_shard_bytes=128,
                             num_ps=2, step_timeout_s=TIMEOUT_S, replace_hung=True,
                             start_timeout_s=120, max_failures=3) as sgd:
        sgd.train(6)
        assert os.path.exists(marker)
        assert sgd.steps_done == 6
        assert [f["error"] for f in sgd.failures] == ["ActorDiedError"], sgd.failures
        assert_replicas_identical(sgd)
        # The replacement's calls after its first are judged by step_timeout_s again.
        pid = sgd.worker_info[1]["pid"]
        stop(pid)
        began = time.monotonic()
        try:
            sgd.train(2)
        finally:
            reap(pid)
        # (found after step_timeout_s, not after start_timeout_s=120 s)
        assert time.monotonic() - began < 90
        assert sgd.steps_done == 8
        assert len(sgd.failures) == 2 and sgd.failures[-1]["error"] == "StepTimeoutError", \
            sgd.failures


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_hung_worker_in_get_weights_is_replaced_and_the_call_answers(shared, uninterrupted):
    sgd = shared
    sgd.step()
    before, pid = len(sgd.failures), pid_of(sgd.workers[0])
    stop(pid)
    try:
        weights = sgd.get_weights()
    finally:
        reap(pid)
    failure = last_failure(sgd, before)
    assert failure["call"] == "get_weights" and failure["error"] == "StepTimeoutError"
    assert "worker(s) 0 died" in failure["reason"] and "run again" in failure["reason"]
    assert pid_of(sgd.workers[0]) != pid
    for got, want in zip(weights, uninterrupted[0], strict=True):
        np.testing.assert_array_equal(got, want)  # worker 1's state, copied
    sgd.step()  # the new worker 0 steps with the others, on the same data
    for got, want in zip(sgd.get_weights(), uninterrupted[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert_replicas_identical(sgd)


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_dead_worker_in_set_weights_is_replaced_and_every_replica_set(shared):
    sgd = shared
    before = len(sgd.failures)
    kill(pid_of(sgd.workers[1]))
    new = [np.full_like(w, 0.5) for w in sgd.get_weights()]
    sgd.set_weights(new)
    failure = last_failure(sgd, before)
    assert failure["call"] == "set_weights" and "worker(s) 1 died" in failure["reason"]
    for got, want in zip(assert_replicas_identical(sgd), new, strict=True):
        np.testing.assert_array_equal(got, want)


# Each call of the driver, one at a time (a worker start each, ~8 s): `slow`.
CALLS = {
    "foreach_model": lambda sgd, tmp: sgd.foreach_model(lambda m: 1) == [1, 1],
    "for_model": lambda sgd, tmp: sgd.for_model(lambda m: 2) == 2,
    "foreach_worker": lambda sgd, tmp: sgd.foreach_worker(lambda w: w.worker_index) == [0, 1],
    "save_checkpoint": lambda sgd, tmp: sgd.save_checkpoint(str(tmp / "c"), {"k": 1}) \
    and sgd.restore_checkpoint(str(tmp / "c")) == {"k": 1},
    "run_on_workers": lambda sgd, tmp: sgd.run_on_workers(
        lambda w, a: a * 10 + w.worker_index, [1, 2]) == [10, 21],
}


# Each call once (every call goes through the same recovery, engine/calls.py), hung and
# dead workers alternating so that each is seen by several calls (with get_weights,
# hung, and set_weights, dead, above): a worker replacement per test, ~20 s on 2 cores.
LOSSES = dict(zip(sorted(CALLS), itertools.cycle(["stop", "kill"])))


@pytest.mark.slow
@pytest.mark.parametrize("call, signal_", sorted(LOSSES.items()))
def test_each_driver_call_survives_a_lost_worker(shared, call, signal_, tmp_path):
    sgd = shared
    before, pid = len(sgd.failures), pid_of(sgd.workers[0])
    (stop if signal_ == "stop" else kill)(pid)
    try:
        assert CALLS[call](sgd, tmp_path)
    finally:
        reap(pid)
    failure = sgd.failures[before]
    assert failure["call"] == call and "worker(s) 0 died" in failure["reason"]
    assert_replicas_identical(sgd)


@pytest.mark.slow
def test_restore_checkpoint_with_a_hung_worker_restores_every_replica(shared, tmp_path):
    sgd = shared
    path = sgd.save_checkpoint(str(tmp_path / "before"))
    saved, steps = sgd.get_weights(), sgd.steps_done
    sgd.step()
    pid = pid_of(sgd.workers[1])
    stop(pid)
    try:
        sgd.restore_checkpoint(path)
    finally:
        reap(pid)
    assert sgd.steps_done == steps and sgd.failures[-1]["call"] == "restore_checkpoint"
    for got, want in zip(assert_replicas_identical(sgd), saved, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_hung_ps_in_ps_info_is_replaced(shared):
    sgd = shared
    pid = ray.get(sgd.ps_actors[0].ping.remote(), timeout=60).pid
    stop(pid)
    try:
        assert len(sgd.ps_info) == 2
    finally:
        reap(pid)
    assert sgd.failures[-1]["call"] == "ps_info" and "PS actor(s) 0 died" in \
        sgd.failures[-1]["reason"]


# -- no data loss at the edges ------------------------------------------------------------------
@pytest.mark.slow
def test_shutdown_while_a_step_is_in_flight_raises_and_leaves_no_actor(tmp_path):
    import threading

    from dsgd.engine import checkpoints

    sgd = make()
    path = sgd.save_checkpoint(str(tmp_path / "ckpt"))
    sgd.step()
    timer = threading.Timer(1.0, sgd.shutdown)
    timer.start()
    with pytest.raises(dsgd.DsgdError, match="shut down"):
        sgd.train(10**6)
    timer.join()
    assert actors_gone(sgd.instance_id) == set()
    files, meta = checkpoints.read(path)  # complete: sizes and checksums verified
    assert meta["step"] == 0 and files
    with pytest.raises(dsgd.DsgdError, match="shut down"):
        sgd.get_weights()


class SlowStart:
    """worker_init that takes `seconds` once `marker` exists (replacements start slowly)."""

    def __init__(self, marker: str, seconds: float):
        self.marker, self.seconds = marker, seconds

    def __call__(self):
        import time

        if os.path.exists(self.marker):
            time.sleep(self.seconds)


@pytest.mark.slow
def test_shutdown_during_a_replacement_leaves_no_actor(tmp_path):
    import threading

    marker = str(tmp_path / "slow")
    sgd = make(worker_init=SlowStart(marker, 6.0))
    sgd.step()
    open(marker, "w").close()
    kill(pid_of(sgd.workers[1]))
    timer = threading.Timer(2.0, sgd.shutdown)  # the replacement is in its worker_init then
    timer.start()
    with pytest.raises(dsgd.DsgdError, match="shut down"):
        sgd.step()
    timer.join()
    assert actors_gone(sgd.instance_id) == set()


@pytest.mark.slow
def test_checkpoint_written_while_a_worker_is_replaced_is_complete(shared, tmp_path):
    """save_checkpoint finds worker 0 hung: it is replaced (state from worker 1) and
    the checkpoint written after; restoring it gives every replica those weights."""
    sgd = shared
    sgd.step()
    want = sgd.get_weights()
    pid = pid_of(sgd.workers[0])
    stop(pid)
    try:
        path = sgd.save_checkpoint(str(tmp_path / "during"))
    finally:
        reap(pid)
    sgd.step()
    sgd.restore_checkpoint(path)
    for got, expected in zip(assert_replicas_identical(sgd), want, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_a_deadline_names_what_it_waits_for_while_it_stalls_and_at_its_end(caplog):
    """`waits.Deadline`, the one way the package blocks on refs: a stall report
    every stall_s names the wait and only the owner still pending; the wait ends
    at the deadline (not at the slow task's end), and `expired` names the late."""
    import logging

    from dsgd.comm.waits import Deadline
    from dsgd.errors import StepTimeoutError

    @ray.remote(num_cpus=0)
    def sleep(s: float) -> float:
        time.sleep(s)
        return s

    refs = [sleep.remote(0.0), sleep.remote(60.0)]
    owners = ["the quick sleep", "the slow sleep"]
    ray.get(refs[0], timeout=60)  # (its worker process started: answered at the first wait)
    deadline = Deadline("two sleeps", 2.0, stall_s=0.5)
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="dsgd"):
            pending = refs
            while pending and not deadline.over():
                _, pending = deadline.wait(refs, owners=owners)
        waited = time.monotonic() - started
        error = deadline.expired([owners[refs.index(r)] for r in pending])
    finally:
        ray.cancel(refs[1], force=True)
    assert pending == [refs[1]] and 1.99 <= waited < 20.0, (pending, waited)
    stalls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall:")]
    assert len(stalls) >= 2, stalls
    assert all(s.startswith("stall: two sleeps: the slow sleep has not answered") and
               "quick" not in s and "(1 answered)" in s for s in stalls), stalls
    assert isinstance(error, StepTimeoutError) and error.late == ["the slow sleep"]
    assert str(error) == "two sleeps: no answer after 2.0 s from the slow sleep"
