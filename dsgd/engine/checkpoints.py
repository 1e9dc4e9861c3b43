"""Checkpoints in TensorFlow's format, written by the driver.

Layout for a checkpoint path P:
  P.dsgd.json                      the commit record: step count, configuration, the
                                   TensorFlow checkpoint's prefix G and every file's
                                   size and SHA-256 (JSON, never pickled)
  G.index, G.data-00000-of-00001   TensorFlow checkpoint, G = P.step<NNNNNNNN>-<token>,
                                   with keys
      weights/<i>                  the replica's state variables (a Keras model's
                                   `weights`, else `get_variables()`)
      optimizer_variables/<i>      the optimizer's `variables` (iteration, slots)
      step                         completed dsgd steps

Saving is atomic: the new generation's files are written under new names
(temporary name, fsync, rename), then P.dsgd.json is replaced in one rename,
then older generations are deleted. A crash at any point leaves either the old
or the new checkpoint complete and loadable. Loading checks every file's size
and checksum first, so a truncated or corrupt checkpoint is a CheckpointError
naming the file, and nothing is changed.

A plain Keras model loads the weights with TensorFlow alone:
  tf.train.Checkpoint(weights=model.weights).read(tf_prefix(P)).expect_partial()

Worker 0 writes into a private temporary directory and hands the bytes to the
driver (dsgd/worker/checkpoint_files.py), which writes them under P with
`write`; restore ships the bytes from `read` to every worker. So checkpoints
work when workers sit on other nodes, with no shared filesystem.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid

from dsgd.errors import CheckpointError

META_SUFFIX = ".dsgd.json"


def write(path: str, files: dict[str, bytes], meta: dict) -> str:
    """(driver side) Write checkpoint files as a new generation of `path` and
    commit it by replacing `path.dsgd.json` (see the module docstring). Blocks
    until everything is fsynced. Returns `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    os.makedirs(directory, exist_ok=True)
    generation = f"{base}.step{int(meta.get('step', 0)):08d}-{uuid.uuid4().hex[:8]}"
    meta = dict(meta, tf_prefix=generation, files={
        suffix: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for suffix, data in files.items()})
    for suffix in sorted(files, key=lambda s: s == ".index"):
        _write_durably(os.path.join(directory, generation + suffix), files[suffix])
    _fsync_directory(directory)
    _write_durably(path + META_SUFFIX, json.dumps(meta, indent=1).encode())  # the commit
    _fsync_directory(directory)
    for name in os.listdir(directory):  # older generations and leftovers of crashed saves
        if (name.startswith(base + ".step") and not name.startswith(generation)) \
                or name.startswith(base + META_SUFFIX + ".tmp-"):
            try:
                os.remove(os.path.join(directory, name))
            except OSError:
                pass
    return path


def _write_durably(target: str, data: bytes) -> None:
    tmp = f"{target}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tf_prefix(path: str) -> str:
    """The TensorFlow checkpoint prefix of the dsgd checkpoint at `path`, for
    `tf.train.Checkpoint(...).read(tf_prefix(path))`."""
    meta = _read_meta(path)
    return os.path.join(os.path.dirname(os.path.abspath(path)), meta["tf_prefix"])


def _read_meta(path: str) -> dict:
    meta_path = path + META_SUFFIX
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"no checkpoint at {path!r} (expected {meta_path})")
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read().decode())
        if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) \
                or not isinstance(meta.get("tf_prefix"), str):
            raise ValueError("missing 'files' or 'tf_prefix'")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path!r}: {meta_path} is corrupt or truncated ({e})") from None
    return meta


def read(path: str) -> tuple[dict[str, bytes], dict]:
    """(driver side) The files and metadata of the checkpoint at `path`, every
    file checked against the size and SHA-256 recorded when it was saved."""
    meta = _read_meta(path)
    directory = os.path.dirname(os.path.abspath(path))
    files = {}
    for suffix, expected in meta["files"].items():
        name = os.path.join(directory, meta["tf_prefix"] + suffix)
        try:
            with open(name, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path!r}: file {name} is missing") from None
        if len(data) != expected.get("bytes"):
            raise CheckpointError(f"checkpoint {path!r}: file {name} has {len(data)} bytes, "
                                  f"{expected.get('bytes')} were saved (truncated?)")
        if hashlib.sha256(data).hexdigest() != expected.get("sha256"):
            raise CheckpointError(f"checkpoint {path!r}: file {name} is corrupt (its SHA-256 "
                                  "differs from the one saved)")
        files[suffix] = data
    if ".index" not in files:
        raise CheckpointError(f"checkpoint {path!r} records no .index file")
    return files, meta


def meta(config, step: int, num_workers: int, skipped_steps: int, plan,
         data_position: int | None, extra: dict | None) -> dict:
    """What a checkpoint's `.dsgd.json` records besides its files: the step, the
    run's shape and exchange settings, the variables' shapes and dtypes, the
    data position of the last dataset trained on, and the caller's `extra`."""
    out = {"step": step, "num_workers": num_workers,
           "devices_per_worker": config.devices_per_worker, "strategy": config.strategy,
           "compression": config.compression, "grad_shard_bytes": config.grad_shard_bytes,
           "all_reduce_alg": config.all_reduce_alg, "on_nonfinite": config.on_nonfinite,
           "skipped_steps": skipped_steps,
           "variables": {"shapes": [list(s) for s in plan.shapes], "dtypes": list(plan.dtypes)}}
    if data_position is not None:
        out["data_position"] = int(data_position)  # rows of the last dataset
    if extra is not None:
        out["extra"] = extra
    return out
