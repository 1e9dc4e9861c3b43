"""A worker's side of the workers' own exchange (strategy "ps", several
workers): `join` sets it up, `exchange_steps` runs steps through the PS actors
(dsgd/comm/ps_client.py), deciding each alike on every worker
(dsgd/comm/commit.py). A mixin of `Worker` (dsgd/worker/worker.py), which holds
`replicas`, `worker_index`, `applied_steps` and the data, and whose
`ApplySchedule` (dsgd/worker/apply_schedule.py) applies each decided step."""

from __future__ import annotations

import dataclasses
import time

import ray

from dsgd import constants
from dsgd.comm.reports import CompactAnswer, StepFailed, StepReport
from dsgd.comm.sharding import ExchangeLayout
from dsgd.errors import picklable_error


# When a decided step's update runs (StepPlan.update).
UPDATES = ("now", "in stages", "in the next call")


def checked_update(during_backward: bool, update: str | None) -> str:
    """`update`, or its default (None: "in the next call" when the buckets leave
    during the backward pass, else "now"; the defaults measured best:
    benchmarks/README.md); a ValueError names a bad one."""
    update = update or ("in the next call" if during_backward else "now")
    if update not in UPDATES or (update != "now" and not during_backward):
        raise ValueError(f"update must be one of {UPDATES} (other than \"now\" only when the "
                         f"buckets leave during the backward pass), got {update!r}")
    return update


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How this worker's steps run, decided at `join` from what every worker is
    told alike (so the same on every worker), and not changed until the next
    `join`. One state machine runs every step from it (`_step`):
    data -> compute and send -> arrive -> decide -> receive and apply -> record,
    with "arrive without compute" for a late worker sitting a step out or one
    whose data ended, and one abort (the step's exchange fails: nothing of it
    was applied here; see `exchange_steps`)."""
    buckets: ExchangeLayout  # the groups that leave, each to its PS
    during_backward: bool    # buckets leave during the backward pass (else after it)
    chosen: bool             # backup workers: PS 0 chooses each step's contributors
    # When the update runs (dsgd/worker/apply_schedule.py): "now", whole, once every
    # mean is in; "in stages": the buckets in at the decision first when at least
    # `split_min_share` of the gradient's bytes is still pending, the rest once in;
    # "in the next call": whole, inside the next step's compiled call when another
    # step follows in the same exchange_steps call (else as "in stages").
    update: str
    on_nonfinite: str        # a step with a non-finite gradient: "raise" or "skip"
    # Whether an update may run in two stages: not when the optimizers cannot be
    # applied in parts (Replicas.per_group_blocker says why).
    stages: bool = True
    split_min_share: float = constants.APPLY_SPLIT_MIN_SHARE

    @property
    def metas_with_gradient(self) -> bool:
        """Whether every worker's meta travels with its part of PS 0's group, and
        PS 0 returns the metas with the mean (one round: after the backward pass,
        without backup workers), rather than through PS 0's gather (during the
        backward pass the meta is made after the buckets leave) or `choose`."""
        return not self.during_backward and not self.chosen

    @classmethod
    def make(cls, layout: ExchangeLayout, during_backward: bool, chosen: bool,
             update: str | None, on_nonfinite: str, replicas) -> StepPlan:
        """The plan of `join` (`update`: see `checked_update`), for this worker's
        `replicas`: uncompiled ones (local mode) cannot run an update inside the
        next step's compiled call (then "in stages"), and optimizers that cannot
        be applied in parts run no update in stages."""
        from dsgd.comm.sharding import bucket_layout

        update = checked_update(during_backward, update)
        if update == "in the next call" and replicas.eager:
            update = "in stages"
        buckets = bucket_layout(layout, constants.BUCKET_MIN_BYTES) if during_backward \
            else layout
        return cls(buckets, during_backward, chosen, update, on_nonfinite,
                   stages=replicas.per_group_blocker is None)


class ExchangeSession:
    """The exchange's state on one worker, made at `join` (see its docstring) and
    kept across `exchange_steps` calls."""

    def _init_exchange(self) -> None:
        self._client = None  # the PSClient of the exchange joined last (join)
        self.plan: StepPlan | None = None  # how the steps run (join)
        self._dead_ps: list[int] = []  # PS actors found dead by a fallback: replaced next
        self._late = False  # backup workers: dropped from the last step (exchange_steps)
        self._recent_metas: dict = {}  # exchange number -> every worker's meta (recent steps)
        self._step_exchanges: dict = {}  # exchange number -> its StepExchange (this step's; the last's until
        # every worker has applied it)
        self.buckets_averaged_here = 0  # buckets this worker averaged itself (their PS died)
        self._next_in_call = False  # _run_steps: another step follows this one
        self._metas_kept = 0  # exchange_steps: how many of them to keep at least

    def join(self, rank: int, peers: list, ps: list, ps_names: list[str], layout,
             timeout_s: float, on_nonfinite: str, need: int | None = None,
             timeline_on: bool = False, during_backward: bool = False,
             update: str | None = None) -> None:
        """Take part in the worker-driven exchange (`exchange_steps`) as worker
        `rank` of `peers` (every worker's handle, in rank order) through the PS
        actors `ps` laid out as `layout`, with the steps planned from
        `during_backward` and `update` (`StepPlan.make`; the plan holds until
        the next `join`). `need` (backup workers): each step's mean is over the
        first `need` workers to have their gradient (default: all).
        `timeline_on`: record this worker's steps for the timeline
        (dsgd/comm/timeline.py). The driver calls it after start-up, after every
        change of workers or PS actors, and after `StepLoop.replan`. Without
        `during_backward` the buckets are `layout`'s groups (one message per PS
        group, sent once the gradient is computed) and the update runs at once."""
        from dsgd.comm import timeline
        from dsgd.comm.ps_client import PSClient

        timeline.enable(f"worker {self.worker_index}", timeline_on)
        client = PSClient(ps, ps_names, rank, len(peers), timeout_s,
                          f"worker {self.worker_index}", peers=peers, need=need)
        self.plan = StepPlan.make(layout, during_backward, client.choosing, update,
                                  on_nonfinite, self.replicas)
        self._client = client
        self._step_exchanges.clear()
        self._dead_ps = []
        self._late = False

    @property
    def _buckets(self):
        """The plan's buckets (an ExchangeLayout)."""
        return self.plan.buckets

    def exchange_steps(self, datas: list, seqs: list[int], run: int, compact: bool = False,
                       reporter: bool = False, timeout_s: float | None = None
                       ) -> list | CompactAnswer:
        """Synchronous steps with every other worker, exchanged by this worker
        itself through the PS actors (`join`): for each step, the gradient,
        averaged across local replicas, goes to the PS actors group by group with
        this worker's meta (dsgd/comm/commit.py); every worker reads the same
        means and metas back, decides the step alike (apply, skip, halt, epoch
        end) and applies the means before the next step. With the plan's
        `during_backward` (`join`) each bucket leaves during the backward pass instead, the metas go to PS
        0 once the step is computed, and the means are applied as they arrive
        (`_step`). `seqs[i]` numbers step
        i's exchange (the same on every worker); `datas` None: every step's
        batches from get_batch.

        Returns one StepReport per step run (dsgd/comm/reports.py: as
        `local_step`'s plus `exchange_s`, `apply_s`, `nonfinite`: every worker's
        non-finite (slot, replica), and `decision`); fewer than asked at an
        epoch's end, after a halting non-finite step, at a step that raised
        (then a last StepRaised), or when the exchange failed (a dead or hung
        peer or PS: a last StepFailed; nothing of that step was applied here). After a halt,
        an error or a failure, later calls of the same `run` return [] at once:
        steps queued behind it must not run. Blocks; each exchange waits at
        most `timeout_s` (default: the `join` timeout; the driver gives a
        worker's first call after it joined running workers longer, as it
        traces its compiled step alone: Config.first_steps_timeout_s).

        `compact`: when every step asked was applied or skipped, return instead
        a `CompactAnswer` (its steps, this worker's figures over them, one
        `StepSummary` per step if `reporter`: every worker's totals, from the
        metas; the positions of the skipped steps), so that what the driver
        reads per step does not grow with the workers; any other ending
        returns the list above.

        Backup workers (`join` with a `need`): each step's contributors are
        the first `need` workers to have their whole gradient (PS 0 chooses;
        dsgd/comm/ps_client.py `choose`); the others receive the means without
        sending a gradient. A worker dropped from a step is *late*: before its next step it
        asks whether that step's contributors are chosen already, and if so it
        sits the step out (no batch read or drawn, no gradient computed) and
        only applies the mean, until it has caught up. Its reports say
        `contributed` / `sat_out`; the reporter's compact answer carries every
        contributor's tally (`tallies`, by slot, from the metas), and each
        worker's `dropped`: [batches, rows] it computed from get_batch and saw
        dropped."""
        if run == self._halted_run:
            return []
        client = self._client
        joined_timeout_s = client.timeout_s if client is not None else None
        if timeout_s is not None and client is not None:
            client.timeout_s = timeout_s
        try:
            return self._run_steps(datas, seqs, run, compact, reporter)
        finally:
            # A step decided last in this call, or before one that stopped, and kept for
            # the next step's compiled call (`_Deferred`): applied now, so that what is
            # read between calls (weights, checkpoints) is every decided step's.
            self._next_in_call = False
            self._apply_deferred()
            # This call's last step's parts (kept for a peer's fallback) are not kept
            # beyond the call, so the store drains between calls; but after a fallback
            # (a PS died) they are kept until the driver has replaced it (`join`): the
            # peers may still be averaging that bucket. (A peer that falls back when
            # this worker had read the mean before the PS died finds them gone; if it
            # had begun applying it exits, recovered as a death.)
            if not self._dead_ps:
                self._step_exchanges.clear()
            if client is not None:
                client.timeout_s = joined_timeout_s

    def _run_steps(self, datas: list, seqs: list[int], run: int, compact: bool,
                   reporter: bool) -> list | CompactAnswer:
        """`exchange_steps`' steps, one `_step` each, until one ends the call (an
        epoch's end, a halt, an error, or the abort: a failed exchange, whose
        StepFailed ends the list); then the call's answer (`_answer`)."""
        from dsgd.comm.waits import actor_died_errors
        from dsgd.errors import ExchangeAbandoned, StepTimeoutError

        self._metas_kept = 2 * len(seqs)
        infos = []
        if datas is None:
            datas = [None] * len(seqs)
        for k, (data, seq) in enumerate(zip(datas, seqs)):
            # (a step whose batches come from get_batch is applied before it is called:
            # get_batch may read the model's state, e.g. its optimizer's iteration count)
            self._next_in_call = k + 1 < len(seqs) and datas[k + 1] is not None
            try:
                info = self._step(data, seq)
            except (*actor_died_errors(), StepTimeoutError, ExchangeAbandoned) as e:
                self._halted_run = run
                # Without its traceback: its frames hold the step's object refs (the
                # group parts put for the PS), which the returned error would keep.
                failure = picklable_error(e).with_traceback(None)
                failure.__context__ = failure.__cause__ = None
                infos.append(StepFailed(failure, abandoned=isinstance(e, ExchangeAbandoned)))
                break
            except Exception as e:
                self._halted_run = run
                infos.append(self._step_error(e, infos, len(datas), "steps"))
                break
            infos.append(info)
            if info.epoch_end:
                break
            if info.decision == "halt":
                self._halted_run = run
                break
        return self._answer(infos, seqs, compact, reporter)

    def _answer(self, infos: list, seqs: list[int], compact: bool,
                reporter: bool) -> list | CompactAnswer:
        """The call's answer: its reports, or with `compact` (and every step applied
        or skipped, or with backup workers ended by an epoch's end or a halt
        after them) a CompactAnswer (see `exchange_steps`)."""
        backups = self.plan.chosen
        done = [i for i in infos if isinstance(i, StepReport) and i.decision in ("apply", "skip")]
        end = None
        if backups and infos and len(done) == len(infos) - 1 and isinstance(infos[-1], StepReport):
            end = "epoch_end" if infos[-1].epoch_end else \
                "halt" if infos[-1].decision == "halt" else None
        if compact and (len(done) == len(seqs) or end is not None):
            out = self._compact(done, seqs[:len(done)], reporter, backups)
            if end is not None:  # (backup workers: the driver reads the reporters only)
                out.end = end
                if end == "halt":
                    out.nonfinite = infos[-1].nonfinite
            return out
        return infos

    def _compact(self, infos: list, seqs: list[int], reporter: bool,
                 backups: bool = False) -> CompactAnswer:
        from dsgd.comm import reports

        tally = reports.worker_tally()
        for info in infos:
            if not backups or info.contributed:
                reports.add_step(tally, info)
        steps = [reports.step_summary([m for m in self._recent_metas[seq] if m is not None],
                                      info) for seq, info in zip(seqs, infos)] if reporter else None
        out = CompactAnswer(len(infos), tally, steps,
                            [i for i, info in enumerate(infos) if info.decision == "skip"])
        if backups:
            dropped = [i for i in infos if i.dropped_rows is not None]
            out.dropped = [len(dropped), sum(i.dropped_rows for i in dropped)]
            if reporter:  # every contributor's figures, from the metas (not only this worker's)
                tallies: dict = {}
                for seq in seqs:
                    for m in self._recent_metas[seq]:
                        if m is not None:
                            reports.add_step(tallies.setdefault(m.slot, reports.worker_tally()),
                                             m.report)
                out.tallies = tallies
        return out

    def _step(self, data, seq: int) -> StepReport:
        """One step, the one state machine of every plan (`StepPlan`), in phases:
        data, compute and send (`_compute_sending`: each bucket goes to its PS
        during the backward pass, from inside the compiled step, or once the
        gradient is computed), arrive (`_arrive`: every worker's meta gathered,
        or backup workers' contributors chosen), decide and apply
        (`_decide_and_apply`: alike everywhere, the buckets' means applied as
        they arrive, each update exactly that of one apply), record. A worker
        that computes nothing (a late one sitting the step out, or one whose
        data ended) arrives without compute (`_arrive_without_compute`). Any
        failure of the exchange aborts the step (raised to `_run_steps`).

        Backup workers: the buckets leave as they do without them, before the
        contributors are chosen; each PS keeps every worker's part of its
        buckets until PS 0 has chosen (`StepExchange.choose`, instead of gathering
        every meta) and then sums the contributors' parts only. A late worker
        whose next step is chosen already sits it out."""
        client = self._client
        start = time.perf_counter()
        label = f"step {self._step_number()}"
        self._check_ps_replaced(label)
        chosen = client.decided(seq, label) if self.plan.chosen and self._late else None
        if chosen is not None:
            self._apply_deferred()  # (a step of its own kept for this call: applied first)
        exchange = client.step_exchange(self._buckets, seq, label,
                                        self.plan.metas_with_gradient)
        self._step_exchanges[seq] = exchange
        if chosen is not None:
            return self._arrive_without_compute(seq, exchange, start, chosen)
        computed, samples, data_s = self._compute_sending(exchange, data, start)
        if computed is None:
            return self._arrive_without_compute(seq, exchange, start)
        computed_at = time.perf_counter()
        report = _report(computed, samples, data_s, computed_at - start)
        metas, contributed = self._arrive(seq, exchange, self._meta(report))
        if contributed is not None:  # backup workers
            report.contributors = sorted(m.slot for m in metas)
            report.contributed = contributed
            if not contributed and data is None:
                report.dropped_rows = samples  # a get_batch batch computed for nothing
        decision, apply_s = self._decide_and_apply(exchange, metas)
        if decision is None:  # (backup workers: the contributors' data ended, this
            return StepReport(epoch_end=True)  # worker's not yet)
        end = time.perf_counter()
        report.exchange_s, report.apply_s = end - computed_at - apply_s, apply_s
        report.applied, report.decision = decision.applied, decision.action
        report.nonfinite = list(decision.nonfinite)
        self._record_step(seq, start, start + data_s, computed_at, end)
        return report

    def _check_ps_replaced(self, label: str) -> None:
        """A PS died last step (its buckets were averaged by the workers): the step
        stops at its start naming it, for the driver to replace it."""
        from dsgd.comm.ps_client import died

        if self._dead_ps:
            dead = self._dead_ps
            raise died(f"worker {self.worker_index} {label}: PS actor(s) "
                       f"{', '.join(self._client.names[j] for j in dead)} died (the last "
                       "step's means were made by the workers)", ps=dead)

    def _meta(self, report: StepReport):
        """This worker's meta of a computed step (dsgd/comm/commit.py)."""
        from dsgd.comm import commit

        return commit.meta(self.worker_index, report.finite, list(report.metrics),
                           report=dataclasses.replace(report))  # (a copy: `report` changes)

    def _compute_sending(self, exchange, data, start: float) -> tuple:
        """Phases data, compute and send: ((losses, finite, metrics) of the compiled
        step, or None at the end of the data; samples; data_s). The buckets leave
        during the backward pass (`StepPlan.during_backward`: a decided step kept
        for this call, `_Deferred`, is applied inside it) or once the whole
        gradient is computed. An error aborts the step (`_abort_compute`)."""
        shards, groups = self.replicas.plan.shards, self._buckets.groups

        def send(g: int, arrays: dict) -> None:
            exchange.send(g, tuple(arrays[p.var_index][p.var_offset:p.var_offset + p.length]
                                   for j in groups[g] for p in shards[j].pieces))

        deferred, fused = self._deferred, None  # the last step's means, applied in this call
        try:
            batches, samples = self._batches(data)
            data_s = time.perf_counter() - start
            if batches is None:
                return None, samples, data_s
            self.begin_compute()
            if not self.plan.during_backward:
                losses, finite, flat_grads, metrics = self.replicas.compute(batches)
                pieces = self.replicas.shard_pieces(flat_grads)
                for g, group in enumerate(groups):
                    exchange.send(g, tuple(piece for j in group for piece in pieces[j]))
                return (losses, finite, metrics), samples, data_s
            fused = time.perf_counter() if deferred is not None else None
            losses, finite, metrics, _ = self.replicas.compute_sending(
                groups, batches, send, deferred=None if deferred is None else deferred.shards)
            if fused is not None:
                self._deferred_applied(deferred, fused)
            return (losses, finite, metrics), samples, data_s
        except Exception as e:
            self._abort_compute(exchange, e, deferred if fused is not None else None, fused)
            raise

    def _abort_compute(self, exchange, error: Exception, deferred, fused: float | None) -> None:
        """The step's compute or send raised `error`: the last step's update kept
        for this call (`deferred`, fused into it at `fused`) is accounted for (a
        worker whose weights may be partly updated exits), and every worker is
        told (no gradient, this error) so that none waits for this one. The
        caller raises `error`."""
        from dsgd.comm import commit

        if deferred is not None and self._deferred is deferred:
            ran = self.replicas.deferred_applied
            if ran is False:  # (the last step's update may have run in part)
                self._exit_partly_applied(error, self._step_number() - 1)
            if ran:
                self._deferred_applied(deferred, fused)
            # (else it did not run: exchange_steps applies it on its own, or raises)
        try:  # no PS or peer waits for this worker's gradient: they stop now
            exchange.send_no_gradient()
            failed = commit.meta(self.worker_index, None, None, error)
            exchange.choose(failed) if exchange.chosen_later else exchange.metas(failed)
        except Exception:  # noqa: BLE001 - this worker's own error is the one to report
            pass

    def _arrive(self, seq: int, exchange, mine: dict) -> tuple[list, bool | None]:
        """Phase arrive: (every contributor's meta, in rank order of the
        contributors; whether this worker is one, None without backup workers).
        Every worker's meta comes with PS 0's group's mean or from PS 0's gather
        (`StepPlan.metas_with_gradient`), or with backup workers PS 0 names the first
        `need`. Keeps this step's `StepExchange` while a peer may still ask for
        its parts, and the metas for reports."""
        if not exchange.chosen_later:
            metas = exchange.metas(mine)
            # Every worker has applied the last step (each sends its meta only after): no
            # peer's fallback can ask for its parts any more.
            self._step_exchanges = {seq: exchange}
            self._keep_metas(seq, metas)
            return metas, None
        chosen = exchange.choose(mine)
        self._contributors_known(seq, chosen)
        return chosen.metas, chosen.mine

    def _contributors_known(self, seq: int, chosen) -> None:
        """(backup workers) Step `seq`'s contributors are `chosen` (a Chosen): this
        worker is late unless one of them; their metas are kept (rank order); the
        last step's exchange is kept too (a worker of its contributors may still
        be applying it: its fallback may ask for this worker's parts of it)."""
        self._late = not chosen.mine
        self._keep_metas(seq, self._by_rank(chosen.ranks, chosen.metas))
        self._step_exchanges = {k: v for k, v in self._step_exchanges.items() if k >= seq - 1}

    def _decide_and_apply(self, exchange, metas: list) -> tuple:
        """Phases decide and apply: the step decided from the contributors' metas,
        alike on every worker (dsgd/comm/commit.py), and, if applied, its means
        applied as they arrive (`_apply_arriving`). Returns (decision, seconds
        applying); (None, 0.0) when the contributors' data ended."""
        from dsgd.comm import commit

        decision = commit.decide(metas, self.plan.on_nonfinite)
        if decision.action == commit.EPOCH_END:
            exchange.release_means()
            return None, 0.0
        apply_s = 0.0
        if decision.action == commit.APPLY:
            apply_s = self._apply_arriving(exchange, self._buckets)
            self._freeze_gc_once()
        self._applied_from(exchange)
        return decision, apply_s

    def _applied_from(self, exchange) -> None:
        """A step's means are applied (or kept for the next call: `_Deferred`): drop
        the references to them, and note the buckets averaged here because their
        PS died (the next step stops at its start naming it)."""
        if self._deferred is None or self._deferred.exchange is not exchange:
            exchange.release_means()
        if exchange.fell_back:
            self.buckets_averaged_here += len(exchange.fell_back)
            self._dead_ps = sorted({self._buckets.ps_of_group[g] for g in exchange.fell_back})

    def _by_rank(self, chosen: list[int], metas: list) -> list:
        """The contributors' `metas` (in `chosen` order) at their ranks, None elsewhere."""
        full: list = [None] * self._client.world
        for r, m in zip(chosen, metas):
            full[r] = m
        return full

    def _arrive_without_compute(self, seq: int, exchange, start: float,
                                chosen=None) -> StepReport:
        """Phase arrive without compute: this worker sends no gradient for step
        `seq` (each PS drops its part, and needs none), either because it sits
        the step out (backup workers: a late worker whose step's contributors
        are `chosen` already, PSClient.decided's Chosen) or because
        its data ended. Without backup workers an ended data ends the step for
        everyone (commit.decide raises unless every worker's epoch ended); with
        them the contributors may still have had data, and this worker decides
        the step as they do and applies its means as they arrive. Returns the
        step's report."""
        from dsgd.comm import commit

        sat_out = chosen is not None
        if sat_out:
            exchange.sit_out(chosen.ranks)
        else:
            exchange.send_no_gradient()
            ended = commit.meta(self.worker_index, None, None)
            if not exchange.chosen_later:
                commit.decide(exchange.metas(ended), self.plan.on_nonfinite)
                return StepReport(epoch_end=True)
            chosen = exchange.choose(ended)
        self._contributors_known(seq, chosen)
        metas = chosen.metas
        sent = time.perf_counter()
        decision, apply_s = self._decide_and_apply(exchange, metas)
        if decision is None:
            return StepReport(epoch_end=True)
        end = time.perf_counter()
        self._record_step(seq, start, sent, sent, end, sat_out=sat_out)
        return StepReport(exchange_s=end - sent - apply_s, apply_s=apply_s,
                          applied=decision.applied, decision=decision.action,
                          nonfinite=list(decision.nonfinite),
                          contributors=sorted(m.slot for m in metas),
                          contributed=False, sat_out=sat_out)

    @ray.method(concurrency_group="peer")
    def parts_of(self, seq: int, g: int) -> list:
        """[this worker's part (an ObjectRef) of bucket `g` of exchange `seq`], or
        [None] if it no longer holds it: a peer whose PS died averages that
        bucket itself (`StepExchange.fallback`). Runs beside `exchange_steps` (its
        own concurrency group), answering at once."""
        exchange = self._step_exchanges.get(seq)
        return [None if exchange is None else exchange.parts[g]]

    def _keep_metas(self, seq: int, metas: list) -> None:
        """Keep step `seq`'s metas (rank order), at least a whole call's: the
        reporter summarises its steps from them, recent_reports serves them."""
        self._recent_metas[seq] = metas
        while len(self._recent_metas) > max(64, self._metas_kept):
            del self._recent_metas[next(iter(self._recent_metas))]

    def recent_reports(self, seqs: list[int]) -> dict:
        """{exchange number: every worker's meta (rank order)} of the recent steps
        among `seqs` this worker exchanged: the driver rebuilds from them the
        reports of a worker that died after applying them."""
        return {seq: self._recent_metas[seq] for seq in seqs if seq in self._recent_metas}


def _report(computed: tuple, samples, data_s: float, compute_s: float) -> StepReport:
    """A computed step's report (its figures; the exchange's are added once it is
    decided): `computed` is the compiled step's (losses, finite, metrics)."""
    losses, finite, metrics = computed
    return StepReport(losses=losses.numpy().tolist(), finite=finite.numpy().tolist(),
                      metrics={k: v.numpy().tolist() for k, v in metrics.items()},
                      samples=samples, data_s=data_s, compute_s=compute_s)
