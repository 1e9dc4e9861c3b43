"""DESIGN §2, tested exactly on a real local Ray cluster: N workers x D devices
with batch b train like one model on the concatenated N*D*b batches.

One instance per configuration, shared by that configuration's tests (a
module-scoped fixture parametrised by configuration: pytest runs each
configuration's tests together, so one instance is alive at a time); a test
that trains again first puts it back to its start (`helpers.Reset`)."""

import dataclasses

import numpy as np
import pytest

import dsgd
import tiny
from helpers import Reset, assert_replicas_identical, replica_weights, reset_tiny_steps

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

BATCH = 4
STEPS = 3
TOL = 1e-5

# workers, devices, strategy, optimizer, shard_bytes, num_ps, all_reduce_alg
CASES = {
    "1x1-ps-sgdm": (1, 1, "ps", "sgdm", 10_000_000, None, "simple"),
    "1x2-simple-adam": (1, 2, "simple", "adam", 10_000_000, None, "simple"),
    "2x1-simple-sgdm": (2, 1, "simple", "sgdm", 10_000_000, None, "simple"),
    "2x1-ps-adam-7shards-1ps": (2, 1, "ps", "adam", 64, 1, "simple"),
    "2x2-ps-sgdm-split-fuse": (2, 2, "ps", "sgdm", 128, None, "simple"),
    "2x2-simple-adam-tree": (2, 2, "simple", "adam", 10_000_000, None, "tree"),
    "2x2-ps-adam-tree-3shards-2ps": (2, 2, "ps", "adam", 100, 2, "tree"),
}
# The workers' exchange with the gradient sent during the backward pass (overlap=True;
# CPU workers send it after the backward pass by default, as the other "ps" cases do).
OVERLAPPED = {"2x2-ps-adam-tree-3shards-2ps"}
# train() of one worker runs several steps per actor call (dsgd/engine/loop.py,
# LocalSteps): 1x2 in calls of 3 here, 1x1 in calls of the default size.
LOCAL_STEPS_PER_CALL = {"1x2-simple-adam": 3}


@dataclasses.dataclass
class Run:
    """A configuration's instance and what its first STEPS steps did."""

    sgd: dsgd.DistributedSGD
    reset: Reset  # back to the weights, optimizer state and batches of step 0
    initial: list
    final: list
    losses: list
    info: dict


RESULTS: dict[str, Run] = {}  # by configuration, for test_simple_and_ps_agree


def start(key: str, path: str):
    workers, devices, strategy, optimizer, shard_bytes, num_ps, alg = CASES[key]
    sgd = dsgd.DistributedSGD(tiny.creator(devices, BATCH, optimizer), workers, devices,
                              gpu=False, strategy=strategy, grad_shard_bytes=shard_bytes,
                              num_ps=num_ps, all_reduce_alg=alg, overlap=key in OVERLAPPED,
                              **({"local_steps_per_call": LOCAL_STEPS_PER_CALL[key]}
                                 if key in LOCAL_STEPS_PER_CALL else {}))
    reset = Reset(sgd, path, reset_tiny_steps)
    initial = sgd.get_weights()
    losses = []
    for _ in range(STEPS):
        losses.append(sgd.step(fetch_stats=True)["loss"])
        assert len(replica_weights(sgd)) == workers * devices
        assert_replicas_identical(sgd)  # bit-identical after every step, not just close
    plan = sgd.plan
    info = {"num_shards": plan.num_shards, "num_ps": len(sgd.ps_actors),
            "fused": any(len(shard.pieces) > 1 for shard in plan.shards),
            "split": any(len(plan.pieces_of(v)) > 1 for v in range(len(plan.shapes)))}
    RESULTS[key] = Run(sgd, reset, initial, sgd.get_weights(), losses, info)
    return RESULTS[key]


@pytest.fixture(scope="module")
def run(request, tmp_path_factory):
    """The instance of configuration `request.param` (a CASES key), trained STEPS
    steps one at a time, replicas compared after each."""
    result = start(request.param, str(tmp_path_factory.mktemp("exact") / "start"))
    with result.sgd:
        yield result


def expected(key: str, initial, steps: int):
    workers, devices, _, optimizer, *_ = CASES[key]
    return tiny.reference_run(initial, workers * devices, BATCH, steps, optimizer)


@pytest.mark.parametrize("run", list(CASES), indirect=True)
def test_matches_single_process_training(run, request):
    key = request.node.callspec.params["run"]
    want, want_losses = expected(key, run.initial, STEPS)
    for got, w in zip(run.final, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=0, atol=TOL)
    np.testing.assert_allclose(run.losses, want_losses, rtol=0, atol=TOL)
    # The weights must actually move, or the comparison above proves nothing.
    assert max(np.abs(a - b).max() for a, b in zip(run.final, run.initial, strict=True)) > 1e-2
    if key == "2x1-ps-adam-7shards-1ps":
        assert run.info["num_shards"] == 7 and run.info["num_ps"] == 1  # more shards than PS
        assert run.info["split"]
    if key == "2x2-ps-sgdm-split-fuse":
        assert run.info["fused"] and run.info["split"] and run.info["num_ps"] == 2


@pytest.mark.parametrize("run", ["2x2-ps-adam-tree-3shards-2ps"], indirect=True)
def test_simple_and_ps_agree(run, tmp_path):
    # The 2x2 Adam runs with the tree allreduce of CASES (the "simple" one ran
    # before this one's instance started, unless test selection left it out).
    simple = RESULTS.get("2x2-simple-adam-tree")
    if simple is None:
        with start("2x2-simple-adam-tree", str(tmp_path / "start")).sgd:
            simple = RESULTS["2x2-simple-adam-tree"]
    for a, b in zip(simple.final, run.final, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL)
    np.testing.assert_allclose(simple.losses, run.losses, rtol=0, atol=TOL)


@pytest.mark.parametrize("run", ["2x1-ps-adam-7shards-1ps"], indirect=True)
def test_train_with_a_step_in_flight_matches_single_process_training(run):
    """train(num_steps) submits each next step before the last one's result is back
    (dsgd/engine/loop.py); the weights are still those of steps run one at a time."""
    sgd = run.reset()
    assert sgd.steps_done == 0
    summary = sgd.train(num_steps=STEPS + 2)
    assert summary["steps"] == STEPS + 2 and sgd.steps_done == STEPS + 2
    want, losses = expected("2x1-ps-adam-7shards-1ps", run.initial, STEPS + 2)
    for got, w in zip(assert_replicas_identical(sgd), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=0, atol=TOL)
    assert summary["loss"] == pytest.approx(float(np.mean(losses)), abs=TOL)
    # Each worker's figures come once per call (dsgd/comm/reports.py): both workers'
    # batches of every step, and their losses average to the steps' losses.
    workers = summary["workers"]
    assert [w["batch_count"] for w in workers] == [STEPS + 2] * 2
    assert [w["num_samples"] for w in workers] == [(STEPS + 2) * BATCH] * 2
    assert summary["num_samples"] == 2 * (STEPS + 2) * BATCH
    mean = sum(w["sums"]["loss"] for w in workers) / sum(w["num_samples"] for w in workers)
    assert mean == pytest.approx(float(np.mean(losses)), abs=TOL)
    assert np.mean([w["last"]["loss"] for w in workers]) == pytest.approx(losses[-1], abs=TOL)


# (Steps chosen from the configuration, not parametrised beside it: a parameter that
# is not the fixture's would make pytest run these apart from the instance's other tests.)
@pytest.mark.parametrize("run", ["1x2-simple-adam", "1x1-ps-sgdm"], indirect=True)
def test_one_worker_train_in_calls_of_several_steps_matches_single_process_training(run,
                                                                                   request):
    """One worker, train(): several steps per actor call, the next call queued
    behind the current one (dsgd/engine/loop.py, LocalSteps): 7 steps in calls of
    3, 3 and 1, or 20 in calls of the default size (8, 8 and 4), are the steps of
    one model."""
    key = request.node.callspec.params["run"]
    steps = {"1x2-simple-adam": 7, "1x1-ps-sgdm": 20}[key]
    assert run.sgd.config.steps_per_call(1, False) == LOCAL_STEPS_PER_CALL.get(
        key, dsgd.constants.LOCAL_STEPS_PER_CALL) == (3 if steps == 7 else 8)
    sgd = run.reset()
    summary = sgd.train(num_steps=steps)
    assert summary["steps"] == steps and sgd.steps_done == steps
    workers, devices = CASES[key][:2]
    assert summary["step_s"] > 0 and summary["num_samples"] == steps * workers * devices * BATCH
    want, losses = expected(key, run.initial, steps)
    for got, w in zip(assert_replicas_identical(sgd), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=0, atol=TOL)
    assert summary["loss"] == pytest.approx(float(np.mean(losses)), abs=TOL)
