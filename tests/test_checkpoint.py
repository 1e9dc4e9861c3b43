"""Checkpoints: atomic saves (a process killed mid-save leaves the previous
checkpoint loadable), corrupt or truncated files are clear errors that change
nothing, the configuration is recorded, and non-trainable state (batch
normalisation's statistics) is saved and restored with the weights."""

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import ray

import dsgd
import tiny

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_local")]

# A child process that writes a checkpoint and dies (os._exit) at the n-th rename. It
# loads only dsgd/engine/checkpoints.py and dsgd/errors.py (the standard library
# alone), not the dsgd package, whose import loads TensorFlow: seconds per child.
CRASHING_SAVE = """
import os, pickle, sys, types
root = sys.argv[4]
for name, path in (("dsgd", root), ("dsgd.engine", os.path.join(root, "engine"))):
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
from dsgd.engine import checkpoints as checkpoint
assert "tensorflow" not in sys.modules
path, blob, crash_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
files, meta = pickle.load(open(blob, "rb"))
real_replace, calls = os.replace, []
def replace(src, dst):
    calls.append(dst)
    if len(calls) == crash_at:
        os._exit(17)  # killed between writing the temporary file and renaming it
    real_replace(src, dst)
os.replace = replace
checkpoint.write(path, files, meta)
"""


class Normed(tiny.TinyModel):
    """tiny's model with Adam and batch normalisation between its layers: its
    moving mean and variance are state that training changes but no gradient
    does (Model.get_state_variables), different on each replica (its own batches)."""

    def __init__(self, worker_index, device_index):
        import keras

        super().__init__(worker_index, device_index, 2, 4, "adam")
        init = lambda k: keras.initializers.GlorotUniform(seed=self.replica + k)  # noqa: E731
        self.model = keras.Sequential([
            keras.Input((tiny.IN,)),
            keras.layers.Dense(tiny.HIDDEN, activation="tanh", kernel_initializer=init(0)),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Dense(tiny.OUT, kernel_initializer=init(1)),
        ])


@pytest.fixture(scope="module")
def sgd():
    """1 worker x 2 devices of Normed for the module."""
    with dsgd.DistributedSGD(Normed, 1, 2, gpu=False) as sgd:
        yield sgd


def weights_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def moving_statistics(sgd) -> list[list[np.ndarray]]:
    """Every replica's batch normalisation moving mean and variance."""
    return sgd.foreach_model(lambda m: [np.array(v.numpy()) for v in m.model.layers[1].weights
                                        if not v.trainable])


def test_batchnorm_statistics_are_saved_and_restored_exactly(sgd, tmp_path):
    sgd.step()
    saved = moving_statistics(sgd)
    assert len(saved[0]) == 2 and not weights_equal(saved[0], saved[1])  # each replica's own
    path = sgd.save_checkpoint(str(tmp_path / "ckpt"))
    weights = sgd.get_weights()
    sgd.step()
    changed = moving_statistics(sgd)
    assert not any(np.array_equal(a, b) for a, b in zip(changed[0], saved[0], strict=True))
    sgd.restore_checkpoint(path)
    # Worker 0 / replica 0's statistics, bit for bit, on every replica.
    for replica in moving_statistics(sgd):
        for got, want in zip(replica, saved[0], strict=True):
            np.testing.assert_array_equal(got, want)
    assert weights_equal(sgd.get_weights(), weights)


@pytest.mark.parametrize("crash_at", [1, 2, 3])  # after data written / after index / before commit
def test_killed_during_save_keeps_the_previous_checkpoint(sgd, tmp_path, crash_at):
    path = str(tmp_path / "ckpt")
    sgd.step()
    sgd.save_checkpoint(path)
    saved, saved_step = sgd.get_weights(), sgd.steps_done
    sgd.step()
    files = ray.get(sgd.workers[0].save_checkpoint.remote(sgd.steps_done), timeout=60)
    blob = str(tmp_path / "blob.pkl")
    with open(blob, "wb") as f:
        pickle.dump((files, {"step": sgd.steps_done}), f)
    child = subprocess.run([sys.executable, "-c", CRASHING_SAVE, path, blob, str(crash_at),
                            os.path.dirname(dsgd.__file__)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 17, child.stderr
    assert not weights_equal(sgd.get_weights(), saved)
    sgd.restore_checkpoint(path)
    assert weights_equal(sgd.get_weights(), saved) and sgd.steps_done == saved_step
    # The next successful save replaces it and removes the crashed save's leftovers.
    sgd.save_checkpoint(path)
    names = sorted(os.listdir(tmp_path))
    assert len([n for n in names if n.startswith("ckpt.step")]) == 2, names  # .index + .data
    assert not [n for n in names if ".tmp-" in n], names


def test_checkpoint_records_the_configuration(sgd, tmp_path):
    path = str(tmp_path / "ckpt")
    sgd.save_checkpoint(path)
    with open(path + ".dsgd.json") as f:
        meta = json.load(f)
    assert meta["step"] == sgd.steps_done and meta["num_workers"] == 1
    # The trainable variables: kernel, bias, BN's gamma and beta, kernel, bias.
    assert meta["strategy"] == "ps" and meta["variables"]["shapes"] == [
        [tiny.IN, tiny.HIDDEN], [tiny.HIDDEN], [tiny.HIDDEN], [tiny.HIDDEN],
        [tiny.HIDDEN, tiny.OUT], [tiny.OUT]]
    assert set(meta["files"]) == {".index", ".data-00000-of-00001"}


def corrupt_truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def corrupt_flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage,suffix,message", [
    (corrupt_truncate, ".data-00000-of-00001", r"has \d+ bytes, \d+ were saved \(truncated\?\)"),
    (corrupt_flip, ".data-00000-of-00001", r"is corrupt \(its SHA-256 differs"),
    (corrupt_flip, ".index", r"\.index is corrupt"),
    (os.remove, ".index", r"\.index is missing"),
    (corrupt_truncate, "json", r"ckpt\.dsgd\.json is corrupt or truncated"),
])
def test_damaged_checkpoint_is_a_clear_error_and_changes_nothing(sgd, tmp_path, damage, suffix,
                                                                   message):
    path = str(tmp_path / "ckpt")
    sgd.save_checkpoint(path)
    steps = sgd.steps_done
    sgd.step()
    before = sgd.get_weights()
    if suffix == "json":
        target = path + ".dsgd.json"
    else:
        target = dsgd.engine.checkpoints.tf_prefix(path) + suffix
    damage(target)
    with pytest.raises(dsgd.CheckpointError, match=message):
        sgd.restore_checkpoint(path)
    assert weights_equal(sgd.get_weights(), before) and sgd.steps_done == steps + 1


def test_missing_checkpoint(sgd, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nothing"):
        sgd.restore_checkpoint(str(tmp_path / "nothing"))
