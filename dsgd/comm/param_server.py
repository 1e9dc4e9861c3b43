"""The parameter-server actor and where it runs.

A PS averages the gradient shards of the groups it owns (one group per PS:
dsgd/comm/sharding.py `exchange_layout`) over every worker. It holds no model
state, so any PS can serve any group and a dead one can simply be replaced.
Both front-ends start this one class, placed by `ps_options`/`ps_nodes`:

- the engine's driver calls `mean` once every worker has written the group
  (one call at a time in the actor's default concurrency group, so `mean`
  reuses its output buffers);
- in the Ray Train backend (dsgd/train), and in a Trainer's custom epochs
  (dsgd/trainer/custom.py), there is no driver in the step: each worker calls
  `reduce` (or `broadcast`) itself, and the call blocks until all `world`
  workers' parts of that exchange have arrived. Those methods run in the
  RENDEZVOUS concurrency group, with more threads than calls that can wait at
  once (`rendezvous_concurrency`), so waiting calls do not block each other
  (nor `mean`).
"""

from __future__ import annotations

import threading

import numpy as np
import ray

from dsgd import constants
from dsgd.comm import store, timeline
from dsgd.comm.means import mean_shard, split_group
from dsgd.comm.reports import Ping
from dsgd.comm.sharding import Shard
from dsgd.errors import ExchangeAbandoned


RENDEZVOUS = "rendezvous"  # the concurrency group of the workers' own exchanges
# Exchange numbers: the attempt (a step retried after a failure is a new attempt) in the
# bits above this one, the step below (dsgd/comm/ps_client.py `sequence_number`).
ATTEMPT_SHIFT = 32


def rendezvous_concurrency(world: int) -> int:
    """`max_concurrency` of a PS serving `world` workers: each worker has at most
    `constants.MAX_BUCKETS_PER_PS` calls of a step waiting on it (the overlapped
    exchange sends every bucket without waiting; one group otherwise) plus its
    metas (PS 0), plus the next exchange's calls of workers that already left,
    plus the driver's probes (missing_ranks, waiting, abandon)."""
    from dsgd import constants

    return max(16, (constants.MAX_BUCKETS_PER_PS + 2) * world + 8)


class ParameterServer:
    def __init__(self, ps_index: int, warm_store_bytes: int = 0,
                 rendezvous_timeout_s: float = constants.DEFAULT_STEP_TIMEOUT_S):
        self.ps_index = ps_index
        self.warmed_store_bytes = store.warm(warm_store_bytes)
        # Scratch output buffers, reused step after step so that summing never
        # touches fresh pages (first touch costs more than the sum on a VM).
        # Ray copies the returned array into the store before the next call.
        self._scratch: dict = {}
        self._scratch_lock = threading.Lock()
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self._arrivals = threading.Condition()
        self._pending: dict = {}  # (kind, seq) -> _Rendezvous
        self._gone: list = []  # (ranks, below): workers that died (backup workers, `gone`)
        self._attempt = 0  # the newest attempt seen (seq >> ATTEMPT_SHIFT)

    def ready(self) -> dict:
        """Where this PS runs: node_id, pid."""
        import os

        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def warm_store(self, max_bytes: int) -> int:
        """Warm this process's object-store mapping up to `max_bytes` (store.warm),
        if not warmed that far already (the Ray Train exchange asks once it knows
        the gradients' size). Blocks in proportion; returns the bytes warmed."""
        if max_bytes > self.warmed_store_bytes:
            self.warmed_store_bytes = max(self.warmed_store_bytes, store.warm(max_bytes))
        return self.warmed_store_bytes

    @ray.method(concurrency_group=RENDEZVOUS)
    def enable_timeline(self, on: bool) -> None:
        """Record this PS's sums for the timeline (dsgd/comm/timeline.py), or stop."""
        timeline.enable(f"PS {self.ps_index}", on)

    @ray.method(concurrency_group=RENDEZVOUS)
    def timeline_events(self) -> list[dict]:
        """This PS's timeline events since the last call."""
        return timeline.recorder().drain()

    def ping(self) -> Ping:
        """Liveness; runs after every call queued before it."""
        import os

        return Ping(os.getpid(), pending=len(self._pending))

    def _means(self, shards, worker_groups, scale: float | None = None) -> tuple:
        """The group's means (or `scale`d sums) in this PS's scratch buffers, valid
        until the next call: the caller hands them to Ray (which copies them into
        the store) before another call may reuse them."""
        out = []
        for k, shard in enumerate(shards):
            key = (k, shard.dtype, shard.num_elements)
            if key not in self._scratch:
                self._scratch[key] = np.zeros(shard.num_elements, shard.wire_numpy_dtype)
            out.append(self._scratch[key])
        for k, (shard, pieces) in enumerate(zip(shards, split_group(shards, worker_groups))):
            try:
                mean_shard(shard, pieces, out=out[k], scale=scale)
            except ValueError as e:
                raise ValueError(f"PS {self.ps_index}, shard {k} of its group: {e}") from e
        return tuple(out)

    # -- Ray Train: the workers call, the PS matches their calls ---------------
    @ray.method(concurrency_group=RENDEZVOUS)
    def reduce(self, seq: int, rank: int, world: int, shards: tuple[Shard, ...],
               pieces: tuple[np.ndarray, ...] | None, scale: float | None = None,
               bucket: int | None = None, chosen_later: bool = False, meta=None) -> list:
        """Worker `rank`'s part of exchange `seq`: its pieces of a group of shards
        (as `mean` takes one worker's group; read-only store views). Blocks
        until all `world` workers' parts arrived, at most `rendezvous_timeout_s`
        seconds (then TimeoutError naming the ranks that never came); the last
        arrival averages (into reused scratch buffers, once per exchange; `scale`
        1.0 sums) and every call returns the same one-element list: the
        ObjectRef of the result, put in the store once for all callers instead of
        copied into each caller's reply. The result is a tuple with one array
        per shard, or None when a worker sent `pieces=None` (no gradient: an
        epoch's end, an error; the engine's steps decide from the metas).

        `meta` (the engine's steps after the backward pass: every worker's meta
        travels with its part of PS 0's group, dsgd/comm/commit.py): the result is
        `(means, metas)`, metas in rank order, so that the step is decided from
        the same round that brings the mean. Every rank of a meeting passes one
        or none. (During the backward pass PS 0 gathers the metas apart,
        `gather`; with backup workers `choose` does.)

        Exchange numbers carry an attempt in their high bits (`seq >> 32`): the
        first part of a newer attempt ends every pending exchange of older ones
        (their callers get an error), so a step retried after a failure never
        meets the parts of its failed attempt.

        `bucket`: which of the step's groups this is, where one PS serves several
        groups of one exchange (the overlapped exchange's buckets: each is its own
        meeting); None: this PS's one group of it.

        `chosen_later` (backup workers' overlapped steps: each bucket leaves
        during the backward pass, before the contributors are chosen): the part
        is kept until `settle` names the contributors; the sum is then over
        theirs and the other parts are dropped. Every one of the `world` ranks
        calls."""
        import ray

        needed = None if chosen_later else tuple(range(world))
        with_metas = meta is not None

        def combine(parts, ranks):
            # Summed into the reused scratch buffers (fresh pages would cost a first
            # touch each time), then put once; the lock keeps two exchanges that
            # finish together on this PS from sharing the scratch.
            values = [parts[r][0] if with_metas else parts[r] for r in ranks]
            with self._scratch_lock, timeline.recorder().span(
                    "sum group", "sum", exchange=seq & ((1 << ATTEMPT_SHIFT) - 1),
                    workers=len(ranks)):
                means = None if any(v is None for v in values) else \
                    self._means(shards, values, scale)
                return [ray.put((means, [parts[r][1] for r in ranks]) if with_metas
                                else means)]

        part, pieces = (pieces, meta) if with_metas else pieces, None  # (the meeting holds it)
        key = ("reduce", seq) if bucket is None else ("reduce", seq, bucket)
        return self._rendezvous(key, rank, world, part, needed, combine)

    @ray.method(concurrency_group=RENDEZVOUS)
    def settle(self, seq: int, chosen: tuple[int, ...], buckets: tuple[int, ...]) -> None:
        """Backup workers' overlapped steps: step `seq`'s contributors are `chosen`
        (sorted ranks, from PS 0's `choose`). Buckets `buckets` of it, whose
        parts this PS kept (`reduce(chosen_later=True)`), are summed over those
        ranks' parts once all are in (here, if they are now); the other ranks'
        parts are dropped now. Exactly one worker settles each (step, PS) pair
        (`StepExchange.choose`), so a meeting it makes is always served and ended.
        Does not block (beyond the sum); never raises (nobody reads its answer)."""
        ready = []
        with self._arrivals:
            if seq >> ATTEMPT_SHIFT < self._attempt:
                return  # (given up: its waiting ranks were told)
            self._end_older_attempts(seq >> ATTEMPT_SHIFT)
            for b in buckets:
                meeting = self._meeting(("reduce", seq, b))
                if meeting.settled:
                    continue
                meeting.settle(chosen)
                if meeting.claim():
                    ready.append(meeting)
        for meeting in ready:
            self._combine(meeting)

    @ray.method(concurrency_group=RENDEZVOUS)
    def choose(self, seq: int, rank: int, world: int, need: int, meta) -> tuple:
        """Backup workers: rank `rank` has its whole gradient of step `seq` (its
        `meta` says whether it is finite, dsgd/comm/commit.py). The first `need`
        ranks to arrive are the step's contributors, for every group alike.
        Blocks until `need` ranks arrived (at most `rendezvous_timeout_s`, then
        TimeoutError naming the ranks that never came); a rank arriving after
        that gets the same answer at once. Returns (contributors: sorted ranks,
        their metas in that order, whether `rank` is one of them)."""
        key = ("choose", seq)
        with self._arrivals:
            self._check_attempt(key)
            self._end_older_attempts(seq >> ATTEMPT_SHIFT)
            meeting = self._meeting(key)
            meeting.needed = tuple(range(world))  # (any `need` of them: for missing_ranks)
            if not meeting.done:
                meeting.parts[rank] = meta
                if len(meeting.parts) >= need:
                    chosen = sorted(meeting.parts)
                    meeting.finish((chosen, [meeting.parts[r] for r in chosen]), None)
                    meeting.parts.clear()
                    self._arrivals.notify_all()
            if not self._arrivals.wait_for(lambda: meeting.done, self.rendezvous_timeout_s):
                missing = sorted(set(range(world)) - set(meeting.parts))
                raise TimeoutError(
                    f"dsgd PS {self.ps_index}: choose {seq}: {len(meeting.parts)} of the {need} "
                    f"contributors needed arrived within {self.rendezvous_timeout_s:.0f} s; "
                    f"rank(s) {missing} of {world} did not")
            if meeting.error is not None:
                raise meeting.error
            self._served(key, meeting, rank, world)
            chosen, metas = meeting.result
            return chosen, metas, rank in chosen

    @ray.method(concurrency_group=RENDEZVOUS)
    def decided(self, seq: int, rank: int, world: int) -> tuple | None:
        """Backup workers: `choose`'s answer for step `seq` if its contributors are
        chosen already (rank `rank` then sits the step out: it computes nothing
        and takes the mean as an observer), else None. Does not block."""
        key = ("choose", seq)
        with self._arrivals:
            self._check_attempt(key)
            meeting = self._pending.get(key)
            if meeting is None or not meeting.done:
                return None
            if meeting.error is not None:
                raise meeting.error
            self._served(key, meeting, rank, world)
            chosen, metas = meeting.result
            return chosen, metas, False

    @ray.method(concurrency_group=RENDEZVOUS)
    def broadcast(self, seq: int, rank: int, world: int, root: int, values):
        """Rank `root`'s `values` (the others pass None), returned to every rank;
        blocks until the root's call arrived (same timeout as `reduce`)."""
        return self._rendezvous(("broadcast", seq), rank, world, values, (root,),
                                lambda parts, _: parts[root])

    @ray.method(concurrency_group=RENDEZVOUS)
    def gather(self, seq: int, rank: int, world: int, value):
        """Every rank's `value`, in rank order, returned to every rank; blocks
        until all `world` ranks' calls arrived (same timeout as `reduce`)."""
        return self._rendezvous(("gather", seq), rank, world, value, range(world),
                                lambda parts, _: [parts[r] for r in range(world)])

    @ray.method(concurrency_group=RENDEZVOUS)
    def waiting(self) -> dict:
        """{exchange number: the ranks not arrived} of every reduce some worker
        waits in now (for the driver's stall reports)."""
        with self._arrivals:
            missing: dict = {}
            for key, m in self._pending.items():  # (every bucket of a step: one entry)
                if key[0] == "reduce" and not m.done and m.parts:
                    missing.setdefault(key[1], set()).update(set(m.needed) - set(m.parts))
            return {seq: sorted(ranks) for seq, ranks in missing.items()}

    @ray.method(concurrency_group=RENDEZVOUS)
    def abandon(self, attempt: int) -> None:
        """Give up every exchange of `attempt` and older (the driver found a failure):
        their waiting callers get ExchangeAbandoned at once, and so does any part
        of them that arrives later."""
        with self._arrivals:
            self._end_older_attempts(attempt + 1)

    @ray.method(concurrency_group=RENDEZVOUS)
    def missing_ranks(self, kind: str, seq: int) -> list[int]:
        """The ranks whose part of exchange (`kind`, `seq`) has not arrived here, in
        any of its meetings ([] if no part of it has)."""
        with self._arrivals:
            missing: set = set()
            for key, meeting in self._pending.items():
                if key[0] == kind and key[1] == seq and meeting.parts:
                    missing.update(set(meeting.needed) - set(meeting.parts))
            return sorted(missing)

    def _check_attempt(self, key: tuple) -> None:
        """(holding `_arrivals`) ExchangeAbandoned for a part of a given-up attempt."""
        attempt = key[1] >> ATTEMPT_SHIFT
        if attempt < self._attempt:
            raise ExchangeAbandoned(f"dsgd PS {self.ps_index}: {key[0]} {key[1]} abandoned: "
                                    f"attempt {attempt} was given up after a failure")

    def _served(self, key: tuple, meeting: _Rendezvous, rank: int, world: int) -> None:
        """(holding `_arrivals`) `rank` has its answer; the last of `world` ends it."""
        if meeting.serve(rank, world) and self._pending.get(key) is meeting:
            del self._pending[key]

    def _meeting(self, key: tuple) -> _Rendezvous:
        """(holding `_arrivals`) The meeting of exchange `key`, made at its first
        arrival (ranks that are `gone` for it count as served)."""
        meeting = self._pending.get(key)
        if meeting is None:
            meeting = self._pending[key] = _Rendezvous()
            for ranks, below in self._gone:
                if key[1] < below:
                    meeting.served.update(ranks)
        return meeting

    @ray.method(concurrency_group=RENDEZVOUS)
    def gone(self, ranks: list[int], below: int) -> None:
        """(driver, backup workers) Workers `ranks` of the membership that made the
        exchanges numbered below `below` died: they will never take those
        exchanges' results, so each ends once the other ranks have theirs (a
        late worker still catching up keeps them until it has). Without it,
        every step the others made while a dead worker was being replaced would
        keep its means here."""
        with self._arrivals:
            self._gone = [(r, b) for r, b in self._gone if b >> ATTEMPT_SHIFT >= self._attempt]
            self._gone.append((tuple(ranks), below))
            for key, meeting in list(self._pending.items()):
                if key[1] < below:
                    meeting.served.update(ranks)
                    if meeting.done and meeting.world and len(meeting.served) >= meeting.world:
                        meeting.parts.clear()
                        del self._pending[key]

    def _rendezvous(self, key: tuple, rank: int, world: int, part, needed, combine):
        """`rank`'s `part` of exchange `key`; once the parts of
        every rank in `needed` are in, `combine(parts, needed)` makes the result
        that every rank of `world` gets. `needed` None: not known yet (`settle`
        tells it; until then any rank's part is kept). Blocks, at most
        `rendezvous_timeout_s`."""
        with self._arrivals:
            try:
                self._check_attempt(key)
            except ExchangeAbandoned:
                part = None  # (not pinned by the error's traceback)
                raise
            self._end_older_attempts(key[1] >> ATTEMPT_SHIFT)
            meeting = self._meeting(key)
            if needed is not None and not meeting.settled:
                meeting.settle(needed)
            elif not meeting.settled:
                meeting.needed = tuple(range(world))  # (until chosen, any of them may be)
            meeting.combine = meeting.combine or combine
            if not meeting.settled or rank in meeting.needed:
                meeting.parts[rank] = part
            part = None  # the meeting holds it (not this frame)
            last = meeting.claim()
        if last:  # combine outside the lock: other exchanges keep arriving meanwhile
            self._combine(meeting)
        with self._arrivals:
            if not self._arrivals.wait_for(lambda: meeting.done, self.rendezvous_timeout_s):
                missing = sorted(set(meeting.needed) - set(meeting.parts))
                what = f"rank(s) {missing} of {world} did not arrive" if meeting.settled else \
                    "the step's contributors were never settled (backup workers: PS 0 chose " \
                    "none, or no contributor told this PS)"
                raise TimeoutError(
                    f"dsgd PS {self.ps_index}: {key[0]} {key[1]}"
                    + (f" (bucket {key[2]})" if len(key) > 2 else "")
                    + f": {what} within {self.rendezvous_timeout_s:.0f} s")
            self._served(key, meeting, rank, world)
        if meeting.error is not None:
            raise meeting.error
        return meeting.result

    def _combine(self, meeting: _Rendezvous) -> None:
        """Make `meeting`'s result (not holding `_arrivals`: other exchanges keep
        arriving meanwhile) and wake its waiting ranks."""
        try:
            result, error = meeting.combine(meeting.parts, meeting.needed), None
        except Exception as e:  # noqa: BLE001 - every rank gets the error
            result, error = None, e
        with self._arrivals:
            meeting.finish(result, error)
            self._arrivals.notify_all()

    def _end_older_attempts(self, attempt: int) -> None:
        """(holding `_arrivals`) A part of attempt `attempt` arrived: pending exchanges
        of older attempts will never complete (their step is being retried); end
        them with an error for their callers. Completed ones that a dead worker
        will never collect are dropped too (they hold their result object: a
        leak per failure otherwise); callers already waiting keep their meeting."""
        if attempt <= self._attempt:
            return
        self._attempt = attempt
        for key, meeting in list(self._pending.items()):
            if key[1] >> ATTEMPT_SHIFT < attempt:
                if not meeting.done:
                    meeting.finish(None, ExchangeAbandoned(
                        f"dsgd PS {self.ps_index}: {key[0]} {key[1]} abandoned: attempt "
                        f"{key[1] >> ATTEMPT_SHIFT} was given up after a failure"))
                # The parts are store views of the workers' objects: a caller's frame
                # kept by its error's traceback would pin them otherwise.
                meeting.parts.clear()
                del self._pending[key]
        self._arrivals.notify_all()



class _Rendezvous:
    """One exchange's meeting on a PS: the parts that arrived, then the result."""

    __slots__ = ("parts", "combining", "done", "result", "error", "served", "needed", "world",
                 "settled", "combine")

    def __init__(self):
        self.needed: tuple = ()
        self.settled = False  # `needed` is known (backup workers: once chosen)
        self.combine = None  # combine(parts, needed) -> the result
        self.parts: dict = {}
        self.combining = self.done = False
        self.result = self.error = None
        self.served: set = set()  # the ranks that have the result (or are gone)
        self.world = 0

    def settle(self, needed) -> None:
        """The ranks whose parts make the result are `needed` (known now); the
        parts of the others are dropped."""
        self.needed, self.settled = tuple(needed), True
        for r in [r for r in self.parts if r not in self.needed]:
            del self.parts[r]

    def claim(self) -> bool:
        """(holding the PS's `_arrivals`) Whether this meeting is to be combined now,
        by the caller (outside the lock): its contributors are known and all their
        parts are in; it is then marked as combining, so only one caller does it."""
        last = self.settled and not self.combining and \
            all(r in self.parts for r in self.needed)
        self.combining = self.combining or last
        return last

    def finish(self, result, error) -> None:
        self.result, self.error, self.done = result, error, True

    def serve(self, rank: int, world: int) -> bool:
        """`rank` of `world` has the result; True once every rank has it (or is gone)."""
        self.world = world
        self.served.add(rank)
        return len(self.served) >= world


def ps_options(node_id: str) -> dict:
    """Ray options of a PS actor on node `node_id`: hard node affinity (a soft
    one was seen to fall back to another node although a 0-CPU actor fits), no
    CPU slot (it must never keep a worker from being scheduled on a small
    node) and niceness 0 like the workers. Its process never imports TensorFlow
    (dsgd/tf_logging.py): a replacement starts in ~1 s instead of ~7 (chaos
    benchmark, 2-core VM) and holds ~0.1 GB instead of ~0.75."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": constants.PS_NUM_CPUS, "runtime_env": constants.ACTOR_RUNTIME_ENV,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def ps_actor_class(cls=None, world: int = 1):
    """`ray.remote` of the PS class with its RENDEZVOUS concurrency group sized for
    `world` workers (Ray takes concurrency groups at ray.remote, not .options)."""
    return ray.remote(concurrency_groups={RENDEZVOUS: rendezvous_concurrency(world)})(
        cls or ParameterServer)


def ps_nodes(ps_indices: list[int], worker_nodes: list[str]) -> list[str]:
    """The node of each PS: round-robin over the workers' distinct nodes (in the
    order of the workers), so that every node that sends gradients also sums
    its share, as in BytePS, and no node holds two PS actors while another
    holds none. On one node: every PS there."""
    nodes = list(dict.fromkeys(worker_nodes))
    return [nodes[j % len(nodes)] for j in ps_indices]


def default_num_ps(num_shards: int, num_workers: int, worker_nodes: list[str]) -> int:
    """`num_ps=None`: workers on several nodes get one PS per worker node (so each
    node's NIC carries one PS's share of the bytes both ways, the groups being
    balanced by bytes, shards cut at byte ranges of large tensors); on one node
    one PS per worker (no NIC to share; the PS actors sum in parallel). Never
    more PS than shards."""
    nodes = len(set(worker_nodes))
    return max(1, min(num_shards, nodes if nodes > 1 else num_workers))
