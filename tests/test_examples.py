"""The README's main job, run briefly: it trains, reports and its replicas agree."""

import json

import pytest

from dsgd.examples import mnist, recovery

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


def test_mnist_example_runs_and_learns(capsys):
    result = mnist.main(["--steps", "12", "--eval-every", "6", "--batch-size", "32",
                         "--strategy", "ps"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == result
    for key in ("test_accuracy", "steps", "num_workers", "strategy", "images_per_s", "wall_s"):
        assert key in result
    assert result["steps"] == 12 and result["num_workers"] == 2
    assert result["final_loss"] < 0.8 * result["first_loss"]
    assert result["test_accuracy"] > 0.3  # chance is 0.1; evaluate() asserted replicas agree


def test_mnist_data_split_is_fixed_and_disjoint():
    x_train, y_train, x_test, y_test = mnist.load_mnist()
    assert x_train.shape == (4000, 28, 28, 1) and x_test.shape == (1000, 28, 28, 1)
    assert sorted(set(y_test.tolist())) == list(range(10))
    assert 0.0 <= x_train.min() and x_train.max() <= 1.0


def test_recovery_example_matches_the_uninterrupted_run(capsys):
    result = recovery.main(["--steps", "6", "--kill-worker-at", "2", "--kill-ps-at", "4"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["failures"] == 2 and result["max_weight_difference"] <= 1e-6
    assert all(s > 0 for s in result["recovery_s"])
