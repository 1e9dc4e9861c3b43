"""The step decision of the worker-driven exchange (dsgd/comm/commit.py): pure,
made alike by every worker from every worker's meta."""

import pytest

from dsgd.comm import commit
from dsgd.errors import DsgdError


def metas(*finite, names=("acc",)):
    return [commit.meta(slot, f, list(names)) for slot, f in enumerate(finite)]


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip", "ignore"])
def test_finite_everywhere_applies(on_nonfinite):
    assert commit.decide(metas([True, True], [True, True]), on_nonfinite) == \
        commit.Decision(commit.APPLY)


def test_a_nonfinite_replica_skips_or_halts_naming_every_one():
    m = metas([True, False], [True, True], [False, False])
    bad = ((0, 1), (2, 0), (2, 1))
    assert commit.decide(m, "skip") == commit.Decision(commit.SKIP, bad)
    assert commit.decide(m, "raise") == commit.Decision(commit.HALT, bad)


def test_an_epoch_ends_for_every_worker_or_is_an_error():
    ended = [commit.meta(s, None, None) for s in range(3)]
    assert commit.decide(ended, "raise").action == commit.EPOCH_END
    mixed = ended[:2] + metas([True])[:1]
    with pytest.raises(DsgdError, match=r"worker\(s\) \[0, 1\] ended its epoch before the others"):
        commit.decide(mixed, "raise")


def test_metric_names_must_agree():
    m = [commit.meta(0, [True], ["acc"]), commit.meta(1, [True], ["acc", "auc"])]
    with pytest.raises(ValueError, match=r"worker 0 returns \['acc'\]; worker 1 returns "
                                         r"\['acc', 'auc'\]. No weights were changed"):
        commit.decide(m, "raise")


def test_a_worker_whose_step_raised_stops_the_others():
    m = metas([True]) + [commit.meta(1, None, None, KeyError("x"))]
    with pytest.raises(DsgdError, match=r"worker 1's step raised KeyError: 'x'. No weights"):
        commit.decide(m, "skip")
