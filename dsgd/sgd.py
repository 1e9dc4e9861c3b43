"""`DistributedSGD`: the driver. It plans shards, starts actors and drives steps;
workers and PS actors only execute."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable

import numpy as np

from dsgd import checkpoint, constants, ops
from dsgd.arguments import check_args, check_resources
from dsgd.errors import DsgdError, ModelMismatchError, StepTimeoutError
from dsgd.model import Model
from dsgd.param_server import ParameterServer, mean_shard
from dsgd.sharding import ShardPlan, assign_shards, plan_shards, whole_plan
from dsgd.worker import Worker

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
        start_timeout_s: longest wait for the workers to start and build replicas.

    Raises, before any actor starts: TypeError/ValueError for bad arguments,
    `ResourceError` when the cluster cannot hold the workers.
    """

    def __init__(self, model_creator: Callable[[int, int], Model], num_workers: int,
                 devices_per_worker: int, gpu: bool = True, strategy: str = "ps",
                 grad_shard_bytes: int = constants.DEFAULT_GRAD_SHARD_BYTES,
                 all_reduce_alg: str = "simple", num_ps: int | None = None, *,
                 num_cpus_per_worker: float = constants.DEFAULT_NUM_CPUS_PER_WORKER,
                 step_timeout_s: float = constants.DEFAULT_STEP_TIMEOUT_S,
                 start_timeout_s: float = constants.DEFAULT_START_TIMEOUT_S):
        check_args(model_creator, num_workers, devices_per_worker, gpu, strategy,
                    grad_shard_bytes, all_reduce_alg, num_ps, num_cpus_per_worker,
                    step_timeout_s, start_timeout_s)
        import ray

        if not ray.is_initialized():
            ray.init()
        self.num_workers = num_workers
        self.devices_per_worker = devices_per_worker
        self.gpu = gpu
        self.strategy = strategy
        self.grad_shard_bytes = grad_shard_bytes
        self.all_reduce_alg = all_reduce_alg
        self.step_timeout_s = float(step_timeout_s)
        self.steps_done = 0
        self.workers: list = []
        self.ps_actors: list = []
        self._names: dict = {}  # actor handle id -> readable name
        self._suffix = uuid.uuid4().hex[:6]
        check_resources(num_workers, devices_per_worker, gpu, num_cpus_per_worker)
        try:
            self._start_workers(model_creator, num_cpus_per_worker, start_timeout_s)
            self._start_ps(num_ps, start_timeout_s)
            self._broadcast_state()  # everyone starts from worker 0 / replica 0
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, model_creator, num_cpus: float, timeout_s: float) -> None:
        import ray

        options = {"num_cpus": num_cpus, "scheduling_strategy": "SPREAD"}
        if self.gpu:
            options["num_gpus"] = self.devices_per_worker
        worker_cls = ray.remote(Worker)
        for i in range(self.num_workers):
            name = f"{constants.WORKER_NAME_PREFIX}{i}-{self._suffix}"
            handle = worker_cls.options(name=name, **options).remote(
                model_creator, i, self.devices_per_worker, self.gpu, self.all_reduce_alg)
            self.workers.append(handle)
            self._names[id(handle)] = name
        refs = [w.setup.remote() for w in self.workers]
        self.worker_info = self._wait(refs, self.workers, "starting (setup: import TensorFlow, "
                                      "build replicas)", timeout_s)
        first = self.worker_info[0]
        for i, info in enumerate(self.worker_info[1:], start=1):
            if info["shapes"] != first["shapes"] or info["dtypes"] != first["dtypes"]:
                k = next((k for k, (a, b) in enumerate(zip(info["shapes"], first["shapes"]))
                          if a != b or info["dtypes"][k] != first["dtypes"][k]),
                         min(len(info["shapes"]), len(first["shapes"])))
                raise ModelMismatchError(
                    f"worker {i}'s replicas have {len(info['shapes'])} variables, worker 0's have "
                    f"{len(first['shapes'])}; first difference at variable {k}: "
                    f"{_describe(info, k)} vs {_describe(first, k)}")
        shapes, dtypes = first["shapes"], first["dtypes"]
        if self.strategy == "ps":
            self.plan: ShardPlan = plan_shards(shapes, dtypes, self.grad_shard_bytes)
        else:
            self.plan = whole_plan(shapes, dtypes)
        self._wait([w.configure.remote(self.plan) for w in self.workers], self.workers,
                   "compiling the step", timeout_s)

    def _start_ps(self, num_ps: int | None, timeout_s: float) -> None:
        import ray

        self.ps_assignment: list[int] = []
        self.ps_info: list[dict] = []
        if self.strategy != "ps" or self.num_workers == 1:
            return
        num_shards = self.plan.num_shards
        if num_ps is None:
            num_ps = min(num_shards, self.num_workers)
        elif num_ps > num_shards:
            logger.warning("num_ps=%d but the gradients make only %d shard(s); %d PS actor(s) "
                           "will idle (lower grad_shard_bytes to make more shards)",
                           num_ps, num_shards, num_ps - num_shards)
        self.ps_assignment = assign_shards([s.nbytes for s in self.plan.shards], num_ps)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ps_cls = ray.remote(ParameterServer)
        for j in range(num_ps):
            name = f"{constants.PS_NAME_PREFIX}{j}-{self._suffix}"
            # PS j lives beside worker j (round-robin): every node that sends
            # gradients also sums its share, as in BytePS. Hard affinity: a soft one
            # was seen to fall back to another node even though a 0-CPU actor fits;
            # start-up is bounded by start_timeout_s either way.
            node_id = self.worker_info[j % self.num_workers]["node_id"]
            handle = ps_cls.options(
                name=name, num_cpus=constants.PS_NUM_CPUS,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(j)
            self.ps_actors.append(handle)
            self._names[id(handle)] = name
        self.ps_info = self._wait([p.ready.remote() for p in self.ps_actors], self.ps_actors,
                                  "starting", timeout_s)

    def _broadcast_state(self) -> None:
        import ray

        state = self._wait([self.workers[0].get_state.remote()], self.workers[:1],
                           "reading worker 0's weights", self.step_timeout_s)[0]
        ref = ray.put(state)
        self._wait([w.set_state.remote(ref) for w in self.workers[1:]] +
                   [self.workers[0].set_state.remote(ref)], self.workers[1:] + self.workers[:1],
                   "broadcasting worker 0's weights", self.step_timeout_s)

    def step(self, fetch_stats: bool = False) -> dict | None:
        """Run one synchronous step on every replica. Blocks until every replica
        has applied the step's mean gradient, at most `step_timeout_s`.

        Returns None, or with `fetch_stats=True` a dict: `loss` (mean over all
        replicas of their losses before the update), and timings in seconds:
        `compute_s` (slowest worker's gradient computation, local allreduce and
        packing), `apply_s` (slowest worker's optimizer update), `exchange_s`
        (the rest of `step_s`: moving shards and averaging them) and `step_s`
        (driver wall time).
        """
        start = time.perf_counter()
        if self.num_workers == 1:
            infos = self._wait([self.workers[0].local_step.remote()], self.workers,
                               f"step {self.steps_done + 1}", self.step_timeout_s)
            applied = [{"apply_s": 0.0}]
        else:
            infos, applied = self._exchange_step(start)
        self.steps_done += 1
        if not fetch_stats:
            return None
        step_s = time.perf_counter() - start
        losses = [x for info in infos for x in info["losses"]]
        compute_s = max(info["compute_s"] for info in infos)
        apply_s = max(a["apply_s"] for a in applied)
        return {"loss": float(np.mean(losses)), "compute_s": compute_s,
                "exchange_s": max(0.0, step_s - compute_s - apply_s), "apply_s": apply_s,
                "step_s": step_s, "step": self.steps_done}

    def _exchange_step(self, start: float):
        """Workers stream their shards; PS j is called for shard j as soon as every
        worker has written it, so summing overlaps with writing the next shard."""
        import ray

        label = f"step {self.steps_done + 1}"
        streams = [w.compute.options(num_returns="streaming").remote() for w in self.workers]
        info_refs = [self._next(stream, w, f"{label}: computing gradients", start)
                     for stream, w in zip(streams, self.workers)]
        infos = self._wait(info_refs, self.workers, f"{label}: computing gradients",
                           self._time_left(start))
        mean_refs = []
        for j, shard in enumerate(self.plan.shards):
            refs = [self._next(stream, w, f"{label}: writing shard {j}", start)
                    for stream, w in zip(streams, self.workers)]
            if self.strategy == "ps":
                mean_refs.append(self.ps_actors[self.ps_assignment[j]].mean.remote(shard, *refs))
            else:
                pieces = self._wait(refs, self.workers, f"{label}: gathering shard {j}",
                                    self._time_left(start))
                mean_refs.append(ray.put(mean_shard(shard, pieces)))
        applied = self._wait([w.apply.remote(*mean_refs) for w in self.workers], self.workers,
                             label, self._time_left(start))
        return infos, applied

    def _next(self, stream, owner, what: str, start: float):
        """The next ObjectRef of a worker's shard stream, waiting at most until
        the step's deadline."""
        import ray

        timeout_s = self._time_left(start)
        ready, _ = ray.wait([stream], timeout=timeout_s)
        if not ready:
            raise StepTimeoutError(f"{what}: no answer after {timeout_s:.1f} s from "
                                   f"{self._names.get(id(owner), '?')}")
        try:
            return next(stream)
        except StopIteration:
            raise DsgdError(f"{what}: {self._names.get(id(owner), '?')} ended its shard "
                            "stream early") from None

    def _time_left(self, start: float) -> float:
        return max(0.001, self.step_timeout_s - (time.perf_counter() - start))

    def _wait(self, refs: list, owners: list, what: str, timeout_s: float) -> list:
        """ray.get with a deadline; a timeout names the actors that did not answer."""
        import ray

        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            late = sorted({self._names.get(id(owners[refs.index(r)]), "?") for r in pending})
            raise StepTimeoutError(
                f"{what}: no answer after {timeout_s:.1f} s from {', '.join(late)}. "
                f"Cluster resources available now: {ray.available_resources()}")
        return ray.get(refs, timeout=timeout_s)

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

    def save_checkpoint(self, path: str) -> str:
        """Write weights, optimizer state and step count under path prefix `path`
        (files `path.index`, `path.data-*`, `path.dsgd.json`). Returns `path`."""
        files = self._wait([self.workers[0].save_checkpoint.remote(self.steps_done)],
                           self.workers[:1], "save_checkpoint", self.step_timeout_s)[0]
        meta = {"step": self.steps_done, "num_workers": self.num_workers,
                "devices_per_worker": self.devices_per_worker, "strategy": self.strategy,
                "grad_shard_bytes": self.grad_shard_bytes, "all_reduce_alg": self.all_reduce_alg,
                "variables": {"shapes": [list(s) for s in self.plan.shapes],
                              "dtypes": list(self.plan.dtypes)}}
        return checkpoint.write(path, files, meta)

    def restore_checkpoint(self, path: str) -> None:
        """Load a checkpoint written by `save_checkpoint` into every replica (any
        number of workers). A checkpoint that does not fit the model raises
        ModelMismatchError before any replica changes."""
        import ray

        files, _ = checkpoint.read(path)
        ref = ray.put(files)
        steps = self._call_all("restore_checkpoint", ref)
        self.steps_done = int(steps[0])

    def _call_all(self, method: str, *args) -> list:
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return self._wait(refs, self.workers, method, self.step_timeout_s)

    def shutdown(self) -> None:
        """Kill every actor. Idempotent."""
        import ray

        for handle in self.workers + self.ps_actors:
            try:
                ray.kill(handle)
            except Exception:  # already dead
                pass
        self.workers, self.ps_actors = [], []

    def __enter__(self) -> "DistributedSGD":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _describe(info: dict, k: int) -> str:
    if k >= len(info["shapes"]):
        return "(missing)"
    return f"{info['names'][k]} {info['dtypes'][k]}{tuple(info['shapes'][k])}"
