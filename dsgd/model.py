"""The replica interface (`Model`) and the ready-made `KerasModel`."""

from __future__ import annotations

from typing import Any

import numpy as np

from dsgd.errors import ModelMismatchError


class Model:
    """One model replica. dsgd builds one per device by calling
    `model_creator(worker_index, device_index)` inside `tf.device(<device>)` and
    `tf.name_scope(f"device_{i}")`, in the worker's process; build every
    variable there (in `__init__`) so it lives on that device.

    Subclasses implement `get_loss` and `get_optimizer`. If they set
    `self.model` to a Keras model, the defaults of `get_variables` and the
    weight accessors use it. dsgd calls these methods in the worker, one
    replica at a time.
    """

    def get_loss(self, batch: Any):
        """The loss to minimise on one batch. Required.

        Traced into the worker's compiled step (`tf.function`): use TensorFlow
        ops on `batch`, not Python side effects.

        Args:
            batch: what `get_batch` returned (or this replica's share of a
                `dsgd.Dataset` batch), converted to tensors.

        Returns:
            (tf.Tensor | dict): The scalar mean loss of the batch. Or a dict:
                "loss" (that scalar, or with several optimizers one scalar per
                optimizer) and other scalar metrics, which steps report
                averaged over replicas.
        """
        raise NotImplementedError("dsgd.Model subclasses must implement get_loss(batch)")

    def get_optimizer(self):
        """The Keras optimizer of this replica, or a list of them, each updating
        one group of `get_variable_groups()` (e.g. a GAN's discriminator and
        generator). Required. Return the same objects on every call, and
        different objects for every replica. It is applied to the mean
        gradient over all replicas."""
        raise NotImplementedError("dsgd.Model subclasses must implement get_optimizer()")

    def get_variables(self) -> list:
        """Trainable variables, in a fixed order that is the same on every replica.
        Default: `self.model.trainable_variables`."""
        model = getattr(self, "model", None)
        if model is None:
            raise NotImplementedError("override get_variables() or set self.model to a Keras model")
        return list(model.trainable_variables)

    def get_state_variables(self) -> list:
        """Everything checkpoints and the start-up broadcast hold of this replica:
        default `self.model.weights` (non-trainable state such as BatchNorm
        statistics included) if it is a Keras model, else `get_variables()`."""
        weights = getattr(getattr(self, "model", None), "weights", None)
        return list(weights) if weights else list(self.get_variables())

    def get_variable_groups(self) -> list:
        """With several optimizers: one list of variables per optimizer, in
        `get_optimizer()` order, together exactly `get_variables()`. Loss i (see
        `get_loss`) is differentiated with respect to group i."""
        return [self.get_variables()]

    def get_batch(self) -> Any:
        """Next batch for `get_loss`; runs eagerly in Python, once per `step()`
        (not when the steps' batches come from a `dsgd.Dataset`). Default:
        None (for a `get_loss` that reads its own input pipeline)."""
        return None

    def get_metrics(self) -> dict[str, float]:
        """Optional evaluation, run eagerly when the user asks (e.g. through
        `DistributedSGD.foreach_model`); dsgd never calls it itself. Default:
        no metrics."""
        return {}

    def steps_per_epoch(self) -> int | None:
        """Optional: steps in one pass over this replica's own data (`get_batch`),
        so that `DistributedSGD.train()` without a dataset runs one epoch by
        default. Default None (unknown)."""
        return None

    def get_weights(self) -> list[np.ndarray]:
        """Copies of the trainable variables' values, in `get_variables()` order:
        new numpy arrays the caller owns."""
        return [np.array(v.numpy()) for v in self.get_variables()]

    def set_weights(self, weights: list[np.ndarray]) -> None:
        """Assign `weights` to the trainable variables (values copied into them,
        cast to each variable's dtype; the caller keeps its arrays).

        Args:
            weights: one array per variable, in `get_variables()` order.

        Raises:
            ValueError: wrong number of arrays, or an array whose shape is not
                its variable's (then nothing is assigned: a replica that took
                some arrays would differ from the others).
        """
        variables = self.get_variables()
        if len(weights) != len(variables):
            raise ValueError(f"set_weights: got {len(weights)} arrays for {len(variables)} variables")
        arrays = [np.asarray(w) for w in weights]
        for i, (v, w) in enumerate(zip(variables, arrays)):
            if tuple(w.shape) != tuple(v.shape):
                raise ValueError(f"set_weights: array {i} has shape {tuple(w.shape)} but variable "
                                 f"{i} ({_name(v)}) has shape {tuple(v.shape)}")
        for v, w in zip(variables, arrays):
            v.assign(w.astype(_np_dtype(v), copy=False))


class KerasModel(Model):
    """A plain Keras model trained on a `tf.data.Dataset` of `(x, y)` batches.

    Args:
        model (keras.Model): the model; built here from the dataset's element
            spec if needed.
        loss_fn (keras.losses.Loss | Callable | str): a Keras loss (object,
            function or name) called as `loss_fn(y, y_pred)`; per-example
            losses are averaged. The model's own `losses` are added.
        optimizer (keras.optimizers.Optimizer | str): a Keras optimizer (or its
            name). Create it inside `model_creator` so every replica has its own.
        dataset (tf.data.Dataset | None): yields `(x, y)` batches (the per-replica batch size is the
            dataset's); repeated forever. Shard it by `(worker_index, device_index)`
            so replicas see different data. None: batches come only from
            `DistributedSGD.train(dataset=...)` (then `model` must be built,
            e.g. start it with `keras.Input`).

    Raises:
        TypeError: `model`, `loss_fn` or `dataset` of the wrong type.
        ValueError: an unbuilt `model` without a dataset.
    """

    def __init__(self, model, loss_fn, optimizer, dataset=None):
        import keras
        import tensorflow as tf

        if not isinstance(model, keras.Model):
            raise TypeError(f"KerasModel: `model` must be a keras.Model, got {type(model).__name__}")
        if dataset is not None and not isinstance(dataset, tf.data.Dataset):
            raise TypeError("KerasModel: `dataset` must be a tf.data.Dataset or None, got "
                            f"{type(dataset).__name__}")
        self.model = model
        self.loss_fn = keras.losses.get(loss_fn) if isinstance(loss_fn, str) else loss_fn
        if not callable(self.loss_fn):
            raise TypeError(f"KerasModel: `loss_fn` must be callable or a Keras loss name, got {loss_fn!r}")
        self.optimizer = keras.optimizers.get(optimizer)
        self.dataset = dataset
        self._iterator = None
        if not model.built:
            if dataset is None:
                raise ValueError("KerasModel: without a dataset the model must be built "
                                 "(start it with keras.Input, or call model.build)")
            spec = dataset.element_spec
            x_spec = spec[0] if isinstance(spec, (tuple, list)) else spec
            model.build(tuple(x_spec.shape))

    def get_loss(self, batch):
        import tensorflow as tf

        x, y = batch[0], batch[1]
        per_example = self.loss_fn(y, self.model(x, training=True))
        loss = tf.reduce_mean(per_example)
        if self.model.losses:
            loss = loss + tf.add_n(self.model.losses)
        return loss

    def get_optimizer(self):
        return self.optimizer

    def get_batch(self):
        if self.dataset is None:
            raise ValueError("KerasModel has no dataset of its own: pass one to KerasModel, or "
                             "train with DistributedSGD.train(dataset=...)")
        if self._iterator is None:
            self._iterator = iter(self.dataset.repeat())
        return next(self._iterator)

    def steps_per_epoch(self) -> int | None:
        """Batches in one pass over the dataset, when TensorFlow knows it."""
        if self.dataset is None:
            return None
        n = int(self.dataset.cardinality())
        return n if n >= 0 else None


def _name(variable) -> str:
    return getattr(variable, "path", None) or getattr(variable, "name", "?")


def _np_dtype(variable):
    dtype = variable.dtype
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype))


# -- what a replica's methods return, checked (dsgd/worker/replicas.py) --------------
def optimizer_groups(replica: Model, variables: list, where: str) -> tuple[list, list]:
    """The replica's optimizers and, for each, the indices (into `variables`) of
    the variables it updates: `get_optimizer()` may return one optimizer (all
    variables) or a list matched to `get_variable_groups()`."""
    optimizer = replica.get_optimizer()
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    groups = replica.get_variable_groups() if len(optimizers) > 1 else [variables]
    if len(groups) != len(optimizers):
        raise ModelMismatchError(f"replica ({where}) has {len(optimizers)} optimizers but "
                                 f"get_variable_groups() gives {len(groups)} variable groups")
    position = {id(v): k for k, v in enumerate(variables)}
    indices, used = [], set()
    for g, group in enumerate(groups):
        group_indices = []
        for v in group:
            if id(v) not in position or id(v) in used:
                raise ModelMismatchError(f"replica ({where}): variable {_name(v)} of group {g} is "
                                         "not in get_variables(), or in two groups")
            used.add(id(v))
            group_indices.append(position[id(v)])
        indices.append(group_indices)
    return optimizers, indices


def loss_parts(out, num_objectives: int) -> tuple[list, dict]:
    """get_loss's result as (one scalar objective per optimizer, {name: float32
    scalar metric}). It returns a scalar, or a dict whose "loss" is a scalar or
    one scalar per optimizer, the other entries being scalar metrics."""
    import tensorflow as tf

    metrics = {}
    if isinstance(out, dict):
        if "loss" not in out:
            raise ValueError(f"get_loss returned a dict without 'loss': keys {sorted(out)}; "
                             "return a scalar loss, or {'loss': loss, <metric>: scalar, ...}")
        metrics = {k: tf.cast(tf.convert_to_tensor(v), tf.float32) for k, v in out.items()
                   if k != "loss"}
        out = out["loss"]
    if out is None:
        raise ValueError("get_loss returned None as the loss: return a scalar tf.Tensor")
    objectives = list(out) if isinstance(out, (list, tuple)) else [out]
    if len(objectives) != num_objectives:
        raise ValueError(f"get_loss returned {len(objectives)} loss(es) for {num_objectives} "
                         "optimizer(s): return one scalar loss per optimizer")
    objectives = [tf.convert_to_tensor(o) for o in objectives]
    named = [("the loss" if len(objectives) == 1 else f"loss {k}", o)
             for k, o in enumerate(objectives)] + [(f"metric {k!r}", v) for k, v in metrics.items()]
    for name, value in named:
        if value.shape.rank != 0:
            raise ValueError(f"get_loss must return scalars, but {name} has shape {value.shape}: "
                             "reduce it (e.g. tf.reduce_mean)")
    return objectives, metrics
