"""DESIGN §2, tested exactly on a real local Ray cluster: N workers x D devices
with batch b train like one model on the concatenated N*D*b batches."""

import numpy as np
import pytest

import dsgd
import tiny

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

BATCH = 4
STEPS = 3
TOL = 1e-5


RUNS: dict = {}  # run() results by arguments, so a configuration is trained once per session


def run(*args):
    if args not in RUNS:
        RUNS[args] = train(*args)
    return RUNS[args]


def train(num_workers, devices, strategy, optimizer, shard_bytes=10_000_000, num_ps=None,
          all_reduce_alg="simple"):
    """Train STEPS steps; check replicas agree after every step. Returns
    (initial weights, final weights, per-step losses, the DistributedSGD's plan info)."""
    with dsgd.DistributedSGD(tiny.creator(devices, BATCH, optimizer), num_workers, devices,
                             gpu=False, strategy=strategy, grad_shard_bytes=shard_bytes,
                             num_ps=num_ps, all_reduce_alg=all_reduce_alg) as sgd:
        initial = sgd.get_weights()
        losses = []
        for _ in range(STEPS):
            losses.append(sgd.step(fetch_stats=True)["loss"])
            per_replica = sgd.foreach_model(lambda m: m.get_weights())
            assert len(per_replica) == num_workers * devices
            for weights in per_replica[1:]:
                for a, b in zip(per_replica[0], weights, strict=True):
                    np.testing.assert_array_equal(a, b)  # bit-identical, not just close
        plan = sgd.plan
        info = {"num_shards": plan.num_shards, "num_ps": len(sgd.ps_actors),
                "fused": any(len(shard.pieces) > 1 for shard in plan.shards),
                "split": any(len(plan.pieces_of(v)) > 1 for v in range(len(plan.shapes)))}
        return initial, sgd.get_weights(), losses, info


CASES = [
    # workers, devices, strategy, optimizer, shard_bytes, num_ps, all_reduce_alg
    pytest.param(1, 1, "ps", "sgdm", 10_000_000, None, "simple", id="1x1-ps-sgdm"),
    pytest.param(1, 2, "simple", "adam", 10_000_000, None, "simple", id="1x2-simple-adam"),
    pytest.param(2, 1, "simple", "sgdm", 10_000_000, None, "simple", id="2x1-simple-sgdm"),
    pytest.param(2, 1, "ps", "adam", 64, 1, "simple", id="2x1-ps-adam-7shards-1ps"),
    pytest.param(2, 2, "ps", "sgdm", 128, None, "simple", id="2x2-ps-sgdm-split-fuse"),
    pytest.param(2, 2, "simple", "adam", 10_000_000, None, "tree", id="2x2-simple-adam-tree"),
    pytest.param(2, 2, "ps", "adam", 100, 2, "tree", id="2x2-ps-adam-tree-3shards-2ps"),
]


@pytest.mark.parametrize("workers,devices,strategy,optimizer,shard_bytes,num_ps,alg", CASES)
def test_matches_single_process_training(workers, devices, strategy, optimizer, shard_bytes,
                                         num_ps, alg):
    initial, final, losses, info = run(workers, devices, strategy, optimizer, shard_bytes,
                                       num_ps, alg)
    expected, expected_losses = tiny.reference_run(initial, workers * devices, BATCH, STEPS,
                                                   optimizer)
    for got, want in zip(final, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    np.testing.assert_allclose(losses, expected_losses, rtol=0, atol=TOL)
    # The weights must actually move, or the comparison above proves nothing.
    assert max(np.abs(a - b).max() for a, b in zip(final, initial, strict=True)) > 1e-2
    if strategy == "ps" and workers > 1 and shard_bytes == 64:
        assert info["num_shards"] == 7 and info["num_ps"] == 1  # more shards than PS actors
        assert info["split"]
    if strategy == "ps" and workers > 1 and shard_bytes == 128:
        assert info["fused"] and info["split"] and info["num_ps"] == 2


def test_simple_and_ps_agree():
    # The two 2x2 Adam runs with the tree allreduce of CASES (trained there already).
    _, simple, simple_losses, _ = run(2, 2, "simple", "adam", 10_000_000, None, "tree")
    _, ps, ps_losses, _ = run(2, 2, "ps", "adam", 100, 2, "tree")
    for a, b in zip(simple, ps, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL)
    np.testing.assert_allclose(simple_losses, ps_losses, rtol=0, atol=TOL)


@pytest.mark.parametrize("workers,devices", [(1, 2), (2, 1)])
def test_train_with_a_step_in_flight_matches_single_process_training(workers, devices):
    """train(num_steps) submits each next step before the last one's result is back
    (dsgd/engine/loop.py); the weights are still those of steps run one at a time."""
    with dsgd.DistributedSGD(tiny.creator(devices, BATCH, "adam"), workers, devices, gpu=False,
                             grad_shard_bytes=128) as sgd:
        initial = sgd.get_weights()
        summary = sgd.train(num_steps=STEPS + 2)
        assert summary["steps"] == STEPS + 2 and sgd.steps_done == STEPS + 2
        final = sgd.get_weights()
        replicas = sgd.foreach_model(lambda m: m.get_weights())
    expected, losses = tiny.reference_run(initial, workers * devices, BATCH, STEPS + 2, "adam")
    for got, want in zip(final, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    assert summary["loss"] == pytest.approx(float(np.mean(losses)), abs=TOL)
    for weights in replicas[1:]:
        for a, b in zip(replicas[0], weights, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("most,steps", [(3, 7), (None, 40)])
def test_one_worker_train_in_calls_of_several_steps_matches_single_process_training(
        most, steps):
    """One worker, train(): several steps per actor call, the next call queued
    behind the current one (dsgd/engine/loop.py, LocalSteps): 7 steps in calls of 3, 3
    and 1, or 40 in calls of the default size, are the steps of one model."""
    options = {} if most is None else {"local_steps_per_call": most}
    with dsgd.DistributedSGD(tiny.creator(2, BATCH, "adam"), 1, 2, gpu=False, **options) as sgd:
        initial = sgd.get_weights()
        summary = sgd.train(num_steps=steps)
        assert summary["steps"] == steps and sgd.steps_done == steps
        assert summary["step_s"] > 0 and summary["num_samples"] == steps * 2 * BATCH
        final = sgd.get_weights()
    expected, losses = tiny.reference_run(initial, 2, BATCH, steps, "adam")
    for got, want in zip(final, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    assert summary["loss"] == pytest.approx(float(np.mean(losses)), abs=TOL)
