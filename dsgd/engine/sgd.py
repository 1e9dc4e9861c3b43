"""`DistributedSGD`: the driver's facade. Its state is made in `__init__`:
the frozen `Config`, the actor set (actors and membership), the `Topology`
(shard plan, PS layout), the `Progress` (steps, failures, last checkpoint) and
the datasets' `Feeds`; `StepLoop` runs every step and `Recovery` carries out
the failure policy. Each state object changes only through its own methods."""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from dsgd import constants
from dsgd.comm import ps_client
from dsgd.comm import timeline as timeline_file
from dsgd.config import Config
from dsgd.engine import checkpoints, launch, training
from dsgd.engine.stragglers import Stragglers
from dsgd.engine.calls import DriverCalls
from dsgd.engine.datasets import Feeds
from dsgd.engine.loop import StepLoop
from dsgd.engine.recovery import Recovery
from dsgd.engine.resources import resolve_gpu
from dsgd.engine.state import Progress
from dsgd.model import Model
from dsgd.native import ops
from dsgd.worker.worker import Worker

logger = logging.getLogger("dsgd")
ops.check_installed_tf()  # a TensorFlow other than the one dsgd was built against: ImportError


class DistributedSGD:
    """Synchronous data-parallel SGD over Ray actors.

    Builds `num_workers` worker actors with `devices_per_worker` replicas each,
    broadcasts worker 0 / replica 0's weights to every replica, and on each
    `step()` applies the mean gradient over all replicas to every replica.
    Starts Ray (`ray.init()`) if it is not running. Inside a placement group
    (e.g. a Ray Tune trial) the workers are placed in its bundles; otherwise
    they are spread over the cluster. Also a context manager: leaving the
    `with` block calls `shutdown()`.

    The constructor blocks until every worker has started, built its replicas
    and received the broadcast weights: at most `start_timeout_s` for the
    start-up and `step_timeout_s` for each later call.

    Args:
        model_creator: `(worker_index, device_index) -> dsgd.Model`, called in each
            worker under the replica's `tf.device` and `tf.name_scope(f"device_{i}")`.
            It travels pickled.
        num_workers: worker actors (Ray processes).
        devices_per_worker: replicas per worker: GPUs with `gpu=True`, else logical
            CPU devices carved out of the worker's CPU.
        gpu: True: each worker asks Ray for `devices_per_worker` GPUs and
            builds one replica per GPU; False: replicas on logical CPU devices;
            None (default): True when the cluster (or the placement group this
            runs in, e.g. a Ray Tune trial) has GPUs, else False. The choice is
            logged at start (the "dsgd" logger, INFO) and kept in
            `config.gpu`.
        strategy: "ps" (sharded parameter servers) or "simple" (the driver averages
            whole gradients; the reference path). See `dsgd.constants.STRATEGIES`.
        grad_shard_bytes: largest gradient shard, in bytes ("ps"; several nodes: `spread_plan`).
        all_reduce_alg: local allreduce across a worker's devices, one of
            `dsgd.constants.ALL_REDUCE_ALGS` ("nccl" needs `gpu=True`).
        num_ps: PS actors ("ps"); default: workers on one node, one PS per
            worker; on several nodes, one PS per worker node; never more than
            shards. PS actors go round-robin over the workers' nodes.
        num_cpus_per_worker: CPUs Ray reserves for each worker.
        step_timeout_s: longest wait for one step (or one call), in seconds,
            counted from when the driver begins waiting for it; then
            `StepTimeoutError` (or, with `replace_hung`, a recovery). A first step
            (or one after a new batch shape) includes tracing: seconds, large models.
        start_timeout_s: longest wait for workers to start and build replicas,
            in seconds; each step of a replacement's first call (it traces alone)
            waits max(step_timeout_s, start_timeout_s).
        stall_warning_s: while a wait is pending, log a stall report naming the
            actors that have not answered every this many seconds (default:
            a quarter of `step_timeout_s`, at most 60 s).
        on_nonfinite: a gradient with NaN/Inf: "raise" `NonFiniteError` naming
            the step, worker and replica (with several workers before any weight
            changes; with one worker after its update, which the check does not
            delay); "skip" the step (weights unchanged, counted in the stats);
            "ignore" (no check, no extra pass over the gradients).
        max_failures: actor deaths survived over the object's life; one more
            raises `DsgdError`. A dead worker or PS actor is replaced and the
            interrupted step retried (docs/fault-tolerance.md).
        elastic: when a dead worker cannot be replaced for lack of resources,
            continue with fewer workers (a smaller global batch), and add
            workers back when resources return. Without it, that is an error.
        replace_hung: a step or any other call (`get_weights`, `foreach_model`,
            `save_checkpoint`, ...) that times out (`step_timeout_s`) kills the
            actors that did not answer and recovers as if they had died
            (replaced, the step retried or the call run again on the new
            group), logging it; so does an actor that neither answers nor dies
            while a recovery probes it. Without it the call raises
            `StepTimeoutError`. A dead actor is replaced either way.
        worker_init: called with no arguments in every worker process before
            its replicas are built (e.g. to set environment variables or a
            Keras precision policy); it travels pickled.
        compression: None, "fp16" or "bf16" (strategy="ps", 2+ workers): float32
            gradients travel as 16-bit values (half the bytes), rounded to
            nearest even by each worker, summed in float32 by the PS and the
            mean rounded once; fp16 overflows from 65520 on (a non-finite
            gradient), bf16 keeps float32's range with 8 significant bits
            (docs/engine.md "Gradient compression").
        backup_workers: b, with 0 <= b < `num_workers`: each step averages the
            gradients of the first `num_workers - b` workers to report them
            (the same set in every shard) and every worker applies that mean;
            a late worker sits out the steps it fell behind on and applies
            their means, so weights stay identical. `step()`'s stats name the
            contributors. 0: every worker contributes to every step.
        local: run the one worker (num_workers=1) in this process instead of
            an actor, its steps eager (not compiled), so that a debugger or
            `breakpoint()` in `model_creator` or `get_loss` stops in this
            terminal; the same driver code path otherwise (dsgd/engine/local.py).
            For debugging: slower, and a worker that raises is not replaced.
        local_steps_per_call: (performance switch, never changes results)
            `train()`: steps per actor call with one worker, and per call of
            each worker on the workers' own exchange. None (default): 8 with
            one worker; max(8, 4 x num_workers) on the workers' exchange, so
            that the driver makes one call per 4 steps or fewer whatever the
            number of workers (the progress bar moves in such chunks).
        overlap: (performance switch; results the same to float32 round-off:
            tests/test_overlap.py checks True against False within 1e-5, not
            bit for bit) the workers' exchange (backup workers included):
            True sends the gradient during the backward pass, each bucket of
            consecutive layers (>= 4 MiB) to its PS as soon as the backward
            pass has made it, and applies the means as they arrive
            (docs/architecture.md "One step"); False sends it once the step
            is computed. None (default): True with `gpu`, False on CPU
            workers, whose compute would share the cores with the exchange
            (measured: benchmarks/README.md "Overlap").
        timeline: a file path: write a Chrome trace of the run there (open it in
            https://ui.perfetto.dev or chrome://tracing): per worker each step's
            data, compute, exchange and apply and each group's send, per PS each
            group's sum, and the driver's calls. Written after each `train()`,
            at `shutdown()` and by `write_timeline()`. None (default): the
            `DSGD_TIMELINE` environment variable if set, else no timeline (and
            no cost). See dsgd/comm/timeline.py.
        snapshot_interval_s: seconds between automatic snapshots: between
            steps, with no step in flight, the driver copies worker 0's state
            (what `save_checkpoint` writes) into its own memory, so that losing
            every worker at once restores it rather than fail. Steps since then
            are run again from a dataset's position (exactly the uninterrupted
            run's), or, with `get_batch`, counted as lost
            (`failures[-1]["lost_steps"]`). The first is taken before the first
            step; each costs one copy of the state into the driver. None: no
            snapshot (every worker lost then needs a checkpoint).

    Raises:
        TypeError: a bad argument (wrong type, or a function Ray cannot
            pickle), before any actor starts; the message names it.
        ValueError: a bad argument value, before any actor starts; the message
            names it and the accepted values.
        ResourceError: the cluster cannot hold the workers (before any actor
            starts) or, once the workers have built their models, the object
            store cannot hold a step.
        ModelMismatchError: the replicas disagree on variable count, shape or
            dtype.
        StepTimeoutError: the workers did not start within `start_timeout_s`.

    Attributes:
        config: the `dsgd.config.Config` built from these arguments, frozen.

    The driver's state is made here and changed only by the engine's own
    objects: `config`, the actors and membership (dsgd/engine/actors.py), the
    topology and progress (dsgd/engine/state.py), the datasets' feeds
    (dsgd/engine/datasets.py).
    """

    __slots__ = ("config", "on_workers_changed", "_actors", "_topology", "_progress",
                 "_feeds", "_calls", "_recovery", "_loop", "_finalizer",
                 "__weakref__")

    def __init__(self, model_creator: Callable[[int, int], Model], num_workers: int,
                 devices_per_worker: int, gpu: bool | None = None, strategy: str = "ps",
                 grad_shard_bytes: int = constants.DEFAULT_GRAD_SHARD_BYTES,
                 all_reduce_alg: str = "simple", num_ps: int | None = None, *,
                 num_cpus_per_worker: float = constants.DEFAULT_NUM_CPUS_PER_WORKER,
                 step_timeout_s: float = constants.DEFAULT_STEP_TIMEOUT_S,
                 start_timeout_s: float = constants.DEFAULT_START_TIMEOUT_S,
                 stall_warning_s: float | None = None, on_nonfinite: str = "raise",
                 max_failures: int = constants.DEFAULT_MAX_FAILURES, elastic: bool = False,
                 replace_hung: bool = False, worker_init: Callable[[], Any] | None = None,
                 compression: str | None = None, backup_workers: int = 0,
                 local: bool = False, local_steps_per_call: int | None = None,
                 snapshot_interval_s: float | None = constants.DEFAULT_SNAPSHOT_INTERVAL_S,
                 timeline: str | None = None, overlap: bool | None = None):
        self.config = Config(
            model_creator, num_workers, devices_per_worker, gpu, strategy, grad_shard_bytes,
            all_reduce_alg, num_ps, num_cpus_per_worker=num_cpus_per_worker,
            step_timeout_s=step_timeout_s, start_timeout_s=start_timeout_s,
            stall_warning_s=stall_warning_s, on_nonfinite=on_nonfinite,
            max_failures=max_failures, elastic=elastic, replace_hung=replace_hung,
            worker_init=worker_init, compression=compression,
            local_steps_per_call=local_steps_per_call, backup_workers=backup_workers, local=local,
            snapshot_interval_s=snapshot_interval_s,
            timeline=timeline_file.path_from(timeline), overlap=overlap)
        # Starts Ray if it is not running; gpu=None becomes whether the cluster has GPUs.
        self.config = config = self.config.with_gpu(
            resolve_gpu(gpu, num_workers, devices_per_worker))
        # Run after recovery or elastic growth put new workers in place (copied
        # state), e.g. so that the Trainer gives them its train() info.
        self.on_workers_changed: list[Callable[[], Any]] = []
        # One builder turns the config into the started actors and topology, and
        # starts replacements the same way (dsgd/engine/launch.py).
        launcher = launch.Launcher(config, uuid.uuid4().hex[:6])
        # Nothing outlives the instance: dropped or garbage-collected without
        # shutdown() (a notebook after its first error), its actors are killed. The
        # workers hold each other's handles once joined, so Ray's reference counting
        # alone never frees them. (The finalizer holds the actor set, not this object.)
        self._finalizer = weakref.finalize(self, launcher.actors.shutdown)
        self._progress = Progress()
        self._feeds = Feeds(constants.DATA_FEEDS_KEPT)
        self._actors, self._topology = launcher.start()  # (shuts its actors down on error)
        self._calls = DriverCalls(config, self._actors, self._progress)
        self._recovery = Recovery(config, launcher, self._progress,
                                  self.restore_checkpoint, self.on_workers_changed,
                                  Stragglers(config.backup_workers, config.step_timeout_s,
                                             config.replace_hung), self._calls.restore_snapshot)
        self._calls.recovery = self._recovery
        self._loop = StepLoop(config, self._actors, self._topology, self._progress,
                              self._recovery, self._calls.take_snapshot)
        if config.timeline is not None:
            self._loop.timeline = timeline_file.Recorder("driver")

    @property
    def num_workers(self) -> int:
        """Workers now (fewer than asked for while an elastic run is shrunk)."""
        return self._actors.num_workers

    @property
    def devices_per_worker(self) -> int:
        """Replicas per worker, as constructed."""
        return self.config.devices_per_worker

    @property
    def step_timeout_s(self) -> float:
        """Longest wait for one step or call, in seconds, as constructed."""
        return self.config.step_timeout_s

    @property
    def steps_done(self) -> int:
        """Steps applied to every replica so far."""
        return self._progress.steps_done

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient (on_nonfinite="skip")."""
        return self._progress.skipped_steps

    @property
    def failures(self) -> list[dict]:
        """One record per failure, in the order found: step, error, reason,
        recovery_s (seconds; None while it is being recovered from, e.g. a
        backup worker's replacement still starting in the background). Every
        record counts against `max_failures`."""
        return self._progress.failures

    @property
    def plan(self):
        """The gradient shard plan (dsgd/comm/sharding.py)."""
        return self._topology.plan

    @property
    def shard_groups(self) -> tuple[tuple[int, ...], ...]:
        """Shard indices that travel as one object per worker and step."""
        return self._topology.groups

    @property
    def exchange_layout(self):
        """The shard plan, its groups and the PS of every group
        (dsgd/comm/sharding.py `ExchangeLayout`)."""
        return self._topology.layout

    @property
    def ps_assignment(self) -> tuple[int, ...]:
        """The PS index of every shard (empty when no PS exchanges)."""
        return self._topology.ps_of_shard

    @property
    def per_group_blocker(self) -> str | None:
        """Why an overlapped step is applied in one update rather than in two as
        its means arrive (None: the optimizers allow two)."""
        return self._topology.per_group_blocker

    @property
    def workers(self) -> list:
        """Worker actor handles, in worker order (the current ones: a replaced
        worker has a new handle)."""
        return self._actors.workers

    @property
    def ps_actors(self) -> list:
        """PS actor handles, in PS order."""
        return [p for p in self._actors.ps if p is not None]

    @property
    def worker_info(self) -> list[dict]:
        """What each worker's setup reported (node_id, pid, devices, ...), in worker order."""
        return [self._actors.info(s) for s in self._actors.slots]

    @property
    def instance_id(self) -> str:
        """The id that ends the name of every actor of this instance
        (`dsgd-worker-<i>-<id>`, `dsgd-ps-<j>-<id>`)."""
        return self._actors.suffix

    @property
    def ps_info(self) -> list[dict]:
        """What each PS actor reports (its node), in PS order. Blocks for one
        call per PS, at most `step_timeout_s`."""
        return self._calls.retried("ps_info", lambda _: (
            [p.ready.remote() for p in self.ps_actors], self.ps_actors))

    def step(self, fetch_stats: bool = False) -> dict | None:
        """Run one synchronous step on every replica, each on the batch of its
        own `get_batch()`.

        Blocks until every replica has applied the step's mean gradient; each
        wait at most `step_timeout_s`. If a worker or PS actor dies, it is
        replaced (see `max_failures`, `elastic`) and the step retried, or not
        if it had been applied.

        Args:
            fetch_stats: return the step's statistics.

        Returns:
            None, or with `fetch_stats=True` a dict: `loss` (mean over all
                replicas of their losses before the update), and timings in
                seconds: `compute_s` (slowest worker's gradient computation,
                local allreduce and packing), `apply_s` (slowest worker's
                optimizer update), `exchange_s` (the rest of `step_s`: moving
                shards and averaging them) and `step_s` (driver wall time,
                recovery included); `step` (steps applied so far), `skipped`
                (this step was skipped: non-finite gradient), `skipped_steps`,
                `num_workers` and `failures` (failures recovered so far); with
                `backup_workers`, `contributors` (sorted worker indices whose
                gradients make the step's mean: the loss is theirs) and
                `dropped` (the others).

        Raises:
            StepTimeoutError: an actor did not answer within `step_timeout_s`
                (without `replace_hung`); names it.
            NonFiniteError: a gradient had NaN/Inf (`on_nonfinite="raise"`).
            DsgdError: a failure beyond `max_failures`, a dead worker that
                cannot be replaced (without `elastic`), or a call after
                `shutdown()`.
        """
        start = time.perf_counter()
        result = next(iter(self._loop.run(None, 1)))
        if not fetch_stats:
            return None
        return training.step_stats(result, time.perf_counter() - start, self._progress,
                                  self.config, sorted(self._actors.slots))

    def train(self, num_steps: int | None = None, dataset=None, *, desc: str = "train") -> dict:
        """Run many steps, each replica's `get_loss(batch)` getting its batch from
        `dataset`, or, without a dataset, from the replicas' own `get_batch()`.

        A dataset continues where the last `train` on it stopped. Blocks until
        the last step is applied (each wait at most `step_timeout_s`, failures
        recovered as in `step`); shows a progress bar named `desc` when stderr
        is a terminal.

        Args:
            num_steps: steps to run. None: one epoch of the dataset (of the
                replicas' own data if their `steps_per_epoch()` says; until the
                epoch ends for Ray Data); streaming data of unknown length needs
                it.
            dataset (dsgd.Dataset | None): the data (then `get_batch` is not
                called), or None.
            desc: the progress bar's name.

        Returns:
            A summary: `loss` (mean over the steps), `steps` (steps run),
                `num_samples` (examples trained on), `skipped_steps`,
                `train_s` (wall time, seconds), `step_s` (median seconds per
                step), `samples_per_s`, `workers` (per-worker sums), and more
                (see dsgd/engine/training.py `train`).

        Raises:
            ValueError: `num_steps` is not a positive int or None, or None
                where the length of one epoch is unknown or 0 steps.
            StepTimeoutError: as `step`.
            NonFiniteError: as `step`.
            DsgdError: as `step`.
        """
        entry = None
        if dataset is not None:
            entry, dropped = self._feeds.entry(dataset, self.devices_per_worker)
            for key in dropped:
                self._calls.call_all("detach_data", key)
        if num_steps is None:
            num_steps = training.epoch_steps(entry, self.config, self.num_workers, self.for_model)
        elif isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) \
                or num_steps < 1:
            raise ValueError(f"num_steps must be a positive int or None (one epoch), got "
                             f"{num_steps!r}")
        if entry is not None:
            self._feeds.used(entry)
        rows = (f"{self.num_workers} worker(s) x batch_size={dataset.batch_size}"
                if dataset is not None else "")
        summary = training.train(self._loop, entry, num_steps, desc, rows)
        if self.config.timeline is not None:
            self.write_timeline()
        return summary

    def foreach_worker(self, fn: Callable[[Worker], Any]) -> list:
        """Run `fn(worker)` on every worker actor, in the worker's process.

        Blocks, at most `step_timeout_s`. A worker that dies (or hangs, with
        `replace_hung`) meanwhile is replaced and `fn` runs again on every
        worker, so a function with side effects (files written, counters) may
        see them twice on the survivors.

        Args:
            fn: travels pickled; gets the worker object (its replicas are
                `worker.models()`).

        Returns:
            What `fn` returned on each worker, in worker order, as Ray
                deserialises it (arrays may be read-only views of the object
                store).
        """
        return self._calls.call_all("foreach_worker", fn)

    def foreach_model(self, fn: Callable[[Model], Any]) -> list:
        """Run `fn(replica)` on every replica (`dsgd.Model`), in its worker's
        process.

        Blocks, at most `step_timeout_s`; retried on the new group after a
        replacement, like `foreach_worker`.

        Returns:
            What `fn` returned, one entry per replica, worker-major (worker 0's
                replicas first).
        """
        return [x for per_worker in self._calls.call_all("foreach_model", fn) for x in per_worker]

    def for_model(self, fn: Callable[[Model], Any]) -> Any:
        """Run `fn(replica)` on worker 0's replica 0 and return its result.

        Blocks, at most `step_timeout_s`; retried once on the new worker 0
        after a replacement, like `foreach_worker`.
        """
        return self._calls.first("for_model", "foreach_model", fn)[0]

    def run_on_workers(self, fn: Callable[..., Any], per_worker: list, *args,
                       timeout_s: float | None = None, what: str = "run_on_workers") -> list:
        """Run `fn(worker, per_worker[k], *args)` on worker k: work split among
        the workers (the layers above use it, e.g. the Trainer's validation).

        A worker that dies (or hangs, with `replace_hung`) meanwhile is
        replaced (state copied from a survivor, nothing retried in between
        steps) and the whole call run again once, so `fn` must be safe to
        repeat. Blocks, at most `timeout_s` per attempt; without
        `replace_hung` a timeout raises `StepTimeoutError` and kills nobody.

        Args:
            fn: travels pickled.
            per_worker: one argument per worker, or a callable returning that
                list (called again after a recovery, for the new group).
            *args (Any): passed to every call after the worker's own argument.
            timeout_s: longest wait per attempt, in seconds (default
                `step_timeout_s`).
            what: names the call in errors and logs.

        Returns:
            What `fn` returned on each worker, in worker order.
        """
        return self._calls.run_each(fn, per_worker, args, timeout_s, what)

    def get_weights(self) -> list[np.ndarray]:
        """Worker 0 / replica 0's trainable weights (every replica holds the same).

        Blocks, at most `step_timeout_s`; retried once after a replacement.

        Returns:
            One array per variable, in `get_variables()`
                order, as Ray deserialises them: large ones are read-only
                views of the object store (each keeps its object alive); copy
                (`np.array(w)`) before writing to them.
        """
        return self._calls.first("get_weights", "get_weights")

    def set_weights(self, weights: list[np.ndarray]) -> None:
        """Set the trainable weights of every replica.

        `weights` is copied once into the object store (`ray.put`) when the
        call starts; the caller keeps its arrays, free to change them once
        this returns. Blocks until every replica holds them
        (at most `step_timeout_s`); a worker lost meanwhile is replaced and
        every replica set again.

        Args:
            weights: one array per variable, in `get_variables()` order, with
                the variables' shapes (values are cast to their dtypes).
        """
        import ray

        ref = ray.put(list(weights))
        self._calls.retried("set_weights", lambda ws: ([w.set_weights.remote(ref) for w in ws], ws))

    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        """Write weights, optimizer state, step count and configuration as the
        checkpoint `path`, atomically: a crash mid-save leaves the previous
        checkpoint loadable.

        Worker 0 / replica 0's state is written by the driver (no shared file
        system needed), with the position in the dataset last trained on.
        Blocks until the files are fsynced.

        Args:
            path: the checkpoint's name: files `path.dsgd.json` and
                `path.step<N>-<id>.*` are written.
            extra: JSON-serialisable values stored with it (e.g. a trainer's
                epoch), which `restore_checkpoint` returns.

        Returns:
            `path`.
        """
        files = self._calls.first("save_checkpoint", "save_checkpoint", self.steps_done)
        meta = checkpoints.meta(self.config, self.steps_done, self.num_workers, self.skipped_steps,
                                self.plan, self._feeds.position, extra)
        checkpoints.write(path, files, meta)
        self._progress.saved(path, self.steps_done)
        return path

    def restore_checkpoint(self, path: str) -> dict | None:
        """Load a checkpoint written by `save_checkpoint` (by any number of
        workers) into every replica, shipped once through the object store.

        Its data position goes to the dataset last trained on (or, if none
        was, to the next one). Blocks until every replica is restored (at most
        `step_timeout_s`).

        Args:
            path: what `save_checkpoint` was given.

        Returns:
            The `extra` saved with it, or None.

        Raises:
            CheckpointError: the checkpoint is truncated or corrupt, before any
                replica changes.
            ModelMismatchError: the checkpoint does not fit the model, before
                any replica changes.
        """
        import ray

        files, meta = checkpoints.read(path)
        steps = self._calls.call_all("restore_checkpoint", ray.put(files))  # retried after a loss
        self._progress.restored(path, int(steps[0]))
        if "data_position" in meta:
            self._feeds.seek(int(meta["data_position"]))
        return meta.get("extra")

    def write_timeline(self) -> str | None:
        """With `timeline=`: collect every worker's and PS actor's events since the
        last call and (re)write the trace file with every event so far. Blocks,
        at most `step_timeout_s` (actors that do not answer are left out).
        Returns the file's path, or None without a timeline."""
        path = self.config.timeline
        if path is None:
            return None
        self._calls.timeline_events += self._loop.timeline.drain()
        self._calls.timeline_events += ps_client.collect_timeline_events(
            list(self._actors.workers) + self.ps_actors, self.config.step_timeout_s)
        timeline_file.write(path, self._calls.timeline_events)
        return path

    def shutdown(self) -> None:
        """Kill every actor. Idempotent; does not wait for the processes to exit.
        With `timeline=`, first writes the trace (`write_timeline`). An instance
        dropped without it is shut down when Python collects it (its actors are
        killed; no trace is written then).

        Safe from another thread while a step or a recovery runs (that call
        then raises `DsgdError` and no actor is started after). Every later
        call raises `DsgdError`.
        """
        if self.config.timeline is not None and not self._actors.closed:
            try:
                self.write_timeline()
            except Exception as e:  # noqa: BLE001 - shutting down matters more
                logger.warning("timeline not written: %s: %s", type(e).__name__, e)
        self._finalizer()  # ActorSet.shutdown, once

    def __enter__(self) -> DistributedSGD:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
