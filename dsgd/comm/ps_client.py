"""The worker side of an exchange through PS actors: the one client of
`ParameterServer`'s rendezvous methods (dsgd/comm/param_server.py).

Every front-end whose workers exchange by themselves holds one `PSClient` per
worker: the engine's workers (dsgd/worker/worker.py `exchange_steps`), the Ray
Train backend (dsgd/train/exchange.py) and the Trainer's custom epochs
(dsgd/trainer/custom.py). The driver's few PS calls (giving up an attempt, stall
reports, backup workers' `gone`, the timeline) are the functions at the end. A client numbers its exchanges (one
counter from a base; every worker makes the same calls in the same order, so
the PS matches them by number), puts each group of gradient pieces in the
object store once, calls its PS, waits with a deadline, and reads the mean.

Failures are named, never waited out in silence:
- a PS actor that died: Ray's `ActorDiedError`, with a note naming the PS;
- a peer worker that died (when the client knows its peers): the same, naming
  the worker, as soon as a ping finds it (the PS would otherwise wait for it
  until its rendezvous timeout);
- nobody dead but no answer after `timeout_s`: `StepTimeoutError` naming the
  workers that did not arrive (by position, `late_workers`) and the PS actors
  that did not answer (`late_ps`), asked of the PS actors themselves.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dsgd.comm import timeline
from dsgd.comm.sharding import ExchangeLayout, to_wire
from dsgd.comm.waits import (Deadline, actor_died_errors, dead_owners, fetch, outcomes,
                              ready)
from dsgd.errors import StepTimeoutError

if TYPE_CHECKING:
    from dsgd.comm.commit import Meta

# While waiting, how often the client looks at its peers (seconds).
POLL_S = 1.0
_STEP_BITS = (1 << 32) - 1  # the step part of an exchange number (the attempt above it)


def sequence_number(attempt: int, step: int) -> int:
    """The number of step `step`'s exchange in attempt `attempt` (a step retried
    after a failure is a new attempt): a PS ends the pending exchanges of older
    attempts when a newer one's arrives (dsgd/comm/param_server.py)."""
    from dsgd.comm.param_server import ATTEMPT_SHIFT

    return (attempt << ATTEMPT_SHIFT) | step


class PSClient:
    """One worker's exchanges with the PS actors.

    Args:
        ps: the PS actor handles, by PS index.
        names: their names, for errors.
        rank: this worker's position among the `world` workers of the exchange.
        world: how many workers take part in every exchange.
        timeout_s: longest wait for one exchange, in seconds.
        what: names the exchanges in errors ("dsgd.train", "custom train_epoch").
        seq_base: the first exchange number (exchanges of another attempt start
            elsewhere, so that a PS never matches them with an older one's).
        peers: the other workers' actor handles by position (None: not watched;
            the PS's own rendezvous timeout then names a dead peer).
        need: backup workers: how many of the `world` workers make a step's
            mean (`choose`); default all of them.
    """

    def __init__(self, ps: Sequence, names: Sequence[str], rank: int, world: int,
                 timeout_s: float, what: str, seq_base: int = 0, peers: Sequence | None = None,
                 need: int | None = None):
        self.ps, self.names = list(ps), list(names)
        self.rank, self.world, self.timeout_s, self.what = rank, world, timeout_s, what
        self.need = world if need is None else need
        self.choosing = need is not None  # backup workers: PS 0 names each step's contributors
        self.peers = list(peers) if peers is not None else None
        self._sequence = itertools.count(seq_base)
        self._lock = threading.Lock()  # a Ray Train worker may call from several threads

    def next_seq(self) -> int:
        """The next exchange number (every exchange takes one, on every worker alike)."""
        with self._lock:
            return next(self._sequence)

    def reduce(self, layout: ExchangeLayout, flat: Sequence[np.ndarray],
               scale: float | None = None, label: str | None = None) -> list[np.ndarray]:
        """The mean over every worker (or `scale` times the sum; 1.0: the sum) of
        this worker's flattened arrays `flat` (one per variable of
        `layout.plan`), one array per shard of the plan in its layout (zero
        padding between pieces). Each group travels as one object to its PS;
        the results are read-only views of the objects the PS actors put
        (each keeps its object alive). Blocks, at most `timeout_s`. `label`
        names the exchange in errors (default "exchange <number>")."""
        plan = layout.plan
        pieces = [[to_wire(flat[p.var_index][p.var_offset:p.var_offset + p.length], s.dtype)
                   for p in s.pieces] for s in plan.shards]
        return self.reduce_pieces(layout, pieces, scale, label)

    def reduce_pieces(self, layout: ExchangeLayout, pieces: Sequence[Sequence[np.ndarray]],
                      scale: float | None = None, label: str | None = None) -> list[np.ndarray]:
        """`reduce` of arrays already cut as the plan says: `pieces[j]` holds shard
        j's pieces in wire dtype (the worker's compiled step makes them so)."""
        return self._exchange(layout, pieces, self.next_seq(), scale, label)

    def step_exchange(self, layout: ExchangeLayout, seq: int, label: str,
                      metas_with_gradient: bool = False) -> StepExchange:
        """One engine step's exchange, numbered `seq`, sent group by group while the
        step is computed (`StepExchange`: send each group as soon as it exists, then
        the metas, then read the means as they arrive). `layout`'s groups are
        the step plan's buckets (`sharding.bucket_layout`'s, or the PS groups).
        `metas_with_gradient`: the metas travel with the parts of PS 0's group (one
        round; the gradient is whole before the meta is made) instead of PS 0's
        gather."""
        return StepExchange(self, layout, seq, label, metas_with_gradient)

    # -- backup workers: the first `need` of the workers make a step --------------------------
    def choose(self, seq: int, meta: Meta, label: str) -> Chosen:
        """Step `seq`'s contributors (PS 0 `choose`: the first `need` ranks to
        have their whole gradient). Blocks until they are chosen, at most
        `timeout_s`; a worker arriving after that is answered at once (it is
        dropped from the step)."""
        ref = self.ps[0].choose.remote(seq, self.rank, self.world, self.need, meta)
        return Chosen(*self._wait([ref], [0], seq, label, kind="choose", watch=())[0])

    def decided(self, seq: int, label: str) -> Chosen | None:
        """`choose`'s answer if step `seq`'s contributors are chosen already (this
        worker, late, then sits the step out), else None. One round trip to PS 0."""
        ref = self.ps[0].decided.remote(seq, self.rank, self.world)
        answer = self._wait([ref], [0], seq, label, kind="choose", watch=())[0]
        return None if answer is None else Chosen(*answer)

    def _exchange(self, layout, pieces, seq: int, scale, label) -> list[np.ndarray]:
        import ray

        label = label or f"exchange {seq}"
        refs, owners = [], []
        tl = timeline.recorder()
        for g, group in enumerate(layout.groups):
            start = time.time() if tl.on else 0.0
            # One object per group (pickle 5 copies each piece once into its place in
            # the store buffer): Ray's cost per object would dominate one per piece.
            part = ray.put(tuple(piece for j in group for piece in pieces[j]))
            ps = layout.ps_of_group[g]
            refs.append(self.ps[ps].reduce.remote(seq, self.rank, self.world, layout.shards(g),
                                                  part, scale))
            owners.append(ps)
            if tl.on:
                tl.add(f"send group {g}", "send", start, time.time(), ps=ps,
                       exchange=seq & _STEP_BITS)
        # Each PS answers with the ref of its group's result, put once for all workers;
        # reading it maps the store (no copy).
        answers = self._wait(refs, owners, seq, label)
        results = self._wait([a[0] for a in answers], owners, seq, label)
        means: list = [None] * layout.plan.num_shards
        for group, arrays in zip(layout.groups, results):
            for j, array in zip(group, arrays):
                means[j] = array
        return means

    def broadcast(self, value, root: int, label: str | None = None):
        """Rank `root`'s `value` (any picklable value; the others pass anything),
        on every worker, through PS 0. Blocks, at most `timeout_s`."""
        seq = self.next_seq()
        label = label or f"broadcast {seq}"
        ref = self.ps[0].broadcast.remote(seq, self.rank, self.world, root,
                                          value if self.rank == root else None)
        return self._wait([ref], [0], seq, label, kind="broadcast")[0]

    def gather(self, value, label: str | None = None) -> list:
        """Every worker's `value`, in rank order, on every worker, through PS 0."""
        seq = self.next_seq()
        label = label or f"allgather {seq}"
        ref = self.ps[0].gather.remote(seq, self.rank, self.world, value)
        return self._wait([ref], [0], seq, label, kind="gather")[0]

    def warm_store(self, nbytes: int) -> None:
        """Every PS warms `nbytes` of its store mapping (dsgd/comm/store.py); blocks."""
        refs = [ps.warm_store.remote(nbytes) for ps in self.ps]
        self._wait(refs, list(range(len(refs))), None, "warming the store")

    # -- waiting ---------------------------------------------------------------------------
    def _wait(self, refs: list, owners: list[int], seq: int | None, label: str,
              kind: str = "reduce", watch: Sequence[int] | None = None) -> list:
        """The answers of `refs` (owner PS indices `owners`): ends at once when a PS or
        (with peers) a peer worker died, after `timeout_s` naming who did not
        arrive. The PS's own rendezvous timeout is `timeout_s` too; its error
        naming the missing ranks may come first. `watch`: the peers (ranks)
        whose death ends the wait (None: every peer)."""
        import ray

        deadline = Deadline(f"{self.what} {label}", self.timeout_s)
        pending = list(refs)
        # One ping in flight per peer: a busy peer answers after its current call, a
        # dead one at once; an answered ping is sent again, so a peer that dies later
        # in the wait is found too.
        pings: dict = {}
        while pending:
            _, pending = deadline.wait(pending, slice_s=POLL_S)
            if not pending:
                break
            if self.peers is not None:
                for r, peer in enumerate(self.peers):
                    if r != self.rank and r not in pings and (watch is None or r in watch):
                        pings[r] = peer.ping.remote()
                for r, ping in list(pings.items()):
                    if ready([ping])[0]:
                        try:
                            fetch(ping, f"{self.what} {label}: worker {r}'s ping", POLL_S)
                        except actor_died_errors():
                            raise died(f"{self.what} {label}: worker {r} died") from None
                        except Exception:  # noqa: BLE001 - alive (its call failed): ask again
                            pass
                        del pings[r]
            if deadline.over():
                raise self._timeout(refs, owners, pending, seq, label, kind)
        try:
            return fetch(list(refs), f"{self.what} {label}", max(1.0, self.timeout_s))
        except actor_died_errors() as e:
            dead = dead_owners(refs, owners)
            who = ", ".join(self.names[j] for j in dead) or "a PS actor"
            raise died(f"{self.what} {label}: PS actor {who} died ({type(e).__name__})",
                       ps=dead) from None
        except ray.exceptions.RayTaskError as e:
            if not isinstance(e.cause, TimeoutError):
                raise
            # The PS's rendezvous timed out first: the same StepTimeoutError as ours.
            raise self._timeout(refs, owners, list(refs), seq, label, kind) from None

    def _timeout(self, refs: list, owners: list[int], pending: list, seq: int | None,
                 label: str, kind: str) -> StepTimeoutError:
        """Who did not arrive: the PS actors whose answer is pending but which hold
        every part (hung), and the workers that the other PS actors still miss."""
        late_ps = sorted({owners[refs.index(r)] for r in pending})
        missing: set[int] = set()
        if seq is not None:
            asked = {j: self.ps[j].missing_ranks.remote(kind, seq) for j in late_ps}
            answered, _ = Deadline(f"{self.what} {label}: the missing ranks",
                                   POLL_S).wait(list(asked.values()))
            for j, ref in asked.items():
                if ref in answered:
                    absent = outcomes([ref], f"{self.names[j]}'s missing ranks")[0]
                    if isinstance(absent, Exception):  # a PS that cannot say stays named
                        continue
                    if absent:  # the PS waits for workers: they are late, not it
                        missing.update(absent)
                        late_ps.remove(j)
        missing.discard(self.rank)
        who = [f"worker {r}" for r in sorted(missing)] + [self.names[j] for j in late_ps]
        return StepTimeoutError(
            f"{self.what} {label}: no answer after {self.timeout_s:.1f} s; not arrived: "
            f"{', '.join(who) or 'unknown'}", late_workers=sorted(missing), late_ps=late_ps)


@dataclasses.dataclass(frozen=True)
class Chosen:
    """A step's contributors under backup workers, as PS 0 chose them (`choose`)."""
    ranks: tuple[int, ...]  # the contributors' ranks, sorted
    metas: tuple            # their metas (commit.Meta), in that order
    mine: bool              # whether this worker is one of them

    def __post_init__(self):
        object.__setattr__(self, "ranks", tuple(self.ranks))
        object.__setattr__(self, "metas", tuple(self.metas))


class StepExchange:
    """One step of the overlapped exchange (`PSClient.step_exchange`), in three parts:

    1. `send(g, part)` for each group, from any thread (the worker's compiled
       step calls it from TensorFlow's threads during the backward pass): puts
       the group's pieces in the object store (the one copy: the fusion) and
       calls the group's PS; returns at once. The PS sums once every worker's
       part is in.
    2. `metas(meta)` once the step is computed: every worker's meta (rank order)
       through PS 0's gather, or with the parts of PS 0's group
       (`metas_with_gradient`: that part is put by `send` and PS 0 is called once
       the meta is made; it returns the metas with the mean: one round), so
       that every worker decides the step alike (commit.py) before any replica
       applies anything. Blocks.
    3. `mean(g)`: group g's mean, waiting for it if needed. A group whose PS died
       is averaged here from every worker's part (their writers keep them:
       `parts`, asked of the peers through `Worker.parts_of`), with the PS's own
       kernel and order, so a step begun to be applied is finished exactly.

    Buffer ownership: the arrays `mean` returns are read-only views of the
    store object the PS put (kept alive by them); this worker's own part
    objects stay alive while the `StepExchange` is kept (the worker keeps it until
    every worker has applied the step: the next step's metas, or the end of
    its call)."""

    def __init__(self, client: PSClient, layout: ExchangeLayout, seq: int, label: str,
                 metas_with_gradient: bool = False):
        self.client, self.layout, self.seq, self.label = client, layout, seq, label
        # The group whose parts carry the metas (`metas`): PS 0's first, as PS 0 is the
        # step's one rendezvous whichever way the metas travel; None: PS 0 gathers them.
        self.metas_group = layout.ps_of_group.index(0) \
            if metas_with_gradient and not client.choosing else None
        self._held = None  # (metas_group's part, put, until the meta is made: `send`)
        self.answers: list = [None] * len(layout.groups)  # each group's reduce call
        self.parts: list = [None] * len(layout.groups)    # this worker's part of each group
        self.fell_back: list[int] = []  # the groups whose mean `fallback` made (their PS died)
        # Backup workers: the parts leave before the step's contributors are chosen
        # (`choose`); each PS keeps them until told (`ParameterServer.settle`).
        self.chosen_later = client.choosing
        # The contributors, once chosen: only their deaths end a wait for a mean (a late
        # worker that dies is the driver's to replace, not this step's).
        self.chosen: tuple[int, ...] | None = None
        self._means: dict = {}  # group -> its mean, read ahead by `collect`
        self._lock = threading.Lock()

    def send(self, g: int, part: tuple | None) -> None:
        """Send group `g`'s pieces `part` (a tuple of 1-D arrays, as `reduce_pieces`
        sends a group; None: no gradient, e.g. at an epoch's end). The arrays
        are copied before this returns. Does not wait for the PS. The group
        that carries the metas (`metas_group`) is only put here: `metas` calls
        its PS, with this worker's meta."""
        import ray

        start = time.time()
        ref = None if part is None else ray.put(part)
        if g == self.metas_group:
            self._held = ref
            return
        self._call(g, ref, start)

    def _call(self, g: int, ref, start: float, meta: Meta | None = None) -> None:
        """Call group `g`'s PS with this worker's part `ref` (put at `start`; None:
        no gradient) and, for the metas' group, its `meta`."""
        tl = timeline.recorder()
        client, ps = self.client, self.layout.ps_of_group[g]
        later = {"chosen_later": True} if self.chosen_later else \
            {"meta": meta} if meta is not None else {}
        answer = client.ps[ps].reduce.remote(self.seq, client.rank, client.world,
                                             self.layout.shards(g), ref, bucket=g, **later)
        with self._lock:
            if self.answers[g] is not None:
                raise RuntimeError(f"{client.what} {self.label}: group {g} sent twice")
            self.answers[g], self.parts[g] = answer, ref
        if tl.on:
            tl.add(f"send group {g}" if ref is not None else f"join group {g}", "send",
                   start, time.time(), ps=ps, exchange=self.seq & _STEP_BITS)

    def send_no_gradient(self) -> None:
        """Send every group not sent yet with no gradient (this worker's step
        ended early: an epoch's end or an error), so no PS waits for it."""
        for g, answer in enumerate(self.answers):
            if answer is None and g != self.metas_group:  # (that one: `metas`)
                self.send(g, None)

    def sit_out(self, chosen) -> None:
        """(backup workers) This worker sits the step out: its contributors were
        `chosen` (ranks) already. Sends no gradient (each PS drops a part, and
        needs none)."""
        self.chosen = tuple(chosen)
        self.send_no_gradient()

    def metas(self, meta: Meta) -> list[Meta]:
        """Every worker's `meta` of this step, in rank order: PS 0 gathers them
        (while waiting, reads the means already summed: `collect`), or they come
        back with the mean of PS 0's group (`metas_group`: its part, put by
        `send`, or none, goes to PS 0 now with `meta`). Blocks, at most the
        client's `timeout_s`; a dead peer or PS 0 ends the wait at once (nothing
        of the step is applied anywhere before this)."""
        client = self.client
        if self.metas_group is not None:
            g, ps = self.metas_group, self.layout.ps_of_group[self.metas_group]
            self._call(g, self._held, time.time(), meta)
            self._held = None
            answer = client._wait([self.answers[g]], [ps], self.seq, self.label)[0]
            means, metas = fetch(answer[0], f"{self.label}: group {g}'s mean and the metas",
                                 max(1.0, client.timeout_s))
            if means is not None:
                self._means[g] = means
            return metas
        ref = client.ps[0].gather.remote(self.seq, client.rank, client.world, meta)
        if not ready([ref], fetch_local=False)[0]:
            self.collect()
        return client._wait([ref], [0], self.seq, self.label, kind="gather")[0]

    def choose(self, meta: Meta) -> Chosen:
        """(backup workers, instead of `metas`) This step's contributors: PS 0
        names the first `need` workers to have sent their meta (`PSClient.choose`).
        Then each PS holding buckets of the step is told (`settle`), by one
        contributor each (the PS's index modulo their number picks it: the
        settles of a step spread over the contributors, one call per PS in
        all). Blocks until they are chosen, at most the client's `timeout_s`."""
        client = self.client
        chosen = client.choose(self.seq, meta, self.label)
        self.chosen = chosen.ranks
        owners = sorted(set(self.layout.ps_of_group))
        for j in owners:
            if self.chosen[j % len(self.chosen)] == client.rank:
                buckets = tuple(g for g, p in enumerate(self.layout.ps_of_group) if p == j)
                client.ps[j].settle.remote(self.seq, self.chosen, buckets)
        return chosen

    def collect(self) -> None:
        """Read every group's mean that is summed and already in this node's store
        (kept for `mean`); a group whose answer failed is left to `mean`. Does
        not block: a mean summed on another node is left for `read`, which pulls
        every remaining mean at once (pulled here, in two rounds, each keeping
        only some PS's uplinks busy: docs/scaling.md)."""
        waiting = [(g, a) for g, a in enumerate(self.answers)
                   if a is not None and g not in self._means]
        if not waiting:
            return
        answered = set(ready([a for _, a in waiting], fetch_local=False)[0])
        groups = [g for g, a in waiting if a in answered]
        if not groups:
            return
        try:
            refs = [r[0] for r in fetch([self.answers[g] for g in groups], self.label,
                                        self.client.timeout_s)]
            here = set(ready(refs)[0])  # (timeout 0: in this node's store now)
            local = [(g, r) for g, r in zip(groups, refs) if r in here]
            means = fetch([r for _, r in local], self.label, self.client.timeout_s) \
                if local else []
        except Exception:  # noqa: BLE001 - a failed group is `mean`'s to name or average
            return
        for (g, _), m in zip(local, means):
            m = self._mean_of(g, m)
            if m is not None:
                self._means[g] = m

    def read(self, groups: Sequence[int]) -> None:
        """Read the means of `groups` in parallel: wait for every group's answer,
        then pull every mean at once (kept for `mean`; one after the other, one
        PS's NIC at a time would serve every worker). A dead actor or a lost
        object leaves every group to `mean` (which names a dead PS or averages
        the group from the workers' parts); a timeout or any other error is
        raised. Waits for every group's answer before pulling (the
        means of a stage come from the PS's last sums, close together). Blocks,
        at most the client's `timeout_s`; a dead peer or PS ends the wait at once."""
        client = self.client
        todo = [g for g in groups if g not in self._means and self.answers[g] is not None]
        if len(todo) < 2:
            return
        try:
            answers = client._wait([self.answers[g] for g in todo],
                                   [self.layout.ps_of_group[g] for g in todo], self.seq,
                                   self.label, watch=self.chosen)
            means = fetch([a[0] for a in answers], self.label, max(1.0, client.timeout_s))
        except actor_died_errors():  # (ObjectLostError included) each group is `mean`'s
            return
        for g, m in zip(todo, means):
            m = self._mean_of(g, m)
            if m is not None:
                self._means[g] = m

    def _mean_of(self, g: int, result):
        """Group `g`'s mean in its PS's `result` (the metas' group's carries the
        metas too: `metas`)."""
        return result[0] if g == self.metas_group and result is not None else result

    def release_means(self) -> None:
        """Drop the references to the PS actors' results (the step is applied), so
        the store frees the means now; this worker's parts stay (a peer's
        fallback may still ask for them)."""
        self.answers = [None] * len(self.answers)
        self._means.clear()

    def ready_prefix(self) -> int:
        """How many groups, from group 0 on, have their means here already (the
        rest are still being summed or sent), after a `collect`. Does not block."""
        self.collect()
        count = 0
        while count < len(self.answers) and count in self._means:
            count += 1
        return count

    def mean(self, g: int) -> tuple[np.ndarray, ...]:
        """Group `g`'s mean: one read-only array per shard of the group. Blocks, at
        most the client's `timeout_s`. If the group's PS died, the mean is made
        here from every worker's part (`fallback`); if that cannot be done
        either, the PS's death is raised."""
        import ray

        if g in self._means:
            return self._means.pop(g)
        client, ps = self.client, self.layout.ps_of_group[g]
        try:
            result_ref = client._wait([self.answers[g]], [ps], self.seq, self.label,
                                      watch=self.chosen)[0][0]
            means = self._mean_of(g, fetch(result_ref, f"{self.label}: group {g}'s mean",
                                           max(1.0, client.timeout_s)))
        except (*actor_died_errors(), ray.exceptions.ObjectLostError) as e:
            dead = getattr(e, "dead_ps", None)
            if dead is not None and ps not in dead:
                raise
            try:
                means = self.fallback(g)
                self.fell_back.append(g)
                return means
            except Exception as inner:  # noqa: BLE001 - the PS's death is the cause
                raise e from inner
        if means is None:
            raise RuntimeError(f"{client.what} {self.label}: group {g} has no mean (a worker "
                               "sent no gradient)")
        return means

    def fallback(self, g: int) -> tuple[np.ndarray, ...]:
        """Group `g`'s mean over every worker's part (backup workers: every
        contributor's), computed here as its PS would (the PS died): each peer
        is asked for its part (`Worker.parts_of`).
        Blocks, at most the client's `timeout_s`."""
        from dsgd.comm.means import group_means

        client = self.client
        if client.peers is None:
            raise RuntimeError("no peers to ask for their parts")
        # (backup workers: the contributors' parts, in rank order, as the PS sums them)
        ranks = range(client.world) if self.chosen is None else self.chosen
        asked = [None if r == client.rank else client.peers[r].parts_of.remote(self.seq, g)
                 for r in ranks]
        what = f"{self.label}: the workers' parts of group {g}"
        theirs = iter(fetch([a for a in asked if a is not None], what, client.timeout_s))
        refs = [[self.parts[g]] if a is None else next(theirs) for a in asked]
        if any(r is None or r[0] is None for r in refs):
            raise RuntimeError(f"a worker no longer holds its part of group {g}")
        parts = fetch([r[0] for r in refs], what, client.timeout_s)
        return group_means(self.layout.shards(g), parts)


def died(what: str, ps: Sequence[int] = ()) -> Exception:
    """An actor of the exchange died: Ray's `ActorDiedError` with `what` as a note
    (the driver's policy recovers from it as from any death) and the dead PS
    indices in `dead_ps`."""
    from ray.exceptions import ActorDiedError

    error = ActorDiedError()
    error.add_note(what)
    error.dead_ps = list(ps)
    return error


def abandon(ps: Sequence, attempt: int) -> list:
    """(driver side) Tell every live PS in `ps` to give up the exchanges of
    `attempt` and older (a failure was found): workers waiting in them return at
    once. Does not wait; returns the calls' refs."""
    return [p.abandon.remote(attempt) for p in ps if p is not None]


def gone(ps: Sequence, ranks: list[int], below: int) -> list:
    """(driver side, backup workers) Tell every live PS in `ps` that workers
    `ranks` of the membership whose exchanges are numbered below `below` died
    (`ParameterServer.gone`). Does not wait; returns the calls' refs."""
    return [p.gone.remote(ranks, below) for p in ps if p is not None]


def enable_timeline(ps: Sequence, on: bool) -> list:
    """(driver side) Have every live PS in `ps` record its events (or stop:
    dsgd/comm/timeline.py). Does not wait; returns the calls' refs."""
    return [p.enable_timeline.remote(on) for p in ps if p is not None]


def timeline_events(actor):
    """(driver side) The ref of a worker's or PS actor's timeline events since the
    last such call (`Recorder.drain`). Does not wait."""
    return actor.timeline_events.remote()


def collect_timeline_events(actors: Sequence, timeout_s: float) -> list[dict]:
    """(driver side) Every actor's timeline events since the last such call, in
    `actors` order; an actor that does not answer within `timeout_s` (or died)
    is left out, its events lost with it. Blocks, at most `timeout_s`."""
    refs = [timeline_events(a) for a in actors]
    answered = Deadline("timeline events", timeout_s).wait(refs)[0]
    events: list[dict] = []
    for answer in outcomes(answered, "timeline events", timeout_s):
        if not isinstance(answer, Exception):  # a dead actor's events are lost with it
            events += answer
    return events


def waiting(ps: Sequence, timeout_s: float) -> dict[int, set[int]]:
    """(driver side) {exchange number: ranks not arrived} over every live PS in
    `ps`, for the exchanges some worker waits in; PS actors that do not answer
    within `timeout_s` are left out. Blocks, at most `timeout_s`."""
    refs = [p.waiting.remote() for p in ps if p is not None]
    missing: dict[int, set[int]] = {}
    what = "the PS actors' waiting exchanges"
    for answer in outcomes(Deadline(what, timeout_s).wait(refs)[0], what):
        if isinstance(answer, Exception):  # a PS that cannot say is named by the timeout
            continue
        for seq, ranks in answer.items():
            missing.setdefault(seq, set()).update(ranks)
    return missing
