"""The actors a `DistributedSGD` owns, and its membership: worker actors by slot
(the worker index given to `model_creator`, kept by a replacement), what each
worker reported at setup, PS actors by index, and a membership number that
changes whenever workers are replaced or added. Only this class's methods
change them. Starting, waiting on (through dsgd/comm/waits.py: deadlines and
stall reports naming the actors), probing and killing actors; the driver
decides (dsgd/engine/failures.py), this class carries out.
"""

from __future__ import annotations

import logging
import threading

from dsgd import constants
from dsgd.comm import waits
from dsgd.comm.param_server import ParameterServer, ps_actor_class
from dsgd.comm.reports import Ping
from dsgd.errors import DsgdError, StepTimeoutError
from dsgd.worker.worker import Worker

logger = logging.getLogger("dsgd")


class ActorSet:
    """Worker and PS actors of one DistributedSGD.

    Args:
        worker_args: `(model_creator, devices_per_worker, gpu, all_reduce_alg, worker_init)`.
        worker_options: Ray options of a worker actor (resources, scheduling).
        suffix: this DistributedSGD's id, the last part of every actor name.
        stall_s: interval of stall reports while a wait is pending.
        worker_cls, ps_cls: the actor classes (a seam for tests).
        local: the workers run in this process (dsgd/engine/local.py).
        ps_world: the most workers a PS serves (sizes its rendezvous threads).
    """

    def __init__(self, worker_args: tuple, worker_options: dict, suffix: str, stall_s: float,
                 worker_cls=Worker, ps_cls=ParameterServer, local: bool = False,
                 ps_world: int = 1):
        import ray

        from dsgd.engine.local import LocalActorClass

        self.worker_args = worker_args
        self.worker_options = worker_options
        self.suffix = suffix
        self.stall_s = stall_s
        self._worker_cls = LocalActorClass(worker_cls) if local else \
            ray.remote(concurrency_groups={"peer": 1})(worker_cls)
        self._ps_cls = ps_actor_class(ps_cls, ps_world)
        self._slots: list[int] = []     # worker slot of self._workers[k]
        self._workers: list = []
        self._infos: dict[int, dict] = {}  # slot -> what its setup reported
        self._ps: list = []              # PS j, or None while dead / not started
        # id(handle) -> (handle, actor name): the handle is kept beside its name so that
        # its id is never reused by a later handle while the entry exists (a replaced
        # actor's new handle can land at the dead one's address; names never repeat).
        self._names: dict[int, tuple[object, str]] = {}
        self._joining: dict[int, object] = {}  # slot -> a replacement started in the background
        # id(handle) -> handle: workers that joined running workers and have not yet
        # ended a call of steps (`new_to_steps`).
        self._new: dict[int, object] = {}
        self._generation = 0
        self._membership = 0
        self._processes: dict[int, tuple[object, str, int]] = {}  # id -> (handle, node id, pid)
        self._closed = False
        self._lock = threading.Lock()  # shutdown (any thread) against starting actors

    # -- membership -----------------------------------------------------------
    @property
    def workers(self) -> list:
        """Worker handles in slot order (a copy)."""
        return list(self._workers)

    @property
    def slots(self) -> list[int]:
        return list(self._slots)

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def ps(self) -> list:
        """PS handles by index, None where dead (a copy)."""
        return list(self._ps)

    @property
    def membership(self) -> int:
        """Changes whenever workers are replaced or added (data loaders are then sent again)."""
        return self._membership

    @property
    def closed(self) -> bool:
        """After `shutdown`: no actor is started any more."""
        return self._closed

    def check_open(self, what: str) -> None:
        """DsgdError when the set was shut down (`what`: the call refused)."""
        if self._closed:
            raise DsgdError(f"{what}: this DistributedSGD was shut down (its actors are killed)")

    def _keep(self, handle, name: str) -> None:
        """Record a new actor, or kill it at once when the set was shut down meanwhile
        (a recovery racing shutdown() from another thread leaves no actor behind).
        Call with the lock held."""
        if self._closed:
            _kill(handle)
            raise DsgdError(f"starting {name}: this DistributedSGD was shut down")
        self._names[id(handle)] = (handle, name)

    def info(self, slot: int) -> dict:
        return self._infos[slot]

    def worker(self, slot: int):
        return self._workers[self._slots.index(slot)]

    def name(self, handle) -> str:
        """The actor's name (unique over the instance's life: a replacement's carries
        a generation tag), "?" for a handle this set did not start."""
        known = self._names.get(id(handle))
        return known[1] if known is not None and known[0] is handle else "?"

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
            with self._lock:
                self._keep(handle, name)
                if self._generation:  # a replacement, or growth: it joins running workers
                    self._new[id(handle)] = handle
                handles.append(handle)
                position = sorted(self._slots + [slot]).index(slot)
                self._slots.insert(position, slot)
                self._workers.insert(position, handle)
        return handles

    def spawn_worker(self, slot: int):
        """Create a worker actor for `slot` outside the set (a replacement started
        in the background, backup workers): it joins with `admit_worker`, is
        killed by `drop_joining` or `shutdown`. Returns its handle."""
        model_creator, devices, gpu, alg, init = self.worker_args
        name = self._name(constants.WORKER_NAME_PREFIX, slot)
        handle = self._worker_cls.options(name=name, runtime_env=constants.ACTOR_RUNTIME_ENV,
                                          **self.worker_options).remote(
            model_creator, slot, devices, gpu, alg, init)
        with self._lock:
            self._keep(handle, name)
            self._joining[slot] = handle
        return handle

    @property
    def joining(self) -> dict[int, object]:
        """Replacements started in the background, by slot (a copy)."""
        return dict(self._joining)

    def admit_worker(self, slot: int, info: dict) -> None:
        """A background replacement joins the set (a new membership)."""
        handle = self._joining.pop(slot)
        position = sorted(self._slots + [slot]).index(slot)
        self._slots.insert(position, slot)
        self._workers.insert(position, handle)
        self._infos[slot] = info
        self._located(handle, info)
        self._new[id(handle)] = handle
        self._membership += 1

    def new_to_steps(self, workers: list) -> bool:
        """Whether any of `workers` joined running workers and has not ended a call
        of steps yet (its first traces its compiled step: Config.first_steps_timeout_s)."""
        return any(self._new.get(id(w)) is w for w in workers)

    def stepped(self, workers: list) -> None:
        """`workers` ended a call of steps: their steps are judged by step_timeout_s."""
        for w in workers:
            if self._new.get(id(w)) is w:
                del self._new[id(w)]

    def drop_joining(self, slot: int) -> None:
        _kill(self._joining.pop(slot))

    def set_up(self, slots: list[int], infos: list[dict]) -> None:
        """Record what the workers of `slots` reported at setup."""
        self._infos.update(zip(slots, infos))
        for slot, info in zip(slots, infos):
            self._located(self.worker(slot), info)

    def ps_ready(self, handles: list, infos: list[dict]) -> None:
        """Record where the PS actors `handles` run (their `ready()` answers)."""
        for handle, info in zip(handles, infos):
            self._located(handle, info)

    def _located(self, handle, info: dict) -> None:
        if "pid" in info and "node_id" in info:
            self._processes[id(handle)] = (handle, info["node_id"], int(info["pid"]))

    def start_ps(self, indices: list[int], node_ids: list[str], warm_store_bytes: int = 0,
                 rendezvous_timeout_s: float = constants.DEFAULT_STEP_TIMEOUT_S) -> list:
        """Create PS actors `indices`, PS j on node `node_ids[k]` (dsgd/comm/param_server.py
        `ps_options`), each warming `warm_store_bytes` of its store mapping; their
        workers' own exchanges (a Trainer's custom epochs: `reduce`) wait at most
        `rendezvous_timeout_s`. Returns their handles."""
        from dsgd.comm.param_server import ps_options

        handles = []
        for j, node_id in zip(indices, node_ids):
            name = self._name(constants.PS_NAME_PREFIX, j)
            handle = self._ps_cls.options(name=name, **ps_options(node_id)).remote(
                j, warm_store_bytes, rendezvous_timeout_s)
            with self._lock:
                self._keep(handle, name)
                while len(self._ps) <= j:
                    self._ps.append(None)
                self._ps[j] = handle
                handles.append(handle)
        return handles

    def next_generation(self, workers_added: bool) -> None:
        """Before starting replacements: new names; with `workers_added`, a new membership."""
        self._generation += 1
        if workers_added:
            self._membership += 1

    # -- stopping -------------------------------------------------------------
    def kill(self, handle) -> None:
        """Kill one actor (a hung one, to be replaced by recovery). Ray gives an
        actor a grace period to exit (about 5 s) before its raylet kills the
        process, which a hung (e.g. stopped) process never uses: one on this
        node is SIGKILLed at once too, so its resources free for the replacement."""
        _kill(handle)
        where = self._processes.get(id(handle))
        if where is not None and where[0] is handle:
            del self._processes[id(handle)]
            _kill_local_process(*where[1:])

    def remove_worker(self, slot: int) -> None:
        k = self._slots.index(slot)
        _kill(self._workers[k])
        self._new.pop(id(self._workers[k]), None)
        del self._slots[k], self._workers[k]
        self._infos.pop(slot, None)

    def remove_ps(self, j: int) -> None:
        _kill(self._ps[j])
        self._ps[j] = None

    def shutdown(self) -> None:
        """Kill every actor and start none from now on (safe from any thread)."""
        with self._lock:
            self._closed = True
            handles = (self._workers + [p for p in self._ps if p is not None]
                       + list(self._joining.values()))
            self._workers, self._slots, self._ps, self._joining = [], [], [], {}
        for handle in handles:
            _kill(handle)

    # -- waiting --------------------------------------------------------------
    def wait(self, refs: list, owners: list, what: str, timeout_s: float,
             stall_s: float | None = None) -> list:
        """ray.get of `refs` (one per owner actor) with a deadline: stall reports
        every `stall_s` (default: the set's), StepTimeoutError naming the actors
        that did not answer in `timeout_s`. Actor errors propagate from ray.get;
        DsgdError after `shutdown`."""
        self.check_open(what)
        try:
            return waits.get_all(refs, owners, what, timeout_s, name_of=self.name,
                                 stall_s=stall_s or self.stall_s)
        except Exception:
            self.check_open(what)  # killed by shutdown() from another thread: say so
            raise

    def next_all(self, streams: list, owners: list, what: str, timeout_s: float) -> list:
        """The next ObjectRef of each streaming generator (one per owner actor)."""
        return waits.next_all(streams, owners, what, timeout_s, name_of=self.name,
                              stall_s=self.stall_s)

    def probe(self, timeout_s: float, kill_hung: bool = False
              ) -> tuple[dict[int, Ping | None], list[int]]:
        """Ping every actor; a ping runs after the calls already queued on that
        actor, so a live one answers once its in-flight work has ended.
        Returns ({slot: ping info, or None if dead}, [dead PS indices]).
        An actor that neither answers nor dies in `timeout_s` is hung: with
        `kill_hung` it is killed and reported dead, otherwise StepTimeoutError."""

        died = waits.actor_died_errors()
        handles = self._workers + [p for p in self._ps if p is not None]
        refs = [h.ping.remote() for h in handles]
        ready_ids = {r.hex() for r in waits.Deadline("recovering: the actors' pings",
                                                      timeout_s).wait(refs)[0]}
        answers = []
        for handle, ref in zip(handles, refs):
            if ref.hex() not in ready_ids:
                if not kill_hung:
                    raise StepTimeoutError(f"recovering: {self.name(handle)} neither answered nor "
                                           f"died within {timeout_s:.1f} s", [handle])
                logger.warning("recovering: %s neither answered nor died within %.1f s: killing "
                               "it (hung)", self.name(handle), timeout_s)
                self.kill(handle)
                answers.append(None)
                continue
            try:
                answers.append(waits.fetch(ref, f"recovering: {self.name(handle)}'s ping",
                                           timeout_s))
            except died:
                answers.append(None)
        workers = dict(zip(self._slots, answers[:len(self._workers)]))
        live_ps = [j for j, p in enumerate(self._ps) if p is not None]
        dead_ps = [j for j, a in zip(live_ps, answers[len(self._workers):]) if a is None]
        return workers, dead_ps


def _kill_local_process(node_id: str, pid: int) -> None:
    """SIGKILL process `pid` if it runs on this node and is still a Ray worker process."""
    import os
    import signal

    import ray

    try:
        if node_id != ray.get_runtime_context().get_node_id():
            return
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read().startswith(b"ray::"):
                return  # exited, and the pid is someone else's now
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def _kill(handle) -> None:
    import ray

    try:
        ray.kill(handle)
    except Exception:  # noqa: BLE001 - already dead
        pass
