"""A hung (SIGSTOP) or dead (SIGKILL) actor in any driver call, not only inside
steps, is replaced (replace_hung) and the call run again on the new group
(DistributedSGD._retried, Recovery.recover(call=...)).

Real processes on the local Ray cluster: a SIGSTOPped actor answers nothing, the
driver's wait times out after step_timeout_s, kills it and starts a replacement
that copies a survivor's state."""

import os
import signal
import time

import numpy as np
import pytest
import ray

import dsgd
import tiny
import trainer_ops

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

TIMEOUT_S = 5.0


def pid_of(handle) -> int:
    return ray.get(handle.ping.remote(), timeout=60)["pid"]


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


def assert_replicas_equal(sgd):
    first, *rest = sgd.foreach_model(lambda m: m.get_weights())
    for other in rest:
        for a, b in zip(first, other, strict=True):
            np.testing.assert_array_equal(a, b)


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


def last_failure(sgd, before):
    assert len(sgd.failures) == before + 1, sgd.failures
    return sgd.failures[-1]


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
    assert_replicas_equal(sgd)


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_dead_worker_in_set_weights_is_replaced_and_every_replica_set(shared):
    sgd = shared
    before = len(sgd.failures)
    kill(pid_of(sgd.workers[1]))
    new = [np.full_like(w, 0.5) for w in sgd.get_weights()]
    sgd.set_weights(new)
    failure = last_failure(sgd, before)
    assert failure["call"] == "set_weights" and "worker(s) 1 died" in failure["reason"]
    for replica in sgd.foreach_model(lambda m: m.get_weights()):
        for got, want in zip(replica, new, strict=True):
            np.testing.assert_array_equal(got, want)


def test_hung_ps_in_a_step_is_replaced_like_a_dead_one(keyed):
    sgd, initial, uninterrupted = keyed
    sgd.restore_checkpoint(initial)
    before = len(sgd.failures)
    sgd.step()
    pid = ray.get(sgd.ps_actors[1].ping.remote(), timeout=60)["pid"]
    stop(pid)
    try:
        for _ in range(3):
            sgd.step()
    finally:
        reap(pid)
    failure = last_failure(sgd, before)
    assert sgd.steps_done == 4 and "call" not in failure
    assert failure["error"] == "StepTimeoutError" and "PS actor(s) 1 died" in failure["reason"]
    assert ray.get(sgd.ps_actors[1].ping.remote(), timeout=60)["pid"] != pid
    for got, want in zip(sgd.get_weights(), uninterrupted[3], strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert_replicas_equal(sgd)


def test_driver_time_between_steps_is_not_the_next_steps(keyed, monkeypatch):
    """The step after step 2 was submitted ahead; the driver then spends longer than
    step_timeout_s before it waits for it (here: counting step 2; in CI's chaos run:
    replacing a PS). That time is the driver's: the step is not called hung, no
    worker is killed (replace_hung), and the weights are the uninterrupted ones."""
    from dsgd.engine.loop import StepLoop

    sgd, initial, uninterrupted = keyed
    sgd.restore_checkpoint(initial)
    before = len(sgd.failures)
    count = StepLoop._count

    def slow_count(self, result, entry):
        error = count(self, result, entry)
        if self.progress.steps_done == 2:
            time.sleep(TIMEOUT_S + 1)
        return error

    monkeypatch.setattr(StepLoop, "_count", slow_count)
    sgd.train(4)
    assert sgd.failures[before:] == [] and sgd.steps_done == 4
    for got, want in zip(sgd.get_weights(), uninterrupted[3], strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert_replicas_equal(sgd)


def test_trainer_worker_hung_between_epochs_completes_the_epoch_with_a_new_worker():
    """The issue's case: a worker SIGSTOPped between two epochs; the next train()
    replaces it in the epoch's setup call and trains the whole epoch, exactly."""
    config = {dsgd.BATCH_SIZE: 16}
    with dsgd.Trainer(trainer_ops.Classifier, num_workers=2, config=config,
                      step_timeout_s=TIMEOUT_S) as trainer:
        trainer.train()
        pid = trainer.sgd.worker_info[1]["pid"]
        stop(pid)
        try:
            result = trainer.train()
        finally:
            reap(pid)
        assert result["epoch"] == 2 and result["num_samples"] == 64
        assert len(trainer.sgd.failures) == 1
        assert trainer.sgd.failures[0]["call"] == "foreach_worker"
        assert trainer.sgd.worker_info[1]["pid"] != pid
        weights = trainer.get_model().get_weights()
        assert_replicas_equal(trainer.sgd)
    _, want, _, _ = trainer_ops.reference(2, 16)
    for got, expected in zip(weights, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


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


@pytest.mark.slow
@pytest.mark.parametrize("signal_", ["stop", "kill"])
@pytest.mark.parametrize("call", sorted(CALLS))
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
    assert_replicas_equal(sgd)


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
    for replica in sgd.foreach_model(lambda m: m.get_weights()):
        for got, want in zip(replica, saved, strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_hung_ps_in_ps_info_is_replaced(shared):
    sgd = shared
    pid = ray.get(sgd.ps_actors[0].ping.remote(), timeout=60)["pid"]
    stop(pid)
    try:
        assert len(sgd.ps_info) == 2
    finally:
        reap(pid)
    assert sgd.failures[-1]["call"] == "ps_info" and "PS actor(s) 0 died" in \
        sgd.failures[-1]["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("call", ["validate", "save", "load", "get_model"])
def test_trainer_calls_survive_a_lost_worker(call, tmp_path):
    """A hung worker (SIGSTOP); in validate() a dead one (SIGKILL): validation
    allows VALIDATION_TIMEOUT_STEPS step timeouts before a hang is called one
    (a minute here), the same replacement follows."""
    with dsgd.Trainer(trainer_ops.Classifier, num_workers=2, config={dsgd.BATCH_SIZE: 16},
                      step_timeout_s=TIMEOUT_S) as trainer:
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
        assert len(trainer.sgd.failures) == 1 and trainer.sgd.worker_info[0]["pid"] != pid
        assert trainer.train()["num_samples"] == 64
        assert_replicas_equal(trainer.sgd)
        if call == "save":  # the checkpoint written across the replacement loads
            trainer.load(str(tmp_path / "saved"))
    assert instance_actors(trainer.sgd.instance_id) == []  # the replacement too


# -- no data loss at the edges ------------------------------------------------------------------
def instance_actors(instance_id: str, timeout_s: float = 15.0) -> list[str]:
    """Live named actors of one instance, after giving killed ones time to go."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        names = [n for n in ray.util.list_named_actors() if n.endswith(instance_id)
                 or f"-{instance_id}-r" in n]
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.2)


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
    assert instance_actors(sgd.instance_id) == []
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
    assert instance_actors(sgd.instance_id) == []


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
    for replica in sgd.foreach_model(lambda m: m.get_weights()):
        for got, expected in zip(replica, want, strict=True):
            np.testing.assert_array_equal(got, expected)
