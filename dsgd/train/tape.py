"""Horovod's gradient wrappers: `DistributedGradientTape` (custom loops) and
`DistributedOptimizer` (Keras `fit`), averaging gradients over all Ray Train
workers through the run's PS actors (dsgd/train/exchange.py), eagerly or
inside a `tf.function` (one stateful `tf.numpy_function` per exchange)."""

from __future__ import annotations

from dsgd.train import collectives
from dsgd.train.collectives import Average, Compression

# Horovod arguments that only steer its own fusion, devices or locking: accepted (a port
# keeps working) and ignored (dsgd fuses by its shard plan, on the CPU; Keras 3 optimizers
# take no lock); process_set only as None.
_HINTS = ("device_dense", "device_sparse", "sparse_as_dense", "num_groups", "groups",
          "process_set", "scale_local_gradients", "use_locking")


def _check_hints(kwargs: dict, where: str) -> None:
    accepted = "compression, op, gradient_predivide_factor" + (
        ", backward_passes_per_step, average_aggregated_gradients, name"
        if "Optimizer" in where else "")
    collectives.check_hints(kwargs, where, accepted, _HINTS)


def _check_predivide(factor, where: str) -> None:
    """Horovod's gradient_predivide_factor f splits the average into a division
    by f before the sum and by size/f after it; dsgd averages in one step, so
    only f = 1.0 (Horovod's default, the same mean) is accepted."""
    if factor != 1.0:
        raise ValueError(f"{where}: gradient_predivide_factor={factor!r} is not supported (dsgd "
                         "averages in one step); leave it 1.0")


def mean_tensors(tensors: list, compression=None, op=Average) -> list:
    """The mean (or with op=Sum the sum) over all workers of each tensor (None
    stays None; IndexedSlices are made dense), in one exchange. Works eagerly
    and inside `tf.function`; every worker must call it in the same order."""
    present = [k for k, t in enumerate(tensors) if t is not None]
    if not present or collectives.size() == 1:  # one worker: its gradients are the mean
        return list(tensors)
    means = collectives.grouped_allreduce([tensors[k] for k in present], op=op,
                                          compression=compression, name="dsgd_mean")
    out = list(tensors)
    for k, mean in zip(present, means):
        out[k] = mean
    return out


class DistributedGradientTape:
    """Horovod's `hvd.DistributedGradientTape(tape, compression=..., op=...)`: wraps
    a `tf.GradientTape` so that `gradient` returns the mean over all Ray Train
    workers. Other attributes go to the wrapped tape.

    Args:
        gradtape (tf.GradientTape): the tape that recorded the loss.
        compression (type): `dsgd.train.Compression.none`, `.fp16` or `.bf16`:
            the gradients' wire type.
        op (int): `dsgd.train.Average` or `dsgd.train.Sum`.
        gradient_predivide_factor: must stay 1.0 (not supported).
        **hints (Any): Horovod's device, sparse-as-dense and grouping
            arguments, accepted and ignored; `process_set` only as None.

    Raises:
        TypeError: an unknown keyword argument.
        ValueError: a bad `compression` or `op`, a `process_set`, or
            `gradient_predivide_factor` other than 1.0.
    """

    def __init__(self, gradtape, compression=Compression.none, op=Average,
                 gradient_predivide_factor: float = 1.0, **hints):
        _check_hints(hints, "DistributedGradientTape")
        collectives.wire_of(compression)  # fails early on a bad value
        collectives._op_of(op, None)
        _check_predivide(gradient_predivide_factor, "DistributedGradientTape")
        self._tape, self._compression, self._op = gradtape, compression, op

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """The wrapped tape's gradient, then the mean (op=Sum: the sum) over all
        workers of every worker's gradient, in one exchange (None stays None;
        IndexedSlices are made dense). Eagerly or inside `tf.function`; every
        worker must call it in the same order. Blocks until every worker has
        called it (at most `DsgdConfig.timeout_s` seconds); with one worker,
        no exchange.

        Args:
            target (Any): as `tf.GradientTape.gradient`'s.
            sources (Any): as `tf.GradientTape.gradient`'s.
            output_gradients (Any): as `tf.GradientTape.gradient`'s.
            **kwargs (Any): passed to `tf.GradientTape.gradient`.

        Returns:
            (Any): The averaged gradients, in the structure of `sources`:
                tensors of their own.
        """
        import tensorflow as tf

        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat = tf.nest.flatten(grads, expand_composites=False)
        return tf.nest.pack_sequence_as(grads, mean_tensors(flat, self._compression, self._op))

    def __getattr__(self, name):
        return getattr(self._tape, name)


def DistributedOptimizer(optimizer, name: str | None = None, compression=Compression.none,  # noqa: N802
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, op=Average,
                         gradient_predivide_factor: float = 1.0, **hints):
    """Horovod's Keras `hvd.DistributedOptimizer`: a Keras 3 optimizer that averages
    gradients over all Ray Train workers before `optimizer` applies them:
    `model.compile(optimizer=DistributedOptimizer(opt), jit_compile=False)`
    then `model.fit(...)` trains data-parallel (Horovod's own no longer works
    with Keras 3).

    Each apply blocks until every worker has reached it (at most
    `DsgdConfig.timeout_s` seconds). XLA cannot compile the exchange (a
    `tf.numpy_function`): keep `jit_compile=False`. Not with the
    `mixed_float16` policy: compile() then wraps this optimizer in a
    LossScaleOptimizer that skips overflowing steps per worker, before
    averaging, and workers would fall out of step; use `mixed_bfloat16`.

    Args:
        optimizer (keras.optimizers.Optimizer): the optimizer that applies the
            averaged gradients; it holds the learning rate and iterations.
        name: the wrapper's name (default `distributed_<optimizer.name>`).
        compression (type): `dsgd.train.Compression.none`, `.fp16` or `.bf16`:
            the gradients' wire type.
        backward_passes_per_step: k: gradients are accumulated locally for k
            calls and exchanged, then applied, on every k-th; the other calls
            apply nothing.
        average_aggregated_gradients: with k > 1, average the k passes'
            gradients instead of summing them (as Horovod).
        op (int): `dsgd.train.Average` or `dsgd.train.Sum`.
        gradient_predivide_factor: must stay 1.0 (Horovod's default; other
            values are not supported).
        **hints (Any): Horovod's device, sparse-as-dense, grouping and
            `use_locking` arguments, accepted and ignored; `process_set` only
            as None.

    Returns:
        (keras.optimizers.Optimizer): The wrapping optimizer.

    Raises:
        TypeError: `optimizer` is not a Keras optimizer, or an unknown keyword
            argument.
        ValueError: the `mixed_float16` policy is set, a bad
            `backward_passes_per_step`, `compression` or `op`, a
            `process_set`, or `gradient_predivide_factor` other than 1.0.
    """
    import keras

    _check_hints(hints, "DistributedOptimizer")
    _check_predivide(gradient_predivide_factor, "DistributedOptimizer")
    if keras.mixed_precision.global_policy().name == "mixed_float16":
        raise ValueError("DistributedOptimizer under the mixed_float16 policy: Keras would check "
                         "for overflow per worker before the average, and workers could skip "
                         "different steps; use mixed_bfloat16, or DistributedGradientTape in a "
                         "custom loop that scales the loss itself")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras optimizer, got {type(optimizer).__name__}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"DistributedOptimizer: backward_passes_per_step must be an int >= 1, got "
                         f"{backward_passes_per_step!r}")
    collectives.wire_of(compression)
    collectives._op_of(op, None)
    return _distributed_class()(optimizer, name=name, compression=compression, op=op,
                                passes=backward_passes_per_step,
                                average_passes=average_aggregated_gradients)


_CLASS: list = []


def _distributed_class():
    """The optimizer class, made once Keras is imported (Keras loads lazily here)."""
    if _CLASS:
        return _CLASS[0]
    import keras

    class DistributedKerasOptimizer(keras.optimizers.Optimizer):
        """Averages gradients over the Ray Train workers, then lets the inner
        optimizer apply them (structured like Keras's LossScaleOptimizer)."""

        def __init__(self, inner_optimizer, name=None, compression=None, op=Average, passes=1,
                     average_passes=False):
            super().__init__(learning_rate=0.0, name=name or f"distributed_{inner_optimizer.name}")
            self.inner_optimizer = inner_optimizer
            self._compression, self._op = compression, op
            self._passes, self._average_passes = passes, average_passes
            self._accumulators: list = []

        def build(self, var_list):
            self.inner_optimizer.build(var_list)
            super().build(var_list)
            if self._passes > 1:
                # Plain tf.Variables, outside `variables`: a worker's partial sum is its
                # own (never broadcast, never checkpointed), as Horovod's aggregation.
                import tensorflow as tf

                self._pass = tf.Variable(0, dtype=tf.int64, trainable=False)
                self._accumulators = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                                      for v in var_list]

        @property
        def variables(self):
            return self._variables + self.inner_optimizer.variables

        def apply(self, grads, trainable_variables=None):
            if not self.built:
                self.build(trainable_variables)
                self.built = True
            grads = list(grads)
            if self._passes == 1:
                self.inner_optimizer.apply(mean_tensors(grads, self._compression, self._op),
                                           trainable_variables)
                return
            _accumulate_and_apply(self, grads, trainable_variables)

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
            return {"name": self.name, "passes": self._passes,
                    "average_passes": self._average_passes,
                    "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}

        @classmethod
        def from_config(cls, config, custom_objects=None):
            inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                          custom_objects=custom_objects)
            return cls(inner, **config)

    _CLASS.append(DistributedKerasOptimizer)
    return DistributedKerasOptimizer


def _accumulate_and_apply(opt, grads: list, trainable_variables) -> None:
    """`backward_passes_per_step` > 1: add `grads` to `opt`'s own accumulators;
    every `opt._passes`-th call, exchange their sum (or mean over the passes)
    and have the inner optimizer apply it, then zero them. Works eagerly and
    inside `tf.function` (`tf.cond`)."""
    import tensorflow as tf

    for acc, g in zip(opt._accumulators, grads, strict=True):
        if g is not None:
            acc.assign_add(tf.convert_to_tensor(g))
    opt._pass.assign_add(1)

    def exchange_and_apply():
        summed = [tf.convert_to_tensor(a) for a in opt._accumulators]
        if opt._average_passes:
            summed = [s / tf.cast(opt._passes, s.dtype) for s in summed]
        opt.inner_optimizer.apply(mean_tensors(summed, opt._compression, opt._op),
                                  trainable_variables)
        for a in opt._accumulators:
            a.assign(tf.zeros_like(a))
        return tf.constant(True)

    tf.cond(tf.equal(opt._pass % opt._passes, 0), exchange_and_apply,
            lambda: tf.constant(False))
