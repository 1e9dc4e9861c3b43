"""The worker actor: one process holding `devices_per_worker` replicas.

The driver wraps `Worker` with `ray.remote` and calls it; with several workers
and strategy "ps" the workers exchange by themselves through the PS actors
(`join`, then `exchange_steps`), and when a PS died mid-step they average its
buckets themselves. Call order:

1. `setup()` once (imports TensorFlow, builds the replicas), then
   `configure(plan)` once per shard plan (compiles the step functions);
2. `attach_data(key, loader)` / `detach_data(key)` when a `dsgd.Dataset`
   feed starts or ends (see dsgd/data/feeds.py);
3. per step, one of
   - `local_step(data)` or `local_steps(datas, run)` (one worker: no exchange),
   - `exchange_steps(datas, seqs, run)` (the workers' own exchange, after `join`),
   - `compute(groups, data)` (streamed gradient groups), then `apply(groups,
     *means)` (strategy "simple": the driver averages and passes every mean);
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

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from dsgd.comm import store, timeline
from dsgd.comm.reports import Ping, StepRaised, StepReport
from dsgd.comm.sharding import ShardPlan
from dsgd.errors import DsgdError, picklable_error
from dsgd.model import Model
from dsgd.worker import checkpoint_files
from dsgd.worker.apply_schedule import ApplySchedule
from dsgd.worker.exchange_session import ExchangeSession
from dsgd.worker.records import Configured, FullState
from dsgd.worker.replicas import Replicas
from dsgd.worker.spans import StepSpans


class Worker(ExchangeSession, ApplySchedule, StepSpans):
    """One worker process (see the module docstring). Its jobs live beside it:
    the workers' own exchange (dsgd/worker/exchange_session.py), when a
    decided step's update runs (dsgd/worker/apply_schedule.py) and the
    timeline's spans of a step (dsgd/worker/spans.py); this module holds its
    lifecycle, data, the steps without an exchange and its state."""

    def __init__(self, model_creator: Callable[[int, int], Model], worker_index: int,
                 devices_per_worker: int, gpu: bool, all_reduce_alg: str,
                 worker_init: Callable[[], Any] | None = None):
        self.worker_index = worker_index
        self.worker_init = worker_init
        self.applied_steps = 0
        self._gc_frozen = False
        self._loaders: dict = {}  # data feed key -> loader (dsgd/data/feeds.py)
        self._halted_run = None  # local_steps, exchange_steps: the run that was stopped
        self.warmed_store_bytes = 0  # of this process's store mapping (configure)
        self._init_exchange()
        self._init_apply_schedule()
        self.replicas = Replicas(model_creator, worker_index, devices_per_worker, gpu,
                                 all_reduce_alg)

    def setup(self) -> dict:
        """Build the replicas (imports TensorFlow). Returns their variable signature
        (names, shapes, dtypes), devices, node id and pid."""
        if self.worker_init is not None:
            self.worker_init()  # e.g. environment variables, a Keras precision policy
        info = self.replicas.setup()
        info["node_id"] = ray.get_runtime_context().get_node_id()
        return info

    def configure(self, plan: ShardPlan, on_nonfinite: str = "raise",
                  warm_store_bytes: int = 0) -> Configured:
        """Compile the step for `plan` and warm `warm_store_bytes` of this process's
        object-store mapping (store.warm). Returns why the step cannot be applied
        group by group (`Replicas.apply_stage`), or None, as a `Configured`."""
        self.replicas.configure(plan, on_nonfinite)
        self.warmed_store_bytes = store.warm(warm_store_bytes)
        self._gc_frozen = False  # new functions: freeze again once they are traced
        return Configured(per_group_blocker=self.replicas.per_group_blocker)

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

    def ping(self) -> Ping:
        """Liveness and progress; runs after every call queued before it."""
        return Ping(os.getpid(), applied_steps=self.applied_steps)

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

    def local_step(self, data=None) -> StepReport:
        """A whole step with no exchange (num_workers == 1). Blocks until applied.
        `finite` says which replicas' gradients were finite; `applied` whether
        the update ran (not with a non-finite gradient and on_nonfinite="skip");
        `epoch_end` (and nothing else) when `data`'s epoch had ended."""
        start = time.perf_counter()
        batches, samples = self._batches(data)
        if batches is None:
            return StepReport(epoch_end=True)
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
            to_wall = tl.to_wall
            tl.add("data", "step", start + to_wall, start + data_s + to_wall,
                   step=self.applied_steps)
            tl.add("compute and apply", "step", start + data_s + to_wall, computed + to_wall,
                   step=self.applied_steps)
            self.forward_backward_spans(tl, start + data_s, computed, self.applied_steps)
        return StepReport(losses=losses.numpy().tolist(), finite=finite, applied=applied,
                          metrics={k: v.numpy().tolist() for k, v in metrics.items()},
                          samples=samples, data_s=data_s, compute_s=time.perf_counter() - start)

    def local_steps(self, datas: list, run: int, timeline_on: bool = False) -> list:
        """Several `local_step`s in one call (one worker, `train()`): one
        StepReport per step run, in order; `timeline_on`: record each step's
        `data` and `compute and apply` on the timeline (dsgd/comm/timeline.py).
        Stops after a step whose data's epoch ended, and after a step with a
        non-finite gradient under on_nonfinite="raise" (that step was applied,
        as with `local_step`), or at a step that raised (raised here if it was
        the first, else returned as a last StepRaised after the reports of the
        steps applied before it); later calls with the
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
            if info.epoch_end:
                break
            if not all(info.finite) and info.applied:
                self._halted_run = run
                break
        return infos

    def _step_error(self, e: Exception, infos: list, total: int, what: str) -> StepRaised:
        """A step of a call of several raised: re-raised if it was the first (nothing
        applied); else the steps before it were applied, so it is reported after
        them, as a `StepRaised`, with a note saying which step of the call it was."""
        if not infos:
            raise e
        e.add_note(f"(worker {self.worker_index}, step {len(infos) + 1} of a call of {total} "
                   f"{what}; the {len(infos)} before it were applied)")
        return StepRaised(picklable_error(e))

    def compute(self, groups: tuple[tuple[int, ...], ...], data=None,
                timeline_on: bool = False):
        """This step's gradients, averaged across local replicas, streamed group by
        group. A generator (call with num_returns="streaming"): yields its
        StepReport, then for each group of shard indices one flat tuple of the pieces of
        its shards, in order. Each yield becomes its own object, in the store as
        soon as it is written, so a PS can sum group g while group g+1 is being
        written. At the end of `data`'s epoch it yields only a StepReport(epoch_end=True).
        `timeline_on`: record the step's `data` and `compute` and each group's
        write (the driver-relayed exchange's timeline; dsgd/comm/timeline.py)."""
        tl = self.use_timeline(timeline_on)
        start = time.perf_counter()
        batches, samples = self._batches(data)
        if batches is None:
            yield StepReport(epoch_end=True)
            return
        data_s = time.perf_counter() - start
        self.begin_compute()
        losses, finite, flat_grads, metrics = self.replicas.compute(batches)
        pieces = self.replicas.shard_pieces(flat_grads)
        step = self.applied_steps + 1
        if tl.on:
            to_wall = tl.to_wall
            tl.add("data", "step", start + to_wall, start + data_s + to_wall, step=step)
            tl.add("compute", "step", start + data_s + to_wall, time.perf_counter() + to_wall,
                   step=step)
            self.forward_backward_spans(tl, start + data_s, time.perf_counter(), step)
        yield StepReport(losses=losses.numpy().tolist(), finite=finite.numpy().tolist(),
                         metrics={k: v.numpy().tolist() for k, v in metrics.items()},
                         samples=samples, data_s=data_s, compute_s=time.perf_counter() - start)
        for g, group in enumerate(groups):  # (Ray's generator wrapper cannot `yield from`)
            written = time.time() if tl.on else 0.0
            yield tuple(piece for j in group for piece in pieces[j])
            if tl.on:  # (resumed once Ray has the group in the store)
                tl.add(f"write group {g}", "send", written, time.time(), step=step)

    def apply(self, groups: tuple[tuple[int, ...], ...], *group_means: tuple) -> float:
        """Apply the global mean gradient to every replica. `group_means[g]` holds
        one 1-D array per shard of `groups[g]`, as a PS returns them: read-only
        object-store views, read during the call, not kept. Returns the seconds
        it took."""
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
            to_wall = tl.to_wall
            tl.add("apply", "step", start + to_wall, time.perf_counter() + to_wall,
                   step=self.applied_steps)
        return time.perf_counter() - start

    def models(self) -> list[Model]:
        """This worker's replicas (the `Model`s `model_creator` made), in device
        order: what the driver's per-worker functions (`run`) work on."""
        return self.replicas.replicas

    def get_state(self) -> list[np.ndarray]:
        """Replica 0's full model state (a Keras model's `weights`, non-trainable
        included; else `get_variables()`), for the start-up broadcast."""
        return [np.array(v.numpy()) for v in checkpoint_files.state_variables(self.replicas.replicas[0])]

    def set_state(self, state: list[np.ndarray]) -> None:
        for replica in self.replicas.replicas:
            for variable, value in zip(checkpoint_files.state_variables(replica), state, strict=True):
                variable.assign(value)

    def get_full_state(self) -> FullState:
        """Everything a replacement worker needs to continue exactly: replica 0's
        model state, its optimizer's variables (iteration count, slots) and
        `applied_steps`. Returned through the object store."""
        return FullState(
            model=self.get_state(),
            optimizer=[np.array(v.numpy()) for v in self.replicas.optimizer_variables(0)],
            applied_steps=self.applied_steps)

    def set_full_state(self, state: FullState) -> None:
        """Load a `get_full_state()` into every replica (read, not kept)."""
        self.set_state(state.model)
        for i in range(len(self.replicas.replicas)):
            for variable, value in zip(self.replicas.optimizer_variables(i), state.optimizer,
                                       strict=True):
                variable.assign(value)
        self.applied_steps = int(state.applied_steps)

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


def _rows(batch) -> int:
    """Examples in a replica's batch: the leading dimension of its first array
    (0 for None, a scalar, or an empty structure)."""
    while isinstance(batch, (tuple, list, dict)):
        if not batch:
            return 0
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else 0
