"""Checkpoints in TensorFlow's format, written by the driver.

Layout under a path prefix P (as `tf.train.Checkpoint` uses):
  P.index, P.data-00000-of-00001   TensorFlow checkpoint with keys
      weights/<i>                  the replica's state variables (a Keras model's
                                   `weights`, else `get_variables()`)
      optimizer_variables/<i>      the optimizer's `variables` (iteration, slots)
      step                         completed dsgd steps
  P.dsgd.json                      step count and configuration (never pickled)

A plain Keras model loads the weights with TensorFlow alone:
  tf.train.Checkpoint(weights=model.weights).read(P).expect_partial()

Worker 0 writes into a private temporary directory and hands the bytes to the
driver, which writes them under P; restore ships the bytes to every worker. So
checkpoints work when workers sit on other nodes, with no shared filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from dsgd.errors import ModelMismatchError

_PREFIX = "ckpt"
META_SUFFIX = ".dsgd.json"


def state_variables(replica) -> list:
    """What a checkpoint (and the start-up broadcast) holds of one replica."""
    model = getattr(replica, "model", None)
    weights = getattr(model, "weights", None)
    return list(weights) if weights else list(replica.get_variables())


def _tf_checkpoint(replica, optimizer, step_var):
    import tensorflow as tf

    return tf.train.Checkpoint(weights=state_variables(replica),
                               optimizer_variables=list(optimizer.variables), step=step_var)


def save_files(replica, optimizer, step: int) -> dict[str, bytes]:
    """(worker side) One replica's state as checkpoint files: {suffix: bytes}."""
    import tensorflow as tf

    tmp = tempfile.mkdtemp(prefix="dsgd-ckpt-")
    try:
        step_var = tf.Variable(step, dtype=tf.int64)
        _tf_checkpoint(replica, optimizer, step_var).write(os.path.join(tmp, _PREFIX))
        files = {}
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                files[name[len(_PREFIX):]] = f.read()
        return files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def restore_files(replicas, optimizers, files: dict[str, bytes]) -> int:
    """(worker side) Load checkpoint files into every replica. Checks the
    checkpoint against the model first, so a mismatch changes nothing."""
    import tensorflow as tf

    tmp = tempfile.mkdtemp(prefix="dsgd-ckpt-")
    try:
        for suffix, data in files.items():
            with open(os.path.join(tmp, _PREFIX + suffix), "wb") as f:
                f.write(data)
        prefix = os.path.join(tmp, _PREFIX)
        _check_compatible(prefix, replicas[0], optimizers[0])
        step = 0
        for replica, optimizer in zip(replicas, optimizers):
            step_var = tf.Variable(0, dtype=tf.int64)
            _tf_checkpoint(replica, optimizer, step_var).read(prefix).assert_existing_objects_matched()
            step = int(step_var.numpy())
        return step
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_compatible(prefix: str, replica, optimizer) -> None:
    import tensorflow as tf

    shapes = tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
    for group, variables in (("weights", state_variables(replica)),
                             ("optimizer_variables", list(optimizer.variables))):
        saved = sum(1 for k in shapes if k.startswith(group + "/") and k.endswith("VARIABLE_VALUE"))
        if saved != len(variables):
            raise ModelMismatchError(f"checkpoint has {saved} {group} but the model has {len(variables)}")
        for i, v in enumerate(variables):
            key = f"{group}/{i}/.ATTRIBUTES/VARIABLE_VALUE"
            if tuple(shapes[key]) != tuple(v.shape):
                name = getattr(v, "path", None) or v.name
                raise ModelMismatchError(f"checkpoint {group}[{i}] has shape {tuple(shapes[key])} but "
                                         f"the model's variable {name} has shape {tuple(v.shape)}")


def write(path: str, files: dict[str, bytes], meta: dict) -> str:
    """(driver side) Write checkpoint files under prefix `path`. Each file goes to
    a temporary name, is fsynced and renamed; the index and the metadata come
    last, so a crash mid-save never leaves a new index over old data."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    ordered = sorted(files, key=lambda s: s == ".index")
    blobs = [(s, files[s]) for s in ordered] + [(META_SUFFIX, json.dumps(meta, indent=1).encode())]
    for suffix, data in blobs:
        tmp = f"{path}{suffix}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path + suffix)
    return path


def read(path: str) -> tuple[dict[str, bytes], dict]:
    """(driver side) The files and metadata of the checkpoint at prefix `path`."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    base = os.path.basename(path)
    files = {}
    for name in os.listdir(directory):
        if name.startswith(base) and ".tmp-" not in name:
            suffix = name[len(base):]
            if suffix == ".index" or suffix.startswith(".data-"):
                with open(os.path.join(directory, name), "rb") as f:
                    files[suffix] = f.read()
    if ".index" not in files:
        raise FileNotFoundError(f"no checkpoint at {path!r} (expected {path}.index)")
    meta_path = path + META_SUFFIX
    meta = {}
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    return files, meta
