"""A discrete-event simulator of one synchronous data-parallel step on many nodes:
dsgd's exchange as the code does it, ring allreduce (Horovod) and BytePS-style
parameter servers, on the same nodes, links and compute profile.

    from sim import Hardware, Costs, Workload, simulate
    t = simulate("dsgd", workload, hardware, costs, workers=64)   # seconds per step

What is simulated (read from the code, `dsgd/worker/worker.py` and
`dsgd/comm/ps_client.py`, not assumed):

- **Nodes and links.** One worker per node (with D devices), PS j on node
  j mod N (`param_server.ps_nodes`). Every node has a NIC with one link per
  direction (B bytes/s each, latency l). Transfers share the links max-min fairly,
  re-evaluated as transfers start and end (`Network`: no link ever above its rate);
  on one node it costs nothing. TCP incast at large fan-in is not modelled.
- **CPU.** Each actor's Python work (a worker's sending thread, a PS's calls
  and sums) is serial (the GIL); where `Hardware.host_cores` is set, every
  node's CPU work also takes one of that many cores shared by all nodes (the
  emulated cluster: every "node" on this one machine).
- **dsgd, overlapped** (`overlap=True`, the default with GPUs): the buckets of
  `comm/sharding.py` `bucket_layout` (dsgd's own plan, computed here) leave as
  the backward pass makes them: copy to host (GPU, PCIe), `ray.put`
  (c_put + S/B_put) and the PS call (c_call) on the worker's sending thread;
  the PS's node pulls the part when the call arrives (transfer + l_pull), the
  PS handles the call (c_call), and the last arrival sums (N·S/B_sum + fresh
  pages + the result's put). The worker sends its meta to PS 0 when the backward
  pass ends; while PS 0 gathers the N metas the worker reads the means whose
  answers are in (`StepExchange.metas` -> `collect`: one parallel pull, waited for);
  after the decision it reads the ready ones again, applies the ready prefix
  in one update and the rest in a second, each stage's means pulled at once
  when all its answers are in (`StepExchange.read`), or everything in one update
  when under `APPLY_SPLIT_MIN_SHARE` is still pending
  (`Worker._apply_arriving`).
  With `prefetch=True` (not what the code does: a proposed change, see
  docs/scaling.md) each mean is pulled as soon as its answer arrives. With
  `metas_with_last=True` (also not built) there is no gather: each worker's
  meta rides with its last-ready bucket, sent once the backward pass ends, and
  that bucket's PS answers every worker with its mean and the N metas, when
  the step is decided. With `two_level=True` (not built either; `TwoLevel`) each
  bucket is summed in two levels: the workers, in ceil(sqrt(N)) groups of
  consecutive nodes, call their group's sub-aggregator (a PS actor on a node of
  the group) with their parts; it handles each call as the root would (c_call),
  sums them, puts the partial and calls the bucket's PS (its root) with it
  (c_call); the root's node pulls the partials, the root sums them and puts the
  mean; each sub-aggregator's call returns, it pulls the mean once, puts it again
  in its own store and answers its group, whose workers pull it from there. At
  N < `TWO_LEVEL_MIN_WORKERS` it is one level.
- **dsgd, after the backward pass** (`overlap=False`, CPU workers): one object per
  PS group (`exchange_layout`), put and sent when the compute ends, metas riding
  with them; the worker waits for every answer, pulls every mean in parallel
  and applies once.
- **ring** (Horovod): when the previous allreduce is done, its background
  thread's next cycle fuses the ready gradients (in the order they became
  ready, up to `fusion_bytes`) and allreduces the buffer over a ring of N·D
  ranks: 2(ND−1) steps of S/(ND) bytes, each through one NIC direction, plus
  the per-step latency α (or hierarchically with D > 1, whichever is faster);
  buffers are allreduced one at a time. The optimizer runs on the GPU when
  the last gradient is reduced.
- **byteps** (BytePS, one server per node): gradients cut into partitions of
  `partition_bytes`, assigned to servers round-robin; a worker pushes each
  partition when its gradient is ready (local reduce over NVLink and copy to
  host first), the server sums as pushes arrive and answers every pull once the N
  pushes are in; the worker copies each pulled partition back to the GPU; the
  optimizer runs when every partition is back. Per message `msg_s` of CPU.

Steps are synchronous: a worker's next step starts when its apply ends. The
simulator runs `steps` steps and reports the job's period (the last worker's
ends, per step, after a warm-up step: `_result`; not a median over workers,
which flatters staggered workers), with each phase's end for worker 0.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import statistics
from typing import Callable, Sequence

import numpy as np


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Hardware:
    """Nodes, links and devices. Bytes per second, seconds."""

    link_bw: float                 # NIC line rate per direction
    link_latency_s: float = 25e-6  # one way, per message
    link_efficiency: float = 0.9   # fraction of the line rate a transfer reaches
    gpu: bool = True
    devices: int = 1               # D per worker (node)
    pcie_bw: float = 12e9          # host <-> GPU, per direction
    hbm_bw: float = 900e9          # GPU memory (the optimizer's passes)
    nvlink_bw: float = 100e9       # in-node allreduce bus bandwidth (D > 1)
    host_cores: int | None = None  # one CPU pool shared by every node (emulated cluster)
    # TCP incast (not modelled unless set): a downlink with more than this many
    # transfers into it delivers `incast_fan_in / transfers` of its rate (switch
    # buffer overflow, retransmission timeouts): a stated assumption for
    # sensitivity rows, None for the model's default (no collapse).
    incast_fan_in: int | None = None
    # The network re-rates its transfers at most once per `net_quantum_s` (Network):
    # a transfer starts at the next multiple of it, so each hop may end up to this
    # much later than with exact re-rating (0: exact; tests/test_simulate.py checks
    # the two agree within 0.5 % of a step).
    net_quantum_s: float = 10e-6

    @property
    def rate(self) -> float:
        return self.link_bw * self.link_efficiency


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per-object, per-call and per-byte costs of the software (seconds, bytes/s)."""

    put_s: float          # one ray.put: fixed part
    put_bw: float         # ray.put: bytes per second copied into the store
    call_s: float         # one actor call: CPU of the caller and of the callee, each
    rpc_s: float          # one-way latency of an actor call or reply (beyond the link's)
    pull_s: float         # fixed latency of pulling one object from another node
    sum_bw: float         # PS kernel: input bytes summed per second
    mem_bw: float         # one copy (the PS's result put)
    fresh_bw: float = 0.0     # first read of pages just pulled (0: free)
    apply_s: float = 0.0      # one compiled apply update: fixed part (host)
    apply_bw: float = 0.0     # host apply: gradient bytes per second (CPU workers; 0: free)
    loop_s: float = 0.0       # per step, a worker's own fixed cost outside compute/apply
    split_min_pending: float = 0.25  # dsgd's APPLY_SPLIT_MIN_SHARE
    xfer_cpu_bw: float = 0.0  # CPU a transfer costs (emulated cluster, shared cores; 0: none)
    # Of `pull_s`, the part that is work on the node serving the object (its object
    # manager, one request at a time: N pulls of one PS's mean queue there); the rest
    # is latency at the requester. 0: all latency (as calibrated on one machine).
    pull_serve_s: float = 0.0
    wake_s: float = 0.0       # a PS thread's wake-up per call, on its GIL (beyond call_s)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One device's model: its variables (shapes, in model order) and when the
    backward pass makes each one's gradient (seconds after the step starts)."""

    name: str
    shapes: tuple                    # trainable variable shapes, model order
    ready_s: tuple                   # per variable: gradient ready (device), s after start
    compute_s: float                 # forward + backward (device), s
    cpu_compute_s: float = 0.0       # of which takes a host core (CPU models)
    update_bytes_factor: float = 5.0  # optimizer passes over the gradient (GPU apply)

    @property
    def grad_bytes(self) -> int:
        return 4 * sum(math.prod(s) for s in self.shapes)

    @property
    def sizes(self) -> list[int]:
        return [4 * math.prod(s) for s in self.shapes]


# ---------------------------------------------------------------------------
# The event engine and its resources
# ---------------------------------------------------------------------------

class Engine:
    def __init__(self):
        self.queue: list = []
        self.count = 0
        self.now = 0.0

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self.queue, (t, self.count, fn, args))
        self.count += 1

    def run(self) -> None:
        while self.queue:
            t, _, fn, args = heapq.heappop(self.queue)
            self.now = t
            fn(*args)


class Serial:
    """One server (a thread under the GIL, a DMA engine): FIFO."""

    def __init__(self):
        self.free = 0.0

    def take(self, t: float, seconds: float) -> float:
        start = max(t, self.free)
        self.free = start + seconds
        return self.free


class Cores:
    """k identical cores; None: always one free."""

    def __init__(self, k: int | None):
        self.free = [0.0] * k if k else None

    def start(self, t: float) -> float:
        return t if self.free is None else max(t, self.free[0])

    def hold(self, start: float, seconds: float) -> None:
        if self.free is not None:
            heapq.heapreplace(self.free, max(self.free[0], start) + seconds)


def cpu(cores: Cores, thread: Serial, t: float, seconds: float) -> float:
    """Run `seconds` of CPU on `thread`, holding a core: returns the end."""
    start = cores.start(max(t, thread.free))
    cores.hold(start, seconds)
    thread.free = start + seconds
    return thread.free


class Network:
    """Max-min fair sharing of every NIC direction among the transfers using it
    (what TCP flows converge to, loss aside): rates rise together until a link is
    full; the transfers through it keep that rate, and the rest rise on over what
    the links have left (progressive filling). Re-evaluated whenever a transfer
    starts or ends. A link thus never carries more than its rate, and a transfer
    held back elsewhere leaves its share to the others on its link. Transfers are
    asynchronous: `send` calls `then(t)` with the arrival time (end + link
    latency) from the engine's queue.

    The transfers are numpy arrays and the engine holds one event for the network
    (the next transfer to end): a change of the transfers re-rates them all at
    once, after every event of that instant (transfers of symmetric workers start
    and end together: one re-rate, not N). Re-rates happen on a grid of
    `Hardware.net_quantum_s` (a transfer starts at the next point of it; one that
    ends between two points arrives at its own end + latency, but its link share
    stays unused until the next point: pessimistic by at most one quantum per hop),
    so the work per step is bounded by the step's time over the quantum, not by
    transfers x re-rates: BytePS's 131,000 transfers of a step at 256 workers in
    about a minute.

    `log` (a list, when given) receives (src, dst, start, end, bytes) per segment of
    constant rate of every transfer, so `link_overload` can check the rule above."""

    def __init__(self, eng: Engine, nodes: int, hw: Hardware, costs: Costs, cores: Cores,
                 log: list | None = None):
        self.eng = eng
        self.link_rate, self.latency = hw.rate, hw.link_latency_s
        self.quantum = hw.net_quantum_s
        self.incast = hw.incast_fan_in
        self.cores, self.xfer_cpu_bw = cores, costs.xfer_cpu_bw
        self.bytes = 0
        self.log = log
        self.n_up = np.zeros(nodes, np.int64)     # transfers on each uplink
        self.n_down = np.zeros(nodes, np.int64)
        self.src = np.zeros(0, np.int64)          # per slot (a transfer while active)
        self.dst = np.zeros(0, np.int64)
        self.left = np.zeros(0)                   # bytes still to move, as of `since`
        self.rate = np.zeros(0)
        self.finish = np.zeros(0)                 # when it ends at its present rate
        self.active = np.zeros(0, bool)
        self.then: list = []
        self.free: list = []
        self.idx: np.ndarray | None = None        # the active slots (None: to recompute)
        self.since = 0.0
        self.version = 0                          # of the one pending end event
        self.settling = False

    def send(self, t: float, src: int, dst: int, nbytes: float, then: Callable) -> None:
        if src == dst:
            self.eng.at(t, then, t)
            return
        self.bytes += nbytes
        if self.xfer_cpu_bw:
            self.cores.hold(t, nbytes / self.xfer_cpu_bw)
        self.eng.at(self._grid(t), self._start, src, dst, nbytes, then)

    def _grid(self, t: float) -> float:
        """The first re-rate point at or after `t`."""
        if not self.quantum:
            return t
        return max(t, math.ceil(t / self.quantum - 1e-9) * self.quantum)

    def _slot(self) -> int:
        if not self.free:
            old = len(self.left)
            grow = max(64, old)
            self.src = np.concatenate([self.src, np.zeros(grow, np.int64)])
            self.dst = np.concatenate([self.dst, np.zeros(grow, np.int64)])
            self.left = np.concatenate([self.left, np.zeros(grow)])
            self.rate = np.concatenate([self.rate, np.zeros(grow)])
            self.finish = np.concatenate([self.finish, np.zeros(grow)])
            self.active = np.concatenate([self.active, np.zeros(grow, bool)])
            self.then.extend([None] * grow)
            self.free = list(range(old + grow - 1, old - 1, -1))
        return self.free.pop()

    def _start(self, src: int, dst: int, nbytes: float, then: Callable) -> None:
        self._advance()
        i = self._slot()
        self.src[i], self.dst[i], self.left[i], self.rate[i] = src, dst, nbytes, 0.0
        self.active[i], self.then[i], self.idx = True, then, None
        self.n_up[src] += 1
        self.n_down[dst] += 1
        self._touched()

    def _active(self) -> np.ndarray:
        if self.idx is None:
            self.idx = np.flatnonzero(self.active)
        return self.idx

    def _advance(self) -> None:
        """Every active transfer's bytes moved since `since`, at its rate since then."""
        now = self.eng.now
        dt = now - self.since
        self.since = now
        if dt <= 0:
            return
        idx = self._active()
        if not idx.size:
            return
        moved = np.minimum(self.left[idx], self.rate[idx] * dt)
        self.left[idx] -= moved
        if self.log is not None:
            for i, m in zip(idx.tolist(), moved.tolist()):
                if m > 0:
                    self.log.append((int(self.src[i]), int(self.dst[i]), now - dt, now, m))

    def _touched(self) -> None:
        """The transfers changed: re-rate once, after every event of this instant."""
        if not self.settling:
            self.settling = True
            self.eng.at(self.eng.now, self._settle)

    def _settle(self) -> None:
        self.settling = False
        self._advance()
        self.version += 1
        idx = self._active()
        if not idx.size:
            return
        rate = self._max_min(self.src[idx], self.dst[idx])
        self.rate[idx] = rate
        finish = self.eng.now + self.left[idx] / rate
        self.finish[idx] = finish
        self.eng.at(self._grid(float(np.min(finish))), self._end, self.version)

    def _max_min(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Max-min fair rates of transfers src[i] -> dst[i] (progressive filling):
        each round, the links whose remaining rate split over their unfixed
        transfers is the least fix those transfers at that share. Rounds: one per
        distinct bottleneck level (a few in symmetric steps)."""
        nodes = len(self.n_up)
        cap_up = np.full(nodes, self.link_rate)
        cap_down = np.full(nodes, self.link_rate)
        if self.incast:  # a downlink past the fan-in delivers fan-in/transfers of its rate
            cap_down *= np.minimum(1.0, self.incast / np.maximum(self.n_down, 1))
        rate = np.zeros(len(src))
        unfixed = np.ones(len(src), bool)
        while unfixed.any():
            at = np.flatnonzero(unfixed)
            s, d = src[at], dst[at]
            n_up = np.bincount(s, minlength=nodes)
            n_down = np.bincount(d, minlength=nodes)
            share_up = np.full(nodes, np.inf)
            share_down = np.full(nodes, np.inf)
            np.divide(cap_up, n_up, out=share_up, where=n_up > 0)
            np.divide(cap_down, n_down, out=share_down, where=n_down > 0)
            level = min(float(share_up.min()), float(share_down.min()))
            tight = level * (1 + 1e-9)
            fixed = at[(share_up[s] <= tight) | (share_down[d] <= tight)]
            rate[fixed] = level
            unfixed[fixed] = False
            cap_up -= np.bincount(src[fixed], minlength=nodes) * level
            cap_down -= np.bincount(dst[fixed], minlength=nodes) * level
            np.maximum(cap_up, 0.0, out=cap_up)
            np.maximum(cap_down, 0.0, out=cap_down)
        return rate

    def _end(self, version: int) -> None:
        if version != self.version:
            return  # the transfers changed since: a later re-rate scheduled its own
        self._advance()
        idx = self._active()
        # (ends within a picosecond, or closer than `now` can resolve: this instant)
        now = self.eng.now
        done = idx[self.left[idx] <= self.rate[idx] * (1e-12 + 4 * np.spacing(now))]
        for i in done.tolist():
            self.active[i] = False
            self.n_up[self.src[i]] -= 1
            self.n_down[self.dst[i]] -= 1
            arrive = max(now, float(self.finish[i]) + self.latency)
            self.eng.at(arrive, self.then[i], arrive)
            self.then[i] = None
            self.free.append(i)
        self.idx = None
        self._touched()


def link_overload(log: list, rate: float) -> float:
    """The most any NIC direction carried beyond `rate` (bytes/s) at any moment, in
    bytes/s, over the segments of `log` (Network.log: a segment
    moves its bytes evenly over [start, end] on its source's uplink and its
    destination's downlink): 0.0 when no link ever carried more than its rate."""
    links: dict = {}
    for src, dst, start, end, nbytes in log:
        if end <= start:
            continue
        for link in (("up", src), ("down", dst)):
            links.setdefault(link, []).extend(((start, nbytes / (end - start)),
                                               (end, -nbytes / (end - start))))
    worst = 0.0
    for changes in links.values():
        changes.sort(key=lambda c: (c[0], c[1]))  # at one instant, ends before starts
        load = 0.0
        for _, delta in changes:
            load += delta
            worst = max(worst, load - rate)
    return worst


# ---------------------------------------------------------------------------
# dsgd
# ---------------------------------------------------------------------------

def dsgd_layout(w: Workload, workers: int, shard_bytes: int, num_ps: int | None,
                compression: str | None, overlap: bool, tail_pieces: int = 0,
                link_bw: float = 0.0, deadline_min_bytes: int = 0):
    """dsgd's own plan: (groups as [(wire bytes, ps, ready_s, float32 bytes)],
    number of PS). Buckets when `overlap`, else one group per PS.

    `tail_pieces` > 1 (a what-if, not what dsgd does): every bucket whose fan-in
    to its PS (workers x its bytes at `link_bw`) would end after the backward
    pass is cut into that many equal pieces on distinct PS actors, each piece a
    group of its own (its own object and call): the tail's bytes spread over
    many PS nodes' links instead of one's.

    `deadline_min_bytes` > 0 (a what-if: the engine does not measure the profile
    yet): buckets closed by deadline (`bucket_layout` with a `ReadyProfile` of this
    workload's ready times at `link_bw`), none under that many bytes."""
    from dsgd import constants
    from dsgd.comm.sharding import ReadyProfile, bucket_layout, exchange_layout, spread_plan

    # One worker per node: on several, the engine's spread plan (launch.start).
    spread = (num_ps or workers) if workers > 1 else 1
    plan = spread_plan(list(w.shapes), ["float32"] * len(w.shapes), int(shard_bytes), spread,
                       compression=compression)
    asked = num_ps or max(1, min(plan.num_shards, workers))  # param_server.default_num_ps
    layout = exchange_layout(plan, asked)
    if overlap and deadline_min_bytes > 0:
        ready = tuple(max(w.ready_s[p.var_index] for p in shard.pieces) for shard in plan.shards)
        profile = ReadyProfile(ready, w.compute_s, link_bw, workers)
        layout = bucket_layout(layout, deadline_min_bytes, profile)
    elif overlap:
        layout = bucket_layout(layout, constants.BUCKET_MIN_BYTES)
    groups = []
    for g, ps in zip(layout.groups, layout.ps_of_group):
        wire = sum(plan.shards[j].nbytes for j in g)
        f32 = sum(4 * p.length for j in g for p in plan.shards[j].pieces)
        ready = max(w.ready_s[p.var_index] for j in g for p in plan.shards[j].pieces)
        groups.append((wire, ps, ready, f32))
    if tail_pieces > 1 and overlap and link_bw > 0:
        pieces = min(tail_pieces, asked)
        cut = []
        for wire, ps, ready, f32 in groups:
            if pieces > 1 and ready + workers * wire / link_bw > w.compute_s:
                cut += [(wire / pieces, (ps + i * asked // pieces) % asked, ready, f32 / pieces)
                        for i in range(pieces)]
            else:
                cut.append((wire, ps, ready, f32))
        groups = cut
    return groups, asked


# two_level (what-if, not built): below this many workers it is one level (N <= 4:
# at most two groups of two, the root's fan-in falls by two and every part gains a hop).
TWO_LEVEL_MIN_WORKERS = 5


@dataclasses.dataclass(frozen=True)
class TwoLevel:
    """Two-level aggregation's plan (a what-if, not built): per bucket, where each
    worker's part goes. The N workers are cut into ceil(sqrt(N)) groups of consecutive
    nodes; each group of two or more sends to a sub-aggregator, a PS actor on one of
    its nodes (not the bucket's root, nor on the root's node where the group has
    another; rotated over the group's PS by bucket, so different buckets' sub-
    aggregators land on different nodes); a group of one, or one with no PS actor
    but the root, sends straight to the root, as one level does."""

    sub_of: tuple   # [bucket][worker]: the PS its part goes to (sub-aggregator or root)
    members: tuple  # [bucket]: {sub-aggregator PS: (its workers)}
    direct: tuple   # [bucket]: the workers sending straight to the root

    def fan_in(self, b: int) -> int:
        """Inputs the bucket's root sums: one partial per sub-aggregator, plus the direct parts."""
        return len(self.members[b]) + len(self.direct[b])


def two_level_plan(groups, ps_node: list[int], n: int) -> TwoLevel:
    """The `TwoLevel` plan of `n` workers (one per node) for the simulator's buckets
    `groups` (tuples whose second item is the bucket's root PS), with PS actor j on
    node `ps_node[j]`."""
    count = math.ceil(math.sqrt(n))
    size, extra = divmod(n, count)
    node_groups, first = [], 0
    for i in range(count):  # consecutive nodes, the first `extra` groups one larger
        m = size + (1 if i < extra else 0)
        node_groups.append(range(first, first + m))
        first += m
    ps_on: dict = {}
    for ps, node in enumerate(ps_node):
        ps_on.setdefault(node, []).append(ps)
    sub_of, members, direct = [], [], []
    for b, (_, root, _, _) in enumerate(groups):
        to, subs, straight = [root] * n, {}, []
        for i, nodes in enumerate(node_groups):
            cands = [p for v in nodes for p in ps_on.get(v, ()) if p != root]
            apart = [p for p in cands if ps_node[p] != ps_node[root]]
            cands = apart or cands
            if len(nodes) < 2 or not cands:
                straight.extend(nodes)
                continue
            sub = cands[(b + i) % len(cands)]
            subs[sub] = tuple(nodes)
            for u in nodes:
                to[u] = sub
        sub_of.append(tuple(to))
        members.append(subs)
        direct.append(tuple(straight))
    return TwoLevel(tuple(sub_of), tuple(members), tuple(direct))


def simulate_dsgd(w: Workload, hw: Hardware, k: Costs, workers: int, *,
                  shard_bytes: int = 10_000_000, num_ps: int | None = None,
                  compression: str | None = None, overlap: bool = True,
                  prefetch: bool = False, steps: int = 5, tail_pieces: int = 0,
                  deadline_min_bytes: int = 0, metas_with_last: bool = False,
                  two_level: bool = False, link_log: list | None = None) -> dict:
    n = workers
    groups, asked = dsgd_layout(w, n, shard_bytes, num_ps, compression, overlap,
                                tail_pieces, hw.link_bw, deadline_min_bytes)
    if two_level and not overlap:
        raise ValueError("two_level is a what-if of the overlapped exchange (overlap=True)")
    if n == 1:  # no exchange: the worker applies its own gradient
        return _single(w, hw, k, steps, groups)
    eng = Engine()
    cores = Cores(hw.host_cores)
    net = Network(eng, n, hw, k, cores, link_log)
    ps_node = [j % n for j in range(asked)]
    # two_level (what-if, not built): each part goes to its group's sub-aggregator,
    # which sums the group's parts and sends one partial to the bucket's root PS; the
    # root's mean goes back the same way (TwoLevel). None: one level, as built.
    tree = two_level_plan(groups, ps_node, n) if two_level and n >= TWO_LEVEL_MIN_WORKERS \
        else None
    sender = [Serial() for _ in range(n)]     # the worker's sending thread (GIL)
    main = [Serial() for _ in range(n)]       # the worker's step thread
    d2h = [Serial() for _ in range(n)]
    h2d = [Serial() for _ in range(n)]
    ps_gil = [Serial() for _ in range(asked)]
    object_manager = [Serial() for _ in range(n)]   # per node: serves pulls
    total_wire = sum(g[0] for g in groups)
    nb = len(groups)
    # metas_with_last (what-if, not built): each worker's meta rides with its last-ready
    # bucket's part, whose PS answers the means with every meta: no gather on PS 0.
    last = max(range(nb), key=lambda b: groups[b][2])
    state: dict = {}
    ends: dict = {}
    marks: dict = {}

    def hop(a: int, b: int) -> float:
        return k.rpc_s + (hw.link_latency_s if a != b else 0.0)

    def to_ps(b: int, u: int) -> int:
        """The PS actor worker u sends bucket b's part to, and whose node's store
        it pulls b's mean from: the bucket's PS (its root), or u's sub-aggregator."""
        return tree.sub_of[b][u] if tree else groups[b][1]

    def mean_node(b: int, u: int) -> int:
        return ps_node[to_ps(b, u)]

    def count(s: int, what: str, b: int) -> None:
        """One more transfer into (root_in) or out of (root_out) bucket b's root's node."""
        c = state[s].setdefault(what, [0] * nb)
        c[b] += 1

    def local_allreduce_s(nbytes: float) -> float:  # the D devices' mean (NVLink)
        d = hw.devices
        return 2 * (d - 1) / d * nbytes / hw.nvlink_bw if d > 1 else 0.0

    def start_step(s: int, u: int, t0: float) -> None:
        st = state.setdefault(s, {"arrived": [0] * nb, "replies": [[math.inf] * nb for _ in range(n)],
                                  "metas": 0, "meta_t": 0.0, "start": {}})
        st["start"][u] = t0
        compute_end = t0 + w.compute_s + local_allreduce_s(w.grad_bytes)
        if w.cpu_compute_s:
            t = cpu(cores, main[u], t0, w.cpu_compute_s)
            compute_end = max(compute_end, t)
        if overlap:
            for b, (wire, ps, ready, f32) in enumerate(groups):
                t = t0 + ready + local_allreduce_s(f32)
                if metas_with_last and b == last:  # it carries the meta: made at the end
                    t = max(t, compute_end)
                eng.at(t, send_bucket, s, u, b)
            eng.at(compute_end, backward_end, s, u)
        else:
            eng.at(compute_end, send_all, s, u)

    def put_and_call(u: int, t: float, wire: float) -> float:
        return cpu(cores, sender[u], t, k.put_s + wire / k.put_bw + k.call_s)

    def send_bucket(s: int, u: int, b: int) -> None:
        wire = groups[b][0]
        t = eng.now
        if hw.gpu:
            t = d2h[u].take(t, wire / hw.pcie_bw)
        t = put_and_call(u, t, wire)
        eng.at(t + hop(u, mean_node(b, u)), arrive, s, u, b)

    def send_all(s: int, u: int) -> None:
        t = eng.now
        for b, (wire, ps, _, _) in enumerate(groups):
            if hw.gpu:
                t = d2h[u].take(t, wire / hw.pcie_bw)
            t = put_and_call(u, t, wire)
            eng.at(t + hop(u, ps_node[ps]), arrive, s, u, b)
        main[u].free = max(main[u].free, t)
        state[s].setdefault("sent", {})[u] = t

    def arrive(s: int, u: int, b: int) -> None:
        wire, ps = groups[b][0], to_ps(b, u)
        node = ps_node[ps]
        to_root = ps == groups[b][1]
        if node == u:
            if to_root:
                handled(s, b)
            else:
                sub_handled(s, b, ps)
        elif to_root:  # Ray resolves the argument (pulls the part) before the call runs
            count(s, "root_in", b)
            serve(u, node, wire, lambda t: eng.at(t, handled, s, b))
        else:
            serve(u, node, wire, lambda t: eng.at(t, sub_handled, s, b, ps))

    def sum_and_put(ps: int, t: float, wire: float, parts: int, remote: int) -> float:
        """A PS sums `parts` parts (`remote` of them pulled from other nodes: their
        pages read fresh) and puts the result: when it is in its node's store."""
        fresh = remote * wire / k.fresh_bw if k.fresh_bw else 0.0
        return cpu(cores, ps_gil[ps], t,
                   parts * wire / k.sum_bw + fresh + wire / k.mem_bw + k.put_s)

    def handled(s: int, b: int) -> None:
        wire, ps, _, _ = groups[b]
        node = ps_node[ps]
        st = state[s]
        t = cpu(cores, ps_gil[ps], eng.now, k.call_s + k.wake_s)
        st["arrived"][b] += 1
        fan_in = tree.fan_in(b) if tree else n
        if st["arrived"][b] < fan_in:
            return
        if tree:  # the sub-aggregators' partials, the direct parts off the root's node
            remote = sum(1 for p in tree.members[b] if ps_node[p] != node) + sum(
                1 for u in tree.direct[b] if u != node)
        else:
            remote = n - 1
        done = sum_and_put(ps, t, wire, fan_in, remote)
        if overlap and metas_with_last and b == last:
            mark(s, 0, "metas_gathered", done)
        if not tree:
            answer(s, b, range(n), done, node)
            return
        answer(s, b, tree.direct[b], done, node)
        for sub in tree.members[b]:  # each sub-aggregator's call returns; it pulls the mean
            eng.at(done + hop(node, ps_node[sub]), sub_pulls, s, b, sub)

    def answer(s: int, b: int, users, done: float, node: int) -> None:
        """Bucket b's mean is in `node`'s store at `done`: the calls of `users` (the
        workers whose parts went to that node's PS) return."""
        st = state[s]
        for u in users:
            st["replies"][u][b] = done + hop(node, u)
        if not overlap:  # metas ride with the means: the answers are the decision
            if all(a == n for a in st["arrived"]):
                for u in users:
                    eng.at(max(st["replies"][u]), read_all, s, u)
        elif prefetch:
            for u in users:
                eng.at(st["replies"][u][b], prefetch_one, s, u, b)
        if overlap and metas_with_last and b == last:
            for u in users:
                eng.at(st["replies"][u][b], decided, s, u)
        for u in users:
            if (u, b) in st.get("waiters", ()):
                st["waiters"].discard((u, b))
                eng.at(st["replies"][u][b], advance, s, u)

    def sub_handled(s: int, b: int, sub: int) -> None:
        """A sub-aggregator handles one of its group's calls (the root's per-call
        cost); the last sums the group's parts, puts the partial sum and calls the
        root with it (a caller's c_call)."""
        wire, root = groups[b][0], groups[b][1]
        st = state[s]
        t = cpu(cores, ps_gil[sub], eng.now, k.call_s + k.wake_s)
        got = st.setdefault("sub_arrived", {})
        got[b, sub] = got.get((b, sub), 0) + 1
        members = tree.members[b][sub]
        if got[b, sub] < len(members):
            return
        node = ps_node[sub]
        t = sum_and_put(sub, t, wire, len(members), sum(1 for u in members if u != node))
        t = cpu(cores, ps_gil[sub], t, k.call_s)
        eng.at(t + hop(node, ps_node[root]), partial_arrives, s, b, sub)

    def partial_arrives(s: int, b: int, sub: int) -> None:
        wire, root = groups[b][0], groups[b][1]
        if ps_node[sub] == ps_node[root]:
            handled(s, b)
        else:  # the root's node pulls the partial before the call runs
            count(s, "root_in", b)
            serve(ps_node[sub], ps_node[root], wire, lambda t: eng.at(t, handled, s, b))

    def sub_pulls(s: int, b: int, sub: int) -> None:
        """A sub-aggregator's call to the root has returned: it pulls the mean once."""
        wire, root = groups[b][0], groups[b][1]
        if ps_node[sub] == ps_node[root]:
            sub_serves(s, b, sub, remote=False)
        else:
            count(s, "root_out", b)
            serve(ps_node[root], ps_node[sub], wire,
                  lambda t: eng.at(t, sub_serves, s, b, sub, True))

    def sub_serves(s: int, b: int, sub: int, remote: bool) -> None:
        """The mean is on the sub-aggregator's node: it puts it in its own store (one
        put, the root's result-put cost, its pulled pages read fresh) and answers its
        group's calls, whose workers pull it from there."""
        wire = groups[b][0]
        fresh = wire / k.fresh_bw if remote and k.fresh_bw else 0.0
        t = cpu(cores, ps_gil[sub], eng.now, fresh + wire / k.mem_bw + k.put_s)
        answer(s, b, tree.members[b][sub], t, ps_node[sub])

    def pull(s: int, u: int, b: int) -> None:
        """Worker u starts pulling bucket b's mean now (once): it is in u's store
        (`pulled_by`) at the time `pulled` records; inf until then."""
        have = pulled_by(state[s], u)
        if b in have:
            return
        have[b] = math.inf
        wire, node = groups[b][0], mean_node(b, u)
        if node == u:
            pulled(s, u, b)
        else:
            if to_ps(b, u) == groups[b][1]:
                count(s, "root_out", b)
            serve(node, u, wire, lambda t: eng.at(t, pulled, s, u, b))

    def serve(src: int, dst: int, wire: float, then: Callable) -> None:
        """Node `dst` pulls an object of `wire` bytes from node `src`: `pull_serve_s`
        of work on src's object manager (one request at a time), the transfer, then
        the rest of `pull_s` at the requester; then(t)."""
        t = cpu(cores, object_manager[src], eng.now, k.pull_serve_s) \
            if k.pull_serve_s else eng.now
        rest = max(0.0, k.pull_s - k.pull_serve_s)
        net.send(t, src, dst, wire, lambda t: then(t + rest))

    def pulled(s: int, u: int, b: int) -> None:
        st = state[s]
        pulled_by(st, u)[b] = eng.now
        waiting = st.setdefault("pull_waiters", {}).get(u, [])
        st["pull_waiters"][u] = []
        for need, then in waiting:
            when_pulled(s, u, need, then)

    def when_pulled(s: int, u: int, need, then: Callable) -> None:
        """then() once every bucket of `need` is in worker u's store (now if they are)."""
        have = pulled_by(state[s], u)
        if all(have.get(b, math.inf) <= eng.now for b in need):
            eng.at(eng.now, then)
        else:
            state[s].setdefault("pull_waiters", {}).setdefault(u, []).append((tuple(need), then))

    def prefetch_one(s: int, u: int, b: int) -> None:
        pull(s, u, b)

    def read_all(s: int, u: int) -> None:  # after the backward pass: every mean at once
        if main[u].free > eng.now:
            eng.at(main[u].free, read_all, s, u)
            return
        for b in range(nb):
            pull(s, u, b)
        when_pulled(s, u, range(nb), lambda: apply_stage(s, u, tuple(range(nb)), None))

    def mark(s: int, u: int, what: str, t: float) -> None:
        if u == 0:
            marks.setdefault(s, {})[what] = t - state[s]["start"][0]

    def backward_end(s: int, u: int) -> None:
        mark(s, u, "backward_end", eng.now)
        t = max(eng.now, sender[u].free)  # the last bucket's op has returned
        mark(s, u, "last_bucket_sent", t)
        if metas_with_last:  # (the meta left with the last bucket)
            mark(s, u, "meta_sent", t)
        else:
            t = cpu(cores, sender[u], t, k.call_s)  # the gather call to PS 0
            mark(s, u, "meta_sent", t)
            eng.at(t + hop(u, ps_node[0]), meta_arrives, s)
        # collect(): the means whose answers are in, pulled in parallel, waited for.
        eng.at(t, collect, s, u, "metas")

    def meta_arrives(s: int) -> None:
        st = state[s]
        t = cpu(cores, ps_gil[0], eng.now, k.call_s)
        st["metas"] += 1
        st["meta_t"] = max(st["meta_t"], t)
        if st["metas"] == n:
            mark(s, 0, "metas_gathered", st["meta_t"])
            for u in range(n):
                eng.at(st["meta_t"] + hop(ps_node[0], u), decided, s, u)

    def pulled_by(st, u: int) -> dict:
        """Worker u's means pulled or being pulled: bucket -> when in its store (inf: not yet)."""
        return st.setdefault("pulled", {}).setdefault(u, {})

    def collect(s: int, u: int, when: str) -> None:
        st = state[s]
        have = pulled_by(st, u)
        # (only the means already on u's node: StepExchange.collect pulls nothing)
        new = [b for b in range(nb) if b not in have and st["replies"][u][b] <= eng.now
               and mean_node(b, u) == u]
        for b in new:
            pull(s, u, b)
        if when == "metas":
            when_pulled(s, u, new, lambda: collected(s, u))
        else:  # the decision: collect again, then split
            when_pulled(s, u, new, lambda: split(s, u))

    def collected(s: int, u: int) -> None:
        st = state[s]
        st.setdefault("collected", set()).add(u)
        if u in st.get("decided", ()):
            collect(s, u, "decision")

    def decided(s: int, u: int) -> None:
        st = state[s]
        mark(s, u, "decided", eng.now)
        st.setdefault("decided", set()).add(u)
        if u in st.get("collected", ()):  # else collected() goes on
            collect(s, u, "decision")

    def split(s: int, u: int) -> None:
        st = state[s]
        mark(s, u, "first_apply_begins", eng.now)
        have = pulled_by(st, u)
        ready = 0
        while ready < nb and ready in have and have[ready] <= eng.now:
            ready += 1
        pending = sum(g[0] for g in groups[ready:]) / total_wire
        if ready == 0 or pending < k.split_min_pending:
            stages = [tuple(range(nb))]
        else:
            stages = [tuple(range(ready)), tuple(range(ready, nb))]
        run_stages(s, u, stages, eng.now)

    def run_stages(s: int, u: int, stages, t: float) -> None:
        state[s].setdefault("plan", {})[u] = {"stages": stages, "si": 0, "bi": 0, "read": False,
                                              "next": t}
        advance(s, u)

    def later(s: int, u: int, t: float) -> None:
        state[s]["plan"][u]["next"] = t
        eng.at(t, advance, s, u)

    def advance(s: int, u: int) -> None:
        """Worker u's reads and applies, stage by stage: every mean of the stage
        pulled at once when all its answers are in (StepExchange.read), then the
        stage's update; each step waits for what it needs."""
        st = state[s]
        p, have, now = st["plan"][u], pulled_by(st, u), eng.now
        if now < p["next"]:
            return  # (a wake-up for a wait already over)
        while p["si"] < len(p["stages"]):
            stage = p["stages"][p["si"]]
            if not p["read"]:
                missing = [b for b in stage if b not in have]
                unknown = [b for b in missing if st["replies"][u][b] == math.inf]
                if unknown:  # still being summed: handled() wakes us
                    for b in unknown:
                        st.setdefault("waiters", set()).add((u, b))
                    p["next"] = now
                    return
                last = max([st["replies"][u][b] for b in missing], default=now)
                if last > now:
                    later(s, u, last)
                    return
                for b in missing:
                    pull(s, u, b)
                p["read"] = True
            if any(have[b] > now for b in stage):
                p["next"] = now
                when_pulled(s, u, stage, lambda: advance(s, u))
                return
            p["si"], p["read"] = p["si"] + 1, False
            later(s, u, apply_time(u, stage, now))
            return
        step_end(s, u)

    def apply_time(u: int, stage, t: float) -> float:
        f32 = sum(groups[b][3] for b in stage)
        wire = sum(groups[b][0] for b in stage)
        remote = sum(groups[b][0] for b in stage if mean_node(b, u) != u)
        seconds = k.apply_s + (remote / k.fresh_bw if k.fresh_bw else 0.0)
        if hw.gpu:
            t = cpu(cores, main[u], t, seconds)
            t = h2d[u].take(t, wire / hw.pcie_bw)
            return t + w.update_bytes_factor * f32 / hw.hbm_bw
        return cpu(cores, main[u], t, seconds + (f32 / k.apply_bw if k.apply_bw else 0.0))

    def apply_stage(s: int, u: int, stage, _) -> None:
        t = apply_time(u, stage, eng.now)
        eng.at(t, step_end, s, u)

    def step_end(s: int, u: int) -> None:
        mark(s, u, "applied", eng.now)
        t = cpu(cores, main[u], eng.now, k.loop_s) if k.loop_s else eng.now
        ends.setdefault(s, {})[u] = t
        if s + 1 < steps:
            eng.at(t, start_step, s + 1, u, t)

    for u in range(n):
        eng.at(0.0, start_step, 0, u, 0.0)
    eng.run()
    last_step = state[steps - 1]
    return _result(ends, state, steps, n, groups=len(groups), num_ps=asked,
                   busy_ps=len({g[1] for g in groups}), net_bytes=net.bytes,
                   worker0_s=marks.get(steps - 1, {}), two_level=tree is not None,
                   # per bucket, in the last step: the calls its root PS handled, the
                   # transfers into and out of the root's node for it
                   root_calls=list(last_step["arrived"]),
                   root_in=last_step.get("root_in", [0] * nb),
                   root_out=last_step.get("root_out", [0] * nb))


def _single(w: Workload, hw: Hardware, k: Costs, steps: int, groups) -> dict:
    """One worker: compute, then its own update (no exchange)."""
    f32 = sum(g[3] for g in groups)
    if hw.gpu:
        apply = w.update_bytes_factor * f32 / hw.hbm_bw
    else:
        apply = k.apply_s + (f32 / k.apply_bw if k.apply_bw else 0.0)
    step = max(w.compute_s, w.cpu_compute_s) + apply + k.loop_s
    return {"step_s": step, "steps": [step] * steps, "groups": len(groups), "num_ps": 0,
            "busy_ps": 0}


def _result(ends: dict, state: dict, steps: int, n: int, **extra) -> dict:
    """`step_s`: the synchronous job's period, the time between the last worker's
    ends of step 1 and of the last step, per step (every worker waits for the
    slowest each step, so its ends set the pace; step 0 is the warm-up). A median
    over workers would flatter a step whose workers finish staggered: the early
    ones start their next step early and then wait."""
    last = steps - 1
    per_worker = [ends[last][u] - (ends[last - 1][u] if last else 0.0) for u in range(n)]
    first = 1 if last >= 2 else 0
    begun = max(ends[first - 1].values()) if first else 0.0
    period = (max(ends[last].values()) - begun) / (last - first + 1)
    return {"step_s": period, "slowest_step_s": max(per_worker),
            "steps": [statistics.median(ends[s][u] - (ends[s - 1][u] if s else 0.0)
                                        for u in range(n)) for s in range(steps)], **extra}


# ---------------------------------------------------------------------------
# Ring allreduce (Horovod) and BytePS-style PS
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RingParams:
    """Horovod's defaults since v0.21 (its CHANGELOG; the tensor-fusion doc still says
    64 MB): HOROVOD_FUSION_THRESHOLD 128 MiB, HOROVOD_CYCLE_TIME 1 ms."""

    fusion_bytes: int = 128 * 2**20
    cycle_s: float = 1e-3
    hop_s: float = 10e-6  # per ring step: NCCL's message latency beyond the link's (assumed)


def simulate_ring(w: Workload, hw: Hardware, workers: int, *, compression: str | None = None,
                  params: RingParams = RingParams(), steps: int = 3) -> dict:
    """Every rank identical: one timeline. Returns as simulate_dsgd."""
    n, d = workers * hw.devices, hw.devices
    wire_factor = 0.5 if compression else 1.0
    sizes, ready = w.sizes, w.ready_s
    order = sorted(range(len(sizes)), key=lambda v: ready[v])
    if n == 1:
        step = w.compute_s + w.update_bytes_factor * w.grad_bytes / hw.hbm_bw
        return {"step_s": step, "steps": [step] * steps, "buffers": 0}
    # Horovod's background thread: at its next cycle tick after the previous
    # allreduce is done, it fuses every gradient ready by then (up to the fusion
    # threshold) into one buffer. (Fusing while the ring is busy, never two small
    # allreduces back to back: a favourable reading of Horovod's cycles.)
    nic_free, t_done, i, buffers = 0.0, 0.0, 0, 0
    per_step_latency = hw.link_latency_s + params.hop_s
    while i < len(order):
        tick = max(nic_free, ready[order[i]])
        tick = math.ceil(tick / params.cycle_s - 1e-9) * params.cycle_s
        nbytes = 0
        while i < len(order) and ready[order[i]] <= tick and \
                (nbytes == 0 or nbytes + sizes[order[i]] * wire_factor <= params.fusion_bytes):
            nbytes += sizes[order[i]] * wire_factor
            i += 1
        # negotiation (response cache: one bit-vector allreduce of the ready set)
        negotiate = 2 * math.ceil(math.log2(n)) * per_step_latency
        # Flat ring over n = N·D ranks: 2(n-1) steps of S/n bytes, each NIC carrying its
        # node's inter-node edge; or, with D > 1, Horovod's hierarchical allreduce: an
        # NVLink reduce-scatter in the node, a ring over the N nodes (each of the D
        # ranks on its 1/D slice, sharing the NIC), an NVLink all-gather
        # (HOROVOD_HIERARCHICAL_ALLREDUCE, off by default). The faster: favourable.
        flat = 2 * (n - 1) * (nbytes / n / hw.rate + per_step_latency)
        nodes = workers
        hier = (2 * (d - 1) / d * nbytes / hw.nvlink_bw
                + 2 * (nodes - 1) * (nbytes / nodes / hw.rate + per_step_latency)) if d > 1 \
            else flat
        nic_free = tick + negotiate + min(flat, hier)
        t_done = nic_free
        buffers += 1
    step = max(t_done, w.compute_s) + w.update_bytes_factor * w.grad_bytes / hw.hbm_bw
    return {"step_s": step, "steps": [step] * steps, "buffers": buffers}


@dataclasses.dataclass(frozen=True)
class BytePSParams:
    """BytePS's defaults (docs/env.md of BytePS 0.2): BYTEPS_PARTITION_BYTES 4,096,000;
    one server per node (colocated, as in its paper's best setup)."""

    partition_bytes: int = 4_096_000
    msg_s: float = 20e-6   # ps-lite per message CPU (assumed)
    sum_bw: float = 10e9   # server summation, bytes/s of input (assumed: one core's memory bw)


def simulate_byteps(w: Workload, hw: Hardware, workers: int, *,
                    compression: str | None = None, params: BytePSParams = BytePSParams(),
                    steps: int = 3, link_log: list | None = None) -> dict:
    n, d = workers, hw.devices
    wire_factor = 0.5 if compression else 1.0
    if n == 1:
        step = w.compute_s + w.update_bytes_factor * w.grad_bytes / hw.hbm_bw
        return {"step_s": step, "steps": [step] * steps, "partitions": 0}
    # partitions in gradient-ready order
    parts = []
    for v in sorted(range(len(w.sizes)), key=lambda v: w.ready_s[v]):
        size = w.sizes[v] * wire_factor
        while size > 0:
            p = min(size, params.partition_bytes)
            parts.append((p, w.ready_s[v]))
            size -= p
    eng = Engine()
    net = Network(eng, n, hw, Costs(0, 1, 0, 0, 0, 1, 1), Cores(None), link_log)
    local = (lambda b: (d - 1) / d * b / hw.nvlink_bw) if d > 1 else (lambda b: 0.0)
    server_cpu = [Serial() for _ in range(n)]
    worker_cpu = [Serial() for _ in range(n)]
    d2h = [Serial() for _ in range(n)]
    h2d = [Serial() for _ in range(n)]
    arrived = [0] * len(parts)
    done_at = [0.0] * len(parts)
    back = [[0.0] * len(parts) for _ in range(n)]

    def push(u: int, i: int) -> None:
        size, _ = parts[i]
        t = eng.now + local(size)              # NCCL reduce to the root GPU
        t = d2h[u].take(t, size / hw.pcie_bw)
        t = worker_cpu[u].take(t, params.msg_s)
        server = i % n
        net.send(t, u, server, size, lambda _: summed(u, i))

    def summed(u: int, i: int) -> None:
        size, _ = parts[i]
        server = i % n
        t = server_cpu[server].take(eng.now, params.msg_s + size / params.sum_bw)
        arrived[i] += 1
        done_at[i] = max(done_at[i], t)
        if arrived[i] == n:
            for v in range(n):
                t2 = server_cpu[server].take(done_at[i], params.msg_s)
                net.send(t2, server, v, size, lambda _, v=v: pulled(v, i))

    def pulled(u: int, i: int) -> None:
        size, _ = parts[i]
        t = h2d[u].take(eng.now, size / hw.pcie_bw) + local(size)  # copy + NCCL broadcast
        back[u][i] = t

    for u in range(n):
        for i, (_, ready) in enumerate(parts):
            eng.at(ready, push, u, i)
    eng.run()
    last = max(max(b) for b in back)
    step = max(last, w.compute_s) + w.update_bytes_factor * w.grad_bytes / hw.hbm_bw
    return {"step_s": step, "steps": [step] * steps, "partitions": len(parts)}


def simulate(algorithm: str, w: Workload, hw: Hardware, costs: Costs | None, workers: int,
             **options) -> dict:
    """`algorithm`: "dsgd", "ring" or "byteps"."""
    if algorithm == "dsgd":
        return simulate_dsgd(w, hw, costs, workers, **options)
    if algorithm == "ring":
        return simulate_ring(w, hw, workers, **options)
    if algorithm == "byteps":
        return simulate_byteps(w, hw, workers, **options)
    raise ValueError(f"algorithm must be 'dsgd', 'ring' or 'byteps', got {algorithm!r}")


def backward_profile(flops: Sequence[float], forward_s: float, backward_s: float) -> list[float]:
    """Per variable, when its gradient exists: the backward pass runs the variables
    in reverse model order, each taking a share of `backward_s` proportional to its
    `flops`; it starts after `forward_s`."""
    total = sum(flops) or 1.0
    ready, t = [0.0] * len(flops), forward_s
    for v in reversed(range(len(flops))):
        t += backward_s * flops[v] / total
        ready[v] = t
    return ready
