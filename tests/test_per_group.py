"""Applying a step in parts on the overlapped workers' exchange (Worker._apply_arriving):
the buckets whose means are in when the step is decided are applied in one update
(Replicas.apply_stage), the rest in a second. The two must be one update of the whole
step: the same weights and optimizer state, bit for bit, as one apply, with
learning-rate schedules, Adam's bias correction, weight decay and several optimizers.
Optimizers that need every gradient at once (per_group_blocker) apply the step at once
whatever has arrived. Here each worker's `StepExchange.ready_prefix` is patched to say 1
(two updates: bucket 0, then bucket 1) or 0 (one update) whatever the timing, and the
replicas' applies are counted, so each test shows which path ran."""

import dataclasses

import numpy as np
import pytest

import dsgd
from dsgd.worker.replicas import per_group_blocker
import tiny
from helpers import Reset, ready_patch, reset_tiny_steps, unpatch

BATCH, STEPS = 4, 4
TOL = 1e-5  # float32 round-off of 4 steps (as tests/test_exact.py)

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


def make(creator, **kwargs):
    # 100-byte shards over 2 PS: 2 buckets, and variable 0 (140 bytes) split across them.
    return dsgd.DistributedSGD(creator, 2, 1, gpu=False, grad_shard_bytes=100, num_ps=2,
                               step_timeout_s=120, overlap=True, **kwargs)


def keyed(w, d):
    """Adam with a schedule (the rate and the bias correction read the iteration
    count); batches keyed by that count, which travels with the optimizer state."""
    return tiny.StepKeyedModel(w, d, 1, BATCH, "adam_schedule")


def run_steps(sgd, ready: int) -> list[dict]:
    """STEPS steps, one `sgd.step()` each (so no step is kept for the next one's
    compiled call), with every worker's ready_prefix saying `ready`; returns
    each worker's applies {"whole": n, "part": n}."""
    sgd.foreach_worker(ready_patch(ready))
    try:
        for _ in range(STEPS):
            sgd.step()
        return sgd.foreach_worker(lambda w: w.applies)
    finally:
        sgd.foreach_worker(unpatch)


def optimizer_state(sgd):
    """Every replica's optimizer variables, worker-major."""
    return sgd.foreach_worker(
        lambda w: [[np.array(v.numpy()) for v in w.replicas.optimizer_variables(i)]
                   for i in range(len(w.replicas.replicas))])


def plan_facts(sgd) -> dict:
    """The buckets the workers send and apply by (the same on every worker): how
    many, whether a variable is split across them, and in how many stages
    apply_stage updates the variables (`last`: each variable's last bucket).
    The workers lay the buckets out when they join the exchange, at the first
    step: call it after one."""
    def facts(w):
        from dsgd.worker.replicas import _last_group_of_variables

        plan, groups = w.replicas.plan, w._buckets.groups
        last = _last_group_of_variables(plan, groups)
        return {"overlap": w.plan.during_backward, "groups": len(groups),
                "split_across_groups": any(
                    len({g for g, shards in enumerate(groups) for j, _ in plan.pieces_of(v)
                         if j in shards}) > 1 for v in range(len(plan.shapes))),
                "stages": len(set(last)), "last": list(last),
                "blocker": w.replicas.per_group_blocker}

    first, *rest = sgd.foreach_worker(facts)
    assert all(f == first for f in rest), [first, *rest]
    assert first["overlap"] and first["blocker"] == sgd.per_group_blocker
    return first


ONCE = {"whole": STEPS, "part": 0}
IN_TWO = {"whole": 0, "part": 2 * STEPS}


def staged_and_whole(sgd, reset):
    """STEPS steps from the instance's start applied in two updates each, then,
    from the start again, the same steps applied at once. Returns (staged,
    whole), each (weights, every replica's optimizer variables)."""
    runs = []
    for ready, want in ((1, IN_TWO), (0, ONCE)):
        reset()
        assert run_steps(sgd, ready) == [want] * 2, ready
        runs.append((sgd.get_weights(), optimizer_state(sgd)))
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


def check_adam_with_a_schedule(run: Shared, optimizer) -> None:
    sgd = run.sgd
    staged, whole = staged_and_whole(sgd, run.reset)
    facts = plan_facts(sgd)
    assert facts["blocker"] is None
    assert facts["groups"] == 2 and facts["stages"] == 2 and facts["split_across_groups"]
    assert_one_update(staged, whole)
    # The iteration count was held between the updates: one per step, not one per update.
    iterations = [replica[0] for worker in staged[1] for replica in worker]
    assert all(int(i) == STEPS for i in iterations)
    expected, _ = tiny.reference_run(run.initial, 2, BATCH, STEPS, optimizer)
    for got, want in zip(staged[0], expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    assert max(np.abs(a - b).max() for a, b in zip(staged[0], run.initial, strict=True)) > 1e-2


def test_adam_with_a_schedule_in_two_updates_equals_one_apply_and_the_reference(shared):
    check_adam_with_a_schedule(shared, "adam_schedule")


@pytest.mark.slow  # the same two-update path as adam_schedule above, plus weight decay
def test_adamw_with_a_schedule_in_two_updates_equals_one_apply_and_the_reference(tmp_path):
    with make(lambda w, d: tiny.StepKeyedModel(w, d, 1, BATCH, "adamw_schedule")) as sgd:
        run = Shared(sgd, Reset(sgd, str(tmp_path / "start")), sgd.get_weights())
        check_adam_with_a_schedule(run, "adamw_schedule")


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
def test_two_optimizers_in_two_updates_equal_one_apply_and_the_reference(tmp_path):
    with make(lambda w, d: tiny.TwoOptimizerModel(w, d, 1, BATCH)) as sgd:
        initial = sgd.get_weights()
        staged, whole = staged_and_whole(sgd, Reset(sgd, str(tmp_path / "start"),
                                                    reset_tiny_steps))
        facts = plan_facts(sgd)
    assert facts["blocker"] is None and facts["stages"] == 2
    # Bucket 0 holds the last layers' gradients: Adam (layer 2: variables 2 and 3) is
    # updated in stage 0 only, SGD (layer 1: variables 0 and 1) in both, so its count
    # is held between them.
    assert facts["last"][2] == facts["last"][3] == 0
    assert len({facts["last"][0], facts["last"][1]}) == 2
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
        initial = sgd.get_weights()
        # Bucket 0 in when each step is decided: applied at once all the same.
        assert run_steps(sgd, 1) == [ONCE] * 2
        final = sgd.get_weights()
        facts = plan_facts(sgd)
    assert "global_clipnorm" in facts["blocker"] and facts["groups"] == 2
    expected, _ = tiny.reference_run(initial, 2, BATCH, STEPS, "adam_global_clipnorm")
    for got, want in zip(final, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    assert max(np.abs(a - b).max() for a, b in zip(final, initial, strict=True)) > 1e-2


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
