"""dsgd/comm/reports.py: the per-step totals worker 0 sends and the per-call
figures each worker sends give the driver what the per-worker reports gave;
and how many steps a call runs (Config.steps_per_call)."""

import numpy as np
import pytest

from dsgd import constants
from dsgd.comm import commit, reports
from dsgd.config import Config


def _info(rng, replicas=2, metrics=("acc",)):
    """A worker's report of one step: StepReport's fields, as a meta carries them."""
    return {"losses": rng.normal(size=replicas).tolist(),
            "metrics": {m: rng.uniform(size=replicas).tolist() for m in metrics},
            "samples": int(rng.integers(1, 9)), "data_s": float(rng.uniform()),
            "compute_s": float(rng.uniform())}


def test_a_call_tally_merged_equals_adding_each_step():
    rng = np.random.default_rng(0)
    steps = [_info(rng) for _ in range(11)]
    one_by_one = reports.worker_tally()
    for info in steps:
        reports.add_step(one_by_one, reports.StepReport(**info))
    merged = reports.worker_tally()
    for call in (steps[:3], steps[3:10], steps[10:]):  # calls of 3, 7 and 1 steps
        tally = reports.worker_tally()
        for info in call:
            reports.add_step(tally, reports.StepReport(**info))
        reports.merge(merged, tally)
    assert merged["num_samples"] == one_by_one["num_samples"] == sum(s["samples"] for s in steps)
    assert merged["batch_count"] == one_by_one["batch_count"] == 11
    assert merged["last"] == one_by_one["last"]
    assert merged["last"]["loss"] == pytest.approx(np.mean(steps[-1]["losses"]))
    for key in ("loss", "acc"):
        assert merged["sums"][key] == pytest.approx(one_by_one["sums"][key], rel=1e-12)
    want = sum(np.mean(s["losses"]) * s["samples"] for s in steps)
    assert merged["sums"]["loss"] == pytest.approx(want, rel=1e-12)


def test_step_summary_is_every_workers_totals():
    rng = np.random.default_rng(1)
    infos = [_info(rng, replicas=3) for _ in range(5)]
    metas = [commit.meta(k, [True] * 3, ["acc"], report=reports.StepReport(**info))
             for k, info in enumerate(infos)]
    own = reports.StepReport(exchange_s=0.25, apply_s=0.125, decision="skip",
                             nonfinite=[(3, 1)])
    row = reports.step_summary(metas, own)
    assert row.loss == pytest.approx(np.mean([x for i in infos for x in i["losses"]]))
    assert row.samples == sum(i["samples"] for i in infos)
    assert row.compute_s == max(i["compute_s"] for i in infos)
    assert row.data_s == max(i["data_s"] for i in infos)
    assert (row.exchange_s, row.apply_s, row.decision, row.nonfinite, row.workers) \
        == (0.25, 0.125, "skip", [(3, 1)], 5)


def _config(**kw):
    return Config(model_creator=lambda w, d: None, num_workers=2, devices_per_worker=1, **kw)


def test_steps_per_call_grows_with_the_workers_on_their_own_exchange():
    config = _config()
    assert config.steps_per_call(1, False) == constants.LOCAL_STEPS_PER_CALL == 8
    assert config.steps_per_call(2, True) == 8
    assert config.steps_per_call(3, True) == 12
    assert config.steps_per_call(64, True) == 256  # one driver call per 4 steps
    assert _config(local_steps_per_call=3).steps_per_call(64, True) == 3
    with pytest.raises(ValueError, match="local_steps_per_call"):
        _config(local_steps_per_call=0)
