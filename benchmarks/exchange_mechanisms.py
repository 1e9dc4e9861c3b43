"""Which Ray mechanism should carry dsgd's gradient exchange, by measurement.

    python benchmarks/exchange_mechanisms.py [--quick] [--out PATH] [--reps 3]
                                             [--mechanisms NAME ...] [--cases NAME ...]

One step: each of N worker actors "computes" its gradient (S MiB of float32 in G
groups, filled with a value of (worker rank, step, group)), each group is summed
over the N workers by the parameter-server (PS) actor that owns it (P = min(N, G)
PS actors, group g on PS g % P, dsgd's own `ParameterServer` and C++ kernel) and
scaled by 1/N, and every worker adds every group's mean into its weights. No
TensorFlow. Mechanisms, each in fresh actors, interleaved (the order rotates
every repetition), medians over repetitions:

- `rendezvous`: the workers drive the step. Per step each worker puts each group
  once (`ray.put`) and calls `ParameterServer.reduce` on its PS, which blocks
  until all N parts of that group arrived, sums once, puts the mean once and
  hands every caller its ref; the worker reads it zero-copy and applies. The
  driver calls `run_steps(k)` on each worker once per k steps.
- `compiled`: a Ray Compiled Graph: worker.compute (G returns, one channel each,
  routed to the owning PS) -> BenchPS.mean (one node per group) ->
  worker.apply (all G means) -> driver. The driver calls `execute` per step, up
  to `inflight` executions ahead, and reads the N apply outputs (O(N) reads: a
  compiled graph allows no leaf nodes, so every apply must feed something).
- `compiled_collect`: the same graph with the N apply outputs collected by one
  method on PS 0, so that the driver reads one output per step.
- `driver_relayed` (the engine's exchange when this was measured, since
  retired from dsgd): per step the driver gets each worker's G refs
  (`num_returns=G`), calls `BenchPS.mean` per group and `apply` per worker:
  O(N*G) refs and O(N + G) calls through the driver.

Measured: (1) "driver_cost" (S=8 MiB in 1 MiB groups, N = 2, 4, 6, 8): the
driver's CPU per step (`time.process_time`, every thread of the driver process)
and wall per step; (2) "exchange_bound" (N=2, S=100 MiB in 10 MiB groups, P=2):
wall per step and CPU per step summed over the driver and every actor process
(/proc/<pid>/stat utime + stime; workers, PS actors, and Ray's raylet and GCS
reported apart); (3) "emulated_compute" (the driver-cost gradient, N=2, each
worker's compute a 100 ms sleep, as on an accelerator): what every process burns
while the workers compute, since a compiled graph's readers wait by polling;
(4) for the compiled graph, what a membership change costs (teardown, build +
`experimental_compile`, first execute; same members and one worker fewer);
(5) "polling": the CPU of an idle compiled graph's actors, and of the driver
waiting in `get`; (6) "failure": a worker or a PS killed during a compiled step,
or a worker that hangs (what `get` raises and after how long, whether teardown
returns, whether the others answer, recovery with a replacement checked
exactly), and `resize_probe`: what happens without the channel-size workaround
(see `Exchange`). Every `get` and every teardown has a timeout.

Every mechanism's result is checked exactly: after the run each worker's weights
must equal (np.array_equal) the same float32 arithmetic done in the driver
(sum over workers left to right, times float32(1/N), added step by step); a
mismatch raises. Writes JSON to benchmarks/results/exchange_mechanisms.json or
`--out`; `--quick` is a small smoke run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import ray

from dsgd import constants
from dsgd.comm.param_server import ParameterServer, ps_actor_class
from dsgd.comm.sharding import Piece, Shard

MIB = 2**20
MECHANISMS = ("rendezvous", "compiled", "compiled_collect", "driver_relayed")
CASES = ("driver_cost", "exchange_bound", "emulated_compute", "polling", "failure")
NO_STALL, EVERY_RANK = -1, -2  # cmd's stall_rank: nobody sleeps / every worker sleeps
# What Ray 2.60's Compiled Graphs do here, found while building this script; the
# probes (resize_probe, polling_probe, failure) measure the last three again each run.
COMPILED_GRAPH_NOTES = {
    "multiple_returns_routed": "yes: compute.options(num_returns=G).bind(x) gives G nodes, "
                               "each read by a different PS actor",
    "zero_copy_reads": "yes: arrays read from a channel are read-only views of its buffer",
    "loop_inside_actors": "no: one execute() is one pass of the graph; up to "
                          "_max_inflight_executions passes may be in flight",
    "leaf_nodes": "not allowed: every apply must feed an output (the driver reads N outputs, "
                  "or one actor collects them: compiled_collect)",
    "buffer_size": "experimental_compile(_buffer_size_bytes=) does not reach actor-to-actor "
                   "channels (SharedMemoryType.create_channel builds CompositeChannel without "
                   "its type; Channel(typ=None) uses the DAGContext default, 1e6 bytes); a "
                   "larger write resizes the channel, after which teardown() never returns "
                   "(resize_probe). Workaround: env RAY_CGRAPH_buffer_size_bytes in every "
                   "actor's runtime_env",
    "waiting": "readers poll: idle graph actors and a driver waiting in get() burn CPU "
               "(polling_probe)",
    "actor_death": "detected: get() raises ActorDiedError; the graph shuts down and must be "
                   "torn down and recompiled (failure)",
}
_LEFT_BEHIND: list = []  # compiled graphs whose teardown did not return


def value(rank: int, step: int, group: int) -> np.float32:
    """The gradient fill of worker `rank`, step `step`, group `group`."""
    return np.float32(0.25 + 0.37 * (rank + 1) + 0.011 * step + 0.0013 * group)


def group_sizes(grad_mib: float, group_mib: float) -> list[int]:
    """float32 elements of each group: S MiB cut into groups of `group_mib` MiB."""
    total, per = int(grad_mib * MIB) // 4, int(group_mib * MIB) // 4
    return [min(per, total - start) for start in range(0, total, per)]


def cpu_s(pid: int) -> float:
    """utime + stime of every thread of process `pid`, in seconds (NaN if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def system_pids() -> list[int]:
    """This cluster's raylet and GCS server (private Ray API; [] if it moved)."""
    try:
        processes = ray._private.worker._global_node.live_processes()
        return [p.pid for kind, p in processes if kind in ("raylet", "gcs_server")]
    except Exception:  # noqa: BLE001 - a moved private API only loses this column
        return []


def bounded(fn, timeout_s: float):
    """fn() in a thread, at most `timeout_s`: (result, error, seconds); a call
    still running then gives error TimeoutError (the thread is left behind)."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported, not raised
            box["error"] = e

    start = time.perf_counter()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    seconds = time.perf_counter() - start
    if thread.is_alive():
        return None, TimeoutError(f"still running after {timeout_s:.0f} s"), seconds
    return box.get("result"), box.get("error"), seconds


def describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {str(error)[:600]}"


class Worker:
    """A data-parallel worker: fills its gradient groups, exchanges them by the
    mechanism under test, adds the means into its weights. `rank` names the
    worker in the closed form; `position`/`world` are its place in a rendezvous."""

    def __init__(self, rank: int, sizes: list[int], timeout_s: float, warm_bytes: int = 0):
        from dsgd.comm import store

        store.warm(warm_bytes)  # as dsgd's actors do: no first-touch faults in the store
        self.rank, self.timeout_s = rank, timeout_s
        self.grads = [np.zeros(n, np.float32) for n in sizes]
        self.weights = [np.zeros(n, np.float32) for n in sizes]
        self.applied, self.views = 0, None

    def info(self) -> dict:
        return {"pid": os.getpid(), "rank": self.rank}

    def join(self, ps: list, shards: list, position: int, world: int) -> None:
        self.ps, self.shards, self.position, self.world = ps, shards, position, world

    def _fill(self, cmd) -> tuple:
        step, stall_rank, stall_s = cmd  # stall: an emulated accelerator, or a hang
        if stall_rank in (self.rank, EVERY_RANK):
            time.sleep(stall_s)
        for g, buf in enumerate(self.grads):
            buf.fill(value(self.rank, step, g))
        return tuple((buf,) for buf in self.grads)  # a group: the tuple of its pieces

    def compute(self, cmd):
        """Groups as `BenchPS.mean` takes them (G returns; G == 1: one)."""
        parts = self._fill(cmd)
        return parts if len(parts) > 1 else parts[0]

    def apply(self, *means) -> int:
        """Adds each group's mean (a one-shard tuple, read, not kept); returns the
        number of steps applied so far."""
        if self.views is None:
            self.views = {"writeable": bool(means[0][0].flags.writeable),
                          "owndata": bool(means[0][0].flags.owndata)}
        for w, mean in zip(self.weights, means):
            np.add(w, mean[0], out=w)
        self.applied += 1
        return self.applied

    def run_steps(self, first_step: int, k: int, compute_s: float = 0.0) -> int:
        """Mechanism `rendezvous`: k steps driven by this worker."""
        num_ps = len(self.ps)
        for step in range(first_step, first_step + k):
            parts = self._fill((step, EVERY_RANK, compute_s))
            calls = [self.ps[g % num_ps].reduce.remote(
                step * len(parts) + g, self.position, self.world, (self.shards[g],),
                ray.put(part)) for g, part in enumerate(parts)]
            answers = ray.get(calls, timeout=self.timeout_s)
            self.apply(*ray.get([a[0] for a in answers], timeout=self.timeout_s))
        return self.applied

    def state(self) -> dict:
        return {"weights": self.weights, "applied": self.applied, "views": self.views}


class BenchPS(ParameterServer):
    """dsgd's PS plus `mean` (a group's mean over every worker's part, passed
    whole: the driver-relayed exchange, retired from dsgd) and `collect`, the
    one output of the `compiled_collect` graph."""

    def mean(self, shards, *worker_groups) -> tuple:
        return self._means(shards, worker_groups)

    def collect(self, *applied) -> int:
        return min(applied)


class Exchange:
    """One mechanism on its own fresh actors: N workers, P PS actors."""

    def __init__(self, name: str, num_workers: int, sizes: list[int], inflight: int,
                 timeout_s: float, warm_bytes: int = 0, size_channels: bool = True,
                 compute_s: float = 0.0):
        self.name, self.sizes, self.inflight, self.timeout_s = name, sizes, inflight, timeout_s
        self.compute_s = compute_s  # each worker's emulated compute per step (a sleep)
        self.num_ps = min(num_workers, len(sizes))
        self.shards = [Shard("float32", (Piece(g, 0, n, 0),)) for g, n in enumerate(sizes)]
        # Ray 2.60 does not hand experimental_compile's _buffer_size_bytes to the
        # channels between actors: SharedMemoryType.create_channel builds its
        # CompositeChannel without the type, so Channel(typ=None) takes the creating
        # process's DAGContext default (1e6 bytes, env RAY_CGRAPH_buffer_size_bytes). A
        # larger write resizes the channel, and after a resize teardown() never
        # returns (README). So every actor gets the size through that variable.
        self.buffer_bytes = 4 * max(sizes) + 64 * 1024
        env = {"env_vars": dict(constants.ACTOR_RUNTIME_ENV["env_vars"])}
        if size_channels:  # False: only resize_probe, to show what happens without it
            env["env_vars"]["RAY_CGRAPH_buffer_size_bytes"] = str(self.buffer_bytes)
        self.worker_cls = ray.remote(num_cpus=1)(Worker).options(runtime_env=env)
        self.ps_cls = ps_actor_class(BenchPS, num_workers).options(num_cpus=0, runtime_env=env)
        self.warm_bytes, self.compiled = warm_bytes, None
        self.workers = {r: self.worker_cls.remote(r, sizes, timeout_s, warm_bytes)
                        for r in range(num_workers)}
        self.ps = [self.ps_cls.remote(j, warm_bytes, timeout_s) for j in range(self.num_ps)]
        self.members = list(range(num_workers))  # worker ranks in the current step
        self.history: list[tuple[int, tuple]] = []  # (step, members) of every applied step
        self.next_step = 0
        self.pids = {f"worker{r}": i["pid"] for r, i in zip(self.workers, self.get(
            [w.info.remote() for w in self.workers.values()]))}
        self.pids.update({f"ps{j}": i["pid"] for j, i in enumerate(
            self.get([p.ready.remote() for p in self.ps]))})
        if name == "rendezvous":
            self.get([self.workers[r].join.remote(self.ps, self.shards, i, num_workers)
                      for i, r in enumerate(self.members)])
        if name.startswith("compiled"):
            self.compile()

    def get(self, refs):
        return ray.get(refs, timeout=self.timeout_s)

    def compile(self) -> None:
        """Build and compile the graph of the current members."""
        from ray.dag import InputNode, MultiOutputNode

        G, members = len(self.sizes), [self.workers[r] for r in self.members]
        with InputNode() as cmd:
            parts = []
            for w in members:
                out = w.compute.options(num_returns=G).bind(cmd)
                parts.append(list(out) if G > 1 else [out])
            means = [self.ps[g % self.num_ps].mean.bind((self.shards[g],),
                                                        *[p[g] for p in parts])
                     for g in range(G)]
            applied = [w.apply.bind(*means) for w in members]
            dag = MultiOutputNode([self.ps[0].collect.bind(*applied)]
                                  if self.name == "compiled_collect" else applied)
        # A channel holds one group's tuple (pickle and Ray's metadata beside the data);
        # every channel has `inflight` buffers.
        self.compiled = dag.experimental_compile(
            _buffer_size_bytes=self.buffer_bytes,
            _max_inflight_executions=self.inflight, _submit_timeout=self.timeout_s)

    def teardown(self, timeout_s: float = 90.0) -> None:
        """Tears the compiled graph down; raises RuntimeError if that has not
        returned after `timeout_s` (Ray's own wait has no bound)."""
        if self.compiled is not None:
            _, error, _ = bounded(self.compiled.teardown, timeout_s)
            if error is not None:
                raise RuntimeError(f"{self.name}: compiled graph teardown: "
                                   f"{describe(error)}") from error
            self.compiled = None

    def run(self, k: int) -> None:
        """k steps; the driver blocks until all are applied."""
        first, self.next_step = self.next_step, self.next_step + k
        steps = range(first, first + k)
        if self.name == "rendezvous":
            self.get([self.workers[r].run_steps.remote(first, k, self.compute_s)
                      for r in self.members])
        else:
            pending = collections.deque()
            for step in steps:
                if len(pending) >= self.inflight:
                    self.get(pending.popleft())
                pending.append(self._submit(step))
            while pending:
                self.get(pending.popleft())
        self.history += [(s, tuple(self.members)) for s in steps]

    def _submit(self, step: int):
        cmd = (step, EVERY_RANK, self.compute_s)
        if self.compiled is not None:
            return self.compiled.execute(cmd)
        G, members = len(self.sizes), [self.workers[r] for r in self.members]
        parts = [w.compute.options(num_returns=G).remote(cmd) for w in members]
        parts = [p if G > 1 else [p] for p in parts]
        means = [self.ps[g % self.num_ps].mean.remote((self.shards[g],), *[p[g] for p in parts])
                 for g in range(G)]
        return [w.apply.remote(*means) for w in members]

    def check(self, ranks=None) -> dict:
        """Every worker's weights against the closed form; raises on any difference."""
        views = {}
        for r in (self.workers if ranks is None else ranks):
            state = self.get(self.workers[r].state.remote())
            for g, got in enumerate(state["weights"]):
                want = np.full(self.sizes[g], expected_weight(self.history, r, g), np.float32)
                if not np.array_equal(got, want):
                    bad = np.flatnonzero(got != want)
                    raise AssertionError(
                        f"{self.name}: worker {r} group {g} wrong after "
                        f"{len(self.history)} steps: {bad.size} elements differ, e.g. "
                        f"[{bad[0]}] = {got[bad[0]]!r}, closed form {want[0]!r}")
            views[r] = state["views"]
        return views

    def stop(self) -> None:
        try:
            self.teardown()
        finally:
            for actor in [*self.workers.values(), *self.ps]:
                ray.kill(actor)


def expected_weight(history, rank: int, group: int) -> np.float32:
    """Worker `rank`'s weight in `group` after `history`: the kernel's float32
    arithmetic (sum over the members left to right, times float32(1/N))."""
    weight = np.float32(0)
    for step, members in history:
        if rank in members:
            total = value(members[0], step, group)
            for r in members[1:]:
                total = np.float32(total + value(r, step, group))
            weight = np.float32(weight + np.float32(total * np.float32(1.0 / len(members))))
    return weight


def measure(exchange: Exchange, steps: int, k: int) -> dict:
    """CPU and wall per step over `steps` steps in calls of k steps."""
    system = system_pids()
    actors0 = {n: cpu_s(p) for n, p in exchange.pids.items()}
    system0 = [cpu_s(p) for p in system]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(steps // k):
        exchange.run(k)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    used = {name: cpu_s(p) - actors0[name] for name, p in exchange.pids.items()}
    workers = sum(c for name, c in used.items() if name.startswith("worker"))
    ps = sum(c for name, c in used.items() if name.startswith("ps"))
    actors = workers + ps
    system_cpu = sum(cpu_s(p) - c for p, c in zip(system, system0))
    n = steps // k * k
    return {"steps": n, "wall_ms_per_step": 1000 * wall / n,
            "driver_cpu_ms_per_step": 1000 * cpu / n,
            "workers_cpu_ms_per_step": 1000 * workers / n,
            "ps_cpu_ms_per_step": 1000 * ps / n,
            "actors_cpu_ms_per_step": 1000 * actors / n,
            "raylet_gcs_cpu_ms_per_step": 1000 * system_cpu / n if system else None,
            "total_cpu_ms_per_step": 1000 * (cpu + actors + system_cpu) / n}


def rebuild_costs(exchange: Exchange) -> dict:
    """A compiled graph's membership change: teardown, build + compile, first step;
    with the same members, then with the last worker left out."""
    out = {}
    for label, members in (("same", list(exchange.members)), ("one_fewer", exchange.members[:-1])):
        t0 = time.perf_counter()
        exchange.teardown()
        t1 = time.perf_counter()
        exchange.members = members
        exchange.compile()
        t2 = time.perf_counter()
        exchange.run(1)
        t3 = time.perf_counter()
        out[label] = {"teardown_s": t1 - t0, "compile_s": t2 - t1, "first_step_s": t3 - t2}
    exchange.run(2)
    return out


def run_case(case: str, num_workers: int, sizes, mechanisms, ks, inflight: dict, reps: int,
             steps: int, warmup: int, timeout_s: float, warm_bytes: int, rebuild: bool,
             compute_s: float = 0.0) -> list:
    rows = []
    for rep in range(reps):
        order = list(mechanisms[rep % len(mechanisms):]) + list(mechanisms[:rep % len(mechanisms)])
        for name in order:
            t0 = time.perf_counter()
            ex = Exchange(name, num_workers, sizes, inflight[name], timeout_s, warm_bytes,
                          compute_s=compute_s)
            try:
                start_s = time.perf_counter() - t0
                for k in ks:
                    ex.run(warmup)
                    row = {"case": case, "mechanism": name, "num_workers": num_workers,
                           "num_ps": ex.num_ps, "num_groups": len(sizes),
                           "grad_mib": 4 * sum(sizes) / MIB, "compute_ms": 1000 * compute_s,
                           "k": k,
                           "inflight": inflight[name] if name != "rendezvous" else None,
                           "rep": rep, "start_s": start_s, **measure(ex, steps, k)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if rebuild and name == "compiled":
                    rows[-1]["rebuild"] = rebuild_costs(ex)
                rows[-1]["views"] = ex.check()[ex.members[0]]
            finally:
                ex.stop()
    return rows


def failure_case(victim: str, num_workers: int, sizes, timeout_s: float, get_timeout_s: float,
                 stall_s: float, kill_after_s: float) -> dict:
    """During a step of a compiled graph, kill worker 1 (victim "worker") or PS 0
    ("ps"), or let worker 1 hang for `stall_s` ("hang": nothing dies, the driver's
    get times out after `get_timeout_s`). Then: what the next execute does,
    teardown, whether the others still answer, and the recovery (a replacement
    actor where one died, a new graph) checked exactly."""
    ex = Exchange("compiled", num_workers, sizes, 1, timeout_s)
    result = {"victim": victim, "num_workers": num_workers, "stall_s": stall_s}
    try:
        ex.run(2)
        actor = ex.ps[0] if victim == "ps" else ex.workers[1]
        refs = ex.compiled.execute((ex.next_step, 0 if victim == "ps" else 1, stall_s))
        ex.next_step += 1  # this step is never applied (checked below)
        time.sleep(kill_after_s)
        event = time.perf_counter()
        if victim != "hang":
            ray.kill(actor)
        _, error, _ = bounded(lambda: ray.get(refs, timeout=get_timeout_s), get_timeout_s + 30)
        result["get_raised"] = describe(error)
        result["get_returned_after_s"] = time.perf_counter() - event  # after the kill

        def execute_again():
            return ray.get(ex.compiled.execute((ex.next_step, NO_STALL, 0.0)), timeout=10)
        _, error, seconds = bounded(execute_again, 40)
        result["next_execute_raised"], result["next_execute_s"] = describe(error), seconds
        if error is None:  # the graph went on: that step was applied
            ex.history.append((ex.next_step, tuple(ex.members)))
            ex.next_step += 1
        _, error, seconds = bounded(ex.teardown, 120)
        result["teardown_raised"], result["teardown_s"] = describe(error), seconds
        if ex.compiled is not None:
            _LEFT_BEHIND.append(ex.compiled)
            ex.compiled = None
        others = [*((f"worker{r}", w, "info") for r, w in ex.workers.items()),
                  *((f"ps{j}", p, "ready") for j, p in enumerate(ex.ps))]
        result["others_answer"] = {
            n: bounded(lambda a=a, m=m: ray.get(getattr(a, m).remote(), timeout=10),
                       20)[1] is None
            for n, a, m in others if victim == "hang" or a is not actor}
        t0 = time.perf_counter()
        if victim == "worker":
            new_rank = max(ex.workers) + 1  # a rank never seen: its own closed form
            del ex.workers[1]
            ex.workers[new_rank] = ex.worker_cls.remote(new_rank, sizes, timeout_s)
            ex.get(ex.workers[new_rank].info.remote())
            ex.members = [r for r in ex.members if r != 1] + [new_rank]
        elif victim == "ps":
            ex.ps[0] = ex.ps_cls.remote(0, 0, timeout_s)
            ex.get(ex.ps[0].ready.remote())
        t1 = time.perf_counter()
        ex.compile()
        t2 = time.perf_counter()
        ex.run(1)
        t3 = time.perf_counter()
        ex.run(2)
        ex.check(ex.members)  # the failed step applied nowhere, the new graph exact
        result.update(replacement_start_s=t1 - t0, recompile_s=t2 - t1, first_step_s=t3 - t2,
                      recovered_exact=True)
    except Exception as e:  # noqa: BLE001 - recorded: this case reports what happens
        result["error"] = describe(e)
    finally:
        _abandon(ex)
    return result


def _abandon(ex: Exchange) -> None:
    """Kills the actors of `ex` without waiting for a teardown that may never
    return; its graph stays referenced (its destructor would wait on the same
    lock as the hung teardown) until the actors' death ends Ray's wait."""
    if ex.compiled is not None:
        _LEFT_BEHIND.append(ex.compiled)
        ex.compiled = None
    ex.stop()


def resize_probe(timeout_s: float, teardown_timeout_s: float) -> dict:
    """A compiled graph whose groups (2 MiB) exceed the channels' 1e6-byte default,
    without the RAY_CGRAPH_buffer_size_bytes workaround: do steps run exactly, and
    does teardown return?"""
    sizes = group_sizes(4.0, 2.0)
    ex = Exchange("compiled", 2, sizes, 2, timeout_s, size_channels=False)
    result = {"group_bytes": 4 * sizes[0], "buffer_size_bytes_passed": ex.buffer_bytes}
    try:
        ex.run(4)
        ex.check()
        result["steps_exact"] = True
        _, error, seconds = bounded(lambda: ex.teardown(teardown_timeout_s),
                                    teardown_timeout_s + 30)
        result.update(teardown_raised=describe(error), teardown_s=seconds)
    except Exception as e:  # noqa: BLE001 - recorded
        result["error"] = describe(e)
    finally:
        _abandon(ex)
    return result


def polling_probe(sizes, timeout_s: float, idle_s: float = 2.0, wait_s: float = 0.5) -> dict:
    """What a compiled graph's waiting readers burn: CPU of its actors while the
    graph is idle (every worker waits on the driver's input channel, every PS
    on the workers) and of the driver while it waits `wait_s` in `get` on a
    step whose workers sleep (no other work in the step)."""
    ex = Exchange("compiled", 2, sizes, 1, timeout_s)
    try:
        ex.run(2)
        before = {n: cpu_s(p) for n, p in ex.pids.items()}
        time.sleep(idle_s)
        idle = {n: (cpu_s(p) - before[n]) / idle_s for n, p in ex.pids.items()}
        ex.compute_s, cpu0 = wait_s, time.process_time()
        ex.run(1)
        driver = (time.process_time() - cpu0) / wait_s
        ex.check()
        return {"idle_s": idle_s, "idle_cores_per_actor": idle, "wait_s": wait_s,
                "driver_cores_while_waiting": driver}
    finally:
        ex.stop()


def medians(rows: list) -> list:
    keys = ("wall_ms_per_step", "driver_cpu_ms_per_step", "workers_cpu_ms_per_step",
            "ps_cpu_ms_per_step", "actors_cpu_ms_per_step",
            "raylet_gcs_cpu_ms_per_step", "total_cpu_ms_per_step", "start_s")
    groups = collections.defaultdict(list)
    for r in rows:
        groups[(r["case"], r["mechanism"], r["num_workers"], r["k"])].append(r)
    out = []
    for (case, name, n, k), rs in groups.items():
        m = {"case": case, "mechanism": name, "num_workers": n, "k": k, "reps": len(rs)}
        for key in keys:
            vals = [r[key] for r in rs if r.get(key) is not None]
            m[key] = statistics.median(vals) if vals else None
        rebuilds = [r["rebuild"] for r in rs if "rebuild" in r]
        if rebuilds:
            m["rebuild"] = {label: {key: statistics.median(b[label][key] for b in rebuilds)
                                    for key in rebuilds[0][label]} for label in rebuilds[0]}
        out.append(m)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 6, 8])
    p.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS), choices=MECHANISMS)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="measured steps, driver-cost case")
    p.add_argument("--exchange-steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 8], help="steps per driver call")
    p.add_argument("--exchange-inflight", type=int, default=2,
                   help="compiled/driver_relayed executions ahead, exchange-bound case")
    p.add_argument("--store-gib", type=float, default=3.0)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--compute-ms", type=float, default=100.0,
                   help="emulated compute per step (a sleep), emulated_compute case")
    p.add_argument("--compute-workers", type=int, default=2)
    p.add_argument("--compute-steps", type=int, default=16)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "exchange_mechanisms.json"))
    args = p.parse_args(argv)
    driver_mib, driver_group_mib, exchange_mib, exchange_group_mib = 8.0, 1.0, 100.0, 10.0
    if args.quick:
        args.workers, args.reps, args.steps, args.exchange_steps = [2, 3], 1, 8, 8
        args.warmup, args.ks, args.store_gib = 2, [1, 4], 1.0
        args.compute_ms, args.compute_steps = 30.0, 6
        driver_mib, driver_group_mib, exchange_mib, exchange_group_mib = 2.0, 0.5, 8.0, 2.0

    ray.init(num_cpus=max(*args.workers, args.compute_workers) + 2,
             object_store_memory=int(args.store_gib * 2**30),
             include_dashboard=False, log_to_driver=False,
             runtime_env=constants.ACTOR_RUNTIME_ENV)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    result = {"benchmark": "exchange_mechanisms", "quick": args.quick,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
              "python": platform.python_version(), "ray": ray.__version__,
              "numpy": np.__version__, "date": time.strftime("%Y-%m-%d"),
              "commit": commit.stdout.strip() or "unknown", "args": vars(args)}
    result["compiled_graph_notes"] = COMPILED_GRAPH_NOTES
    mechs = args.mechanisms
    driver_sizes = group_sizes(driver_mib, driver_group_mib)
    rows = []
    if "driver_cost" in args.cases:
        for n in args.workers:
            inflight = {m: max(args.ks) for m in mechs}
            rows += run_case("driver_cost", n, driver_sizes, mechs, args.ks, inflight,
                             args.reps, args.steps, args.warmup, args.timeout_s, 0, rebuild=True)
    if "exchange_bound" in args.cases:
        exchange_sizes = group_sizes(exchange_mib, exchange_group_mib)
        warm_bytes = min(6 * int(exchange_mib * MIB), int(args.store_gib * 2**30) // 2)
        inflight = {m: args.exchange_inflight for m in mechs}
        rows += run_case("exchange_bound", 2, exchange_sizes, mechs, args.ks, inflight,
                         args.reps, args.exchange_steps, args.warmup // 2, args.timeout_s,
                         warm_bytes, rebuild=True)
    if "emulated_compute" in args.cases:
        inflight = {m: max(args.ks) for m in mechs}
        rows += run_case("emulated_compute", args.compute_workers, driver_sizes, mechs, args.ks,
                         inflight, args.reps, args.compute_steps, 2, args.timeout_s, 0,
                         rebuild=False, compute_s=args.compute_ms / 1000)
    result.update(driver_cost={"grad_mib": driver_mib, "group_mib": driver_group_mib},
                  exchange_bound={"grad_mib": exchange_mib, "group_mib": exchange_group_mib,
                                  "num_workers": 2},
                  emulated_compute={"grad_mib": driver_mib, "group_mib": driver_group_mib,
                                    "num_workers": args.compute_workers,
                                    "compute_ms": args.compute_ms},
                  rows=rows, medians=medians(rows))
    if "polling" in args.cases:
        result["polling_probe"] = polling_probe(driver_sizes, args.timeout_s)
        print(json.dumps(result["polling_probe"]), flush=True)
    if "failure" in args.cases:
        n = 2 if args.quick else 4
        result["failure"] = [
            failure_case(victim, n, driver_sizes, args.timeout_s, get_timeout_s=60.0,
                         stall_s=3.0, kill_after_s=0.5) for victim in ("worker", "ps")]
        result["failure"].append(failure_case("hang", n, driver_sizes, args.timeout_s,
                                              get_timeout_s=5.0, stall_s=15.0,
                                              kill_after_s=0.0))
        result["resize_probe"] = resize_probe(args.timeout_s, 30.0 if args.quick else 60.0)
        for f in [*result["failure"], result["resize_probe"]]:
            print(json.dumps(f), flush=True)
    ray.shutdown()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for m in result["medians"]:
        print(json.dumps(m))
    print(json.dumps({"out": args.out}))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
