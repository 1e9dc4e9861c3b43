"""Checkpoints: atomic saves (a process killed mid-save leaves the previous
checkpoint loadable), corrupt or truncated files are clear errors that change
nothing, and the configuration is recorded."""

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

# A child process that writes a checkpoint and dies (os._exit) at the n-th rename.
CRASHING_SAVE = """
import os, pickle, sys
from dsgd.engine import checkpoints as checkpoint
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


@pytest.fixture(scope="module")
def sgd():
    with dsgd.DistributedSGD(tiny.creator(1, 4, "adam"), 1, 1, gpu=False) as sgd:
        yield sgd


def weights_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


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
    child = subprocess.run([sys.executable, "-c", CRASHING_SAVE, path, blob, str(crash_at)],
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
    assert meta["strategy"] == "ps" and meta["variables"]["shapes"][0] == [tiny.IN, tiny.HIDDEN]
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
