"""The actors a `DistributedSGD` owns: starting, naming, waiting on, probing and
replacing workers and PS actors. The driver decides (dsgd/engine/failures.py); this
module only carries out.

Every wait has a deadline. While a wait is pending, a stall report is logged
every `stall_warning_s` naming the actors that have not answered, well before
the deadline raises `StepTimeoutError` naming them.
"""

from __future__ import annotations

import logging
import time

from dsgd import constants
from dsgd.errors import DsgdError, StepTimeoutError
from dsgd.comm.param_server import ParameterServer
from dsgd.worker.worker import Worker

logger = logging.getLogger("dsgd")


def actor_died_errors() -> tuple:
    """Ray's errors that mean an actor (or the node under it) is gone."""
    from ray import exceptions as rx

    return tuple(getattr(rx, n) for n in ("RayActorError", "ObjectLostError", "OwnerDiedError",
                                          "WorkerCrashedError", "NodeDiedError") if hasattr(rx, n))


class ActorSet:
    """Worker actors by slot (the worker index given to `model_creator`) and PS actors.

    Args:
        worker_args: `(model_creator, devices_per_worker, gpu, all_reduce_alg, worker_init)`.
        worker_options: Ray options of a worker actor (resources).
        suffix: this DistributedSGD's id, the last part of every actor name.
        stall_warning_s: interval of stall reports while a wait is pending.
    """

    def __init__(self, worker_args: tuple, worker_options: dict, suffix: str,
                 stall_warning_s: float, worker_cls=Worker, ps_cls=ParameterServer):
        import ray

        self.worker_args = worker_args
        self.worker_options = worker_options
        self.suffix = suffix
        self.stall_warning_s = stall_warning_s
        self._worker_cls = ray.remote(worker_cls)
        self._ps_cls = ray.remote(ps_cls)
        self.slots: list[int] = []     # worker slot of self.workers[k]
        self.workers: list = []
        self.ps: list = []
        self.names: dict[int, str] = {}  # id(handle) -> actor name
        self._generation = 0

    # -- starting -------------------------------------------------------------
    def _name(self, prefix: str, index: int) -> str:
        # Replacements get a generation tag: a dead actor's name may still be taken.
        tag = f"-r{self._generation}" if self._generation else ""
        return f"{prefix}{index}-{self.suffix}{tag}"

    def start_workers(self, slots: list[int]) -> list:
        """Create worker actors for `slots` (not yet set up). Returns their handles."""
        model_creator, devices, gpu, alg, init = self.worker_args
        handles = []
        for slot in slots:
            name = self._name(constants.WORKER_NAME_PREFIX, slot)
            handle = self._worker_cls.options(name=name, runtime_env=constants.ACTOR_RUNTIME_ENV,
                                              **self.worker_options).remote(
                model_creator, slot, devices, gpu, alg, init)
            self.names[id(handle)] = name
            handles.append(handle)
            position = sorted(self.slots + [slot]).index(slot)
            self.slots.insert(position, slot)
            self.workers.insert(position, handle)
        return handles

    def start_ps(self, indices: list[int], node_ids: list[str], warm_store_bytes: int = 0) -> list:
        """Create PS actors `indices`, PS j pinned to node `node_ids[k]` (hard
        affinity: a soft one was seen to fall back to another node although a
        0-CPU actor fits), each warming `warm_store_bytes` of its object-store
        mapping (store.warm). Returns their handles."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        handles = []
        for j, node_id in zip(indices, node_ids):
            name = self._name(constants.PS_NAME_PREFIX, j)
            handle = self._ps_cls.options(
                name=name, num_cpus=constants.PS_NUM_CPUS, runtime_env=constants.ACTOR_RUNTIME_ENV,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
                j, warm_store_bytes)
            self.names[id(handle)] = name
            while len(self.ps) <= j:
                self.ps.append(None)
            self.ps[j] = handle
            handles.append(handle)
        return handles

    def next_generation(self) -> None:
        self._generation += 1

    def kill(self, handle) -> None:
        """Kill one actor (a hung one, to be replaced by recovery)."""
        self._kill(handle)

    def remove_worker(self, slot: int) -> None:
        k = self.slots.index(slot)
        self._kill(self.workers[k])
        del self.slots[k], self.workers[k]

    def worker(self, slot: int):
        return self.workers[self.slots.index(slot)]

    # -- waiting --------------------------------------------------------------
    def name(self, handle) -> str:
        return self.names.get(id(handle), "?")

    def wait(self, refs: list, owners: list, what: str, timeout_s: float,
             stall_warning_s: float | None = None) -> list:
        """ray.get of `refs` (one per owner actor) with a deadline: logs a stall
        report every `stall_warning_s` (default: the set's), raises
        StepTimeoutError naming the actors that did not answer in `timeout_s`.
        Actor errors propagate from ray.get."""
        import ray

        self._await(refs, owners, what, timeout_s, stall_warning_s)
        return ray.get(refs, timeout=max(1.0, timeout_s))

    def _await(self, refs: list, owners: list, what: str, timeout_s: float,
               stall_warning_s: float | None = None) -> None:
        import ray

        interval_s = stall_warning_s or self.stall_warning_s
        pending = list(refs)
        start = time.monotonic()
        while pending:
            left = timeout_s - (time.monotonic() - start)
            if left <= 0:
                late = list({id(h): h for h in (owners[refs.index(r)] for r in pending)}.values())
                error = StepTimeoutError(
                    f"{what}: no answer after {timeout_s:.1f} s from "
                    f"{', '.join(sorted(self.name(h) for h in late))}. "
                    f"Cluster resources available now: {ray.available_resources()}")
                error.late = late  # the actors' handles (DistributedSGD replace_hung)
                raise error
            _, pending = ray.wait(pending, num_returns=len(pending),
                                  timeout=min(left, interval_s))
            if pending and time.monotonic() - start < timeout_s:
                self._stall_report(what, [owners[refs.index(r)] for r in pending],
                                   len(refs) - len(pending), time.monotonic() - start, timeout_s)

    def next_all(self, streams: list, owners: list, what: str, timeout_s: float) -> list:
        """The next ObjectRef of each streaming generator (one per owner actor),
        within `timeout_s`; stall reports and the timeout name the late owners."""
        self._await(streams, owners, what, timeout_s)
        refs = []
        for stream, owner in zip(streams, owners):
            try:
                refs.append(next(stream))
            except StopIteration:
                raise DsgdError(f"{what}: {self.name(owner)} ended its shard stream early") from None
        return refs

    def _stall_report(self, what, late, answered, waited_s, timeout_s) -> None:
        logger.warning("stall: %s: %s ha%s not answered after %.0f s (%d answered); "
                       "StepTimeoutError after %.0f s", what,
                       ", ".join(sorted(self.name(a) for a in late)),
                       "s" if len(late) == 1 else "ve", waited_s, answered, timeout_s)

    # -- probing --------------------------------------------------------------
    def probe(self, timeout_s: float) -> tuple[dict[int, dict | None], list[int]]:
        """Ping every actor; a ping runs after the calls already queued on that
        actor, so a live one answers once its in-flight work has ended.
        Returns ({slot: ping info, or None if dead}, [dead PS indices]).
        An actor that neither answers nor dies in `timeout_s` raises StepTimeoutError."""
        import ray

        died = actor_died_errors()
        handles = self.workers + [p for p in self.ps if p is not None]
        refs = [h.ping.remote() for h in handles]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        answers = []
        for handle, ref in zip(handles, refs):
            try:
                answers.append(ray.get(ref, timeout=0.001 if answers else timeout_s))
            except died:
                answers.append(None)
            except ray.exceptions.GetTimeoutError:
                raise StepTimeoutError(f"recovering: {self.name(handle)} neither answered nor "
                                       f"died within {timeout_s:.1f} s") from None
        workers = dict(zip(self.slots, answers[:len(self.workers)]))
        live_ps = [j for j, p in enumerate(self.ps) if p is not None]
        dead_ps = [j for j, a in zip(live_ps, answers[len(self.workers):]) if a is None]
        return workers, dead_ps

    # -- stopping -------------------------------------------------------------
    @staticmethod
    def _kill(handle) -> None:
        import ray

        try:
            ray.kill(handle)
        except Exception:  # already dead
            pass

    def shutdown(self) -> None:
        for handle in self.workers + [p for p in self.ps if p is not None]:
            self._kill(handle)
        self.workers, self.slots, self.ps = [], [], []


def placeable_workers(options: dict, want: int) -> int:
    """How many more workers with Ray `options` fit in the resources available now
    (each worker's CPUs and GPUs on one node). Blocks for one GCS call. Workers
    placed in a placement group (under Ray Tune) take the bundles a dead one
    left: all of them."""
    from dsgd.ray_private import available_resources_per_node

    if not isinstance(options.get("scheduling_strategy"), str):
        return want
    cpu, gpu = options.get("num_cpus", 1), options.get("num_gpus", 0)
    fit = 0
    for available in available_resources_per_node().values():
        by_cpu = int(available.get("CPU", 0) // cpu) if cpu else want
        by_gpu = int(available.get("GPU", 0) // gpu) if gpu else want
        fit += min(by_cpu, by_gpu)
    return min(fit, want)
