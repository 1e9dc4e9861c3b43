"""The worker actor: one process holding `devices_per_worker` replicas.

The driver wraps `Worker` with `ray.remote` and calls it; a worker also
calls PS actors (`apply_staged` waits on their means) and, when a PS died
mid-step, averages that group itself. Call order:

1. `setup()` once (imports TensorFlow, builds the replicas), then
   `configure(plan)` once per shard plan (compiles the step functions);
2. `attach_data(key, loader)` / `detach_data(key)` when a `dsgd.Dataset`
   feed starts or ends (see dsgd/data/feeds.py);
3. per step, one of
   - `local_step(data)` or `local_steps(datas, run)` (one worker: no exchange),
   - `compute(groups, data)` (streamed gradient groups), then `apply(groups,
     *means)` (the driver passes every group's mean) or `apply_staged(groups,
     mean_refs, grad_refs, ...)` (each group applied as its mean arrives);
4. any time between steps: state and checkpoints (`get_state`, `set_state`,
   `get_full_state`, `set_full_state`, `get/set_weights`, `save_checkpoint`,
   `restore_checkpoint`), `ping`, and the user's `foreach_model`,
   `foreach_worker` and `run(fn, *args)`.

A step's batches come from each replica's `get_batch()`, or, when the driver
passes `data`, from the loader that `attach_data` installed.

`applied_steps` counts the steps this worker has applied; the driver reads it
(`ping`) after a failure to tell whether the interrupted step was applied.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from dsgd import constants
from dsgd.comm import store, timeline
from dsgd.worker import checkpoint_files
from dsgd.errors import DsgdError
from dsgd.model import Model
from dsgd.worker.replicas import Replicas
from dsgd.comm.sharding import ShardPlan


@dataclasses.dataclass
class _Pending:
    """An overlapped step decided and read, whose update runs in the next step's
    compiled call (Replicas.compute_sending's `pending`): the forward pass of
    the first layers then overlaps the update of the others. Kept only within
    one exchange_steps call (flushed at its end, so that weights read between
    calls are the applied step's)."""
    sending: Any            # the step's Sending (its means are released once applied)
    shards: list            # the mean of every shard, by shard index (read-only views)
    step: int               # the timeline's step number


class Worker:
    def __init__(self, model_creator: Callable[[int, int], Model], worker_index: int,
                 devices_per_worker: int, gpu: bool, all_reduce_alg: str,
                 worker_init: Callable[[], Any] | None = None):
        self.worker_index = worker_index
        self.worker_init = worker_init
        self.applied_steps = 0
        self._gc_frozen = False
        self._loaders: dict = {}  # data feed key -> loader (dsgd/data/feeds.py)
        self._halted_run = None  # local_steps, exchange_steps: the run that was stopped
        self._exchange = None  # (PSClient, layout, on_nonfinite) after join()
        self._late = False  # backup workers: dropped from the last step (exchange_steps)
        self._recent_metas: dict = {}  # exchange number -> every worker's meta (recent steps)
        self._sendings: dict = {}  # exchange number -> its Sending (this step's; the last's until
        # every worker has applied it)
        self.overlap = False  # send the gradient during the backward pass (join)
        # Apply the buckets in at the decision before the rest only when the rest is at
        # least this share of the gradient's bytes (constants.APPLY_SPLIT_MIN_PENDING).
        self.split_apply = constants.APPLY_SPLIT_MIN_PENDING
        # Overlapped steps applied here: each bucket its own update as its mean arrives
        # (True), instead of at most two (benchmarks/overlap.py measures both).
        self.apply_each_bucket = False
        self.fell_back = 0  # buckets this worker averaged itself (their PS died)
        # Overlapped steps: each bucket's put and call from a sender thread, not from
        # the TensorFlow thread of its op (Sending.send_later; benchmarks/overlap.py).
        self.send_thread = constants.SEND_THREAD
        # Overlapped steps: apply a decided step's means inside the next step's compiled
        # call when one follows in the same exchange_steps call (`_Pending`).
        self.defer_apply = True
        self.deferred_applies = 0  # steps applied so, in all
        self._pending: _Pending | None = None
        self._next_in_call = False  # _exchange_steps: another step follows this one
        self._metas_kept = 0  # exchange_steps: how many of them to keep at least
        self.replicas = Replicas(model_creator, worker_index, devices_per_worker, gpu,
                                 all_reduce_alg)

    def setup(self) -> dict:
        """Build the replicas (imports TensorFlow). Returns their variable signature
        (names, shapes, dtypes), devices, node id and pid."""
        import ray

        if self.worker_init is not None:
            self.worker_init()  # e.g. environment variables, a Keras precision policy
        info = self.replicas.setup()
        info["node_id"] = ray.get_runtime_context().get_node_id()
        return info

    def configure(self, plan: ShardPlan, on_nonfinite: str = "raise",
                  warm_store_bytes: int = 0) -> dict:
        """Compile the step for `plan` and warm `warm_store_bytes` of this process's
        object-store mapping (store.warm). Returns {"per_group_blocker": why the
        step cannot be applied group by group (`apply_staged`), or None}."""
        self.replicas.configure(plan, on_nonfinite)
        self.warmed_store_bytes = store.warm(warm_store_bytes)
        self._gc_frozen = False  # new functions: freeze again once they are traced
        return {"per_group_blocker": self.replicas.per_group_blocker}

    def _freeze_gc_once(self) -> None:
        """After the first step (TensorFlow, Keras and the traced step are built),
        move every object alive into Python's permanent GC generation, so that
        full collections stop walking them every few steps (what that cost:
        benchmarks/design_measurements.md). Objects made later are collected
        as usual."""
        if not self._gc_frozen:
            import gc

            gc.collect()
            gc.freeze()
            self._gc_frozen = True

    def ping(self) -> dict:
        """Liveness and progress; runs after every call queued before it."""
        import os

        return {"applied_steps": self.applied_steps, "pid": os.getpid()}

    def attach_data(self, key: int, loader) -> None:
        """Steps that pass `data=(key, arg)` take their batches from `loader`
        (replacing any loader under `key`): `loader.batches(arg, num_devices)`
        returns (one batch per replica, rows in this worker's batch), or None
        at the end of an epoch. Loaders are kept until `detach_data`, so a
        dataset trained on again continues where it stopped."""
        self._loaders[key] = loader

    def detach_data(self, key: int) -> None:
        self._loaders.pop(key, None)

    def _batches(self, data) -> tuple[list | None, int]:
        """(one batch per replica, samples), or (None, 0) at the end of the data's epoch."""
        if data is None:
            batches = self.replicas.next_batches()
            return batches, sum(_rows(b) for b in batches)
        key, arg = data
        if key not in self._loaders:
            raise DsgdError(f"worker {self.worker_index}: a step passed data of feed {key} but "
                            "no such data loader is attached (attach_data)")
        loaded = self._loaders[key].batches(arg, self.replicas.num_devices)
        return loaded if loaded is not None else (None, 0)

    def local_step(self, data=None) -> dict:
        """A whole step with no exchange (num_workers == 1). Blocks until applied.
        `finite` says which replicas' gradients were finite; `applied` whether
        the update ran (not with a non-finite gradient and on_nonfinite="skip");
        `epoch_end` (and nothing else) when `data`'s epoch had ended."""
        start = time.perf_counter()
        batches, samples = self._batches(data)
        if batches is None:
            return {"epoch_end": True}
        data_s = time.perf_counter() - start
        self.begin_compute()
        losses, finite, metrics = self.replicas.local_step(batches)
        computed = time.perf_counter()
        finite = finite.numpy().tolist()
        applied = all(finite) or not self.replicas.gate_apply
        self.applied_steps += applied
        self._freeze_gc_once()
        tl = timeline.recorder()
        if tl.on:  # (one compiled call: forward, backward, local mean and update)
            to_wall = time.time() - time.perf_counter()
            tl.add("data", "step", start + to_wall, start + data_s + to_wall,
                   step=self.applied_steps)
            tl.add("compute and apply", "step", start + data_s + to_wall, computed + to_wall,
                   step=self.applied_steps)
            self.forward_backward_spans(tl, start + data_s, computed, self.applied_steps)
        return {"losses": losses.numpy().tolist(), "finite": finite, "applied": applied,
                "metrics": {k: v.numpy().tolist() for k, v in metrics.items()},
                "samples": samples, "data_s": data_s, "compute_s": time.perf_counter() - start}

    def local_steps(self, datas: list, run: int, timeline_on: bool = False) -> list[dict]:
        """Several `local_step`s in one call (one worker, `train()`): one info per
        step run, in order; `timeline_on`: record each step's `data` and `compute
        and apply` on the timeline (dsgd/comm/timeline.py). Stops after a step whose data's epoch ended, and after
        a step with a non-finite gradient under on_nonfinite="raise" (that step
        was applied, as with `local_step`), or at a step that raised (raised
        here if it was the first, else returned as a last {"error": exception}
        after the infos of the steps applied before it); later calls with the
        same `run` then return [] without running anything, so that steps
        queued behind it are not applied. Blocks until the steps are applied."""
        if run == self._halted_run:
            return []
        if timeline_on != timeline.recorder().on:
            timeline.enable(f"worker {self.worker_index}", timeline_on)
        infos = []
        for data in datas:
            try:
                info = self.local_step(data)
            except Exception as e:
                self._halted_run = run  # nothing queued behind this call runs either
                infos.append(self._step_error(e, infos, len(datas), "local steps"))
                break
            infos.append(info)
            if info.get("epoch_end"):
                break
            if not all(info["finite"]) and info["applied"]:
                self._halted_run = run
                break
        return infos

    def _step_error(self, e: Exception, infos: list, total: int, what: str) -> dict:
        """A step of a call of several raised: re-raised if it was the first (nothing
        applied); else the steps before it were applied, so it is reported after
        them, as {"error": e}, with a note saying which step of the call it was."""
        if not infos:
            raise e
        e.add_note(f"(worker {self.worker_index}, step {len(infos) + 1} of a call of {total} "
                   f"{what}; the {len(infos)} before it were applied)")
        return {"error": _picklable(e)}

    def join(self, rank: int, peers: list, ps: list, ps_names: list[str], layout,
             timeout_s: float, on_nonfinite: str, need: int | None = None,
             timeline_on: bool = False, overlap: bool = False) -> None:
        """Take part in the worker-driven exchange (`exchange_steps`) as worker
        `rank` of `peers` (every worker's handle, in rank order) through the PS
        actors `ps` laid out as `layout`. `need` (backup workers): each step's
        mean is over the first `need` workers to have their gradient (default:
        all). `timeline_on`: record this worker's steps for the timeline
        (dsgd/comm/timeline.py). `overlap`: send the gradient during the
        backward pass (`_overlapped_step`). The driver
        calls it after start-up and after every change of workers or PS actors."""
        from dsgd import constants
        from dsgd.comm import timeline
        from dsgd.comm.ps_client import PSClient
        from dsgd.comm.sharding import bucket_layout

        timeline.enable(f"worker {self.worker_index}", timeline_on)
        self._exchange = (PSClient(ps, ps_names, rank, len(peers), timeout_s,
                                   f"worker {self.worker_index}", peers=peers, need=need),
                          layout, on_nonfinite)
        self._buckets = bucket_layout(layout, constants.BUCKET_MIN_BYTES)
        self.overlap = overlap
        self._sendings.clear()
        self._dead_ps: list[int] = []  # PS actors found dead by a fallback: replaced next
        self._late = False

    def exchange_steps(self, datas: list, seqs: list[int], run: int, compact: bool = False,
                       reporter: bool = False) -> list[dict] | dict:
        """Synchronous steps with every other worker, exchanged by this worker
        itself through the PS actors (`join`): for each step, the gradient,
        averaged across local replicas, goes to the PS actors group by group with
        this worker's meta (dsgd/comm/commit.py); every worker reads the same
        means and metas back, decides the step alike (apply, skip, halt, epoch
        end) and applies the means before the next step. With `overlap` (`join`)
        each bucket leaves during the backward pass instead, the metas go to PS
        0 once the step is computed, and the means are applied as they arrive
        (`_overlapped_step`). `seqs[i]` numbers step
        i's exchange (the same on every worker); `datas` None: every step's
        batches from get_batch.

        Returns one report per step run, as `local_step`'s plus `exchange_s`,
        `apply_s`, `nonfinite` (every worker's non-finite (slot, replica)) and
        `decision`; fewer than asked at an epoch's end, after a halting
        non-finite step, at a step that raised (then a last {"error": e}), or
        when the exchange failed (a dead or hung peer or PS: a last
        {"failure": e}; nothing of that step was applied here). After a halt,
        an error or a failure, later calls of the same `run` return [] at once:
        steps queued behind it must not run. Blocks; each exchange waits at
        most the `join` timeout.

        `compact`: when every step asked was applied or skipped, return instead
        {"compact": n steps, "tally": this worker's figures over them
        (dsgd/comm/reports.py), "steps": one `step_summary` per step (every
        worker's totals, from the metas) if `reporter`, else None, "skipped":
        the positions of the skipped steps}, so that
        what the driver reads per step does not grow with the workers; any
        other ending returns the list above.

        Backup workers (`join` with a `need`): each step's contributors are
        the first `need` workers to have their whole gradient (PS 0 chooses;
        dsgd/comm/ps_client.py `choose`); the others receive the means without
        sending. A worker dropped from a step is *late*: before its next step it
        asks whether that step's contributors are chosen already, and if so it
        sits the step out (no batch read or drawn, no gradient computed) and
        only applies the mean, until it has caught up. Its reports say
        `contributed` / `sat_out`; the reporter's compact answer carries every
        contributor's tally ("tallies", by slot, from the metas), and each
        worker's "dropped": [batches, rows] it computed from get_batch and saw
        dropped."""
        if run == self._halted_run:
            return []
        try:
            return self._exchange_steps(datas, seqs, run, compact, reporter)
        finally:
            # A step decided last in this call, or before one that stopped, and kept for
            # the next step's compiled call (`_Pending`): applied now, so that what is
            # read between calls (weights, checkpoints) is every decided step's.
            self._next_in_call = False
            self._flush_pending()
            # This call's last step's parts (kept for a peer's fallback) are not kept
            # beyond the call, so the store drains between calls; but after a fallback
            # (a PS died) they are kept until the driver has replaced it (`join`): the
            # peers may still be averaging that bucket. (A peer that falls back when
            # this worker had read the mean before the PS died finds them gone; if it
            # had begun applying it exits, recovered as a death.)
            if not self._dead_ps:
                self._sendings.clear()

    def _exchange_steps(self, datas: list, seqs: list[int], run: int, compact: bool,
                        reporter: bool) -> list[dict] | dict:
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
                info = self._exchange_step(data, seq)
            except (*actor_died_errors(), StepTimeoutError, ExchangeAbandoned) as e:
                self._halted_run = run
                # Without its traceback: its frames hold the step's object refs (the
                # group parts put for the PS), which the returned error would keep.
                failure = _picklable(e).with_traceback(None)
                failure.__context__ = failure.__cause__ = None
                infos.append({"failure": failure, "abandoned": isinstance(e, ExchangeAbandoned)})
                break
            except Exception as e:
                self._halted_run = run
                infos.append(self._step_error(e, infos, len(datas), "steps"))
                break
            infos.append(info)
            if info.get("epoch_end"):
                break
            if info["decision"] == "halt":
                self._halted_run = run
                break
        backups = self._exchange[0].choosing
        done = [i for i in infos if i.get("decision") in ("apply", "skip")]
        end = None
        if backups and infos and len(done) == len(infos) - 1:
            end = "epoch_end" if infos[-1].get("epoch_end") else \
                "halt" if infos[-1].get("decision") == "halt" else None
        if compact and (len(done) == len(seqs) or end is not None):
            out = self._compact(done, seqs[:len(done)], reporter, backups)
            if end is not None:  # (backup workers: the driver reads the reporters only)
                out["end"] = end
                if end == "halt":
                    out["nonfinite"] = infos[-1]["nonfinite"]
            return out
        return infos

    def _compact(self, infos: list[dict], seqs: list[int], reporter: bool,
                 backups: bool = False) -> dict:
        from dsgd.comm import reports

        tally = reports.worker_tally()
        for info in infos:
            if not backups or info["contributed"]:
                reports.add_step(tally, info)
        steps = [reports.step_summary([m for m in self._recent_metas[seq] if m is not None],
                                      info) for seq, info in zip(seqs, infos)] if reporter else None
        out = {"compact": len(infos), "tally": tally, "steps": steps,
               "skipped": [i for i, info in enumerate(infos) if info["decision"] == "skip"]}
        if backups:
            dropped = [i for i in infos if i.get("dropped_rows") is not None]
            out["dropped"] = [len(dropped), sum(i["dropped_rows"] for i in dropped)]
            if reporter:  # every contributor's figures, from the metas (not only this worker's)
                tallies: dict = {}
                for seq in seqs:
                    for m in self._recent_metas[seq]:
                        if m is not None:
                            reports.add_step(tallies.setdefault(m["slot"], reports.worker_tally()),
                                             m["report"])
                out["tallies"] = tallies
        return out

    def _exchange_step(self, data, seq: int) -> dict:
        from dsgd.comm import commit

        client, layout, on_nonfinite = self._exchange
        if self.overlap:
            return self._overlapped_step(data, seq)
        if client.choosing:
            return self._backup_step(data, seq)
        start = time.perf_counter()
        label = f"step {self.applied_steps + 1}"
        try:
            batches, samples = self._batches(data)
            data_s = time.perf_counter() - start
            self.begin_compute()
            computed = self.replicas.compute(batches) if batches is not None else None
        except Exception as e:
            # Tell the other workers (no gradient, this error) so that they stop now
            # rather than wait for this worker's gradient until they time out.
            try:
                client.step(layout, None, commit.meta(self.worker_index, None, None, e), seq,
                            label)
            except Exception:  # noqa: BLE001 - this worker's own error is the one to report
                pass
            raise
        if batches is None:
            means, metas = client.step(layout, None, commit.meta(self.worker_index, None, None),
                                       seq, label)
            commit.decide(metas, on_nonfinite)  # raises unless every worker's epoch ended
            return {"epoch_end": True}
        losses, finite, flat_grads, metrics = computed
        pieces = self.replicas.shard_pieces(flat_grads)
        finite = finite.numpy().tolist()
        report = {"losses": losses.numpy().tolist(), "finite": finite,
                  "metrics": {k: v.numpy().tolist() for k, v in metrics.items()},
                  "samples": samples, "data_s": data_s}
        sent = time.perf_counter()
        report["compute_s"] = sent - start
        mine = {k: report[k] for k in ("losses", "metrics", "samples", "data_s", "compute_s")}
        means, metas = client.step(layout, pieces, commit.meta(self.worker_index, finite,
                                                               list(metrics), report=mine),
                                   seq, label)
        self._keep_metas(seq, metas)
        decision = commit.decide(metas, on_nonfinite)
        exchanged = self._apply_decided(decision, means, report, sent)
        self._record_step(seq, start, start + data_s, sent, exchanged)
        return report

    def _overlapped_step(self, data, seq: int) -> dict:
        """`_exchange_step` with the gradient leaving during the backward pass:
        each bucket of consecutive shards (`bucket_layout`) goes to its PS from
        inside the compiled step as soon as its gradients exist
        (Replicas.compute_sending); once the step is computed every worker's
        meta is gathered and the step decided alike everywhere; then the
        buckets' means are applied one by one as they arrive (in the order the
        backward pass made them), each update exactly that of one apply
        (Replicas.apply_stage), where the optimizers allow it.

        Backup workers: the buckets leave as they do without them, before the
        contributors are chosen; each PS keeps every worker's part of its
        buckets until PS 0 has chosen (`Sending.choose`, instead of gathering
        every meta) and then sums the contributors' parts only. A late worker
        whose next step is chosen already sits it out (`_sat_out`)."""
        from dsgd.comm import commit
        from dsgd.comm.ps_client import died

        client, _, on_nonfinite = self._exchange
        buckets = self._buckets
        start = time.perf_counter()
        label = f"step {self.applied_steps + 1}"
        if self._dead_ps:  # a PS died last step (its bucket was averaged here): replace it
            dead = self._dead_ps
            raise died(f"worker {self.worker_index} {label}: PS actor(s) "
                       f"{', '.join(client.names[j] for j in dead)} died (the last step's "
                       "means were made by the workers)", ps=dead)
        choosing = client.choosing
        answer = client.decided(seq, label) if choosing and self._late else None
        if answer is not None:
            return self._sat_out(seq, label, answer, start)
        sending = client.sending(buckets, seq, label)
        self._sendings[seq] = sending
        shards = self.replicas.plan.shards

        put = sending.send_later if self.send_thread else sending.send

        def send(g: int, arrays: dict) -> None:
            put(g, tuple(arrays[p.var_index][p.var_offset:p.var_offset + p.length]
                         for j in buckets.groups[g] for p in shards[j].pieces))

        pending = self._pending  # the last step's means, applied in this step's call
        fused = None
        try:
            batches, samples = self._batches(data)
            data_s = time.perf_counter() - start
            computed = None
            if batches is not None:
                self.begin_compute()
                self.replicas.sender = send
                try:
                    fused = time.perf_counter() if pending is not None else None
                    computed = self.replicas.compute_sending(
                        buckets.groups, batches, pending=None if pending is None else pending.shards)
                except BaseException:
                    sending.flush(raising=False)  # (before send_rest: none in flight)
                    raise
                finally:
                    self.replicas.sender = None
                sending.flush()
                if fused is not None:
                    self._pending_applied(pending, fused)
        except Exception as e:
            if fused is not None and self._pending is pending:
                ran = self.replicas.pending_applied
                if ran is False:  # (the last step's update may have run in part)
                    self._exit_partly_applied(e, self.applied_steps)
                if ran:
                    self._pending_applied(pending, fused)
                # (else it did not run: exchange_steps applies it on its own, or raises)
            try:  # no PS or peer waits for this worker's gradient: they stop now
                sending.send_rest()
                failed = commit.meta(self.worker_index, None, None, e)
                if choosing:
                    sending.choose(failed)
                else:
                    sending.metas(failed)
            except Exception:  # noqa: BLE001 - this worker's own error is the one to report
                pass
            raise
        if computed is None:
            sending.send_rest()
            ended = commit.meta(self.worker_index, None, None)
            if not choosing:
                commit.decide(sending.metas(ended), on_nonfinite)  # raises unless every
                return {"epoch_end": True}                         # worker's epoch ended
            # (backup workers: the contributors may still have had data; then this worker
            # applies their step, as `_backup_step` does)
            chosen, metas, contributed = sending.choose(ended)
            self._late = not contributed
            return self._observe(seq, sending, chosen, metas, start, sat_out=False)
        losses, finite, metrics, _ = computed
        finite = finite.numpy().tolist()
        computed_at = time.perf_counter()
        report = {"losses": losses.numpy().tolist(), "finite": finite,
                  "metrics": {k: v.numpy().tolist() for k, v in metrics.items()},
                  "samples": samples, "data_s": data_s, "compute_s": computed_at - start}
        mine = commit.meta(self.worker_index, finite, list(metrics),
                           report={k: report[k] for k in ("losses", "metrics", "samples",
                                                          "data_s", "compute_s")})
        if choosing:
            chosen, metas, contributed = sending.choose(mine)
            self._late = not contributed
            self._keep_metas(seq, self._by_rank(chosen, metas))
            report.update(contributors=sorted(m["slot"] for m in metas),
                          contributed=contributed, sat_out=False)
            if not contributed and data is None:
                report["dropped_rows"] = samples  # a get_batch batch computed for nothing
            # (a worker of the last step's contributors may still be applying it: its
            # fallback may ask for this worker's parts of it)
            self._sendings = {k: v for k, v in self._sendings.items() if k >= seq - 1}
        else:
            metas = sending.metas(mine)
            # Every worker has applied the last step (each sends its meta only after): no
            # peer's fallback can ask for its parts any more.
            self._sendings = {seq: sending}
            self._keep_metas(seq, metas)
        decision = commit.decide(metas, on_nonfinite)
        if decision.action == commit.EPOCH_END:  # (backup workers: the contributors' data
            sending.release_means()                # ended, this worker's not yet)
            return {"epoch_end": True}
        apply_s = 0.0
        if decision.action == commit.APPLY:
            apply_s = self._apply_arriving(sending, buckets)
            self.applied_steps += 1
            self._freeze_gc_once()
        self._applied_from(sending)
        end = time.perf_counter()
        report.update(exchange_s=end - computed_at - apply_s, apply_s=apply_s,
                      applied=decision.action == commit.APPLY, decision=decision.action,
                      nonfinite=list(decision.nonfinite))
        self._record_step(seq, start, start + data_s, computed_at, end, overlapped=True)
        return report

    def _applied_from(self, sending) -> None:
        """A step's means are applied (or kept for the next call: `_Pending`): drop
        the references to them, and note the buckets averaged here because their
        PS died (the next step stops at its start naming it)."""
        if self._pending is None or self._pending.sending is not sending:
            sending.release_means()
        if sending.fell_back:
            self.fell_back += len(sending.fell_back)
            self._dead_ps = sorted({self._buckets.ps_of_group[g] for g in sending.fell_back})

    def _by_rank(self, chosen: list[int], metas: list[dict]) -> list:
        """The contributors' `metas` (in `chosen` order) at their ranks, None elsewhere."""
        full: list = [None] * self._exchange[0].world
        for r, m in zip(chosen, metas):
            full[r] = m
        return full

    def _sat_out(self, seq: int, label: str, answer: tuple, start: float) -> dict:
        """(backup workers, overlapped) This late worker sits step `seq` out: its
        contributors were chosen already (`answer`: PSClient.decided). Nothing is
        computed; every bucket is joined without a part and the means applied as
        they arrive. A step of its own kept for this call (`_Pending`) is applied
        first, on its own."""
        client = self._exchange[0]
        self._flush_pending()
        chosen, metas, _ = answer
        sending = client.sending(self._buckets, seq, label)
        sending.chosen = tuple(chosen)
        sending.send_rest()  # (not a contributor: each PS drops a part, and needs none)
        self._sendings[seq] = sending
        return self._observe(seq, sending, chosen, metas, start, sat_out=True)

    def _observe(self, seq: int, sending, chosen: list[int], metas: list[dict], start: float,
                 sat_out: bool) -> dict:
        """(backup workers, overlapped) Step `seq` without a part of this worker's
        in its mean (`chosen`: its contributors, `metas` theirs): decide it as they
        do and apply the means as they arrive. `sat_out`: nothing was computed
        (else this worker's data had ended). Returns the step's report."""
        from dsgd.comm import commit

        on_nonfinite = self._exchange[2]
        self._sendings = {k: v for k, v in self._sendings.items() if k >= seq - 1}
        self._keep_metas(seq, self._by_rank(chosen, metas))
        decision = commit.decide(metas, on_nonfinite)
        if decision.action == commit.EPOCH_END:
            return {"epoch_end": True}
        sent = time.perf_counter()
        apply_s = 0.0
        if decision.action == commit.APPLY:
            apply_s = self._apply_arriving(sending, self._buckets)
            self.applied_steps += 1
        self._applied_from(sending)
        end = time.perf_counter()
        self._record_step(seq, start, sent, sent, end, sat_out=sat_out, overlapped=True)
        return {"exchange_s": end - sent - apply_s, "apply_s": apply_s,
                "applied": decision.action == commit.APPLY, "decision": decision.action,
                "nonfinite": list(decision.nonfinite),
                "contributors": sorted(m["slot"] for m in metas),
                "contributed": False, "sat_out": sat_out}

    def _apply_arriving(self, sending, buckets) -> float:
        """Apply the step's means as they arrive, in the order the backward pass
        made the buckets (bucket 0, the last layers', first): the buckets
        already in when the step is decided in one update, while the PS actors
        still sum the later ones, which are applied in a second update once
        in (Replicas.apply_stage keeps the two exactly one update); everything
        in one update when all or none are in, or when the optimizers cannot
        be applied in parts (`per_group_blocker`). A worker that cannot finish
        a step it has begun to apply exits: its weights would be neither the
        step's nor the last (the driver recovers it like any dead worker).
        When another step follows in this exchange_steps call (and
        `defer_apply`), the means are only read: the step is applied, whole, in
        the next step's compiled call, beside its forward pass (`_Pending`).
        Returns the seconds spent applying here."""
        from dsgd.comm import timeline

        tl = timeline.recorder()
        step = sending.seq & ((1 << 32) - 1)
        count = len(buckets.groups)
        if self.defer_apply and self._next_in_call and not self.replicas.eager:
            means = self._read_means(sending, buckets, tuple(range(count)))
            self._pending = _Pending(sending, [means[j] for j in range(len(means))], step)
            return 0.0
        ready = sending.ready_prefix()
        nbytes = [sum(self.replicas.plan.shards[j].nbytes for j in g) for g in buckets.groups]
        pending = sum(nbytes[ready:]) / max(1, sum(nbytes))
        if self.replicas.per_group_blocker is not None:
            stages = [tuple(range(count))]  # one update of everything
        elif self.apply_each_bucket:  # (each bucket as its mean arrives)
            stages = [(b,) for b in range(count)]
        elif ready == 0 or pending < self.split_apply:
            stages = [tuple(range(count))]
        else:  # (two updates: more cost more than they hide, measured: benchmarks/README.md)
            stages = [tuple(range(ready)), tuple(range(ready, count))]
        groups = tuple(tuple(j for b in stage for j in buckets.groups[b]) for stage in stages)
        means: dict = {}
        apply_s, begun = 0.0, False
        try:
            for k, stage in enumerate(stages):
                means.update(self._read_means(sending, buckets, stage))
                arrived = time.perf_counter()
                if len(stages) == 1:
                    self.replicas.apply([means[j] for j in range(self.replicas.plan.num_shards)])
                else:
                    begun = self.replicas.apply_stage(groups, k, means) or begun
                applied = time.perf_counter()
                apply_s += applied - arrived
                if tl.on:
                    to_wall = time.time() - applied
                    tl.add(f"apply group {', '.join(map(str, stage))}", "apply",
                           arrived + to_wall, applied + to_wall, step=step)
        except BaseException as e:
            if begun:
                self._exit_partly_applied(e)
            raise
        return apply_s

    def _read_means(self, sending, buckets, stage) -> dict:
        """{shard index: mean} of the buckets in `stage`, read in parallel
        (Sending.read), then each from there; the timeline's receive spans (the
        stage's first bucket's holds the parallel read). Blocks (Sending.read)."""
        from dsgd.comm import timeline

        tl = timeline.recorder()
        step = sending.seq & ((1 << 32) - 1)
        means: dict = {}
        reading = time.perf_counter()
        sending.read(stage)
        for b in stage:
            waited = reading if b == stage[0] else time.perf_counter()
            means.update(zip(buckets.groups[b], sending.mean(b)))
            if tl.on:
                to_wall = time.time() - time.perf_counter()
                tl.add(f"receive group {b}", "receive", waited + to_wall,
                       time.perf_counter() + to_wall, step=step)
        return means

    def _pending_applied(self, pending: _Pending, started: float) -> None:
        """`pending` was applied, whole, in the compiled call begun at `started`
        (compute_sending): release its means and draw the timeline's apply span
        (from the call's start to the end of the update)."""
        from dsgd.comm import timeline

        self._pending = None
        self.deferred_applies += 1
        pending.sending.release_means()
        tl = timeline.recorder()
        if tl.on and self.replicas.applied_at is not None:
            to_wall = time.time() - time.perf_counter()
            tl.add(f"apply group {', '.join(map(str, range(len(self._buckets.groups))))} "
                   "(in the next step's call)", "apply", started + to_wall,
                   self.replicas.applied_at + to_wall, step=pending.step)

    def _flush_pending(self) -> None:
        """Apply a decided step kept for the next step's compiled call (`_Pending`)
        now: the call's last step, or the next did not get that far. An error
        applying it is raised, as `apply` raises it for a step applied at once."""
        from dsgd.comm import timeline

        pending = self._pending
        if pending is None:
            return
        started = time.perf_counter()
        self._pending = None
        try:
            self.replicas.apply(pending.shards)
        finally:
            pending.sending.release_means()
        tl = timeline.recorder()
        if tl.on:
            to_wall = time.time() - time.perf_counter()
            tl.add(f"apply group {', '.join(map(str, range(len(self._buckets.groups))))}",
                   "apply", started + to_wall, time.perf_counter() + to_wall, step=pending.step)

    def _exit_partly_applied(self, e: BaseException, step: int | None = None) -> None:
        import sys
        import traceback

        step = self.applied_steps + 1 if step is None else step
        print(f"dsgd worker {self.worker_index}: exiting: step {step} "
              f"was partly applied when {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)

    @ray.method(concurrency_group="peer")
    def parts_of(self, seq: int, g: int) -> list:
        """[this worker's part (an ObjectRef) of bucket `g` of exchange `seq`], or
        [None] if it no longer holds it: a peer whose PS died averages that
        bucket itself (`Sending.fallback`). Runs beside `exchange_steps` (its
        own concurrency group), answering at once."""
        sending = self._sendings.get(seq)
        return [None if sending is None else sending.parts[g]]

    def _backup_step(self, data, seq: int) -> dict:
        """`_exchange_step` under backup workers (see `exchange_steps`)."""
        from dsgd.comm import commit

        client, layout, on_nonfinite = self._exchange
        start = time.perf_counter()
        label = f"step {self.applied_steps + 1}"
        report: dict = {}
        answer = client.decided(seq, label) if self._late else None
        pieces, mine = None, None
        if answer is None:  # on time: compute, then arrive at the choice
            try:
                batches, samples = self._batches(data)
                data_s = time.perf_counter() - start
                self.begin_compute()
                computed = self.replicas.compute(batches) if batches is not None else None
            except Exception as e:
                try:  # (chosen, it stops the others at once: commit.decide names it)
                    chosen, _, chosen_me = client.choose(
                        seq, commit.meta(self.worker_index, None, None, e), label)
                    if chosen_me:
                        client.step_of(layout, None, {"slot": self.worker_index}, seq, label,
                                       chosen)
                except Exception:  # noqa: BLE001 - this worker's own error is the one to report
                    pass
                raise
            if computed is None:
                mine = commit.meta(self.worker_index, None, None)
            else:
                losses, finite, flat_grads, metrics = computed
                pieces = self.replicas.shard_pieces(flat_grads)
                finite = finite.numpy().tolist()
                report = {"losses": losses.numpy().tolist(), "finite": finite,
                          "metrics": {k: v.numpy().tolist() for k, v in metrics.items()},
                          "samples": samples, "data_s": data_s,
                          "compute_s": time.perf_counter() - start}
                mine = commit.meta(self.worker_index, finite, list(metrics),
                                   report={k: report[k] for k in ("losses", "metrics", "samples",
                                                                  "data_s", "compute_s")})
            answer = client.choose(seq, mine, label)
        chosen, _, contributed = answer
        sent = time.perf_counter()
        means, metas = client.step_of(layout, pieces, mine or {"slot": self.worker_index}, seq,
                                      label, chosen)
        self._late = not contributed
        self._keep_metas(seq, self._by_rank(chosen, metas))
        decision = commit.decide(metas, on_nonfinite)
        if decision.action == commit.EPOCH_END:
            return {"epoch_end": True}
        exchanged = self._apply_decided(decision, means, report, sent)
        report.update(contributors=sorted(m["slot"] for m in metas), contributed=contributed,
                      sat_out=mine is None)
        # (the wait for PS 0's choice belongs to the exchange)
        self._record_step(seq, start, start + report.get("data_s", 0.0),
                          start + report["compute_s"] if "compute_s" in report else sent,
                          exchanged, sat_out=mine is None)
        if not contributed and mine is not None and data is None and "samples" in report:
            report["dropped_rows"] = report["samples"]  # a get_batch batch computed for nothing
        return report

    def timeline_events(self) -> list[dict]:
        """This worker's timeline events since the last call (dsgd/comm/timeline.py)."""
        from dsgd.comm import timeline

        return timeline.recorder().drain()

    def _record_step(self, seq: int, start: float, computed: float, sent: float,
                     exchanged: float, sat_out: bool = False, overlapped: bool = False) -> None:
        """The timeline's row of one step of the workers' exchange, from
        `perf_counter` stamps: start, batches read, gradient computed (the first
        group about to leave), means read; the apply ends now."""
        from dsgd.comm import timeline

        tl = timeline.recorder()
        if not tl.on:
            return
        end = time.perf_counter()
        to_wall = time.time() - end
        step = seq & ((1 << 32) - 1)
        spans = [("sat out", start, sent)] if sat_out else \
            [("data", start, computed), ("compute", computed, sent)]
        # (overlapped: the groups left during "compute"; each one's receive and apply
        # are on their own rows)
        spans += [("decide, receive and apply", sent, exchanged)] if overlapped else \
            [("exchange", sent, exchanged), ("apply", exchanged, end)]
        for name, a, b in spans:
            if b > a:
                tl.add(name, "step", a + to_wall, b + to_wall, step=step)
        if not sat_out:
            self.forward_backward_spans(tl, computed, sent, step)

    def _keep_metas(self, seq: int, metas: list) -> None:
        """Keep step `seq`'s metas (rank order), at least a whole call's: the
        reporter summarises its steps from them, recent_reports serves them."""
        self._recent_metas[seq] = metas
        while len(self._recent_metas) > max(64, self._metas_kept):
            del self._recent_metas[next(iter(self._recent_metas))]

    def _apply_decided(self, decision, means, report: dict, sent: float) -> float:
        """Apply `means` if `decision` says so, and add the exchange and apply
        times (from `sent`, the gradient leaving) and the decision to `report`.
        Returns when the means were in (perf_counter)."""
        from dsgd.comm import commit

        exchanged = time.perf_counter()
        if decision.action == commit.APPLY:
            self.replicas.apply(means)
            self.applied_steps += 1
            self._freeze_gc_once()
        report.update(exchange_s=exchanged - sent, apply_s=time.perf_counter() - exchanged,
                      applied=decision.action == commit.APPLY, decision=decision.action,
                      nonfinite=list(decision.nonfinite))
        return exchanged

    def recent_reports(self, seqs: list[int]) -> dict:
        """{exchange number: every worker's meta (rank order)} of the recent steps
        among `seqs` this worker exchanged: the driver rebuilds from them the
        reports of a worker that died after applying them."""
        return {seq: self._recent_metas[seq] for seq in seqs if seq in self._recent_metas}

    def compute(self, groups: tuple[tuple[int, ...], ...], data=None,
                timeline_on: bool = False):
        """This step's gradients, averaged across local replicas, streamed group by
        group. A generator (call with num_returns="streaming"): yields the info
        dict, then for each group of shard indices one flat tuple of the pieces of
        its shards, in order. Each yield becomes its own object, in the store as
        soon as it is written, so a PS can sum group g while group g+1 is being
        written. At the end of `data`'s epoch it yields only {"epoch_end": True}.
        `timeline_on`: record the step's `data` and `compute` and each group's
        write (the driver-relayed exchange's timeline; dsgd/comm/timeline.py)."""
        tl = self.use_timeline(timeline_on)
        start = time.perf_counter()
        batches, samples = self._batches(data)
        if batches is None:
            yield {"epoch_end": True}
            return
        data_s = time.perf_counter() - start
        self.begin_compute()
        losses, finite, flat_grads, metrics = self.replicas.compute(batches)
        pieces = self.replicas.shard_pieces(flat_grads)
        step = self.applied_steps + 1
        if tl.on:
            to_wall = time.time() - time.perf_counter()
            tl.add("data", "step", start + to_wall, start + data_s + to_wall, step=step)
            tl.add("compute", "step", start + data_s + to_wall, time.time(), step=step)
            self.forward_backward_spans(tl, start + data_s, time.perf_counter(), step)
        yield {"losses": losses.numpy().tolist(), "finite": finite.numpy().tolist(),
               "metrics": {k: v.numpy().tolist() for k, v in metrics.items()},
               "samples": samples, "data_s": data_s, "compute_s": time.perf_counter() - start}
        for g, group in enumerate(groups):  # (Ray's generator wrapper cannot `yield from`)
            written = time.time() if tl.on else 0.0
            yield tuple(piece for j in group for piece in pieces[j])
            if tl.on:  # (resumed once Ray has the group in the store)
                tl.add(f"write group {g}", "send", written, time.time(), step=step)

    def forward_backward_spans(self, tl, computed: float, end: float, step: int,
                          row: str = "step", **args) -> None:
        """The timeline's `forward` and `backward` spans within a compiled call
        begun at `computed` and ended at `end` (perf_counter), where the call
        noted the forward pass's end (Replicas.mark_forward)."""
        forward = self.replicas.forward_at
        if tl.on and forward is not None and computed <= forward <= end:
            to_wall = time.time() - time.perf_counter()
            tl.add("forward", row, computed + to_wall, forward + to_wall, step=step, **args)
            tl.add("backward", row, forward + to_wall, end + to_wall, step=step, **args)

    def begin_compute(self) -> None:
        """Before a compiled step: note its forward pass's end iff a timeline records."""
        self.replicas.mark_forward = timeline.recorder().on
        self.replicas.forward_at = None

    def use_timeline(self, on: bool):
        """This worker's recorder, turned on or off as the driver's call says."""
        if on != timeline.recorder().on:
            timeline.enable(f"worker {self.worker_index}", on)
        return timeline.recorder()

    def apply(self, groups: tuple[tuple[int, ...], ...], *group_means: tuple) -> dict:
        """Apply the global mean gradient to every replica. `group_means[g]` holds
        one 1-D array per shard of `groups[g]`, as a PS returns them: read-only
        object-store views, read during the call, not kept."""
        start = time.perf_counter()
        if len(group_means) != len(groups):
            raise DsgdError(f"worker {self.worker_index}: got {len(group_means)} mean groups "
                            f"for {len(groups)} groups")
        shards: list = [None] * sum(len(g) for g in groups)
        for group, means in zip(groups, group_means):
            if len(means) != len(group):
                raise DsgdError(f"worker {self.worker_index}: a mean group holds {len(means)} "
                                f"arrays for shards {list(group)}")
            for j, mean in zip(group, means):
                shards[j] = mean
        self.replicas.apply(shards)
        self.applied_steps += 1
        self._freeze_gc_once()
        tl = timeline.recorder()
        if tl.on:
            to_wall = time.time() - time.perf_counter()
            tl.add("apply", "step", start + to_wall, time.time(), step=self.applied_steps)
        return {"apply_s": time.perf_counter() - start}

    def apply_staged(self, groups: tuple[tuple[int, ...], ...], mean_refs: list,
                     grad_refs: list, timeout_s: float, then_s: float = 0.0) -> dict:
        """Apply the global mean gradient group by group, each group's variables as
        soon as its mean is in the store, so applying overlaps the PS summing the
        groups after it (Replicas.apply_stage keeps it exactly one update).
        `mean_refs[g]`: the ObjectRef of group g's PS mean; `grad_refs[g]`: every
        worker's ObjectRef of its group g (nested in lists, so Ray passes them
        unresolved). A mean whose PS died is computed here from the workers'
        gradients, with the PS's own kernel and order, so the step completes
        exactly; the result's "ps_fallback" names such groups, for the driver to
        replace the PS. A worker that cannot finish a step it has begun to apply
        exits (its weights would be neither the step's nor the last): the driver
        then recovers it like any dead worker. Waits at most `timeout_s` seconds
        for the means, `then_s` more once it has begun to apply (a late PS then
        still lets the step complete). The means are read-only object-store
        views, read during the call."""
        import ray

        from dsgd.comm.means import group_means

        start = time.perf_counter()
        deadline = start + timeout_s
        if len(mean_refs) != len(groups) or len(grad_refs) != len(groups):
            raise DsgdError(f"worker {self.worker_index}: got {len(mean_refs)} mean refs and "
                            f"{len(grad_refs)} gradient ref lists for {len(groups)} groups")
        shards: dict = {}
        fallback, wait_s, begun = [], 0.0, False
        tl = timeline.recorder()
        try:
            for k, group in enumerate(groups):
                waited = time.perf_counter()
                if begun:
                    deadline, then_s = deadline + then_s, 0.0
                try:
                    means = ray.get(mean_refs[k], timeout=max(0.001, deadline - waited))
                except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                    worker_groups = ray.get(list(grad_refs[k]),
                                            timeout=max(0.001, deadline - time.perf_counter()))
                    means = group_means([self.replicas.plan.shards[j] for j in group],
                                        worker_groups)
                    fallback.append(k)
                arrived = time.perf_counter()
                wait_s += arrived - waited
                if len(means) != len(group):
                    raise DsgdError(f"worker {self.worker_index}: a mean group holds "
                                    f"{len(means)} arrays for shards {list(group)}")
                shards.update(zip(group, means))
                begun = self.replicas.apply_stage(groups, k, shards) or begun
                if tl.on:
                    to_wall = time.time() - time.perf_counter()
                    tl.add(f"receive group {k}", "receive", waited + to_wall, arrived + to_wall,
                           step=self.applied_steps + 1)
                    tl.add(f"apply group {k}", "apply", arrived + to_wall, time.time(),
                           step=self.applied_steps + 1)
        except BaseException as e:
            if begun:
                self._exit_partly_applied(e)
            raise
        self.applied_steps += 1
        self._freeze_gc_once()
        return {"apply_s": time.perf_counter() - start - wait_s, "wait_s": wait_s,
                "ps_fallback": fallback}

    def get_state(self) -> list[np.ndarray]:
        """Replica 0's full model state (a Keras model's `weights`, non-trainable
        included; else `get_variables()`), for the start-up broadcast."""
        return [np.array(v.numpy()) for v in checkpoint_files.state_variables(self.replicas.replicas[0])]

    def set_state(self, state: list[np.ndarray]) -> None:
        for replica in self.replicas.replicas:
            for variable, value in zip(checkpoint_files.state_variables(replica), state, strict=True):
                variable.assign(value)

    def get_full_state(self) -> dict:
        """Everything a replacement worker needs to continue exactly: replica 0's
        model state, its optimizer's variables (iteration count, slots) and
        `applied_steps`. Returned through the object store."""
        return {"model": self.get_state(),
                "optimizer": [np.array(v.numpy()) for v in self.replicas.optimizer_variables(0)],
                "applied_steps": self.applied_steps}

    def set_full_state(self, state: dict) -> None:
        """Load a `get_full_state()` into every replica (read, not kept)."""
        self.set_state(state["model"])
        for i in range(len(self.replicas.replicas)):
            for variable, value in zip(self.replicas.optimizer_variables(i), state["optimizer"],
                                       strict=True):
                variable.assign(value)
        self.applied_steps = int(state["applied_steps"])

    def get_weights(self) -> list[np.ndarray]:
        return self.replicas.replicas[0].get_weights()

    def set_weights(self, weights: list[np.ndarray]) -> None:
        for replica in self.replicas.replicas:
            replica.set_weights(weights)

    def foreach_model(self, fn: Callable[[Model], Any]) -> list:
        return [fn(replica) for replica in self.replicas.replicas]

    def foreach_worker(self, fn: Callable[[Worker], Any]) -> Any:
        return fn(self)

    def run(self, fn: Callable[..., Any], *args) -> Any:
        """fn(this worker, *args): the driver's way to run per-worker work (e.g.
        the Trainer's validation over this worker's share of the data)."""
        return fn(self, *args)

    def save_checkpoint(self, step: int) -> dict[str, bytes]:
        """Replica 0's weights and optimizer state as checkpoint files {suffix: bytes}."""
        return checkpoint_files.save_files(self.replicas.replicas[0], self.replicas.optimizer_variables(0),
                                     step)

    def restore_checkpoint(self, files: dict[str, bytes]) -> int:
        """Restore every replica from checkpoint files; returns the saved step."""
        step = checkpoint_files.restore_files(
            self.replicas.replicas,
            [self.replicas.optimizer_variables(i) for i in range(len(self.replicas.replicas))], files)
        self.applied_steps = step
        return step


def _picklable(error: Exception) -> Exception:
    """`error` if it survives pickling, else a DsgdError carrying its traceback
    (the steps reported with it must reach the driver either way)."""
    import pickle
    import traceback

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to round-trip
        text = "".join(traceback.format_exception(error))
        return DsgdError(f"{type(error).__name__}: {error}\n{text}")


def _rows(batch) -> int:
    """Examples in a replica's batch: the leading dimension of its first array
    (0 for None, a scalar, or an empty structure)."""
    while isinstance(batch, (tuple, list, dict)):
        if not batch:
            return 0
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else 0
