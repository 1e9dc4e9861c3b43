"""`timeline=` (or DSGD_TIMELINE): a Chrome trace of the workers' exchange
(dsgd/comm/timeline.py), written after train() and at shutdown."""

import json
import os

import pytest

import dsgd
from dsgd.comm import timeline
import tiny

STEPS = 5


def test_recorder_spans_drain_once_and_off_records_nothing():
    rec = timeline.Recorder("worker 7")
    with rec.span("compute", "step", step=3):
        pass
    rec.add("apply", "step", 10.0, 10.5)
    events = rec.drain()
    assert events[0] == {"name": "process_name", "ph": "M", "pid": os.getpid(),
                         "args": {"name": "worker 7"}}
    compute, apply = events[1:]
    assert compute["name"] == "compute" and compute["args"] == {"step": 3}
    assert compute["ph"] == "X" and compute["tid"] == "step" and compute["dur"] >= 0
    assert apply["ts"] == 10e6 and apply["dur"] == 0.5e6
    assert rec.drain()[1:] == []  # drained once
    assert not timeline.OFF.on and timeline.OFF.drain() == []
    with timeline.OFF.span("x", "y"):
        timeline.OFF.add("x", "y", 0.0, 1.0)
    assert timeline.OFF.drain() == []


def test_the_path_comes_from_the_argument_else_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(timeline.ENV, raising=False)
    assert timeline.path_from(None) is None
    monkeypatch.setenv(timeline.ENV, str(tmp_path / "env.json"))
    assert timeline.path_from(None) == str(tmp_path / "env.json")
    assert timeline.path_from("given.json") == "given.json"
    path = str(tmp_path / "sub" / "t.json")
    timeline.write(path, [{"name": "a", "ph": "X", "ts": 1, "dur": 2, "pid": 1, "tid": "r"}])
    with open(path) as f:
        assert json.load(f)["traceEvents"][0]["name"] == "a"


@pytest.mark.parametrize("bad", ["", 3, b"t.json"])
def test_bad_timeline_is_refused_before_any_actor(bad):
    with pytest.raises(ValueError, match=r"timeline must be a file path \(str\) or None"):
        dsgd.DistributedSGD(lambda w, d: None, 2, 1, gpu=False, timeline=bad)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """2 workers, 2 PS, timeline on: STEPS steps of train(); the trace as written."""
    path = str(tmp_path_factory.mktemp("timeline") / "trace.json")
    with dsgd.DistributedSGD(lambda w, d: tiny.StepKeyedModel(w, d, 1, 4), 2, 1, gpu=False,
                             grad_shard_bytes=128, num_ps=2, timeline=path,
                             overlap=True) as sgd:
        summary = sgd.train(STEPS)
        assert sgd.write_timeline() == path
    with open(path) as f:
        return summary, json.load(f)["traceEvents"]




def _assert_forward_backward_within(spans: dict, compute: dict) -> None:
    """The step's `forward` then `backward` spans, one after the other, inside its
    compiled call's span `compute` (µs; 1 of slack for the rounding: a process
    converts every span's `perf_counter` reads with one offset, Recorder.to_wall)."""
    assert "forward" in spans, sorted((k, v["ts"], v["dur"]) for k, v in spans.items())
    forward, backward = spans["forward"], spans["backward"]
    assert compute["ts"] - 1 <= forward["ts"]
    assert forward["ts"] + forward["dur"] <= backward["ts"] + 1
    assert backward["ts"] + backward["dur"] <= compute["ts"] + compute["dur"] + 1


def _by_process(events):
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    out: dict = {}
    for e in events:
        if e["ph"] == "X":
            out.setdefault(names[e["pid"]], []).append(e)
    return out


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
def test_every_worker_ps_and_the_driver_have_a_row(trace):
    summary, events = trace
    rows = _by_process(events)
    assert {"driver", "worker 0", "worker 1", "PS 0", "PS 1"} <= set(rows)
    for w in ("worker 0", "worker 1"):
        steps = {}
        for e in rows[w]:
            if e["tid"] == "step":
                steps.setdefault(e["args"]["step"], {})[e["name"]] = e
        assert len(steps) == summary["steps"] == STEPS
        for spans in steps.values():
            compute, rest = spans["compute"], spans["decide, receive and apply"]
            # In order, one after the other (microseconds, one clock per process).
            assert compute["ts"] + compute["dur"] <= rest["ts"] + 1
            _assert_forward_backward_within(spans, compute)
        # One send and one receive per bucket (one per PS here) per step, and every
        # bucket in one of the step's one or two applies.
        for row in ("send", "receive"):
            assert len([e for e in rows[w] if e["tid"] == row]) == 2 * STEPS, row
        applied: dict = {}
        for e in rows[w]:
            if e["tid"] == "apply":
                buckets = e["name"].removeprefix("apply group ").split(", ")
                applied.setdefault(e["args"]["step"], []).extend(int(b) for b in buckets)
        assert sorted(applied) == sorted(steps) and all(
            sorted(b) == [0, 1] for b in applied.values()), applied
    for p in ("PS 0", "PS 1"):
        sums = [e for e in rows[p] if e["name"] == "sum group"]
        assert len(sums) == STEPS and all(e["args"]["workers"] == 2 for e in sums)
    calls = [e for e in rows["driver"] if e["tid"] == "calls"]
    assert calls and calls[0]["name"].startswith("step")


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
def test_a_group_leaves_from_inside_the_step_and_is_summed_before_it_is_received(trace):
    _, events = trace
    rows = _by_process(events)
    for w in ("worker 0", "worker 1"):
        for send in (e for e in rows[w] if e["tid"] == "send"):
            step = send["args"]["exchange"]
            compute = next(e for e in rows[w] if e["name"] == "compute"
                           and e["args"]["step"] == step)
            # Sent from inside the compiled step (2 ms of slack for the clock reads).
            assert compute["ts"] - 2000 <= send["ts"]
            assert send["ts"] + send["dur"] <= compute["ts"] + compute["dur"] + 2000
    for p in ("PS 0", "PS 1"):
        for s in (e for e in rows[p] if e["name"] == "sum group"):
            step = s["args"]["exchange"]
            for w in ("worker 0", "worker 1"):
                sent = [e for e in rows[w] if e["tid"] == "send"
                        and e["args"]["ps"] == int(p[3:]) and e["args"]["exchange"] == step]
                assert len(sent) == 1
                g = sent[0]["name"].split()[-1]
                received = next(e for e in rows[w] if e["name"] == f"receive group {g}"
                                and e["args"]["step"] == step)
                # Same machine clock; 2 ms of slack for the clock reads around the spans.
                # (The send span ends after the call went out, possibly after the sum.)
                assert sent[0]["ts"] - 2000 <= s["ts"] + s["dur"]
                assert s["ts"] + s["dur"] <= received["ts"] + received["dur"] + 2000


@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
def test_one_worker_records_its_steps(tmp_path):
    """One worker (no exchange, no PS): each step is one compiled call, recorded
    as `data` then `compute and apply` on the worker's step row."""
    path = str(tmp_path / "one.json")
    with dsgd.DistributedSGD(lambda w, d: tiny.StepKeyedModel(w, d, 1, 4), 1, 1, gpu=False,
                             timeline=path) as sgd:
        sgd.train(STEPS)
    events = json.load(open(path))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert sorted(set(names.values())) == ["driver", "worker 0"]
    spans = [e for e in events if e["ph"] == "X" and names[e["pid"]] == "worker 0"]
    computes = [e for e in spans if e["name"] == "compute and apply"]
    assert len(computes) == STEPS and {e["tid"] for e in spans} == {"step"}
    assert [e["args"]["step"] for e in computes] == list(range(1, STEPS + 1))
    datas = [e for e in spans if e["name"] == "data"]
    for data, compute in zip(datas, computes, strict=True):
        assert data["ts"] + data["dur"] <= compute["ts"] + 1  # (µs, rounded)
        _assert_forward_backward_within(
            {e["name"]: e for e in spans if e["args"]["step"] == compute["args"]["step"]},
            compute)


@pytest.mark.slow  # its own 2-worker instance each (~10 s)
@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
def test_the_driver_side_reference_records_every_process(tmp_path):
    """strategy="simple" (the driver averages): each worker's data, compute,
    group writes and apply; the driver's steps and its average of each group."""
    path = str(tmp_path / "simple.json")
    with dsgd.DistributedSGD(lambda w, d: tiny.StepKeyedModel(w, d, 1, 4), 2, 1, gpu=False,
                             grad_shard_bytes=128, num_ps=2, timeline=path,
                             strategy="simple") as sgd:
        summary = sgd.train(STEPS)
        groups = len(sgd._topology.groups)
    assert summary["steps"] == STEPS and groups >= 2
    rows = _by_process(json.load(open(path))["traceEvents"])
    assert {"driver", "worker 0", "worker 1"} <= set(rows)
    for w in ("worker 0", "worker 1"):
        spans = rows[w]
        for name in ("data", "compute", "forward", "backward"):
            assert sorted(e["args"]["step"] for e in spans if e["name"] == name) == \
                list(range(1, STEPS + 1)), name
        writes = [e for e in spans if e["tid"] == "send"]
        assert len(writes) == groups * STEPS
        for write in writes:  # each group written after its step's compute
            compute = next(e for e in spans if e["name"] == "compute"
                           and e["args"]["step"] == write["args"]["step"])
            assert compute["ts"] + compute["dur"] <= write["ts"] + 1
        # Applied whole: one "apply" per step.
        applied = {e["args"]["step"]: groups for e in spans if e["name"] == "apply"}
        assert applied == {s: groups for s in range(1, STEPS + 1)}, applied
    driver = rows["driver"]
    assert len([e for e in driver if e["tid"] == "calls"]) == STEPS
    assert len([e for e in driver if e["tid"] == "relay"]) == groups * STEPS


@pytest.mark.slow  # its own 2-worker Trainer (~10 s)
@pytest.mark.cluster
@pytest.mark.usefixtures("ray_local")
def test_a_trainers_custom_epoch_records_each_train_step(tmp_path):
    """A TrainingOperator's own train_epoch: each train_step's compute (forward,
    backward), exchange and apply on each worker's "train_step" row, by epoch
    and step; each PS's sums."""
    from trainer_ops import CustomEpochClassifier

    path = str(tmp_path / "custom.json")
    with dsgd.Trainer(CustomEpochClassifier, num_workers=2, config={dsgd.BATCH_SIZE: 16},
                      timeline=path) as trainer:
        result = trainer.train()
    rows = _by_process(json.load(open(path))["traceEvents"])
    steps = int(result["batch_count"])  # (per worker)
    assert steps >= 2
    for w in ("worker 0", "worker 1"):
        spans = [e for e in rows[w] if e["tid"] == "train_step"]
        by_step: dict = {}
        for e in spans:
            assert e["args"]["epoch"] == 1
            by_step.setdefault(e["args"]["step"], {})[e["name"]] = e
        assert sorted(by_step) == list(range(1, steps + 1))
        for named in by_step.values():
            compute, exchange, apply = named["compute"], named["exchange"], named["apply"]
            assert compute["ts"] + compute["dur"] <= exchange["ts"] + 2
            assert exchange["ts"] + exchange["dur"] <= apply["ts"] + 2
            _assert_forward_backward_within(named, compute)
        assert len([e for e in rows[w] if e["tid"] == "send"]) >= steps  # each group's send
    sums = [e for p in rows if p.startswith("PS ") for e in rows[p] if e["name"] == "sum group"]
    assert len(sums) >= steps
