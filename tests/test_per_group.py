"""Per-group apply (strategy "ps"): each worker applies a PS group's mean as soon
as it is in the store (Worker.apply_staged). It must be one update of the whole
step: the same weights and optimizer state, bit for bit, as one apply, with
learning-rate schedules, Adam's bias correction and several optimizers."""

import os
import signal
import time

import numpy as np
import pytest
import ray

import dsgd
from dsgd.engine.recovery import Recovery
from dsgd.worker.replicas import _last_group_of_variables, per_group_blocker
import tiny

BATCH, STEPS = 4, 4


def make(creator, **kwargs):
    # 100-byte shards over 2 PS: 2 groups, and variable 0 (140 bytes) split across them.
    return dsgd.DistributedSGD(creator, 2, 1, gpu=False, grad_shard_bytes=100, num_ps=2,
                               step_timeout_s=120, **kwargs)


def run(creator, per_group: bool, steps_to_run=STEPS):
    """(initial weights, final weights, every replica's optimizer variables, sgd facts)."""
    with make(creator, apply_per_group=per_group) as sgd:
        initial = sgd.get_weights()
        for _ in range(steps_to_run):
            sgd.step()
        plan, groups = sgd.plan, sgd.shard_groups
        last = _last_group_of_variables(plan, groups)
        facts = {"per_group": sgd.applies_per_group, "groups": len(groups),
                 "split_across_groups": any(
                     len({g for g, shards in enumerate(groups) for j, _ in plan.pieces_of(v)
                          if j in shards}) > 1 for v in range(len(plan.shapes))),
                 "stages": len(set(last)), "last": last, "blocker": sgd.per_group_blocker}
        optimizer_state = sgd.foreach_worker(
            lambda w: [[np.array(v.numpy()) for v in w.replicas.optimizer_variables(i)]
                       for i in range(len(w.replicas.replicas))])
        return initial, sgd.get_weights(), optimizer_state, facts


pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


# adamw_schedule (~14 s) is `slow`: the same per-group path as adam_schedule, plus weight decay.
@pytest.mark.parametrize("optimizer", ["adam_schedule",
                                       pytest.param("adamw_schedule", marks=pytest.mark.slow)])
def test_adam_with_a_schedule_per_group_equals_one_apply_and_the_reference(optimizer):
    creator = tiny.creator(1, BATCH, optimizer)
    initial, staged, staged_state, facts = run(creator, True)
    assert facts["per_group"] and facts["blocker"] is None
    assert facts["groups"] == 2 and facts["stages"] == 2 and facts["split_across_groups"]
    _, whole, whole_state, whole_facts = run(creator, False)
    assert not whole_facts["per_group"]
    for a, b in zip(staged, whole, strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit
    for worker_staged, worker_whole in zip(staged_state, whole_state, strict=True):
        for replica_staged, replica_whole in zip(worker_staged, worker_whole, strict=True):
            for a, b in zip(replica_staged, replica_whole, strict=True):
                np.testing.assert_array_equal(a, b)  # iterations and every slot
    # The iteration count was held between the groups: one per step, not one per group.
    iterations = [replica[0] for worker in staged_state for replica in worker]
    assert all(int(i) == STEPS for i in iterations)
    expected, _ = tiny.reference_run(initial, 2, BATCH, STEPS, optimizer)
    for got, want in zip(staged, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert max(np.abs(a - b).max() for a, b in zip(staged, initial, strict=True)) > 1e-2


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_two_optimizers_per_group_equal_one_apply():
    creator = lambda w, d: tiny.TwoOptimizerModel(w, d, 1, BATCH)  # noqa: E731
    initial, staged, staged_state, facts = run(creator, True)
    assert facts["per_group"] and facts["stages"] == 2
    # Adam (layer 2: variables 2 and 3) is applied in both stages, so its count is held.
    assert len({facts["last"][2], facts["last"][3]}) == 2
    _, whole, whole_state, _ = run(creator, False)
    for a, b in zip(staged, whole, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(staged_state[0][0], whole_state[0][0], strict=True):
        np.testing.assert_array_equal(a, b)
    # Both optimizers counted one iteration per step.
    counts = sorted(int(np.asarray(v)) for v in staged_state[0][0] if np.asarray(v).ndim == 0
                    and np.asarray(v).dtype.kind == "i")
    assert counts == [STEPS, STEPS]
    assert max(np.abs(a - b).max() for a, b in zip(staged, initial, strict=True)) > 1e-2


def test_global_clipnorm_applies_the_step_at_once_and_stays_exact():
    initial, final, _, facts = run(tiny.creator(1, BATCH, "adam_global_clipnorm"), True)
    assert not facts["per_group"] and "global_clipnorm" in facts["blocker"]
    expected, _ = tiny.reference_run(initial, 2, BATCH, STEPS, "adam_global_clipnorm")
    for got, want in zip(final, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def keyed(w, d):
    return tiny.StepKeyedModel(w, d, 1, BATCH)


@pytest.fixture(scope="module")
def uninterrupted():
    """keyed's weights after 4 and after 5 uninterrupted steps: one run for the module."""
    with make(keyed) as sgd:
        weights = {}
        for step in range(1, 6):
            sgd.step()
            if step >= 4:
                weights[step] = sgd.get_weights()
        return weights


def assert_as_uninterrupted(final, replicas, uninterrupted) -> None:
    """Bit for bit: the weights of the uninterrupted run, the same on every replica."""
    for got, want in zip(final, uninterrupted, strict=True):
        np.testing.assert_array_equal(got, want)
    for a, b in zip(*replicas, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("last_group", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_ps_dead_mid_step_the_workers_compute_its_mean(last_group, uninterrupted):
    """A PS is dead when step 3 starts (train(), step 4 in flight): the workers
    apply group by group, compute that PS's mean themselves from the gradients
    in the store, and complete the step; the driver then replaces the PS (a
    recovered failure, the step not retried). With the PS of the last group,
    group 0 is applied before the mean is found missing. The weights are those
    of an uninterrupted run, bit for bit."""
    with make(keyed) as sgd:
        sgd.step()
        sgd.step()
        assert sgd.applies_per_group
        group = sgd.shard_groups[-1 if last_group else 0]
        dead = sgd.ps_assignment[group[0]]
        os.kill(ray.get(sgd.ps_actors[dead].ping.remote(), timeout=60)["pid"], signal.SIGKILL)
        summary = sgd.train(num_steps=2)
        assert len(sgd.failures) == 1, sgd.failures
        reason = sgd.failures[0]["reason"]
        assert f"PS actor(s) {dead} died" in reason and "not retried" in reason
        assert summary["steps"] == 2 and sgd.steps_done == 4
        assert len(sgd.ps_actors) == 2
        applied = [ray.get(w.ping.remote(), timeout=60)["applied_steps"] for w in sgd.workers]
        assert applied == [4, 4]
        final = sgd.get_weights()
        replicas = sgd.foreach_model(lambda m: m.get_weights())
    assert_as_uninterrupted(final, replicas, uninterrupted[4])


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


# Two instances and three failures at once (~18 s): `slow`. The default run keeps each
# alone (test_a_ps_dead_mid_step_the_workers_compute_its_mean, test_recovery.py).
@pytest.mark.slow
def test_a_worker_found_dead_after_a_ps_fallback_resubmits_the_step_ahead(monkeypatch,
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

    monkeypatch.setattr(Recovery, "replace_dead_ps", worker_dies_first)
    with make(keyed) as sgd:
        sgd.step()
        sgd.step()
        dead = sgd.ps_assignment[sgd.shard_groups[-1][0]]
        os.kill(ray.get(sgd.ps_actors[dead].ping.remote(), timeout=60)["pid"], signal.SIGKILL)
        summary = sgd.train(num_steps=3)
        assert killed and summary["steps"] == 3 and sgd.steps_done == 5
        assert len(sgd.failures) == 1, sgd.failures
        failure = sgd.failures[0]
        assert failure["step"] == 3 and "worker(s) 1 died" in failure["reason"]
        assert "no step to retry" in failure["reason"] and "retrying" not in failure["reason"]
        assert [ray.get(w.ping.remote(), timeout=60)["applied_steps"] for w in sgd.workers] == [5, 5]
        final = sgd.get_weights()
        replicas = sgd.foreach_model(lambda m: m.get_weights())
    assert_as_uninterrupted(final, replicas, uninterrupted[5])
