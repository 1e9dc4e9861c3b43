"""Per-group apply (strategy "ps", the driver-relayed exchange: `worker_exchange=False`
here; the workers' own exchange, backup workers included, does not read the flag): each worker applies a PS group's mean as
soon as it is in the store (Worker.apply_staged). It must be one update of the whole
step: the same weights and optimizer state, bit for bit, as one apply, with
learning-rate schedules, Adam's bias correction and several optimizers."""

import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import ray

import dsgd
from dsgd.engine import step as step_module
from dsgd.engine.recovery import Recovery
from dsgd.worker.replicas import _last_group_of_variables, per_group_blocker
import tiny
from helpers import Reset, assert_replicas_identical, reset_tiny_steps

BATCH, STEPS = 4, 4
TOL = 1e-5  # float32 round-off of 4 steps (as tests/test_exact.py)

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


def make(creator, **kwargs):
    # 100-byte shards over 2 PS: 2 groups, and variable 0 (140 bytes) split across them;
    # the driver relays the groups (the workers' own exchange applies each step at once).
    return dsgd.DistributedSGD(creator, 2, 1, gpu=False, grad_shard_bytes=100, num_ps=2,
                               step_timeout_s=120, worker_exchange=False, **kwargs)


def keyed(w, d):
    """Adam with a schedule (the rate and the bias correction read the iteration
    count); batches keyed by that count, which travels with the optimizer state:
    a restored checkpoint or a replacement worker continues the data exactly."""
    return tiny.StepKeyedModel(w, d, 1, BATCH, "adam_schedule")


def optimizer_state(sgd):
    """Every replica's optimizer variables, worker-major."""
    return sgd.foreach_worker(
        lambda w: [[np.array(v.numpy()) for v in w.replicas.optimizer_variables(i)]
                   for i in range(len(w.replicas.replicas))])


def plan_facts(sgd) -> dict:
    plan, groups = sgd.plan, sgd.shard_groups
    last = _last_group_of_variables(plan, groups)
    return {"per_group": sgd.applies_per_group, "groups": len(groups),
            "split_across_groups": any(
                len({g for g, shards in enumerate(groups) for j, _ in plan.pieces_of(v)
                     if j in shards}) > 1 for v in range(len(plan.shapes))),
            "stages": len(set(last)), "last": last, "blocker": sgd.per_group_blocker}


def staged_and_whole(sgd, reset, monkeypatch):
    """STEPS steps from the instance's start applied group by group, then, from the
    start again, the same steps applied at once: the driver's choice
    (dsgd/engine/step.py `per_group`, which only reads `apply_per_group`) patched
    to what apply_per_group=False makes it. Returns (staged, whole), each
    (weights, every replica's optimizer variables)."""
    runs, asked = [], []
    for patched in (False, True):
        reset()
        if patched:
            monkeypatch.setattr(step_module, "per_group", lambda *a: asked.append(1) or False)
        for _ in range(STEPS):
            sgd.step()
        runs.append((sgd.get_weights(), optimizer_state(sgd)))
    monkeypatch.undo()
    assert len(asked) == STEPS  # every "whole" step asked, and applied at once
    return runs


def assert_one_update(staged, whole) -> None:
    """Bit for bit: the weights, and every replica's iterations and slots."""
    for a, b in zip(staged[0], whole[0], strict=True):
        np.testing.assert_array_equal(a, b)
    for worker_staged, worker_whole in zip(staged[1], whole[1], strict=True):
        for replica_staged, replica_whole in zip(worker_staged, worker_whole, strict=True):
            for a, b in zip(replica_staged, replica_whole, strict=True):
                np.testing.assert_array_equal(a, b)


@dataclasses.dataclass
class Shared:
    sgd: dsgd.DistributedSGD
    reset: Reset  # back to the start: weights, optimizer state (so batches), step count
    initial: list  # the weights at the start


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One `keyed` instance for the module."""
    with make(keyed) as sgd:
        yield Shared(sgd, Reset(sgd, str(tmp_path_factory.mktemp("per_group") / "start")),
                     sgd.get_weights())


@pytest.fixture(scope="module")
def uninterrupted(shared):
    """keyed's weights after 4 and after 5 uninterrupted steps."""
    sgd, weights = shared.reset(), {}
    for step in range(1, 6):
        sgd.step()
        if step >= 4:
            weights[step] = sgd.get_weights()
    return weights


def check_adam_with_a_schedule(run: Shared, monkeypatch, optimizer) -> None:
    sgd = run.sgd
    facts = plan_facts(sgd)
    assert facts["per_group"] and facts["blocker"] is None
    assert facts["groups"] == 2 and facts["stages"] == 2 and facts["split_across_groups"]
    staged, whole = staged_and_whole(sgd, run.reset, monkeypatch)
    assert_one_update(staged, whole)
    # The iteration count was held between the groups: one per step, not one per group.
    iterations = [replica[0] for worker in staged[1] for replica in worker]
    assert all(int(i) == STEPS for i in iterations)
    expected, _ = tiny.reference_run(run.initial, 2, BATCH, STEPS, optimizer)
    for got, want in zip(staged[0], expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    assert max(np.abs(a - b).max() for a, b in zip(staged[0], run.initial, strict=True)) > 1e-2


def test_adam_with_a_schedule_per_group_equals_one_apply_and_the_reference(shared, monkeypatch):
    check_adam_with_a_schedule(shared, monkeypatch, "adam_schedule")


@pytest.mark.slow  # the same per-group path as adam_schedule above, plus weight decay
def test_adamw_with_a_schedule_per_group_equals_one_apply_and_the_reference(monkeypatch,
                                                                           tmp_path):
    with make(lambda w, d: tiny.StepKeyedModel(w, d, 1, BATCH, "adamw_schedule")) as sgd:
        run = Shared(sgd, Reset(sgd, str(tmp_path / "start")), sgd.get_weights())
        check_adam_with_a_schedule(run, monkeypatch, "adamw_schedule")


def two_optimizer_reference(initial, num_replicas: int, steps: int):
    """tiny.TwoOptimizerModel in one process: one model on the concatenated
    batches, SGD with momentum on the first layer and Adam with a schedule on the
    second, both from the gradient of the one loss."""
    import tensorflow as tf

    model = tiny.make_keras_model()
    model.set_weights(initial)
    groups = [model.layers[0].trainable_variables, model.layers[1].trainable_variables]
    optimizers = [tiny.make_optimizer("sgdm"), tiny.make_optimizer("adam_schedule")]
    for t in range(steps):
        batches = [tiny.make_batch(r, t, BATCH) for r in range(num_replicas)]
        x, y = (np.concatenate([b[k] for b in batches]) for k in (0, 1))
        with tf.GradientTape() as tape:
            loss = tiny.mse(model, x, y)
        grads = tape.gradient(loss, groups[0] + groups[1])
        optimizers[0].apply_gradients(zip(grads[:len(groups[0])], groups[0]))
        optimizers[1].apply_gradients(zip(grads[len(groups[0]):], groups[1]))
    return model.get_weights()


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_two_optimizers_per_group_equal_one_apply_and_the_reference(monkeypatch, tmp_path):
    with make(lambda w, d: tiny.TwoOptimizerModel(w, d, 1, BATCH)) as sgd:
        facts = plan_facts(sgd)
        assert facts["per_group"] and facts["stages"] == 2
        # Adam (layer 2: variables 2 and 3) is applied in both stages, so its count is held.
        assert len({facts["last"][2], facts["last"][3]}) == 2
        initial = sgd.get_weights()
        staged, whole = staged_and_whole(sgd, Reset(sgd, str(tmp_path / "start"),
                                                    reset_tiny_steps), monkeypatch)
    assert_one_update(staged, whole)
    # Both optimizers counted one iteration per step.
    counts = sorted(int(np.asarray(v)) for v in staged[1][0][0] if np.asarray(v).ndim == 0
                    and np.asarray(v).dtype.kind == "i")
    assert counts == [STEPS, STEPS]
    # Against one process, and far enough from the start that the comparison tells.
    expected = two_optimizer_reference(initial, 2, STEPS)
    for got, want in zip(staged[0], expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    for k in range(4):  # each optimizer moved each of its variables
        assert np.abs(staged[0][k] - initial[k]).max() > 1e-2, k


def test_global_clipnorm_applies_the_step_at_once_and_stays_exact():
    with make(tiny.creator(1, BATCH, "adam_global_clipnorm")) as sgd:
        facts = plan_facts(sgd)
        assert not facts["per_group"] and "global_clipnorm" in facts["blocker"]
        initial = sgd.get_weights()
        for _ in range(STEPS):
            sgd.step()
        final = sgd.get_weights()
    expected, _ = tiny.reference_run(initial, 2, BATCH, STEPS, "adam_global_clipnorm")
    for got, want in zip(final, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    assert max(np.abs(a - b).max() for a, b in zip(final, initial, strict=True)) > 1e-2


def assert_as_uninterrupted(sgd, uninterrupted) -> None:
    """Bit for bit: the weights of the uninterrupted run, the same on every replica."""
    for got, want in zip(assert_replicas_identical(sgd), uninterrupted, strict=True):
        np.testing.assert_array_equal(got, want)


def kill_ps_of_group(sgd, group: int) -> int:
    dead = sgd.ps_assignment[sgd.shard_groups[group][0]]
    os.kill(ray.get(sgd.ps_actors[dead].ping.remote(), timeout=60)["pid"], signal.SIGKILL)
    return dead


@pytest.mark.parametrize("last_group", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_ps_dead_mid_step_the_workers_compute_its_mean(last_group, shared, uninterrupted):
    """A PS is dead when step 3 starts (train(), step 4 in flight): the workers
    apply group by group, compute that PS's mean themselves from the gradients
    in the store, and complete the step; the driver then replaces the PS (a
    recovered failure, the step not retried). With the PS of the last group,
    group 0 is applied before the mean is found missing. The weights are those
    of an uninterrupted run, bit for bit."""
    sgd = shared.reset()
    failures = len(sgd.failures)
    sgd.step()
    sgd.step()
    assert sgd.applies_per_group
    dead = kill_ps_of_group(sgd, -1 if last_group else 0)
    summary = sgd.train(num_steps=2)
    assert len(sgd.failures) == failures + 1, sgd.failures
    reason = sgd.failures[-1]["reason"]
    assert f"PS actor(s) {dead} died" in reason and "not retried" in reason
    assert summary["steps"] == 2 and sgd.steps_done == 4
    assert len(sgd.ps_actors) == 2
    applied = [ray.get(w.ping.remote(), timeout=60)["applied_steps"] for w in sgd.workers]
    assert applied == [4, 4]
    assert_as_uninterrupted(sgd, uninterrupted[4])


def test_per_group_blocker_names_what_needs_every_gradient():
    import keras

    assert per_group_blocker([keras.optimizers.Adam()]) is None
    assert per_group_blocker([keras.optimizers.SGD(momentum=0.9, clipnorm=1.0)]) is None
    assert per_group_blocker([keras.optimizers.AdamW(weight_decay=0.1)]) is None
    assert "global_clipnorm" in per_group_blocker([keras.optimizers.Adam(global_clipnorm=1.0)])
    assert "use_ema" in per_group_blocker([keras.optimizers.Adam(use_ema=True)])
    assert "gradient_accumulation_steps" in per_group_blocker(
        [keras.optimizers.SGD(gradient_accumulation_steps=2)])
    assert "Nadam" in per_group_blocker([keras.optimizers.Nadam()])
    assert "LossScaleOptimizer" in per_group_blocker(
        [keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())])

    class MyAdam(keras.optimizers.Adam):
        pass

    assert "MyAdam" in per_group_blocker([MyAdam()])
    # One optimizer that cannot be split stops the whole step from being split.
    assert "Nadam" in per_group_blocker([keras.optimizers.SGD(), keras.optimizers.Nadam()])


@ray.remote(num_cpus=0)
class _Gone:
    def value(self):
        return None


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_a_worker_that_cannot_finish_a_partly_applied_step_exits():
    """Worker.apply_staged's rule when a group's mean can be neither read nor
    computed (its PS and the gradients both gone): having applied nothing it
    raises and lives on, its step count unchanged; having applied an earlier
    group it exits, since its weights would be neither the step's nor the last
    (the driver then recovers it as a dead worker)."""
    start = dsgd.comm.store.settled_usage()
    gone = _Gone.remote()
    ray.get(gone.value.remote(), timeout=60)
    ray.kill(gone)
    for _ in range(100):  # ray.kill is asynchronous: wait until its calls fail
        try:
            ray.get(gone.value.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the killed actor still answers")
    with make(keyed) as sgd:
        sgd.step()
        assert sgd.applies_per_group
        groups = tuple(tuple(g) for g in sgd.shard_groups)
        assert len(groups) == 2
        worker = sgd.workers[0]
        before = sgd.get_weights()
        zeros = [ray.put(tuple(np.zeros(sgd.plan.shards[j].num_elements,
                                        sgd.plan.shards[j].wire_numpy_dtype) for j in g))
                 for g in groups]
        lost = [[gone.value.remote() for _ in sgd.workers] for _ in groups]

        # Group 0 already fails: nothing applied, the error comes back, the worker lives.
        with pytest.raises(ray.exceptions.RayError):
            ray.get(worker.apply_staged.remote(groups, [gone.value.remote()] * 2, lost, 30.0),
                    timeout=120)
        assert ray.get(worker.ping.remote(), timeout=60)["applied_steps"] == 1
        np.testing.assert_array_equal(ray.get(worker.get_weights.remote(), timeout=60)[0],
                                      before[0])

        # Group 0 applied (a zero mean), then group 1 fails: the worker exits.
        pid = ray.get(worker.ping.remote(), timeout=60)["pid"]
        with pytest.raises(ray.exceptions.ActorDiedError):
            ray.get(worker.apply_staged.remote(groups, [zeros[0], gone.value.remote()], lost, 30.0),
                    timeout=120)
        for _ in range(100):  # the process has exited (a zombie until reaped, or gone)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        break
            except FileNotFoundError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"worker process {pid} still runs")
    # The means put here were lent to the worker that exited: wait for Ray to free
    # them, so that later tests' store counts start clean.
    del zeros
    left = dsgd.comm.store.drained_usage(baseline=start)
    assert left["num_objects"] <= start["num_objects"], (left, start)


# Three failures at once (a PS, then a worker found dead while the driver replaces
# it): `slow`. The default run keeps each alone (test_a_ps_dead_mid_step_the_workers_
# compute_its_mean, test_recovery.py).
@pytest.mark.slow
def test_a_worker_found_dead_after_a_ps_fallback_resubmits_the_step_ahead(monkeypatch, shared,
                                                                          uninterrupted):
    """train(), step 4 in flight: step 3 completes with the workers computing a
    dead PS's mean, and worker 1 is found dead too when the driver then replaces
    the PS (killed here just before it looks). Recovery copies worker 0's state
    to a replacement, between steps (nothing retried), and step 4, submitted to
    the old workers, is submitted again: the run ends as an uninterrupted one."""
    real, killed = Recovery.replace_dead_ps, []

    def worker_dies_first(recovery, groups):
        if not killed:
            handle = recovery.actors.workers[1]
            os.kill(ray.get(handle.ping.remote(), timeout=60)["pid"], signal.SIGKILL)
            for _ in range(100):
                try:
                    ray.get(handle.ping.remote(), timeout=60)
                except ray.exceptions.RayActorError:
                    break
                time.sleep(0.1)
            killed.append(1)
        real(recovery, groups)

    sgd = shared.reset()
    failures = len(sgd.failures)
    monkeypatch.setattr(Recovery, "replace_dead_ps", worker_dies_first)
    sgd.step()
    sgd.step()
    kill_ps_of_group(sgd, -1)
    summary = sgd.train(num_steps=3)
    assert killed and summary["steps"] == 3 and sgd.steps_done == 5
    assert len(sgd.failures) == failures + 1, sgd.failures
    failure = sgd.failures[-1]
    assert failure["step"] == 3 and "worker(s) 1 died" in failure["reason"]
    assert "no step to retry" in failure["reason"] and "retrying" not in failure["reason"]
    assert [ray.get(w.ping.remote(), timeout=60)["applied_steps"] for w in sgd.workers] == [5, 5]
    assert_as_uninterrupted(sgd, uninterrupted[5])
