"""The failure policy (dsgd/engine/failures.py), in-process: every branch of decide()."""

from dsgd.engine.failures import Status, WorkerStatus, decide


def status(workers, dead_ps=(), steps_done=5, elastic=False,
           placeable=8, checkpoint=False, between_steps=False, call=None):
    return Status([WorkerStatus(s, a, n) for s, a, n in workers], list(dead_ps), steps_done,
                  elastic, placeable, checkpoint, between_steps, call)


def test_no_death_is_not_recovered():
    action = decide(status([(0, True, 5), (1, True, 5)]))
    assert not action.recover and "no actor died" in action.reason


def test_dead_worker_before_apply_retries_from_a_survivor():
    action = decide(status([(0, True, 5), (1, False, None), (2, True, 5)]))
    assert action.recover and not action.step_completed
    assert action.replace_workers == [1] and action.drop_workers == []
    assert action.state_source == 0 and action.sync_workers == []
    assert "retrying" in action.reason


def test_death_during_apply_completes_the_step_without_retry():
    # Worker 0 applied step 6 before worker 1 died; worker 2 had not applied yet.
    action = decide(status([(0, True, 6), (1, False, None), (2, True, 5)]))
    assert action.recover and action.step_completed
    assert action.state_source == 0 and action.sync_workers == [2]
    assert action.replace_workers == [1]


def test_dead_ps_only_is_replaced_and_the_step_retried():
    action = decide(status([(0, True, 5), (1, True, 5)], dead_ps=[1]))
    assert action.recover and action.replace_ps == [1] and action.replace_workers == []
    assert not action.step_completed


def test_death_found_between_steps_retries_nothing():
    # A driver call between steps (e.g. get_weights) found a worker and a PS dead.
    action = decide(status([(0, True, 5), (1, False, None)], dead_ps=[0], between_steps=True))
    assert action.recover and not action.step_completed
    assert action.state_source == 0 and action.replace_workers == [1] and action.replace_ps == [0]
    assert "no step to retry" in action.reason and "retrying" not in action.reason


def test_survivor_ahead_between_steps_is_not_recovered():
    action = decide(status([(0, True, 6), (1, False, None)], between_steps=True))
    assert not action.recover and "between steps" in action.reason
    assert "{0: 6}" in action.reason and "counted 5" in action.reason


def test_max_failures_is_one_budget_every_failure_is_charged_to():
    """Progress.charge: each failure once, in order; the one past max_failures
    raises naming what died, the step and the cause, and is not recorded."""
    import pytest

    from dsgd.engine.state import Progress
    from dsgd.errors import DsgdError

    progress = Progress()
    for step in (3, 3, 4):
        index = progress.charge({"step": step, "error": "ActorDiedError", "reason": "r"}, 3,
                                f"step {step}: worker(s) 1 died")
        progress.annotate_failure(index, recovery_s=0.5)
    assert [f["step"] for f in progress.failures] == [3, 3, 4]
    assert all(f["recovery_s"] == 0.5 for f in progress.failures)
    cause = RuntimeError("the actor died\nmore")
    with pytest.raises(DsgdError, match=r"^step 5: worker\(s\) 1 died: failure 4 exceeds "
                                        r"max_failures=3 \(cause: RuntimeError: the actor died\)$"):
        progress.charge({"step": 5}, 3, "step 5: worker(s) 1 died", cause)
    assert len(progress.failures) == 3


def test_no_room_without_elastic_is_an_error_naming_the_option():
    action = decide(status([(0, True, 5), (1, False, None)], placeable=0))
    assert not action.recover and "elastic=True" in action.reason


def test_no_room_with_elastic_shrinks():
    action = decide(status([(0, True, 5), (1, False, None), (2, False, None)], placeable=1,
                           elastic=True))
    assert action.recover and action.replace_workers == [1] and action.drop_workers == [2]


def test_every_worker_dead_needs_a_checkpoint():
    assert "no checkpoint" in decide(status([(0, False, None)])).reason
    action = decide(status([(0, False, None)], checkpoint=True))
    assert action.recover and action.state_source is None and action.replace_workers == [0]


def test_inconsistent_survivors_are_an_error():
    action = decide(status([(0, True, 3), (1, False, None)]))
    assert not action.recover and "cannot tell" in action.reason


def test_loss_in_a_driver_call_replaces_and_takes_the_first_survivors_state():
    # restore_checkpoint was rewriting the replicas when worker 0 hung: the survivors
    # disagree on their step count; the call's retry makes them agree again.
    action = decide(status([(0, False, None), (1, True, 9), (2, True, 5)], dead_ps=[1],
                           between_steps=True, call="restore_checkpoint"))
    assert action.recover and not action.step_completed
    assert action.state_source == 1 and action.sync_workers == [] and action.replace_workers == [0]
    assert action.replace_ps == [1]
    assert "during restore_checkpoint" in action.reason and "run again" in action.reason


def test_loss_in_a_driver_call_still_obeys_room():
    action = decide(status([(0, True, 5), (1, False, None)], placeable=0, call="get_weights"))
    assert not action.recover and "elastic=True" in action.reason


def test_the_failure_budget_and_hang_recovery_are_decided_in_one_place():
    from dsgd.engine.failures import over_budget, recovers_hang

    assert over_budget(3, 3, "step 5: worker 1 died") is None
    assert over_budget(4, 3, "step 5: worker 1 died") == \
        "step 5: worker 1 died: failure 4 exceeds max_failures=3"
    assert over_budget(1, 0, "x") is not None  # max_failures=0: the first failure stops
    assert recovers_hang(True, ["a late actor"])
    assert not recovers_hang(True, [])  # nobody named: nothing to replace
    assert not recovers_hang(False, ["a late actor"])
