"""What a training loop inside Ray Train calls: `DistributedGradientTape`,
`DistributedOptimizer` and `broadcast_variables` (Horovod's names, so a port
from Horovod changes two lines). Gradients are averaged over all workers
through the run's PS actors (dsgd/train/exchange.py), eagerly or inside a
`tf.function` (a `tf.numpy_function` runs the exchange)."""

from __future__ import annotations

import numpy as np

from dsgd.train import exchange


def mean_tensors(tensors: list) -> list:
    """The mean over all workers of each tensor (None stays None). Works eagerly
    and inside `tf.function`; every worker must call it in the same order."""
    import tensorflow as tf

    present = [k for k, t in enumerate(tensors) if t is not None]
    dense = [tf.convert_to_tensor(tensors[k]) for k in present]  # IndexedSlices -> dense
    if not dense or exchange.world()[1] == 1:  # one worker: its gradients are the mean
        return list(tensors)
    if tf.executing_eagerly():
        means = [tf.convert_to_tensor(m) for m in exchange.mean([t.numpy() for t in dense])]
    else:
        means = tf.numpy_function(lambda *arrays: exchange.mean(list(arrays)), dense,
                                  [t.dtype for t in dense], stateful=True,
                                  name="dsgd_mean")
        for mean, tensor in zip(means, dense):
            mean.set_shape(tensor.shape)
    out = list(tensors)
    for k, mean in zip(present, means):
        out[k] = mean
    return out


class DistributedGradientTape:
    """Wraps a `tf.GradientTape`: `gradient(target, sources)` returns the mean over
    all Ray Train workers of every worker's gradient (Horovod's
    `hvd.DistributedGradientTape`). Other attributes go to the wrapped tape."""

    def __init__(self, tape):
        self._tape = tape

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        import tensorflow as tf

        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat = tf.nest.flatten(grads, expand_composites=False)
        return tf.nest.pack_sequence_as(grads, mean_tensors(flat))

    def __getattr__(self, name):
        return getattr(self._tape, name)


def DistributedOptimizer(optimizer):  # noqa: N802 - Horovod's name, a factory like hvd's
    """A Keras 3 optimizer that averages gradients over all Ray Train workers before
    `optimizer` applies them: `model.compile(optimizer=DistributedOptimizer(opt),
    jit_compile=False)` then `model.fit(...)` trains data-parallel (Horovod's Keras
    `DistributedOptimizer` no longer works with Keras 3). XLA cannot compile the
    exchange (a `tf.numpy_function`): keep `jit_compile=False`. Not with the
    `mixed_float16` policy: compile() then wraps this optimizer in a
    LossScaleOptimizer that skips overflowing steps per worker, before averaging,
    and workers would fall out of step; use `mixed_bfloat16`."""
    import keras

    if keras.mixed_precision.global_policy().name == "mixed_float16":
        raise ValueError("DistributedOptimizer under the mixed_float16 policy: Keras would check "
                         "for overflow per worker before the average, and workers could skip "
                         "different steps; use mixed_bfloat16, or DistributedGradientTape in a "
                         "custom loop that scales the loss itself")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras optimizer, got {type(optimizer).__name__}")
    return _distributed_class()(optimizer)


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Set every worker's `variables` to rank `root_rank`'s values (call it once,
    eagerly, before training, on every worker)."""
    import tensorflow as tf

    variables = list(variables)
    if not tf.executing_eagerly():
        raise RuntimeError("broadcast_variables runs eagerly: call it before training, outside "
                           "tf.function")
    from dsgd.train.exchange import world

    rank, _ = world()
    values = [np.array(v.numpy()) for v in variables] if rank == root_rank else None
    values = exchange.broadcast(values, root_rank)
    for variable, value in zip(variables, values):
        variable.assign(value)


_CLASS: list = []


def _distributed_class():
    """The optimizer class, made once Keras is imported (Keras loads lazily here)."""
    if _CLASS:
        return _CLASS[0]
    import keras

    class DistributedKerasOptimizer(keras.optimizers.Optimizer):
        """Averages gradients over the Ray Train workers, then lets the inner
        optimizer apply them (structured like Keras's LossScaleOptimizer)."""

        def __init__(self, inner_optimizer, name=None):
            super().__init__(learning_rate=0.0, name=name or f"distributed_{inner_optimizer.name}")
            self.inner_optimizer = inner_optimizer

        def build(self, var_list):
            self.inner_optimizer.build(var_list)
            super().build(var_list)

        @property
        def variables(self):
            return self._variables + self.inner_optimizer.variables

        def apply(self, grads, trainable_variables=None):
            if not self.built:
                self.build(trainable_variables)
                self.built = True
            self.inner_optimizer.apply(mean_tensors(list(grads)), trainable_variables)

        @property
        def learning_rate(self):
            return self.inner_optimizer.learning_rate

        @learning_rate.setter
        def learning_rate(self, value):
            self.inner_optimizer.learning_rate = value

        @property
        def iterations(self):
            return self.inner_optimizer.iterations

        def finalize_variable_values(self, var_list):
            self.inner_optimizer.finalize_variable_values(var_list)

        def get_config(self):
            return {"name": self.name,
                    "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}

        @classmethod
        def from_config(cls, config, custom_objects=None):
            inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                          custom_objects=custom_objects)
            return cls(inner, **config)

    _CLASS.append(DistributedKerasOptimizer)
    return DistributedKerasOptimizer
