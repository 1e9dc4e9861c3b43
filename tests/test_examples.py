"""The examples, run briefly: each trains, reports and its replicas agree.

Each run starts its own workers on the shared cluster and takes 15-40 s: they
are marked `slow` (`python -m pytest -m slow`; `.ci/run` runs them)."""

import json

import numpy as np

import pytest

from dsgd.examples import identity, mnist, recovery

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]


@pytest.mark.slow
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
    # Disjoint: no test image is a training image; fixed: a second load is the same split.
    train_images = {image.tobytes() for image in x_train}
    assert not [k for k, image in enumerate(x_test) if image.tobytes() in train_images]
    again = mnist.load_mnist()
    for a, b in zip(again, (x_train, y_train, x_test, y_test), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_recovery_example_matches_the_uninterrupted_run(capsys):
    result = recovery.main(["--steps", "6", "--kill-worker-at", "2", "--kill-ps-at", "4"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["failures"] == 2 and result["max_weight_difference"] <= 1e-6
    assert all(s > 0 for s in result["recovery_s"])


@pytest.mark.slow
def test_identity_example_runs_the_seed_usages(capsys):
    result = identity.main(["--epochs", "2", "--steps", "30"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    # sgd.train(dataset=dataset, num_steps=30) twice, then sgd.train() (the model's own
    # data: one epoch of 50 steps), then sgd.train(dataset=dataset2, num_steps=20).
    assert result["steps"] == 2 * 30 + 50 + 20 and result["own_data_steps"] == 50
    assert result["dataset_rows_trained"] == 2 * 30 * 2 * 32
    assert result["dataset2_loss"] < 0.01 and abs(result["f(0.5)"] - 0.5) < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("source", ["files", "ray-data"])
def test_mnist_example_from_png_files(capsys, tmp_path_factory, source):
    directory = tmp_path_factory.getbasetemp() / "mnist_png"  # written once, shared
    result = mnist.main(["--input", source, "--data-dir", str(directory), "--steps", "12",
                         "--eval-every", "6", "--batch-size", "32"])
    assert result["input"] == source and result["steps"] == 12
    assert result["final_loss"] < 0.8 * result["first_loss"] and result["test_accuracy"] > 0.3
    pngs = sorted(directory.glob("*/*.png"))
    assert len(pngs) == 4000 and (directory / "7").is_dir()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result


@pytest.mark.slow
def test_trainer_mnist_example_trains_saves_and_reloads(capsys, tmp_path):
    from dsgd.examples import trainer_mnist

    result = trainer_mnist.main(["--epochs", "1", "--logdir", str(tmp_path)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["val_accuracy"] > 0.8
    # The second Trainer loaded the checkpoint and the driver's model agrees.
    assert result["reloaded_val_accuracy"] == pytest.approx(result["val_accuracy"], abs=1e-6)
    assert result["get_model_accuracy"] == pytest.approx(result["val_accuracy"], abs=2e-3)
    assert list(tmp_path.glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_dcgan_example_trains_two_models_and_saves_digits(capsys, tmp_path):
    from dsgd.examples import dcgan

    out = tmp_path / "digits.png"
    result = dcgan.main(["--epochs", "1", "--out", str(out)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert out.stat().st_size > 1000 and result["epochs"][0]["epoch"] == 1
    assert np.isfinite(result["epochs"][0]["loss_d"]) and np.isfinite(result["epochs"][0]["loss_g"])
    # its own train_epoch and validate (the seed's custom-epoch way)
    assert 0 < result["epochs"][0]["d_fixed_fake"] < 1
    assert 0 <= result["epochs"][0]["val_d_accuracy"] <= 1


@pytest.mark.slow
def test_tune_mnist_example_runs_its_trials(capsys):
    from dsgd.examples import tune_mnist

    result = tune_mnist.main(["--lrs", "1e-3", "--iterations", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert len(result["trials"]) == 1 and result["trials"][0]["epochs"] == 1
    assert result["best_val_accuracy"] > 0.5


@pytest.mark.slow
def test_raytrain_mnist_example_fits_with_model_fit(capsys, tmp_path):
    from dsgd.examples import raytrain_mnist

    result = raytrain_mnist.main(["--epochs", "1", "--storage-path", str(tmp_path)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert len(result["epochs"]) == 1 and result["epochs"][0]["world_size"] == 2
    assert result["epochs"][0]["samples"] == 2000  # each worker's equal share of 4,000
    assert result["test_accuracy"] > 0.8
