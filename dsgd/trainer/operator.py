"""`dsgd.TrainingOperator`: what one replica trains (RaySGD's TrainingOperator, for Keras).

Subclass it and implement `setup(config)`, which builds the models, optimizers,
loss, metrics and data and registers them. `dsgd.Trainer` makes one operator
per replica (worker x device), inside the replica's `tf.device`, and calls
`train_batch` inside the worker's compiled step (`tf.function`) and
`validate_batch` inside a compiled validation step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

BATCH_SIZE = "*batch_size"
"""The `Trainer(config=...)` key of the global batch size (examples per step
over all replicas), as in RaySGD. The Trainer divides it among all replicas
(ValueError if it does not divide); inside an operator, `config[BATCH_SIZE]`
is the per-replica batch. Registered `dsgd.Dataset`s then get
`config[BATCH_SIZE] // num_workers` as their per-worker `batch_size`."""


class TrainingOperator:
    """One replica's training components. Subclass it and implement `setup`; do
    not construct it: `dsgd.Trainer` makes one per replica (worker x device),
    inside the replica's `tf.device`, in the worker's process.

    Attributes:
        config: the Trainer's `config` (with `config[dsgd.BATCH_SIZE]` the
            per-replica batch).
        world_rank: this replica's index among all replicas, worker-major.
        world_size: replicas in all.
        device: this replica's TensorFlow device.
        models: (after `register`) the registered Keras models, a list;
            `model` is the one when exactly one is registered (else
            AttributeError).
        optimizers: (after `register`) the registered optimizers, a list;
            `optimizer` the one, as `model`.
        loss: the registered loss, or None.
        metrics: the registered Keras metrics, a list.
        schedulers: the registered schedulers, a list; `scheduler` the one,
            as `model`.
    """

    def __init__(self, config: dict, world_rank: int, world_size: int, device: str,
                 loss_scaling: bool = False):
        self._config, self._world_rank, self._world_size = config, world_rank, world_size
        self._device, self._loss_scaling = device, loss_scaling
        self._models: list = []
        self._optimizers: list = []
        self._loss: Callable | None = None
        self._metrics: list = []
        self._schedulers: list = []
        self._train_data = self._validation_data = None
        self._registered = self._data_registered = False
        self._stepper = None  # set while a custom train_epoch runs (dsgd/trainer/custom.py)
        self._replica = None  # the OperatorReplica holding this operator (worker side)

    def __getstate__(self) -> dict:
        """Pickles without the worker-side links (the replica's compiled
        functions cannot be pickled): an operator returned from a worker
        (`Trainer.sgd.for_model(lambda m: m.operator)`) arrives without them."""
        state = dict(self.__dict__)
        state["_replica"] = state["_stepper"] = None
        return state

    # -- to implement -----------------------------------------------------------------
    def setup(self, config: dict) -> None:
        """Build the models, optimizers, loss, metrics and data, and register them
        with `self.register(...)` and `self.register_data(...)`. Required.
        Runs once per replica, inside its `tf.device`, when the Trainer starts
        (and in the driver for `Trainer.get_model`).

        Args:
            config: the Trainer's config; `config[dsgd.BATCH_SIZE]` is the
                per-replica batch.
        """
        raise NotImplementedError("TrainingOperator subclasses must implement setup(config)")

    # -- registration -------------------------------------------------------------------
    def register(self, *, models, optimizers, loss=None, metrics=None, schedulers=None):
        """Register the training components. Call it once, in `setup`.

        Args:
            models (keras.Model | list | tuple): one or several built Keras
                models.
            optimizers (keras.optimizers.Optimizer | list | tuple): one or
                several Keras optimizers; several: optimizer i updates model i
                (e.g. a GAN's discriminator and generator).
            loss (keras.losses.Loss | Callable | str | None): a Keras loss
                object, name or callable `loss(y_true, y_pred)`.
            metrics (keras.metrics.Metric | list | None): Keras metrics,
                reported by validation as `val_<name>`.
            schedulers (Any): learning-rate schedulers, scheduler i driving
                optimizer i; each a
                `keras.optimizers.schedules.LearningRateSchedule`, a callable
                `(epoch_or_step, lr) -> lr` or a `dsgd.ReduceLROnPlateau`;
                stepped as `Trainer(scheduler_step_freq=...)` says (see
                dsgd/trainer/schedules.py).

        Returns:
            (tuple): (models, optimizers) shaped as given, plus the schedulers
                when given; with `use_fp16=True` the optimizers are wrapped in
                `keras.optimizers.LossScaleOptimizer`.

        Raises:
            RuntimeError: a second call.
            TypeError: an argument of the wrong type, named (nothing is
                registered).
            ValueError: an unbuilt model, mismatched counts, or an optimizer
                whose learning rate is itself a schedule when a scheduler
                drives it (nothing is registered).
        """
        import keras

        from dsgd.trainer import schedules

        if self._registered:
            raise RuntimeError(f"{type(self).__name__}.register was called twice: call it once "
                               "in setup, with every model and optimizer (models=(a, b), "
                               "optimizers=(opt_a, opt_b))")
        single_model = not isinstance(models, (list, tuple))
        single_optimizer = not isinstance(optimizers, (list, tuple))
        models = [models] if single_model else list(models)
        optimizers = [optimizers] if single_optimizer else list(optimizers)
        if not models or not optimizers:
            raise ValueError("register: models and optimizers must each hold at least one, got "
                             f"{len(models)} model(s) and {len(optimizers)} optimizer(s)")
        _check_models_and_optimizers(models, optimizers)
        loss, metrics = _checked_loss_and_metrics(loss, metrics)
        single_scheduler = schedulers is not None and not isinstance(schedulers, (list, tuple))
        schedulers = [] if schedulers is None else [schedulers] if single_scheduler \
            else list(schedulers)
        if len(schedulers) > len(optimizers):
            raise ValueError(f"register: {len(schedulers)} schedulers for {len(optimizers)} "
                             "optimizer(s); scheduler i drives optimizer i")
        for i, scheduler in enumerate(schedulers):
            schedules.kind_of(scheduler, i)
            schedules.check_optimizer(optimizers[i], i)
        if self._loss_scaling:
            optimizers = [o if isinstance(o, keras.optimizers.LossScaleOptimizer)
                          else keras.optimizers.LossScaleOptimizer(o) for o in optimizers]
        # Nothing is kept until every argument is checked: a failed register changes nothing.
        self._models, self._optimizers, self._loss, self._metrics = models, optimizers, loss, metrics
        self._schedulers = schedulers
        self._registered = True
        out = (self._models[0] if single_model else tuple(self._models),
               self._optimizers[0] if single_optimizer else tuple(self._optimizers))
        if schedulers:
            out += (schedulers[0] if single_scheduler else tuple(schedulers),)
        return out

    def register_data(self, *, train_data=None, validation_data=None) -> None:
        """Register the data, in `setup`. Each is a `dsgd.Dataset`, a
        `ray.data.Dataset` (both fed by the driver: built here on every replica
        but used from worker 0's) or a `tf.data.Dataset` of batches (each
        replica reads its shard: every batch once per epoch across replicas).

        Args:
            train_data (Any): what `Trainer.train()` trains on.
            validation_data (Any): what `Trainer.validate()` validates on.
        """
        self._train_data, self._validation_data = train_data, validation_data
        self._data_registered = True

    # -- per batch (traced into compiled steps) ------------------------------------------
    def train_batch(self, batch, batch_info: dict) -> dict:
        """The loss of one training batch, traced into the worker's compiled step
        (`tf.function`). dsgd differentiates it, averages the gradients over
        all replicas and applies the optimizers. Default: the mean of
        `loss(y, model(x, training=True))` plus the model's own losses.

        Args:
            batch (Any): this replica's batch, as tensors: `(x, y)`, or a dict of
                columns (the default reads x/y, image/label or features/label).
            batch_info: {"epoch", "batch_idx"} (the replica's variables, read
                in the step) plus `Trainer.train`'s `info`.

        Returns:
            {"loss": the scalar to minimise (with several optimizers, one
                scalar per optimizer)} plus any scalar metrics to report.
        """
        x, y = unpack(batch)
        model = self.model
        loss = self._mean_loss(y, model(x, training=True))
        if model.losses:
            import tensorflow as tf

            loss = loss + tf.add_n(model.losses)
        return {"loss": loss}

    def validate_batch(self, batch, batch_info: dict) -> dict:
        """One validation batch, traced into a compiled validation step. Default:
        {"val_loss"}, and every registered metric updated (reported as
        `val_<name>`).

        Args:
            batch (Any): this replica's batch, as tensors (as `train_batch`'s).
            batch_info: as `train_batch`'s.

        Returns:
            Scalars, averaged over samples by the Trainer.
        """
        x, y = unpack(batch)
        predictions = self.model(x, training=False)
        for metric in self._metrics:
            metric.update_state(y, predictions)
        return {"val_loss": self._mean_loss(y, predictions)}

    # -- per epoch (override for custom epochs) ---------------------------------------------
    def train_epoch(self, iterator, info: dict) -> dict:
        """One epoch on this worker. Override it for a custom epoch (RaySGD's
        `train_epoch`): it then runs in every worker at once, on replica 0's
        operator. Call `self.train_step(batch)` for each step of all workers:
        every worker must call it equally often. Not overridden, the Trainer
        runs the engine's own epoch with `train_batch` (which sends the next
        step while one is applied); this default is the same loop written with
        `train_step`.

        Args:
            iterator (Iterator): this worker's batches (as many on every worker; each is
                split among the worker's replicas by `train_step`).
            info: {"epoch", ...`Trainer.train`'s info}.

        Returns:
            A dict of numbers (add "num_samples" to weight the average over
                workers); `dsgd.AverageMeterCollection` averages per-batch
                values.
        """
        from dsgd.trainer.meters import AverageMeterCollection

        meters = AverageMeterCollection()
        for batch in iterator:
            meters.update(self.train_step(batch))
        return meters.summary()

    def train_step(self, batch) -> dict:
        """(inside a custom `train_epoch`) One synchronous step of all workers on
        this worker's `batch`: the compiled gradient of `train_batch`'s loss(es)
        on each replica's share, the mean over every replica of every worker
        (through the PS actors), the optimizers' update. Blocks until applied,
        each wait at most `step_timeout_s`.

        Args:
            batch (Any): this worker's batch (split among its replicas).

        Returns:
            This worker's {"loss", train_batch's metrics, "num_samples"}.

        Raises:
            RuntimeError: called outside a `train_epoch` the Trainer runs.
        """
        if self._stepper is None:
            raise RuntimeError("train_step runs one step of every worker at once: call it "
                               "inside train_epoch, which the Trainer runs on every worker")
        return self._stepper.step(batch)

    def validate(self, iterator, info: dict) -> dict:
        """Validation on this worker. Override it for a custom validation (the
        RaySGD's `validate(val_iterator, info)`). Not overridden, the Trainer
        validates with `validate_batch` and the registered metrics (their
        states summed over workers: exact over the whole set); this default,
        for an override to call, runs the compiled `validate_batch` on each
        batch and returns its values averaged over samples plus this worker's
        registered metrics.

        Args:
            iterator (Iterator): this worker's share of the validation batches (every
                example once across workers).
            info: `Trainer.validate`'s info.

        Returns:
            A dict of numbers ("num_samples" weights the average over
                workers).

        Raises:
            RuntimeError: called outside a worker (the Trainer calls it).
        """
        from dsgd.data.batching import num_rows
        from dsgd.trainer.meters import AverageMeterCollection

        if self._replica is None:
            raise RuntimeError("validate runs on the workers: the Trainer calls it")
        meters = AverageMeterCollection()
        for batch in iterator:
            meters.update(self._replica.validate(batch, self._replica.eager), n=num_rows(batch))
        result = meters.summary()
        result.update({f"val_{m.name}": float(m.result()) for m in self._metrics})
        return result

    def state_dict(self) -> dict:
        """Extra state for `Trainer.save` to checkpoint (JSON-serialisable:
        numbers, strings, lists, dicts); read from worker 0's replica 0.
        Default: {}."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned; `Trainer.load` calls it on every
        replica. Default: nothing."""

    # -- properties ------------------------------------------------------------------------
    config = property(lambda self: self._config)
    world_rank = property(lambda self: self._world_rank)
    world_size = property(lambda self: self._world_size)
    device = property(lambda self: self._device)
    models = property(lambda self: list(self._models))
    optimizers = property(lambda self: list(self._optimizers))
    loss = property(lambda self: self._loss)
    schedulers = property(lambda self: list(self._schedulers))
    metrics = property(lambda self: list(self._metrics))

    @property
    def model(self):
        self._check_registered("model")
        if len(self._models) != 1:
            raise AttributeError(f"{len(self._models)} models are registered: use self.models")
        return self._models[0]

    @property
    def scheduler(self):
        self._check_registered("scheduler")
        if len(self._schedulers) != 1:
            raise AttributeError(f"{len(self._schedulers)} schedulers are registered: use "
                                 "self.schedulers")
        return self._schedulers[0]

    @property
    def optimizer(self):
        self._check_registered("optimizer")
        if len(self._optimizers) != 1:
            raise AttributeError(f"{len(self._optimizers)} optimizers are registered: use "
                                 "self.optimizers")
        return self._optimizers[0]

    def _check_registered(self, name: str) -> None:
        if not self._registered:
            raise AttributeError(f"self.{name} is set by self.register(models=..., optimizers="
                                 f"...): call register in setup before reading self.{name}")

    def _mean_loss(self, y, predictions):
        import tensorflow as tf

        if self._loss is None:
            raise ValueError("no loss registered: pass loss= to register, or override "
                             "train_batch/validate_batch")
        return tf.reduce_mean(tf.cast(self._loss(y, predictions), tf.float32))

    # -- RaySGD's creator-function API ---------------------------------------------------
    @classmethod
    def from_creators(cls, model_creator: Callable, optimizer_creator: Callable,
                      data_creator: Callable, loss_creator: Callable | None = None,
                      metrics_creator: Callable | None = None,
                      scheduler_creator: Callable | None = None) -> type:
        """An operator class from creator functions (RaySGD's API), whose
        `setup` calls them and registers what they return.

        Args:
            model_creator: `config -> model` (or a tuple of models).
            optimizer_creator: `(model(s), config) -> optimizer(s)`.
            data_creator: `config -> (train_data, validation_data)` (or just
                train_data).
            loss_creator: `config -> loss`.
            metrics_creator: `config -> metrics`.
            scheduler_creator: `(optimizer(s), config) -> scheduler(s)`.

        Returns:
            A `TrainingOperator` subclass, for `Trainer`.

        Raises:
            TypeError: a creator that is not callable.
        """
        for name, fn in (("model_creator", model_creator), ("optimizer_creator", optimizer_creator),
                         ("data_creator", data_creator)):
            if not callable(fn):
                raise TypeError(f"from_creators: {name} must be callable, got {type(fn).__name__}")
        for name, fn in (("loss_creator", loss_creator), ("metrics_creator", metrics_creator),
                         ("scheduler_creator", scheduler_creator)):
            if fn is not None and not callable(fn):
                raise TypeError(f"from_creators: {name} must be callable or None, got "
                                f"{type(fn).__name__}")

        class CreatorOperator(cls):
            def setup(self, config):
                models = model_creator(config)
                optimizers = optimizer_creator(models, config)
                loss = loss_creator(config) if loss_creator else None
                metrics = metrics_creator(config) if metrics_creator else None
                schedulers = scheduler_creator(optimizers, config) if scheduler_creator else None
                self.register(models=models, optimizers=optimizers, loss=loss, metrics=metrics,
                              schedulers=schedulers)
                data = data_creator(config)
                train, validation = data if isinstance(data, tuple) else (data, None)
                self.register_data(train_data=train, validation_data=validation)

        CreatorOperator.__name__ = CreatorOperator.__qualname__ = \
            f"{getattr(model_creator, '__name__', 'creator')}_operator"
        return CreatorOperator


def unpack(batch) -> tuple[Any, Any]:
    """(inputs, labels) of a batch: a tuple/list (x, y), or a dict of columns with
    x/y, image/label or features/label."""
    if isinstance(batch, dict):
        for x_key, y_key in (("x", "y"), ("image", "label"), ("features", "label")):
            if x_key in batch and y_key in batch:
                return batch[x_key], batch[y_key]
        raise ValueError(f"a batch of columns {sorted(batch)}: the default train_batch/"
                         "validate_batch read x/y, image/label or features/label; override them")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError("the default train_batch/validate_batch expect (x, y) batches; override "
                     f"them for batches of type {type(batch).__name__}")


def _check_models_and_optimizers(models: list, optimizers: list) -> None:
    """`register`'s checks of its models (built Keras models) and optimizers
    (Keras optimizers, one or one per model); raises naming the bad one."""
    import keras

    for i, model in enumerate(models):
        if not isinstance(model, keras.Model):
            raise TypeError(f"register: models[{i}] must be a keras.Model, got "
                            f"{type(model).__name__}")
        if not model.built:
            raise ValueError(f"register: models[{i}] ({model.name}) is not built; start it "
                             "with keras.Input or call model.build(input_shape) in setup")
    for i, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"register: optimizers[{i}] must be a Keras optimizer, got "
                            f"{type(optimizer).__name__}")
    if len(optimizers) > 1 and len(optimizers) != len(models):
        raise ValueError(f"register: {len(optimizers)} optimizers for {len(models)} "
                         "models; with several optimizers, optimizer i updates model i")


def _checked_loss_and_metrics(loss, metrics) -> tuple:
    """`register`'s loss (a name made a Keras loss) and metrics (as a list),
    checked; raises naming the bad one."""
    import keras

    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if loss is not None and not callable(loss):
        raise TypeError(f"register: loss must be a Keras loss, a name or a callable, got {loss!r}")
    metrics = [] if metrics is None else list(metrics) if isinstance(metrics, (list, tuple)) \
        else [metrics]
    for metric in metrics:
        if not isinstance(metric, keras.metrics.Metric):
            raise TypeError(f"register: metrics must be keras.metrics.Metric objects, got "
                            f"{type(metric).__name__}")
    return loss, metrics
