"""`DistributedSGD`: the driver and its API. Beside it, driver side: the step
path (dsgd/engine/steps.py), many steps fed by a dataset (dsgd/engine/feeding.py), starting
actors and planning shards (dsgd/engine/launch.py), failure handling (dsgd/engine/recovery.py
carries out dsgd/engine/failures.py) and checkpoint plumbing (dsgd/engine/checkpoints.py).
Workers and PS actors only execute."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from dsgd import constants
from dsgd.engine import checkpoints, feeding, launch, steps
from dsgd.native import ops
from dsgd.engine.actors import ActorSet
from dsgd.config import check_args
from dsgd.model import Model
from dsgd.worker.worker import Worker

logger = logging.getLogger("dsgd")
ops.check_installed_tf()  # a TensorFlow other than the one dsgd was built against: ImportError


class DistributedSGD:
    """Synchronous data-parallel SGD over Ray actors.

    Builds `num_workers` worker actors with `devices_per_worker` replicas each,
    broadcasts worker 0 / replica 0's weights to every replica, and on each
    `step()` applies the mean gradient over all replicas to every replica.

    Args:
        model_creator: `(worker_index, device_index) -> dsgd.Model`, called in each
            worker under the replica's `tf.device` and `tf.name_scope(f"device_{i}")`.
        num_workers: worker actors (Ray processes).
        devices_per_worker: replicas per worker: GPUs with `gpu=True`, else logical
            CPU devices carved out of the worker's CPU.
        gpu: ask Ray for `devices_per_worker` GPUs per worker.
        strategy: "ps" (sharded parameter servers) or "simple" (the driver averages
            whole gradients; the reference path).
        grad_shard_bytes: largest gradient shard, in bytes ("ps").
        all_reduce_alg: local allreduce across a worker's devices, one of
            `dsgd.constants.ALL_REDUCE_ALGS`.
        num_ps: PS actors ("ps"); default one per shard, at most `num_workers`.
        num_cpus_per_worker: CPUs Ray reserves for each worker.
        step_timeout_s: longest wait for one step (or one call) before
            `StepTimeoutError`, in seconds.
        start_timeout_s: longest wait for workers to start and build replicas.
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
            interrupted step retried (see README "Fault tolerance").
        elastic: when a dead worker cannot be replaced for lack of resources,
            continue with fewer workers (a smaller global batch), and add
            workers back when resources return. Without it, that is an error.
        replace_hung: a step that times out (`step_timeout_s`) kills the actors
            that did not answer and recovers as if they had died (replaced, the
            step retried), logging it; without it the step raises
            `StepTimeoutError`.
        worker_init: called with no arguments in every worker process before
            its replicas are built (e.g. to set environment variables or a
            Keras precision policy); it travels pickled.
        compression: None, "fp16" or "bf16" (strategy="ps", 2+ workers): float32
            gradients travel as 16-bit values (half the bytes through the store
            and the network). Each worker rounds its local mean gradient to
            nearest even; the PS sums in float32, scales once and rounds the mean
            to 16 bits; workers widen it exactly while reading it. fp16 keeps 11
            significant bits for |g| >= 6.1e-5 (fewer below: subnormal; under
            3e-8 it rounds to 0) and overflows from 65520 on (a non-finite
            gradient, handled by `on_nonfinite`); bf16 keeps float32's range
            with 8 significant bits. One worker exchanges nothing and is not
            affected.

    Inside a placement group (e.g. a Ray Tune trial) the workers are placed in
    its bundles; otherwise they are spread over the cluster.

    Raises, before any actor starts: TypeError/ValueError for bad arguments,
    `ResourceError` when the cluster cannot hold the workers (or, after the
    workers have built their models, when the object store cannot hold a step).
    """

    def __init__(self, model_creator: Callable[[int, int], Model], num_workers: int,
                 devices_per_worker: int, gpu: bool = True, strategy: str = "ps",
                 grad_shard_bytes: int = constants.DEFAULT_GRAD_SHARD_BYTES,
                 all_reduce_alg: str = "simple", num_ps: int | None = None, *,
                 num_cpus_per_worker: float = constants.DEFAULT_NUM_CPUS_PER_WORKER,
                 step_timeout_s: float = constants.DEFAULT_STEP_TIMEOUT_S,
                 start_timeout_s: float = constants.DEFAULT_START_TIMEOUT_S,
                 stall_warning_s: float | None = None, on_nonfinite: str = "raise",
                 max_failures: int = constants.DEFAULT_MAX_FAILURES, elastic: bool = False,
                 replace_hung: bool = False, worker_init: Callable[[], Any] | None = None,
                 compression: str | None = None):
        check_args(model_creator, num_workers, devices_per_worker, gpu, strategy,
                   grad_shard_bytes, all_reduce_alg, num_ps, num_cpus_per_worker,
                   step_timeout_s, start_timeout_s, stall_warning_s, on_nonfinite,
                   max_failures, elastic, compression)
        if not isinstance(replace_hung, bool):
            raise TypeError(f"replace_hung must be True or False, got {replace_hung!r}")
        if worker_init is not None and not callable(worker_init):
            raise TypeError(f"worker_init must be callable or None, got {type(worker_init).__name__}")
        import ray

        if not ray.is_initialized():
            ray.init()
        self.num_workers = num_workers
        self.target_workers = num_workers
        self.devices_per_worker = devices_per_worker
        self.gpu = gpu
        self.strategy = strategy
        self.compression = compression
        self.grad_shard_bytes = grad_shard_bytes
        self.all_reduce_alg = all_reduce_alg
        self.step_timeout_s = float(step_timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.on_nonfinite = on_nonfinite
        self.max_failures = max_failures
        self.elastic = elastic
        self.replace_hung = replace_hung
        self.steps_done = 0
        self.skipped_steps = 0
        self.failures: list[dict] = []   # one record per recovered failure
        self._num_ps = num_ps
        self._last_checkpoint: str | None = None
        self._next_grow_check = 0.0
        self._suffix = uuid.uuid4().hex[:6]
        self.membership = 0       # bumped whenever workers are replaced or added
        self._feeds = {}          # data feeds by key (dsgd/engine/feeding.py), most recent last
        self.on_workers_changed: list[Callable[[], Any]] = []  # run after recovery/growth
        self.last_feed = None     # the feed of the last step trained from a dataset
        self.pending_data_position = None  # restored before any dataset was used
        options = {"num_cpus": num_cpus_per_worker,
                   "scheduling_strategy": launch.worker_scheduling(num_workers, devices_per_worker,
                                                                   gpu, num_cpus_per_worker)}
        if gpu:
            options["num_gpus"] = devices_per_worker
        stall_s = stall_warning_s or min(constants.MAX_STALL_WARNING_S, self.step_timeout_s / 4)
        self.actors = ActorSet((model_creator, devices_per_worker, gpu, all_reduce_alg, worker_init),
                               options, self._suffix, stall_s)
        try:
            launch.start_workers(self, list(range(num_workers)), first=True)
            launch.start_ps(self, num_ps)
            launch.broadcast_state(self)  # everyone starts from worker 0 / replica 0
        except BaseException:
            self.shutdown()
            raise

    # -- actors -----------------------------------------------------------------
    @property
    def workers(self) -> list:
        return self.actors.workers

    @property
    def ps_actors(self) -> list:
        return [p for p in self.actors.ps if p is not None]

    @property
    def worker_info(self) -> list[dict]:
        """What each worker's setup reported (node_id, pid, devices, ...), in worker order."""
        return [self._info_by_slot[s] for s in self.actors.slots]

    @property
    def ps_info(self) -> list[dict]:
        """Node of each PS actor, in PS order. Blocks for one call per PS."""
        return self._wait([p.ready.remote() for p in self.ps_actors], self.ps_actors, "ps_info",
                          self.step_timeout_s)

    # -- steps ------------------------------------------------------------------
    def step(self, fetch_stats: bool = False) -> dict | None:
        """Run one synchronous step on every replica. Blocks until every replica
        has applied the step's mean gradient; each wait at most `step_timeout_s`.

        If a worker or PS actor dies, it is replaced (see `max_failures`,
        `elastic`) and the step retried, or not if it had been applied.

        Returns None, or with `fetch_stats=True` a dict: `loss` (mean over all
        replicas of their losses before the update), and timings in seconds:
        `compute_s` (slowest worker's gradient computation, local allreduce and
        packing), `apply_s` (slowest worker's optimizer update), `exchange_s`
        (the rest of `step_s`: moving shards and averaging them) and `step_s`
        (driver wall time, recovery included); `step` (steps applied so far),
        `skipped` (this step was skipped: non-finite gradient), `skipped_steps`,
        `num_workers` and `failures` (failures recovered so far).
        """
        start = time.perf_counter()
        infos, applied, skipped = next(steps.run(self, None, 1))
        if not fetch_stats:
            return None
        step_s = time.perf_counter() - start
        losses = [x for info in infos for x in info["losses"]] if infos else [float("nan")]
        compute_s = max(info["compute_s"] for info in infos) if infos else 0.0
        apply_s = max(a["apply_s"] for a in applied)
        return {"loss": float(np.mean(losses)), "compute_s": compute_s,
                "exchange_s": max(0.0, step_s - compute_s - apply_s), "apply_s": apply_s,
                "step_s": step_s, "step": self.steps_done, "skipped": skipped,
                "skipped_steps": self.skipped_steps, "num_workers": self.num_workers,
                "failures": len(self.failures)}

    def train(self, num_steps: int | None = None, dataset=None) -> dict:
        """Run `num_steps` steps, each replica's `get_loss(batch)` getting its batch
        from `dataset` (a `dsgd.Dataset`; `get_batch` is not called), or, without
        a dataset, from the replicas' own `get_batch()`. Default `num_steps`: one
        epoch of the dataset (of the replicas' data if their `steps_per_epoch()`
        says). A dataset continues where the last `train` on it stopped. Blocks;
        shows a progress bar when stderr is a terminal. See dsgd/engine/feeding.py for
        the summary it returns (`loss`, `steps`, `num_samples`, ...)."""
        return feeding.train(self, num_steps, dataset)

    def _wait(self, refs: list, owners: list, what: str, timeout_s: float) -> list:
        return self.actors.wait(refs, owners, what, timeout_s)

    # -- the rest of the API ------------------------------------------------------
    def foreach_worker(self, fn: Callable[[Worker], Any]) -> list:
        """fn(worker) on every worker actor, in worker order. Blocks."""
        return self._call_all("foreach_worker", fn)

    def foreach_model(self, fn: Callable[[Model], Any]) -> list:
        """fn(replica) on every replica; flat list, worker-major. Blocks."""
        return [x for per_worker in self._call_all("foreach_model", fn) for x in per_worker]

    def for_model(self, fn: Callable[[Model], Any]) -> Any:
        """fn on worker 0, replica 0. Blocks."""
        return self._wait([self.workers[0].foreach_model.remote(fn)], self.workers[:1],
                          "for_model", self.step_timeout_s)[0][0]

    def get_weights(self) -> list[np.ndarray]:
        """Worker 0 / replica 0's trainable weights (every replica holds the same)."""
        return self._wait([self.workers[0].get_weights.remote()], self.workers[:1],
                          "get_weights", self.step_timeout_s)[0]

    def set_weights(self, weights: list[np.ndarray]) -> None:
        """Set the trainable weights of every replica (one object-store copy)."""
        import ray

        ref = ray.put(list(weights))
        self._wait([w.set_weights.remote(ref) for w in self.workers], self.workers,
                   "set_weights", self.step_timeout_s)

    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        """Write weights, optimizer state, step count and configuration as the
        checkpoint `path` (files `path.dsgd.json` and `path.step<N>-<id>.*`),
        atomically: a crash mid-save leaves the previous checkpoint loadable.
        `extra`: JSON-serialisable values stored with it (e.g. a trainer's
        epoch), which `restore_checkpoint` returns. Blocks until the files are
        fsynced. Returns `path`."""
        return checkpoints.save(self, path, extra)

    def restore_checkpoint(self, path: str) -> dict | None:
        """Load a checkpoint written by `save_checkpoint` into every replica (any
        number of workers). Returns the `extra` saved with it (None if none).
        A truncated or corrupt checkpoint raises CheckpointError, one that does
        not fit the model ModelMismatchError, both before any replica changes."""
        return checkpoints.restore(self, path)

    def _call_all(self, method: str, *args) -> list:
        workers = list(self.workers)
        refs = [getattr(w, method).remote(*args) for w in workers]
        return self._wait(refs, workers, method, self.step_timeout_s)

    def shutdown(self) -> None:
        """Kill every actor. Idempotent."""
        if hasattr(self, "actors"):
            self.actors.shutdown()

    def __enter__(self) -> DistributedSGD:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
