"""`dsgd.Trainer`: epochs, validation, metrics, checkpoints, mixed precision and
TensorBoard over a `DistributedSGD` (RaySGD's TorchTrainer, for TensorFlow/Keras).

The driver owns one `DistributedSGD` whose replicas are the user's
`TrainingOperator`s (dsgd/trainer/replica.py): training goes through the
engine's steps (one engine, one failure story: dead or hung workers are
replaced and the epoch goes on), validation runs per worker over its share.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import Any


from dsgd import constants
from dsgd.comm import ps_client
from dsgd.config import check_picklable
from dsgd.data import Dataset
from dsgd.data.dataset import is_ray_dataset
from dsgd.data.feeds import RowSpans
from dsgd.engine.resources import resolve_gpu
from dsgd.engine.sgd import DistributedSGD
from dsgd.trainer import results
from dsgd.trainer.custom import EpochContext, custom_train_epoch, custom_validate
from dsgd.trainer.operator import BATCH_SIZE, TrainingOperator
from dsgd.trainer.replica import validate_share
from dsgd.trainer.schedules import STEP_FREQS
from dsgd.trainer.sources import OwnSource, RaySplitSource, RowsSource
from dsgd.trainer.worker_side import (ReplicaCreator, WorkerInit, custom_methods, full_state,
                                      registered_data, replica_config, set_info, start_epoch,
                                      sum_states)

logger = logging.getLogger("dsgd")

PRECISIONS = {False: None, True: "mixed_float16", "float16": "mixed_float16",
              "bfloat16": "mixed_bfloat16"}


class Trainer:
    """Train a `TrainingOperator` on `num_workers` workers x `devices_per_worker`
    replicas.

    Builds a `DistributedSGD` (the attribute `sgd`) whose replicas are the
    operators; blocks while the workers start (each builds its operators), at
    most `start_timeout_s`. Also a context manager: leaving the `with` block
    calls `shutdown()`.

    Args:
        training_operator_cls: a `dsgd.TrainingOperator` subclass.
        num_workers: worker actors, as `DistributedSGD`'s.
        use_gpu: as `DistributedSGD`'s `gpu`: True, False, or None (default):
            the GPUs the cluster has, if any (the choice is logged at start).
        config: passed to the operator's `setup`; `config[dsgd.BATCH_SIZE]` is
            the global batch size, divided among all replicas (ValueError if it
            does not divide); the operator sees the per-replica batch there.
        devices_per_worker: replicas per worker, as `DistributedSGD`'s.
        strategy: "ps" or "simple", as `DistributedSGD`'s.
        use_fp16: False; True (or "float16"): Keras `mixed_float16` with loss
            scaling (the optimizers are wrapped in `LossScaleOptimizer`, dsgd
            scales the loss, steps that overflow are skipped by every replica
            alike); "bfloat16": `mixed_bfloat16` (no scaling; the useful one
            on CPU). Variables stay float32 either way.
        initialization_hook: called with no arguments in every worker process
            before `setup` (e.g. to set environment variables).
        scheduler_step_freq: when the registered schedulers step: "epoch" (at
            the start of every epoch, with the 0-based epoch, as Keras's
            LearningRateScheduler), "batch" (before every step, with the
            optimizer's applied steps, as a Keras optimizer reads a
            LearningRateSchedule) or "manual" (at `update_scheduler()`).
            `dsgd.ReduceLROnPlateau` rules are checked whenever their metric is
            reported (after `validate()` for "val_" metrics, after `train()`
            otherwise), or at `update_scheduler(metric)` with "manual".
        local: run the one worker (num_workers=1) in this process, its steps
            eager (not compiled), so that `breakpoint()` or a debugger in
            `setup`, `train_batch` or `validate_batch` stops here, with tensor
            values; the same code path for batches, metrics, schedulers and
            checkpoints, and the same weights as one worker actor. For
            debugging: slower than an actor, and no failure recovery.
        logdir: write TensorBoard scalars there (train_loss, samples_per_s,
            val_*) after every `train()`/`validate()`, step = epoch.
        **engine_options (Any): passed to `DistributedSGD` (`step_timeout_s`,
            `max_failures`, `backup_workers`, ...). The Trainer turns on
            `replace_hung`. With `backup_workers=b` each step averages the
            first num_workers - b workers' gradients (docs/stragglers.md);
            `train()` then reports `dropped_batches` and `dropped_samples`
            (also to TensorBoard); validation is unaffected.

    Raises:
        TypeError: a bad argument type (e.g. not a `TrainingOperator`
            subclass, an unpicklable `initialization_hook`), or data
            registered in `setup` that the Trainer cannot feed.
        ValueError: a bad argument value (`scheduler_step_freq`, `use_fp16`,
            `local` with several workers, a `config[dsgd.BATCH_SIZE]` that
            does not divide among the replicas, a custom `train_epoch` with
            several workers and no PS actors), or as `DistributedSGD`'s.

    Attributes:
        sgd: the `DistributedSGD` the Trainer drives (its replicas wrap the
            operators).
        epoch: epochs trained so far (restored by `load`).
    """

    def __init__(self, training_operator_cls: type, num_workers: int = 1,
                 use_gpu: bool | None = None,
                 config: dict | None = None, devices_per_worker: int = 1, strategy: str = "ps",
                 use_fp16: bool | str = False, initialization_hook: Callable | None = None,
                 logdir: str | None = None, scheduler_step_freq: str = "epoch",
                 local: bool = False, **engine_options):
        if not (isinstance(training_operator_cls, type)
                and issubclass(training_operator_cls, TrainingOperator)):
            raise TypeError("training_operator_cls must be a dsgd.TrainingOperator subclass, got "
                            f"{training_operator_cls!r}")
        if scheduler_step_freq not in STEP_FREQS:
            raise ValueError(f"scheduler_step_freq must be one of {list(STEP_FREQS)}, got "
                             f"{scheduler_step_freq!r}")
        if not isinstance(local, bool):
            raise TypeError(f"local must be True or False, got {local!r}")
        if local and num_workers != 1:
            raise ValueError(f"local=True runs one worker in this process: num_workers must be "
                             f"1, got {num_workers!r}")
        if use_fp16 not in PRECISIONS:
            raise ValueError(f"use_fp16 must be one of {list(PRECISIONS)}, got {use_fp16!r}")
        if initialization_hook is not None and not callable(initialization_hook):
            raise TypeError("initialization_hook must be callable or None")
        if initialization_hook is not None:
            check_picklable("initialization_hook", initialization_hook,
                            "Ray sends it to every worker")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config must be a dict or None, got {type(config).__name__}")
        self.config = dict(config or {})
        self.num_workers, self.devices_per_worker = num_workers, devices_per_worker
        self.operator_cls = training_operator_cls
        self._replica_config = replica_config(self.config, num_workers, devices_per_worker)
        self.precision = PRECISIONS[use_fp16]
        self.scheduler_step_freq, self.local = scheduler_step_freq, local
        scaling = self.precision == "mixed_float16"
        engine_options.setdefault("replace_hung", True)
        if scaling:  # LossScaleOptimizer skips overflowing steps itself, on every replica alike
            engine_options.setdefault("on_nonfinite", "ignore")
        if use_gpu is not None and not isinstance(use_gpu, bool):
            raise TypeError(f"use_gpu must be True, False or None (use the cluster's GPUs), got "
                            f"{use_gpu!r}")
        # Decided here, not in the engine: the operators are told their device.
        use_gpu = resolve_gpu(use_gpu, num_workers, devices_per_worker)
        world = num_workers * devices_per_worker
        creator = ReplicaCreator(training_operator_cls, self._replica_config, devices_per_worker,
                                  world, use_gpu, scaling, scheduler_step_freq)
        if local:
            engine_options["local"] = True
        self.sgd = DistributedSGD(creator, num_workers, devices_per_worker, gpu=use_gpu,
                                  strategy=strategy,
                                  worker_init=WorkerInit(initialization_hook, self.precision),
                                  **engine_options)
        try:
            train, validation = self.sgd.for_model(registered_data)
            # The driver steps the plateau rules (on the reported, averaged metrics).
            self._plateaus = self.sgd.for_model(lambda m: m.plateaus())
            self._custom_train, self._custom_validate = self.sgd.for_model(custom_methods)
            if self._custom_train and self.sgd.num_workers > 1 and not self.sgd.ps_actors:
                raise ValueError(f"{training_operator_cls.__name__} overrides train_epoch: its "
                                 "steps exchange through PS actors, so use strategy='ps' "
                                 f"(got {strategy!r})")
            self._train_data = self._driver_data(train, "train_data")
            self._validation_data = self._driver_data(validation, "validation_data")
        except BaseException:
            self.sgd.shutdown()
            raise
        self.epoch = 0
        self.logdir = logdir
        self._writer = None
        self._driver_operator = None
        self._info: dict | None = None
        self._scheduler_updates = 0  # update_scheduler() calls ("manual")
        self._exchange_runs = itertools.count(1)  # custom epochs: step numbers apart per attempt
        # A replaced worker copies weights, optimizer state, epoch and batch number from
        # a survivor (get_state_variables); give it train()'s info too.
        self.sgd.on_workers_changed.append(self._resend_info)

    # -- training ----------------------------------------------------------------------------
    def train(self, num_steps: int | None = None, dataset: Dataset | None = None,
              profile: bool = False, reduce_results: bool = True, info: dict | None = None):
        """One epoch (or `num_steps` steps) of the registered training data, or of
        `dataset`. Blocks until the last step is applied (waits and failures
        as `DistributedSGD.train`); a tqdm bar on a terminal.

        Args:
            num_steps: steps to run; None: one epoch.
            dataset: a `dsgd.Dataset` to train on instead of the registered
                data (RaySGD's `train(dataset=...)`).
            profile: add mean seconds per step (`mean_data_s`,
                `mean_compute_s`, `mean_exchange_s`, `mean_apply_s`,
                `mean_step_s`) and `train_epoch_s`.
            reduce_results: False: one dict per worker.
            info: numbers that reach `train_batch`'s `batch_info` (a change
                retraces the compiled step).

        Returns:
            (dict | list[dict]): {"epoch", "batch_count", "num_samples",
                "train_loss", "last_train_loss", "dropped_batches",
                "dropped_samples", ...train_batch's metrics}, averaged over
                batches (weighted by samples) then workers (weighted by
                samples); one such dict per worker with `reduce_results=False`.

        Raises:
            ValueError: nothing to train on (no registered training data and
                no `dataset`).
        """
        self.epoch += 1
        epoch = self.epoch
        self._info = info
        # One call per worker (retried on a new group if a worker is lost): safe to repeat.
        self.sgd.foreach_worker(lambda w: start_epoch(w, epoch, info))
        data = dataset if dataset is not None else self._train_data
        if data is None:
            raise ValueError("nothing to train on: register_data(train_data=...) in setup, or "
                             "pass dataset= to train()")
        if self._custom_train:
            return self._train_custom(epoch, data, num_steps, profile, reduce_results, info)
        summary = self.sgd.train(num_steps, None if isinstance(data, str) else data,
                                 desc=f"epoch {epoch}")
        result = results.train_results(summary, epoch, reduce_results, profile)
        reduced = result if reduce_results else results.train_results(summary, epoch, True, False)
        scalars = {"train_loss": reduced["train_loss"], "samples_per_s": summary["samples_per_s"],
                   "lr": reduced.get("lr")}
        if self.sgd.config.backup_workers:
            scalars.update(dropped_batches=summary["dropped_batches"],
                           dropped_samples=summary["dropped_samples"])
        self._log(scalars)
        self._check_plateaus(reduced, on_validation=False)
        return result

    def validate(self, num_steps: int | None = None, profile: bool = False,
                 reduce_results: bool = True, info: dict | None = None):
        """Validate on the registered validation data, every example exactly once
        across the workers. Blocks: each worker validates its whole share in
        one call, allowed `step_timeout_s` x
        `dsgd.constants.VALIDATION_TIMEOUT_STEPS`.

        Args:
            num_steps: at most this many batches per worker; None: all.
            profile: add `validation_s` (wall time, seconds).
            reduce_results: False: one dict per worker.
            info: numbers that reach `validate_batch`'s `batch_info`.

        Returns:
            (dict | list[dict]): {"num_samples", "batch_count", "val_loss",
                `"val_<metric>"` for every registered metric (over the whole
                set, from the metrics' summed states), ...validate_batch's
                values averaged over samples, `"last_<key>"`}; one dict per
                worker with `reduce_results=False`.

        Raises:
            ValueError: no validation data was registered.
        """
        if self._validation_data is None:
            raise ValueError("no validation data: register_data(validation_data=...) in setup")
        start = time.perf_counter()
        if self._custom_validate:
            return self._validate_custom(num_steps, profile, reduce_results, info, start)
        # A worker validates its whole share in one call, so a long call is no sign of
        # a hang: allowed VALIDATION_TIMEOUT_STEPS step timeouts, then an error.
        tallies = self.sgd.run_on_workers(
            validate_share, self._validation_sources, num_steps, info, what="validating",
            timeout_s=constants.VALIDATION_TIMEOUT_STEPS * self.sgd.step_timeout_s)
        states = sum_states([t.metric_states for t in tallies])
        metrics = self.sgd.for_model(lambda m: m.metric_results(states)) if states else {}
        result = results.validation_results(tallies, metrics, reduce_results,
                                            time.perf_counter() - start, profile)
        reduced = result if reduce_results else results.validation_results(
            tallies, metrics, True, 0.0, False)
        self._log({k: v for k, v in reduced.items() if k.startswith("val_")})
        self._check_plateaus(reduced, on_validation=True)
        return result

    # -- custom epochs (dsgd/trainer/custom.py) -------------------------------------------------
    def _train_custom(self, epoch: int, data, num_steps, profile: bool, reduce_results: bool,
                      info: dict | None):
        """The operator's own train_epoch on every worker at once, from the state of
        the epoch's start (saved here first: an attempt run again after a failure
        starts from it too)."""
        import ray

        start = time.perf_counter()
        first = lambda: [True] + [False] * (self.sgd.num_workers - 1)  # noqa: E731
        state = ray.put(self.sgd.run_on_workers(full_state, first, what=f"epoch {epoch}: "
                                                "saving its starting state")[0])

        def contexts():
            workers = self.sgd.workers
            sources = self._train_sources(data, num_steps, len(workers))
            base = next(self._exchange_runs) * 10**9
            recording = self.sgd.config.timeline is not None
            if recording:  # (the PS actors record their sums too)
                ps_client.enable_timeline(self.sgd.ps_actors, True)
            return [EpochContext(rank=r, world=len(workers), peers=workers,
                                 ps=self.sgd.ps_actors, layout=self.sgd.exchange_layout,
                                 timeout_s=self.sgd.step_timeout_s, seq_base=base,
                                 source=source, timeline=recording)
                    for r, source in enumerate(sources)]

        outs = self.sgd.run_on_workers(
            custom_train_epoch, contexts, state, epoch, info, what=f"epoch {epoch}: train_epoch",
            timeout_s=self._custom_timeout(data, num_steps))
        if self.sgd.config.timeline is not None:
            self.sgd.write_timeline()  # (as train() does after each call)
        rows = []
        for out in outs:
            row = {"epoch": epoch, "num_samples": out.num_samples, "batch_count": out.steps}
            row.update(out.result)
            rows.append(row)
        extra = {"train_epoch_s": time.perf_counter() - start} if profile else {}
        reduced = results.reduce(rows, epoch)
        self._log({"train_loss": reduced.get("train_loss", reduced.get("loss"))})
        self._check_plateaus(reduced, on_validation=False)
        if not reduce_results:
            return [dict(r, **extra) for r in rows]
        return dict(reduced, **extra)

    def _custom_timeout(self, data, num_steps) -> float:
        """A custom epoch's call, as a whole: one step timeout per step, plus one
        (each worker itself reports a step that waits longer than step_timeout_s)."""
        steps = num_steps
        if steps is None and isinstance(data, Dataset) and not data.is_ray_data:
            length = data._feed(self.sgd.devices_per_worker).stream.length
            if length is not None:
                steps = length // (data.batch_size * self.sgd.num_workers)
        return (max(int(steps or 0), constants.VALIDATION_TIMEOUT_STEPS) + 1) \
            * self.sgd.step_timeout_s

    def _train_sources(self, data, num_steps, workers: int) -> list:
        """Each worker's batches of a custom epoch: as many on every worker."""
        if isinstance(data, str):  # own tf.data shards: the smallest shard's batch count
            steps = self.sgd.for_model(lambda m: m.steps_per_epoch())
            if steps is None:
                raise ValueError("a custom train_epoch over tf.data needs a dataset of known "
                                 "cardinality (or pass num_steps)")
            steps = min(steps, num_steps) if num_steps is not None else steps
            return [OwnSource(int(steps))] * workers
        if data.is_ray_data:
            return [RaySplitSource(it, data.batch_size, data.transform, drop_last=True)
                    for it in data.data.streaming_split(workers, equal=True)]
        stream = data._feed(self.sgd.devices_per_worker).stream
        if stream.length is None:
            raise ValueError("a custom train_epoch needs data of known length (not a generator)")
        b = data.batch_size
        steps = stream.length // (b * workers)
        if num_steps is not None:
            steps = min(steps, int(num_steps))
        if steps == 0:
            raise ValueError(f"{data!r} has fewer rows than one step takes ({workers} worker(s) "
                             f"x batch_size={b})")
        blocks = stream.ready(0, steps * b * workers, 0, self.sgd.step_timeout_s)
        sources = []
        for w in range(workers):
            batches = []
            for k in range(steps):  # step k: rows [k*W*b, (k+1)*W*b), worker w's b of them
                first = (k * workers + w) * b
                spans = stream.spans(first, b)
                batches.append(RowSpans([blocks[i] for i, _, _ in spans],
                                        [(lo, hi) for _, lo, hi in spans], first))
            sources.append(RowsSource(batches, data.transform, self.sgd.step_timeout_s))
        return sources

    def _validate_custom(self, num_steps, profile: bool, reduce_results: bool,
                         info: dict | None, start: float):
        per_worker = self.sgd.run_on_workers(
            custom_validate, self._validation_sources, num_steps, info,
            what="validating (custom validate)",
            timeout_s=constants.VALIDATION_TIMEOUT_STEPS * self.sgd.step_timeout_s)
        rows = [dict({"num_samples": 1, "batch_count": 0}, **r) for r in per_worker]
        extra = {"validation_s": time.perf_counter() - start} if profile else {}
        reduced = results.reduce(rows, None)
        self._log({k: v for k, v in reduced.items() if k.startswith("val_")})
        self._check_plateaus(reduced, on_validation=True)
        if not reduce_results:
            return [dict(r, **extra) for r in rows]
        return dict(reduced, **extra)

    # -- schedulers ----------------------------------------------------------------------------
    def update_scheduler(self, metric: float | None = None) -> None:
        """With `scheduler_step_freq="manual"`: step every registered scheduler
        once on every replica (the k-th call steps schedules and callables to
        count k) and check every `ReduceLROnPlateau` rule. Blocks until every
        replica has stepped.

        Args:
            metric: the monitored metric's value; required when a
                `ReduceLROnPlateau` is registered.

        Raises:
            ValueError: the Trainer's `scheduler_step_freq` is not "manual",
                or `metric` is missing.
        """
        if self.scheduler_step_freq != "manual":
            raise ValueError("update_scheduler() is for scheduler_step_freq='manual'; this "
                             f"Trainer steps its schedulers per {self.scheduler_step_freq}")
        if self._plateaus and metric is None:
            raise ValueError("update_scheduler(metric): a ReduceLROnPlateau is registered and "
                             "needs the metric's value")
        self._scheduler_updates += 1
        count = self._scheduler_updates
        self.sgd.foreach_model(lambda m: m.step_schedulers(count))
        for i, plateau in self._plateaus.items():
            self._step_plateau(i, plateau, metric)

    def learning_rates(self) -> list[float]:
        """Each optimizer's learning rate now, in registration order (every
        replica holds the same). Blocks for one call to worker 0."""
        return self.sgd.for_model(lambda m: m.learning_rates())

    def _check_plateaus(self, reported: dict, on_validation: bool) -> None:
        if self.scheduler_step_freq == "manual":
            return
        for i, plateau in self._plateaus.items():
            if plateau.on_validation != on_validation:
                continue
            if reported.get(plateau.monitor) is None:
                raise ValueError(f"{plateau!r} (schedulers[{i}]): "
                                 f"{'validate' if on_validation else 'train'}() reports no "
                                 f"{plateau.monitor!r}; it reports "
                                 f"{sorted(k for k in reported if not k.startswith('last_'))}")
            self._step_plateau(i, plateau, reported[plateau.monitor])

    def _step_plateau(self, i: int, plateau, value: float) -> None:
        new = plateau.step(value, self.learning_rates()[i])
        if new is not None:
            logger.info("ReduceLROnPlateau: %s did not improve; optimizer %d's learning rate "
                        "is now %.3g", plateau.monitor, i, new)
            self.sgd.foreach_model(lambda m: m.set_learning_rate(i, new))

    # -- state -------------------------------------------------------------------------------
    def save(self, path: str) -> str:
        """Write a checkpoint: weights, optimizer state, epoch, data position,
        schedulers and the operator's `state_dict()`, atomically, by the driver
        (no shared file system needed; see `DistributedSGD.save_checkpoint`).
        Blocks until the files are fsynced.

        Args:
            path: the checkpoint's name (files `path.dsgd.json`,
                `path.step<N>-<id>.*`).

        Returns:
            `path`.

        Raises:
            TypeError: `state_dict()` returned values that are not
                JSON-serialisable.
        """
        state = self.sgd.for_model(lambda m: m.operator.state_dict())
        try:
            json.dumps(state)
        except TypeError as e:
            raise TypeError(f"{self.operator_cls.__name__}.state_dict() must return JSON-"
                            f"serialisable values (numbers, strings, lists, dicts): {e}") from None
        schedulers = {"updates": self._scheduler_updates,
                      "plateaus": {str(i): p.state_dict() for i, p in self._plateaus.items()}}
        return self.sgd.save_checkpoint(path, extra={"epoch": self.epoch, "operator": state,
                                                     "schedulers": schedulers})

    def load(self, path: str) -> None:
        """Restore what `save` wrote (with any number of workers) into every
        replica, and the epoch, schedulers and operator state. Blocks.

        Args:
            path: what `save` was given.

        Raises:
            CheckpointError: the checkpoint is truncated or corrupt.
            ModelMismatchError: it does not fit the model.
        """
        extra = self.sgd.restore_checkpoint(path) or {}
        self.epoch = int(extra.get("epoch", 0))
        schedulers = extra.get("schedulers", {})
        self._scheduler_updates = int(schedulers.get("updates", 0))
        for i, plateau_state in schedulers.get("plateaus", {}).items():
            if int(i) in self._plateaus:
                self._plateaus[int(i)].load_state_dict(plateau_state)
        state = extra.get("operator", {})
        self.sgd.foreach_model(lambda m: m.operator.load_state_dict(state))

    def get_model(self):
        """The trained Keras model (a list with several models), built in this
        process by the operator's `setup` (once; later calls reuse it) and
        loaded with a copy of worker 0's weights. The caller owns it: changing
        it does not change the workers'. Blocks for one call to worker 0."""
        if self._driver_operator is None:
            operator = self.operator_cls(self._replica_config, 0, 1, "/device:CPU:0")
            operator.setup(self._replica_config)
            self._driver_operator = operator
        models = self._driver_operator._models
        flat = [v for model in models for v in model.weights]
        weights = self.sgd.for_model(lambda m: m.model_weights())
        for variable, value in zip(flat, weights, strict=True):
            variable.assign(value)
        return models[0] if len(models) == 1 else list(models)

    def shutdown(self) -> None:
        """Kill the workers (call `save` or `get_model` first) and close the
        TensorBoard writer. Idempotent."""
        self.sgd.shutdown()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @classmethod
    def as_trainable(cls, training_operator_cls: type, **trainer_kwargs):
        """A Ray Tune trainable class running this Trainer.

        The trial's config (merged over `config`) goes to the operator's
        `setup`; each training iteration is `train()` then `validate()` (if
        validation data is registered), reporting both results merged; Tune
        checkpoints go through `save`/`load`. A trial's resources are one
        placement group: one CPU for the trainable, then one bundle per
        worker (`num_cpus_per_worker` CPUs, plus `devices_per_worker` GPUs
        with `use_gpu`).

        Args:
            training_operator_cls: a `dsgd.TrainingOperator` subclass.
            **trainer_kwargs (Any): the `Trainer`'s arguments
                (`num_workers`, `use_gpu`, `devices_per_worker`, `config`,
                ...) and `num_cpus_per_worker`.

        Returns:
            (type): A `ray.tune.Trainable` subclass.
        """
        from dsgd.trainer.tune import trainable

        return trainable(cls, training_operator_cls, **trainer_kwargs)

    # -- internals -----------------------------------------------------------------------------
    def _driver_data(self, data, name: str):
        """Registered data as the driver uses it: a dsgd.Dataset (a ray.data.Dataset
        wrapped), OWN (tf.data: each replica reads its shard) or None. With
        config[BATCH_SIZE], a dataset's batch size is the global one per worker."""
        if data is None or isinstance(data, str):
            return data
        per_worker = None
        if BATCH_SIZE in self.config:
            per_worker = self.config[BATCH_SIZE] // self.num_workers
        if is_ray_dataset(data):
            return Dataset(data, batch_size=per_worker or 32 * self.devices_per_worker)
        if isinstance(data, Dataset):
            return data.with_batch_size(per_worker) if per_worker else data
        raise TypeError(f"register_data({name}=...) must be a dsgd.Dataset, a ray.data.Dataset "
                        f"or a tf.data.Dataset, got {type(data).__name__}")

    def _validation_sources(self) -> list:
        """One validation source per worker (dsgd/trainer/replica.py validate_share)."""
        data, workers = self._validation_data, self.sgd.num_workers
        if isinstance(data, str):
            return [OwnSource()] * workers
        if data.is_ray_data:  # not equal=True: that would drop rows
            return [RaySplitSource(it, data.batch_size, data.transform)
                    for it in data.data.streaming_split(workers, equal=False)]
        stream = data._feed(self.sgd.devices_per_worker).stream
        if stream.length is None:
            raise ValueError("validation data must have a known length (not a generator)")
        n, b = stream.length, data.batch_size
        blocks = stream.ready(0, n, 0, self.sgd.step_timeout_s)
        sources = []
        for w in range(workers):
            first, end = n * w // workers, n * (w + 1) // workers
            batches = []
            for start in range(first, end, b):
                spans = stream.spans(start, min(b, end - start))
                batches.append(RowSpans([blocks[k] for k, _, _ in spans],
                                        [(lo, hi) for _, lo, hi in spans], start))
            sources.append(RowsSource(batches, data.transform, self.sgd.step_timeout_s))
        return sources

    def _resend_info(self) -> None:
        info = self._info
        self.sgd.foreach_worker(lambda w: set_info(w, info))

    def _log(self, scalars: dict[str, Any]) -> None:
        if not self.logdir:
            return
        import tensorflow as tf

        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.logdir)
        with self._writer.as_default():
            for name, value in scalars.items():
                if value is not None:
                    tf.summary.scalar(name, float(value), step=self.epoch)
        self._writer.flush()
