"""Bad arguments and bad models: clear errors, raised early, naming the culprit."""

import logging
import types

import numpy as np
import pytest
import ray

import dsgd
import tiny
from helpers import Reset, dsgd_actor_names
from dsgd.engine.resources import check_store
from dsgd.engine.launch import check_signatures
from dsgd.worker.replicas import Replicas
from dsgd.comm.sharding import plan_shards

GOOD = dict(model_creator=tiny.creator(1, 4), num_workers=1, devices_per_worker=1, gpu=False)


@pytest.mark.parametrize("change,error,message", [
    ({"model_creator": "not a function"}, TypeError, "model_creator must be callable"),
    ({"num_workers": 0}, ValueError, "num_workers must be a positive int, got 0"),
    ({"num_workers": 1.5}, ValueError, "num_workers must be a positive int"),
    ({"num_workers": True}, ValueError, "num_workers must be a positive int"),
    ({"devices_per_worker": -2}, ValueError, "devices_per_worker must be a positive int"),
    ({"grad_shard_bytes": 0}, ValueError, "grad_shard_bytes must be a positive int"),
    ({"num_ps": 0}, ValueError, "num_ps must be a positive int"),
    ({"strategy": "allreduce"}, ValueError, r"strategy must be one of \['simple', 'ps'\], got 'allreduce'"),
    ({"all_reduce_alg": "ring"}, ValueError, r"all_reduce_alg must be one of \['simple', 'tree', 'nccl'\]"),
    ({"all_reduce_alg": "nccl"}, ValueError, "all_reduce_alg='nccl' needs GPU devices"),
    ({"gpu": "yes"}, TypeError, "gpu must be True or False"),
    ({"step_timeout_s": 0}, ValueError, "step_timeout_s must be a positive number"),
    ({"stall_warning_s": -1}, ValueError, "stall_warning_s must be a positive number"),
    ({"on_nonfinite": "warn"}, ValueError, r"on_nonfinite must be one of \['raise', 'skip', 'ignore'\]"),
    ({"max_failures": -1}, ValueError, "max_failures must be an int >= 0, got -1"),
    ({"elastic": 1}, TypeError, "elastic must be True or False"),
])
def test_bad_arguments_fail_before_ray_starts(change, error, message):
    was_running = ray.is_initialized()
    with pytest.raises(error, match=message):
        dsgd.DistributedSGD(**{**GOOD, **change})
    assert ray.is_initialized() == was_running


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
class TestOnCluster:
    def test_gpus_that_do_not_exist_fail_fast(self):
        before = dsgd_actor_names()
        with pytest.raises(dsgd.ResourceError, match=r"2 GPU.*cluster has .* 0 GPU.*gpu=False"):
            dsgd.DistributedSGD(tiny.creator(2, 4), 1, 2, gpu=True)
        assert dsgd_actor_names() == before  # refused before any worker was started

    def test_too_many_workers_fail_fast(self):
        with pytest.raises(dsgd.ResourceError, match=r"asked for 64 worker\(s\).*fits only 4"):
            dsgd.DistributedSGD(tiny.creator(1, 4), 64, 1, gpu=False)

    def test_model_creator_error_surfaces_with_its_traceback(self):
        def exploding_creator(worker_index, device_index):
            raise KeyError("no such dataset: imagenet-22k")

        with pytest.raises(KeyError, match="no such dataset: imagenet-22k") as info:
            dsgd.DistributedSGD(exploding_creator, 1, 1, gpu=False)
        assert "exploding_creator" in str(info.value)


# Replicas are built and checked the same way in a worker and in-process: these run
# in-process (conftest gives this process 2 logical CPU devices). That a worker's
# error reaches the driver with its traceback is tested on the cluster above.
def build_replicas(creator, devices_per_worker, worker_index=0):
    return Replicas(creator, worker_index, devices_per_worker, False, "simple").setup()


def test_model_creator_must_return_a_model():
    with pytest.raises(TypeError, match=r"model_creator\(0, 0\) must return a dsgd.Model, got str"):
        build_replicas(lambda w, d: "model", 1)


def test_replicas_with_different_shapes_in_one_worker():
    def creator(w, d):
        return tiny.TinyModel(w, d, 2, 4) if d == 0 else WideReplica(w, d)

    with pytest.raises(dsgd.ModelMismatchError,
                       match=r"worker 0: replica 1: variable 0 .* is float32\(5, 9\) but replica 0's"):
        build_replicas(creator, 2)


def test_workers_with_different_shapes():
    def tiny_model(w, d):
        return tiny.TinyModel(w, d, 1, 4)

    infos = [build_replicas(tiny_model, 1), build_replicas(WideReplica, 1, worker_index=1)]
    with pytest.raises(dsgd.ModelMismatchError, match=r"worker 1's replicas .* variable 0"):
        check_signatures(infos)
    # Another worker's replicas of the same model (its own variables, seeded
    # differently): equal signatures pass.
    same = build_replicas(tiny_model, 1, worker_index=1)
    assert [same[k] == infos[0][k] for k in ("shapes", "dtypes", "optimizers", "groups")] == \
        [True] * 4
    check_signatures([infos[0], same])


def test_replicas_sharing_one_model():
    shared = {}

    def creator(w, d):
        if "model" not in shared:
            shared["model"] = tiny.TinyModel(w, d, 2, 4)
        return shared["model"]

    with pytest.raises(dsgd.ModelMismatchError, match="shares variable 0"):
        build_replicas(creator, 2)


class Faulty(tiny.TinyModel):
    """tiny's model (batch 4; SGD with momentum, or plain SGD: new weights are all
    it takes to train on after a NaN) that misbehaves as `arm` says: replica 1's
    batch `nan_at` (0-based) holds a NaN; replica 0's get_batch call `fail_at`
    (0-based) raises ValueError, once (a worker asks its replicas in order, so
    its other replicas are not asked for that step)."""

    def __init__(self, worker_index, device_index, devices_per_worker, optimizer):
        import keras

        super().__init__(worker_index, device_index, devices_per_worker, 4)
        if optimizer == "sgd":
            self.optimizer = keras.optimizers.SGD(learning_rate=0.1)
        self.arm()

    def arm(self, nan_at=None, fail_at=None):
        """From batch 0 again, with these faults."""
        self.steps, self.calls, self.nan_at, self.fail_at = 0, 0, nan_at, fail_at

    def get_batch(self):
        self.calls += 1
        if self.replica == 0 and self.calls - 1 == self.fail_at:
            raise ValueError(f"no batch {self.fail_at}")
        step = self.steps
        x, y = super().get_batch()
        if self.replica == 1 and step == self.nan_at:
            x = x.copy()
            x[0, 0] = np.nan
        return x, y


# workers, devices, on_nonfinite, optimizer, options: one instance per configuration,
# shared by its tests (pytest runs them together, one instance alive at a time).
CONFIGS = {
    "2x1-raise": (2, 1, "raise", "sgdm", {}),  # the exchange path
    # The local path; train() in calls of 2 steps, the next queued behind.
    "1x2-raise": (1, 2, "raise", "sgd", {"local_steps_per_call": 2}),
    "2x1-skip": (2, 1, "skip", "sgdm", {}),
    "1x2-skip": (1, 2, "skip", "sgdm", {}),
}


@pytest.fixture(scope="module")
def faulty(request, ray_local, tmp_path_factory):
    """`faulty(nan_at=, fail_at=)`: configuration `request.param`'s instance back at
    its start (weights, optimizer state, step count; a checkpoint) with its
    replicas armed so."""
    workers, devices, on_nonfinite, optimizer, options = CONFIGS[request.param]
    with dsgd.DistributedSGD(lambda w, d: Faulty(w, d, devices, optimizer), workers, devices,
                             gpu=False, grad_shard_bytes=128, on_nonfinite=on_nonfinite,
                             **options) as sgd:
        reset = Reset(sgd, str(tmp_path_factory.mktemp("errors") / "start"))

        def start(nan_at=None, fail_at=None):
            reset()
            sgd.foreach_model(lambda m: m.arm(nan_at, fail_at))
            return sgd

        yield start


@pytest.mark.cluster
@pytest.mark.parametrize("faulty", ["2x1-raise", "1x2-raise"], indirect=True)
def test_nonfinite_gradient_raises_naming_step_worker_and_replica(faulty):
    sgd = faulty(nan_at=1)
    workers = sgd.num_workers
    sgd.step()
    before = sgd.foreach_model(lambda m: m.get_weights())
    where = "worker 1, replica 0" if workers == 2 else "worker 0, replica 1"
    # Several workers check before any update; one worker checks alongside its
    # update (a gate before it would cost ~10 % of every step) and says so.
    outcome = "no weights were changed" if workers == 2 else "the update was applied"
    with pytest.raises(dsgd.NonFiniteError, match=f"step 2: non-finite gradient .* on {where} "
                                                  rf"\(global replica 1\); {outcome}"):
        sgd.step()
    after = sgd.foreach_model(lambda m: m.get_weights())
    if workers == 2:
        for a, b in zip(after, before, strict=True):
            for x, y in zip(a, b, strict=True):
                np.testing.assert_array_equal(x, y)
    else:
        assert not all(np.isfinite(w).all() for w in after[0])
    assert sgd.steps_done == (1 if workers == 2 else 2)


@pytest.mark.cluster
@pytest.mark.parametrize("faulty", ["2x1-skip", "1x2-skip"], indirect=True)
def test_nonfinite_gradient_skipped(faulty):
    sgd = faulty(nan_at=1)
    sgd.step()
    before = sgd.get_weights()
    stats = sgd.step(fetch_stats=True)
    assert stats["skipped"] and stats["skipped_steps"] == 1 and stats["step"] == 1
    for x, y in zip(sgd.get_weights(), before, strict=True):
        np.testing.assert_array_equal(x, y)
    stats = sgd.step(fetch_stats=True)  # the next batches are finite again
    assert not stats["skipped"] and stats["step"] == 2 and np.isfinite(stats["loss"])
    assert all(np.isfinite(w).all() for w in sgd.get_weights())


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
def test_object_store_too_small_is_named(caplog):
    # The check DistributedSGD runs once the workers have reported their variables,
    # before any step: here for 128 MiB of gradients, 2 workers, the test cluster's store.
    plan = plan_shards([(8192, 4096)], ["float32"], 50_000_000)
    with pytest.raises(dsgd.ResourceError, match=r"object store is too small: one step with 2 "
                       r"workers holds 3 x 134.2 MB.*object_store_memory is 268.4 MB"):
        check_store(plan, 2)
    caplog.set_level(logging.WARNING, logger="dsgd")
    check_store(plan_shards([(1024, 1024)], ["float32"], 50_000_000), 2)  # 5 x 4 MiB fits
    assert "spill" not in caplog.text
    # 3 x 67 MB fits one step, not the 5 x 67 MB of two overlapping ones: a warning.
    check_store(plan_shards([(4096, 4096)], ["float32"], 50_000_000), 2)
    assert "holds one step's 3 x 67.1 MB" in caplog.text and "not the 5 x" in caplog.text


def test_draining_a_call_counts_it_and_reports_an_applied_nonfinite_step(caplog):
    """A call of local steps whose outcome no one reads (another error is being
    raised) is still counted; an applied NaN step in it is logged, not lost."""
    from dsgd.config import Config
    from dsgd.engine.loop import StepLoop
    from dsgd.engine.state import Progress
    from dsgd.comm.reports import StepReport
    from dsgd.engine.step import StepResult

    progress = Progress()
    for _ in range(4):
        progress.count(skipped=False)
    actors = types.SimpleNamespace(slots=[0], num_workers=1)
    loop = StepLoop(Config(tiny.creator(2, 4), 1, 2, gpu=False), actors, None, progress, None)

    class Call:  # an in-process stand-in for step.LocalSteps
        applies_pending = True

        def finish(self):
            return [StepResult([StepReport(finite=[True, True])], [0.0], 1),
                    StepResult([StepReport(finite=[True, False])], [0.0], 1),
                    StepResult([StepReport(finite=[False, False])], [0.0], 1,
                               skipped=True)]

    caplog.set_level(logging.WARNING, logger="dsgd")
    loop._drain(Call(), None)
    assert progress.steps_done == 6 and progress.skipped_steps == 1
    assert "step 6: non-finite gradient on replica(s) [1], applied" in caplog.text
    assert "step 5" not in caplog.text


class WideReplica(tiny.TinyModel):
    def __init__(self, worker_index, device_index):
        import keras

        super().__init__(worker_index, device_index, 2, 4)
        self.model = keras.Sequential([keras.Input((tiny.IN,)), keras.layers.Dense(9),
                                       keras.layers.Dense(tiny.OUT)])


@pytest.mark.cluster
@pytest.mark.parametrize("faulty", ["1x2-raise"], indirect=True)
def test_nonfinite_in_train_stops_the_steps_queued_behind_it(faulty):
    """One worker runs train()'s steps several per call, the next call queued
    behind the current one: a NaN step (applied, as with one worker always) stops
    its call and the queued one, so no later step is applied, and the driver's
    count matches the worker's. The next train() runs normally."""
    sgd = faulty(nan_at=2)  # NaN at step 3: the 2nd call of 2 steps
    with pytest.raises(dsgd.NonFiniteError, match="step 3: non-finite gradient"):
        sgd.train(num_steps=8)
    applied = ray.get(sgd.workers[0].ping.remote(), timeout=60).applied_steps
    assert sgd.steps_done == applied == 3
    sgd.set_weights([np.ones_like(w) * 0.1 for w in sgd.get_weights()])  # no NaN left
    summary = sgd.train(num_steps=5)
    assert summary["steps"] == 5 and sgd.steps_done == 8
    assert ray.get(sgd.workers[0].ping.remote(), timeout=60).applied_steps == 8
    assert np.isfinite(summary["loss"])


@pytest.mark.cluster
@pytest.mark.parametrize("faulty", ["1x2-raise"], indirect=True)
@pytest.mark.parametrize("fail_at", [2, 3])  # the first step of the 2nd call, its second
def test_a_step_raising_in_a_call_of_several_counts_the_steps_before_it(faulty, fail_at):
    """One worker, train() in calls of 2 steps: a step whose get_batch raises
    stops its call and the call queued behind it; the error reaches the caller,
    and the steps applied before it are counted (driver and worker agree)."""
    sgd = faulty(fail_at=fail_at)
    with pytest.raises(ValueError, match=f"no batch {fail_at}"):
        sgd.train(num_steps=8)
    applied = ray.get(sgd.workers[0].ping.remote(), timeout=60).applied_steps
    assert sgd.steps_done == applied == fail_at
    assert sgd.train(num_steps=3)["steps"] == 3  # a new call runs again
    assert ray.get(sgd.workers[0].ping.remote(), timeout=60).applied_steps == fail_at + 3
