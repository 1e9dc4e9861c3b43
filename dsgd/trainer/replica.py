"""A TrainingOperator as the engine's replica (`dsgd.Model`), worker side.

The engine calls `get_loss(batch)` inside its compiled step: that runs the
operator's `train_batch`, scales the loss under mixed-precision float16, and
returns the loss(es) to differentiate plus the metrics to report. Validation
does not go through steps: `validate_share` (run in each worker) feeds the
worker's share of the validation data to its replicas' compiled
`validate_batch` and returns sums, so that the driver can weight by samples.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dsgd.comm.waits import fetch
from dsgd.trainer.sources import OwnSource, RaySplitSource, RowsSource
from dsgd.model import Model


class OperatorReplica(Model):
    def __init__(self, operator_cls, config: dict, world_rank: int, world_size: int, device: str,
                 loss_scaling: bool, step_freq: str = "epoch"):
        import tensorflow as tf

        from dsgd.trainer import schedules

        self.operator = operator_cls(config, world_rank, world_size, device, loss_scaling)
        self.operator._replica = self
        self.eager = False  # local mode: set by validate_share/custom_validate
        self.operator.setup(config)
        if not self.operator._registered:
            raise ValueError(f"{operator_cls.__name__}.setup must call self.register(models=..., "
                             "optimizers=...)")
        self.loss_scaling = loss_scaling
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="dsgd_epoch")
        self.batch_idx = tf.Variable(0, dtype=tf.int64, trainable=False, name="dsgd_batch_idx")
        # Schedulers (dsgd/trainer/schedules.py): the kind of each, and the last count
        # each was stepped to (a repeated step or epoch start changes nothing).
        self.step_freq = step_freq
        self.schedulers = list(self.operator._schedulers)
        self.scheduler_kinds = [schedules.kind_of(s, i) for i, s in enumerate(self.schedulers)]
        self.scheduler_counts = [tf.Variable(-1, dtype=tf.int64, trainable=False,
                                             name=f"dsgd_scheduler_{i}")
                                 for i in range(len(self.schedulers))]
        for i, kind in enumerate(self.scheduler_kinds):
            if kind == "schedule":  # a schedule defines the rate before its first step too
                self.set_learning_rate(i, float(self.schedulers[i](0)))
        self.info: dict = {}      # train()'s info, in train_batch's batch_info
        self.val_info: dict = {}  # validate()'s, in validate_batch's
        self._own = _shard(self.operator._train_data, world_rank, world_size)
        self._own_validation = _shard(self.operator._validation_data, world_rank, world_size)
        self._iterator = None
        self._validate_fn = None

    # -- dsgd.Model --------------------------------------------------------------------
    def get_variables(self) -> list:
        return [v for m in self.operator._models for v in m.trainable_variables]

    def get_variable_groups(self) -> list:
        return [list(m.trainable_variables) for m in self.operator._models]

    def get_state_variables(self) -> list:
        """Checkpoints, broadcasts and the state a replacement worker copies: every
        model's weights (non-trainable included), then the epoch, batch number and
        each scheduler's last count (last, so a plain Keras model still reads its
        weights by position)."""
        return ([v for m in self.operator._models for v in m.weights]
                + [self.epoch, self.batch_idx] + self.scheduler_counts)

    def model_weights(self) -> list:
        """Every model's weights, as numpy arrays (Trainer.get_model)."""
        import numpy as np

        return [np.array(v.numpy()) for m in self.operator._models for v in m.weights]

    def get_optimizer(self):
        optimizers = self.operator._optimizers
        return optimizers[0] if len(optimizers) == 1 else list(optimizers)

    def get_loss(self, batch):
        import tensorflow as tf

        if self.step_freq == "batch":
            self._step_schedulers_in_graph()
        out = self.operator.train_batch(batch, self._batch_info(self.info))
        if not isinstance(out, dict) or "loss" not in out:
            raise ValueError(f"train_batch must return a dict with 'loss', got {out!r:.200}")
        losses = out["loss"]
        several = isinstance(losses, (list, tuple))
        objectives = [tf.cast(x, tf.float32) for x in (losses if several else [losses])]
        optimizers = self.operator._optimizers
        if len(objectives) != len(optimizers) and len(optimizers) > 1:
            raise ValueError(f"train_batch returned {len(objectives)} losses for "
                             f"{len(optimizers)} optimizers: one per optimizer")
        metrics = {k: v for k, v in out.items() if k not in ("loss", "num_samples")}
        metrics["train_loss"] = tf.add_n(objectives)
        for i, optimizer in enumerate(optimizers):  # the rate this step applies
            metrics.setdefault("lr" if i == 0 else f"lr_{i}",
                               tf.cast(tf.identity(optimizer.learning_rate), tf.float32))
        if self.loss_scaling:  # what compile()/fit() would do; the optimizer unscales
            objectives = [o.scale_loss(x) for o, x in zip(optimizers, objectives)]
        with tf.control_dependencies(objectives):
            self.batch_idx.assign_add(1)
        return {"loss": objectives if several else objectives[0], **metrics}

    def get_batch(self):
        if self._own is None:
            raise ValueError("no tf.data training data registered: register_data(train_data=...) "
                             "or pass dataset= to train()")
        if self._iterator is None:
            self._iterator = iter(self._own)
        try:
            return next(self._iterator)
        except StopIteration:  # num_steps beyond one epoch: the next epoch of the shard
            self._iterator = iter(self._own)
            return next(self._iterator)

    def steps_per_epoch(self) -> int | None:
        """Own tf.data shards: batches of the smallest shard, so that all replicas
        step together (the rest of a larger shard waits for the next epoch)."""
        if self._own is None:
            return None
        total = int(self.operator._train_data.cardinality())
        return total // self.operator.world_size if total >= 0 else None

    # -- schedulers ----------------------------------------------------------------------------
    def _step_schedulers_in_graph(self) -> None:
        """(inside the compiled step, freq "batch") Each schedule/callable scheduler
        to the optimizer's applied-step count, unless already there."""
        import tensorflow as tf

        from dsgd.trainer.schedules import next_rate

        for i, (scheduler, kind) in enumerate(zip(self.schedulers, self.scheduler_kinds)):
            if kind == "plateau":
                continue
            optimizer, done = self.operator._optimizers[i], self.scheduler_counts[i]
            count = tf.cast(optimizer.iterations, tf.int64)

            def step(scheduler=scheduler, kind=kind, optimizer=optimizer, done=done, count=count):
                lr = optimizer.learning_rate
                new = next_rate(scheduler, kind, count, tf.convert_to_tensor(lr))
                lr.assign(tf.cast(new, lr.dtype))
                done.assign(count)
                return tf.constant(True)

            tf.cond(tf.not_equal(done, count), step, lambda: tf.constant(False))

    def step_schedulers(self, count: int) -> None:
        """(eager: freq "epoch" at an epoch start, "manual" at update_scheduler)
        Each schedule/callable scheduler to `count`, unless already there."""
        from dsgd.trainer.schedules import next_rate

        for i, (scheduler, kind) in enumerate(zip(self.schedulers, self.scheduler_kinds)):
            if kind == "plateau" or int(self.scheduler_counts[i].numpy()) == count:
                continue
            lr = float(self.operator._optimizers[i].learning_rate.numpy())
            self.set_learning_rate(i, float(next_rate(scheduler, kind, count, lr)))
            self.scheduler_counts[i].assign(count)

    def set_learning_rate(self, i: int, value: float) -> None:
        self.operator._optimizers[i].learning_rate.assign(value)

    def learning_rates(self) -> list[float]:
        return [float(o.learning_rate.numpy()) for o in self.operator._optimizers]

    def plateaus(self) -> dict[int, object]:
        """{optimizer index: ReduceLROnPlateau} (the driver steps copies of them)."""
        return {i: s for i, (s, k) in enumerate(zip(self.schedulers, self.scheduler_kinds))
                if k == "plateau"}

    # -- per epoch / per call --------------------------------------------------------------
    def start_epoch(self, epoch: int, info: dict | None) -> bool:
        """Set the epoch, restart batch numbering and the own-data iterator, step
        the schedulers (freq "epoch": to the 0-based epoch, as Keras's
        LearningRateScheduler). Returns True when `info` changed (the caller
        retraces the compiled step)."""
        self.epoch.assign(epoch)
        self.batch_idx.assign(0)
        self._iterator = None
        if self.step_freq == "epoch":
            self.step_schedulers(epoch - 1)
        return self.set_info(info)

    def set_info(self, info: dict | None) -> bool:
        """train()'s info (also given to replacement workers). True if it changed."""
        info = dict(info or {})
        changed = info != self.info
        self.info = info
        return changed

    def _batch_info(self, info: dict) -> dict:
        return {"epoch": self.epoch, "batch_idx": self.batch_idx, **info}

    # -- validation --------------------------------------------------------------------------
    def begin_validation(self, info: dict | None, eager: bool = False) -> None:
        """Reset the metrics for a validation pass with `info`; `eager`: its
        batches run uncompiled (local mode)."""
        self.eager = eager
        for metric in self.operator._metrics:
            metric.reset_state()
        if dict(info or {}) != self.val_info:
            self.val_info = dict(info or {})
            self._validate_fn = None

    def validate(self, batch, eager: bool = False) -> dict[str, float]:
        """The compiled validate_batch on one batch (numpy or tensors); with
        `eager` (local mode) not compiled."""
        import tensorflow as tf

        if self._validate_fn is None:
            self._validate_fn = (self._validate_graph if eager
                                 else tf.function(self._validate_graph, reduce_retracing=True))
        out = self._validate_fn(tf.nest.map_structure(tf.convert_to_tensor, batch))
        return {k: float(v) for k, v in out.items()}

    def _validate_graph(self, batch):
        import tensorflow as tf

        out = self.operator.validate_batch(batch, self._batch_info(self.val_info))
        if not isinstance(out, dict):
            raise ValueError(f"validate_batch must return a dict of scalars, got {out!r:.200}")
        return {k: tf.cast(v, tf.float32) for k, v in out.items() if k != "num_samples"}

    def own_batches(self):
        """This replica's tf.data training shard (a custom epoch's batches)."""
        if self._own is None:
            raise ValueError("no tf.data training data registered")
        return self._own

    def own_validation_batches(self):
        if self._own_validation is None:
            raise ValueError("no validation data registered: register_data(validation_data=...)")
        return iter(self._own_validation)

    def metric_states(self) -> list[list[np.ndarray]]:
        return [[np.array(v.numpy()) for v in m.variables] for m in self.operator._metrics]

    def metric_results(self, states: list[list[np.ndarray]]) -> dict[str, float]:
        """Load summed metric states (every worker's) and read the results."""
        results = {}
        for metric, values in zip(self.operator._metrics, states):
            for variable, value in zip(metric.variables, values):
                variable.assign(value)
            results[f"val_{metric.name}"] = float(np.asarray(metric.result()))
        return results


def _shard(data, rank: int, world: int):
    """A tf.data.Dataset's shard for this replica; None for other data (fed by the driver)."""
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):
        return data.shard(world, rank)
    return None


@dataclasses.dataclass(frozen=True)
class ValidationTally:
    """One worker's validation of its share (`validate_share`), back to the Trainer."""
    num_samples: int     # rows validated
    batch_count: int     # worker batches (tf.data shards: every replica's batches)
    sums: dict           # name -> sum over batches of value x rows
    last: dict           # name -> the last batch's value
    metric_states: list  # each registered metric's variables, summed over the replicas


def validate_share(worker, source, num_steps: int | None,
                   info: dict | None) -> ValidationTally:
    """(worker side, via Worker.run) Validate this worker's share: `source` is a
    `RowsSource` (a dsgd.Dataset), a `RaySplitSource` or an `OwnSource` (each
    replica's tf.data shard; dsgd/trainer/sources.py). A worker batch is split
    among the replicas."""
    from dsgd.data.batching import num_rows

    replicas = worker.models()
    eager = worker.replicas.eager
    tally = {"num_samples": 0, "batch_count": 0, "sums": {}, "last": {}}

    def run(replica, batch):
        rows = num_rows(batch)
        if rows == 0:
            return
        out = replica.validate(batch, eager)
        tally["num_samples"] += rows
        for key, value in out.items():
            tally["sums"][key] = tally["sums"].get(key, 0.0) + value * rows
        tally["last"] = out

    for replica in replicas:
        replica.begin_validation(info, eager)
    if isinstance(source, OwnSource):
        for replica in replicas:
            for k, batch in enumerate(replica.own_validation_batches()):
                if num_steps is not None and k >= num_steps:
                    break
                run(replica, batch)
                tally["batch_count"] += 1
    else:
        for k, batch in enumerate(worker_batches(source)):
            if num_steps is not None and k >= num_steps:
                break
            for replica, part in zip(replicas, split_uneven(batch, len(replicas))):
                run(replica, part)
            tally["batch_count"] += 1
    states = [r.metric_states() for r in replicas]
    summed = [[sum(s[m][v] for s in states) for v in range(len(states[0][m]))]
              for m in range(len(states[0]))]
    return ValidationTally(num_samples=tally["num_samples"], batch_count=tally["batch_count"],
                           sums=tally["sums"], last=tally["last"], metric_states=summed)


def worker_batches(source):
    """The worker batches of a `RowsSource` or a `RaySplitSource`, in order."""
    from dsgd.data.batching import take_rows
    from dsgd.data.feeds import finish

    if isinstance(source, RowsSource):
        for spans in source.batches:
            where = f"rows from {spans.first_row}"
            blocks = fetch(spans.refs, where, source.timeout_s)
            yield finish(take_rows(blocks, spans.spans), source.transform, 1, where)[0][0]
    elif isinstance(source, RaySplitSource):
        for k, batch in enumerate(source.iterator.iter_batches(
                batch_size=source.batch_size, batch_format="numpy", drop_last=source.drop_last)):
            yield finish(batch, source.transform, 1, f"batch {k + 1}")[0][0]
    else:
        raise ValueError(f"unknown data source {source!r}")


def validation_batches(worker, source):
    """A custom validate's batches on this worker: its share of the driver's
    validation data, or (`OwnSource`) each replica's tf.data shard, one replica
    after the other (every example once)."""
    if not isinstance(source, OwnSource):
        yield from worker_batches(source)
        return
    import tensorflow as tf

    for replica in worker.models():
        for batch in replica.own_validation_batches():
            yield tf.nest.map_structure(lambda t: t.numpy(), batch)


def split_uneven(batch, parts: int) -> list:
    """`parts` row ranges of a batch, as equal as possible (some may be empty)."""
    from dsgd.data.batching import map_leaves, num_rows

    rows = num_rows(batch)
    bounds = [rows * k // parts for k in range(parts + 1)]
    return [map_leaves(lambda a, lo=lo, hi=hi: a[lo:hi], batch)
            for lo, hi in zip(bounds[:-1], bounds[1:])]
