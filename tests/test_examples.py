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
    """Two epochs: the discriminator tells real from generated digits better than
    chance on every epoch's batches (its loss, the mean of the two binary
    cross-entropies, below ln 2, a constant guess's); the generator's pixels
    left the untrained generator's (tanh of small values: mean ~0, std ~0.03,
    root mean square ~0.03) for the data's range (MNIST in [-1, 1]: mean -0.74,
    std 0.62). Measured over 9 runs (unseeded initial weights): loss_d 0.46-0.58;
    the generated pixels' root mean square 0.34-0.98. (The example's held-out
    accuracy, at the logit threshold 0, is not a measure of learning this early:
    it was 0.40-1.0 after two epochs, 0.5 when D called everything real.)"""
    from dsgd.examples import dcgan

    out = tmp_path / "digits.png"
    result = dcgan.main(["--epochs", "2", "--out", str(out)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert out.stat().st_size > 1000 and [e["epoch"] for e in result["epochs"]] == [1, 2]
    for epoch in result["epochs"]:  # its own train_epoch and validate (the seed's custom epoch)
        assert np.isfinite(epoch["loss_g"]) and epoch["loss_d"] < np.log(2) - 0.05, epoch
        assert 0 < epoch["d_real"] < 1 and 0 < epoch["d_fixed_fake"] < 1
        # 1,000 held-out real digits and as many generated: an accuracy in 2,000ths
        correct = epoch["val_d_accuracy"] * 2000
        assert 0 <= correct <= 2000 and abs(correct - round(correct)) < 1e-6, epoch
    rms = np.hypot(result["generated_mean"], result["generated_std"])
    assert rms > 0.25, result


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


@pytest.mark.slow
def test_ctr_example_learns_click_rates_and_its_replicas_agree(capsys):
    from dsgd.examples import ctr

    result = ctr.main(["--steps", "60", "--eval-every", "30", "--rows", "2000",
                       "--examples", "40000", "--batch-size", "128"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["steps"] == 60 and result["tables_bytes"] == 26 * 2000 * 8 * 4
    assert result["final_loss"] < result["first_loss"]
    # (evaluate() asserted that the replicas agree)
    assert result["test_auc"] > result["untrained_test_auc"] + 0.05


def test_ctr_data_is_criteo_shaped_fixed_by_its_seed_and_bad_arguments_are_named(capsys):
    from dsgd.examples import ctr

    dense, ids, clicks = ctr.make_data(20000, 1000, 1.1, seed=3)
    assert dense.shape == (20000, 13) and ids.shape == (20000, 26) and clicks.shape == (20000,)
    assert ids.min() >= 0 and ids.max() < 1000 and 0.15 < clicks.mean() < 0.35
    _, counts = np.unique(ids[:, 0], return_counts=True)
    assert np.sort(counts)[-10:].sum() > 0.3 * len(ids)  # Zipf: 10 ids of 1000 carry > 30 %
    for a, b in zip((dense, ids, clicks), ctr.make_data(20000, 1000, 1.1, seed=3)):
        np.testing.assert_array_equal(a, b)
    for bad, named in ((["--rows", "0"], "--rows"), (["--zipf", "-1"], "--zipf"),
                       (["--lr", "0"], "--lr"), (["--eval-every", "-5"], "--eval-every"),
                       (["--examples", "100"], "--examples")):
        with pytest.raises(SystemExit):
            ctr.parse_args(bad)
        assert named in capsys.readouterr().err
