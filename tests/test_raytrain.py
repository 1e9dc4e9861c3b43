"""dsgd as a Ray Train backend, with 2 Ray Train workers on the local cluster:
shards, ranks, exact DistributedGradientTape and DistributedOptimizer +
model.fit, the Result, a SIGKILL restart, and no PS actor left behind."""

import time

import numpy as np
import pytest
import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig

import dsgd.train as dt
from dsgd.comm.ps_client import PSClient
from helpers import dsgd_actor_names
import raytrain_loops
import tiny

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

STEPS, BATCH, ROWS = 3, 4, 40


@pytest.mark.slow  # long: CI runs it (.ci/run)
def test_shards_ranks_and_exact_gradients(tmp_path):
    trainer = dt.DsgdTrainer(raytrain_loops.exactness_loop,
                             train_loop_config={"out": str(tmp_path), "steps": STEPS, "batch": BATCH},
                             scaling_config=ScalingConfig(num_workers=2),
                             run_config=RunConfig(storage_path=str(tmp_path / "runs"), name="exact"),
                             datasets={"train": ray.data.range(ROWS)})
    result = trainer.fit()
    assert result.error is None and result.metrics["world"] == 2
    assert result.checkpoint is not None and np.isfinite(result.metrics["fit_loss"])
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    # get_dataset_shard: disjoint shards that cover the dataset.
    a, b = (set(r["ids"].tolist()) for r in ranks)
    assert not a & b and a | b == set(range(ROWS)) and int(ranks[0]["world"]) == 2
    for name in ("sgdm", "adam"):
        np.testing.assert_array_equal(ranks[1][f"{name}_initial_0"], ranks[0][f"{name}_initial_0"])
        initial = tiny.make_keras_model(seed=0).get_weights()  # rank 0's, broadcast
        expected, _ = tiny.reference_run(initial, 2, BATCH, STEPS, name)
        for k, want in enumerate(expected):
            np.testing.assert_allclose(ranks[0][f"{name}_{k}"], want, rtol=0, atol=1e-5)
            np.testing.assert_array_equal(ranks[1][f"{name}_{k}"], ranks[0][f"{name}_{k}"])
    # model.fit with DistributedOptimizer: as SGD+momentum on the concatenated batches.
    expected, _ = tiny.reference_run(tiny.make_keras_model(seed=0).get_weights(), 2, BATCH, STEPS,
                                     "sgdm")
    for k, want in enumerate(expected):
        np.testing.assert_allclose(ranks[0][f"fit_{k}"], want, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(ranks[1][f"fit_{k}"], ranks[0][f"fit_{k}"])
    assert not dsgd_actor_names(("dsgd-ps-",))
    # One exchange: the run's PS actors (one per worker) were the engine's class.
    classes = [mro.split(",") for mro in ranks[0]["ps_classes"].tolist()]
    assert len(classes) == 2
    assert all("dsgd.comm.param_server.ParameterServer" in mro for mro in classes), classes


# Two Ray Train worker groups (~40 s): `slow`. The default run keeps Ray Train's failure
# errors (test_a_dead_ps_is_an_error_naming_it, test_a_missing_rank_times_out_naming_it).
@pytest.mark.slow
def test_a_worker_killed_mid_fit_resumes_from_the_checkpoint_exactly(tmp_path):
    """Rank 1 SIGKILLed at epoch 2 of 4 (one SGD+momentum step each); Ray Train
    restarts the group, the loop loads `ray.train.get_checkpoint()` (weights,
    optimizer state, epoch): the epochs reported after the restart go on from
    the checkpoint's, not from 0, and the final weights are one process's
    after 4 steps on the concatenated batches, as if nothing had failed."""
    marker = tmp_path / "killed"
    trainer = dt.DsgdTrainer(raytrain_loops.resuming_loop,
                             train_loop_config={"marker": str(marker), "out": str(tmp_path),
                                                "run_dir": str(tmp_path / "runs" / "restart")},
                             scaling_config=ScalingConfig(num_workers=2),
                             run_config=RunConfig(storage_path=str(tmp_path / "runs"), name="restart",
                                                  failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    assert marker.exists() and result.error is None
    # Resumed from a registered checkpoint (Ray Train's latest: epoch 0 or 1, the loop
    # waits for one before the kill), not from scratch, and ran to the end.
    start = result.metrics["resumed_from"]
    assert result.metrics["epoch"] == 3 and start in (1, 2)
    epochs = [int(line) for line in (tmp_path / "epochs.txt").read_text().split()]
    assert epochs == [0, 1] + list(range(start, 4)), epochs
    expected, _ = tiny.reference_run(tiny.make_keras_model(seed=0).get_weights(), 2, 4, 4, "sgdm")
    finals = [np.load(tmp_path / f"final{r}.npz") for r in range(2)]
    for k, want in enumerate(expected):
        np.testing.assert_allclose(finals[0][f"arr_{k}"], want, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(finals[1][f"arr_{k}"], finals[0][f"arr_{k}"])
    assert not dsgd_actor_names(("dsgd-ps-",))


def rendezvous_ps(ps_index: int, timeout_s: float):
    """The engine's PS class, started as the Ray Train backend starts it."""
    from dsgd.comm.param_server import ParameterServer, ps_actor_class, rendezvous_concurrency

    return ps_actor_class(ParameterServer, 2).options(
        num_cpus=0, max_concurrency=rendezvous_concurrency(2)).remote(
        ps_index, rendezvous_timeout_s=timeout_s)


def test_a_dead_ps_is_an_error_naming_it():
    from dsgd.errors import DsgdError
    from dsgd.train import exchange

    ps = rendezvous_ps(0, 5.0)
    ray.get(ps.ready.remote(), timeout=180)  # (its start is not what is tested)
    ray.kill(ps)
    # ray.kill is asynchronous: a call made right after it may still run (CI saw the
    # broadcast answer once). Wait until the actor is gone.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(ps.ready.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.1)
    exchange.install([ps], ["dsgd-ps-0-abc"], 64, 30.0)
    try:
        exchange._CONTEXT["client"] = PSClient([ps], ["dsgd-ps-0-abc"], 0, 2, 30.0, "dsgd.train",
                                               seq_base=7)
        with pytest.raises(DsgdError,
                           match=r"broadcast 7: PS actor dsgd-ps-0-abc died .*FailureConfig"):
            exchange.broadcast([np.zeros(3)], 0)
    finally:
        exchange._CONTEXT.clear()  # this process is no Ray Train worker


def test_a_missing_rank_times_out_naming_it():
    ps = rendezvous_ps(3, 1.0)
    with pytest.raises(ray.exceptions.RayTaskError,
                       match=r"dsgd PS 3: broadcast 0: rank\(s\) \[0\] of 2 did not arrive"):
        ray.get(ps.broadcast.remote(0, 1, 2, 0, None), timeout=60)
    ray.kill(ps)


@ray.remote(num_cpus=0)
class _Rank:
    """One rank of the exchange tests: its own process, as a Ray Train worker is
    (two ranks as threads of one process would deserialize the PS's one result
    ref twice there, which Ray's reference counting does not always survive:
    ReferenceCountingAssertionError, ray-project/ray#18751)."""

    def __init__(self, ps, names, rank):
        from dsgd.train import exchange

        self.exchange, self.ps, self.names, self.rank = exchange, ps, names, rank
        self.client = PSClient(ps, names, rank, 2, 30.0, "dsgd.train")

    def mean(self, compression, arrays):
        self.exchange.install(self.ps, self.names, 64, 30.0, compression)
        self.exchange._CONTEXT["client"] = self.client  # numbering goes on across calls
        try:
            return [np.array(m) for m in self.exchange.mean(arrays)]
        finally:
            self.exchange._CONTEXT.clear()

    def timeline(self, on: bool) -> list:
        """Turn this rank's recorder on or off; returns what it recorded."""
        from dsgd.comm import timeline

        events = timeline.recorder().drain()
        timeline.enable(f"worker {self.rank}", on)
        return events


@pytest.fixture(scope="module")
def two_ps():
    """2 PS actors for the exchange tests, and 2 ranks exchanging through them,
    each in its own process (exchanges go on numbering across tests, as steps of
    one run do)."""
    ps = [rendezvous_ps(j, 30.0) for j in range(2)]
    # Started before the tests' 30 s exchange deadlines count: a PS process's start
    # is not what they measure (on a loaded 2-core machine it took over 30 s).
    ray.get([p.ready.remote() for p in ps], timeout=180)
    names = ["ps-a", "ps-b"]
    ranks = [_Rank.remote(ps, names, r) for r in range(2)]
    yield ps, names, ranks
    for handle in ps + ranks:
        ray.kill(handle)


def exchange_as_two_ranks(two_ps, compression, per_rank):
    """`exchange.mean` as Ray Train workers 0 and 1 of 2 call it (the PS actors,
    their rendezvous and the object store are real)."""
    _, _, ranks = two_ps
    return ray.get([rank.mean.remote(compression, arrays)
                    for rank, arrays in zip(ranks, per_rank)], timeout=120)


@pytest.mark.parametrize("compression", [None, "fp16", "bf16"])
def test_the_exchange_is_the_engines_plan_groups_and_compression(compression, two_ps):
    """Mean of two ranks' arrays through 2 PS actors in 64-byte shards (so a
    variable is split and the groups span both PS), compressed as asked."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    shapes = [(3, 5), (40,), (2,)]
    per_rank = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(2)]
    got = exchange_as_two_ranks(two_ps, compression, per_rank)
    wire = {None: np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[compression]
    for a, b, mean0, mean1 in zip(*per_rank, *got, strict=True):
        # Each rank's values rounded to the wire type, summed in float32, the mean rounded once.
        want = ((a.astype(wire).astype(np.float32) + b.astype(wire).astype(np.float32)) * 0.5)
        want = want.astype(wire).astype(np.float32)
        np.testing.assert_array_equal(mean0, want)
        np.testing.assert_array_equal(mean1, mean0)
        assert mean0.dtype == np.float32


def test_the_exchange_records_the_timeline_when_on(two_ps):
    """With the timeline on, a worker records each collective ("allreduce" on its
    "collectives" row, with its size) and each group's send, and each PS each
    group's sum; when off, nothing."""
    import ray

    from dsgd.comm.ps_client import enable_timeline

    ps, names, ranks = two_ps
    rng = np.random.default_rng(1)
    per_rank = [[rng.normal(size=(40,)).astype(np.float32)] for _ in range(2)]
    exchange_as_two_ranks(two_ps, None, per_rank)
    assert ray.get([r.timeline.remote(True) for r in ranks], timeout=60) == [[], []]  # (off)
    ray.get(enable_timeline(ps, True), timeout=60)
    try:
        exchange_as_two_ranks(two_ps, None, per_rank)
        mine = [e for r in ray.get([r.timeline.remote(False) for r in ranks], timeout=60)
                for e in r]
        theirs = [e for p in ps for e in ray.get(p.timeline_events.remote(), timeout=60)]
    finally:
        ray.get(enable_timeline(ps, False), timeout=60)
    reduces = [e for e in mine if e.get("name") == "allreduce"]
    assert len(reduces) == 2 and {e["tid"] for e in reduces} == {"collectives"}
    assert all(e["args"] == {"arrays": 1, "bytes": 160} for e in reduces)
    assert sum(e.get("name", "").startswith("send group") for e in mine) == 2 * 2  # 2 ranks x 2 PS
    assert sum(e.get("name") == "sum group" for e in theirs) == 2


@pytest.mark.slow  # a Ray Train worker group (~30 s): CI runs it (.ci/run)
def test_dsgd_train_writes_a_timeline_users_can_open(tmp_path, monkeypatch):
    """DSGD_TIMELINE (as HOROVOD_TIMELINE) on the driver: the trace file names
    every worker and PS and holds their collectives, sends and sums."""
    import json

    path = tmp_path / "trace.json"
    monkeypatch.setenv("DSGD_TIMELINE", str(path))
    trainer = dt.DsgdTrainer(raytrain_loops.timeline_loop,
                             scaling_config=ScalingConfig(num_workers=2),
                             run_config=RunConfig(storage_path=str(tmp_path / "runs"),
                                                  name="timeline"))
    assert trainer.fit().error is None
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"worker 0", "worker 1"} <= set(names.values())
    assert sum(n.startswith("PS ") for n in names.values()) == 2, names
    for worker in ("worker 0", "worker 1"):
        spans = [e["name"] for e in events if e["ph"] == "X" and names[e["pid"]] == worker]
        assert spans.count("allreduce") == 3 and spans.count("broadcast") == 1, spans
        assert any(s.startswith("send group") for s in spans)
    assert sum(e["name"] == "sum group" for e in events if e["ph"] == "X") >= 3
    assert not dsgd_actor_names(("dsgd-ps-",))


def test_config_errors():
    with pytest.raises(ValueError, match="devices_per_worker must be 1"):
        dt.DsgdConfig(devices_per_worker=2)
    with pytest.raises(ValueError, match="num_ps must be a positive int or None"):
        dt.DsgdConfig(num_ps=0)
    with pytest.raises(ValueError, match=r"compression must be None or one of \['fp16', 'bf16'\]"):
        dt.DsgdConfig(compression="int8")
    with pytest.raises(ValueError, match="timeline must be a file path"):
        dt.DsgdConfig(timeline="")
    with pytest.raises(TypeError, match="dsgd_config must be a dsgd.train.DsgdConfig"):
        dt.DsgdTrainer(lambda: None, dsgd_config={"num_ps": 1})
