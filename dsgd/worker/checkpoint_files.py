"""A replica's state as TensorFlow checkpoint files, worker side.

`save_files` writes one replica's state (its `get_state_variables()`, its
optimizers' variables and the step count) with `tf.train.Checkpoint` into a
private temporary directory and returns the files' bytes; `restore_files`
does the reverse for every replica of a worker, after checking that the
checkpoint fits the model. The driver writes and reads those bytes on its own
file system, atomically (dsgd/engine/checkpoints.py), so checkpoints work when
workers sit on other nodes.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from dsgd.errors import ModelMismatchError

_PREFIX = "ckpt"


def state_variables(replica) -> list:
    """What a checkpoint (and the start-up broadcast) holds of one replica:
    its `get_state_variables()`."""
    return list(replica.get_state_variables())


def _tf_checkpoint(replica, optimizer_variables, step_var):
    import tensorflow as tf

    return tf.train.Checkpoint(weights=state_variables(replica),
                               optimizer_variables=list(optimizer_variables), step=step_var)


def save_files(replica, optimizer_variables: list, step: int) -> dict[str, bytes]:
    """(worker side) One replica's state and the variables of its optimizers
    (`Replicas.optimizer_variables`) as checkpoint files: {suffix: bytes}."""
    import tensorflow as tf

    tmp = tempfile.mkdtemp(prefix="dsgd-ckpt-")
    try:
        step_var = tf.Variable(step, dtype=tf.int64)
        _tf_checkpoint(replica, optimizer_variables, step_var).write(os.path.join(tmp, _PREFIX))
        files = {}
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                files[name[len(_PREFIX):]] = f.read()
        return files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def restore_files(replicas, optimizer_variables: list, files: dict[str, bytes]) -> int:
    """(worker side) Load checkpoint files into every replica (`optimizer_variables[i]`:
    replica i's). Checks the checkpoint against the model first, so a mismatch
    changes nothing."""
    import tensorflow as tf

    tmp = tempfile.mkdtemp(prefix="dsgd-ckpt-")
    try:
        for suffix, data in files.items():
            with open(os.path.join(tmp, _PREFIX + suffix), "wb") as f:
                f.write(data)
        prefix = os.path.join(tmp, _PREFIX)
        _check_compatible(prefix, replicas[0], optimizer_variables[0])
        step = 0
        for replica, variables in zip(replicas, optimizer_variables):
            step_var = tf.Variable(0, dtype=tf.int64)
            _tf_checkpoint(replica, variables, step_var).read(prefix).assert_existing_objects_matched()
            step = int(step_var.numpy())
        return step
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_compatible(prefix: str, replica, optimizer_variables) -> None:
    """ModelMismatchError naming the first difference in count, shape or dtype
    between the checkpoint's variables and the replica's (its model state and
    its optimizers' variables), before anything is loaded."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    for group, variables in (("weights", state_variables(replica)),
                             ("optimizer_variables", list(optimizer_variables))):
        saved = sum(1 for k in shapes if k.startswith(group + "/") and k.endswith("VARIABLE_VALUE"))
        what = "model state variables" if group == "weights" else "optimizer variables"
        if saved != len(variables):
            raise ModelMismatchError(f"the checkpoint is of another model: it holds {saved} "
                                     f"{what} ({group}), this model has {len(variables)}")
        for i, v in enumerate(variables):
            key = f"{group}/{i}/.ATTRIBUTES/VARIABLE_VALUE"
            name = getattr(v, "path", None) or v.name
            saved_dtype, dtype = tf.as_dtype(dtypes[key]).name, tf.as_dtype(v.dtype).name
            if tuple(shapes[key]) != tuple(v.shape) or saved_dtype != dtype:
                raise ModelMismatchError(
                    f"the checkpoint is of another model: its {group}[{i}] is "
                    f"{saved_dtype}{tuple(shapes[key])}, this model's variable {name} is "
                    f"{dtype}{tuple(v.shape)}")
