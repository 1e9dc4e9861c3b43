"""`DistributedSGD.train`: many steps, each replica's batch from a dataset's
feed (dsgd/engine/datasets.py) or from its own get_batch, with a progress bar and
a summary of what was trained (driver side)."""

from __future__ import annotations

import time

import numpy as np

from dsgd import progress as progress_bar
from dsgd.comm import reports
from dsgd.engine.datasets import FeedEntry
from dsgd.engine.loop import StepLoop
from dsgd.engine.state import Progress
from dsgd.engine.step import StepResult


def train(loop: StepLoop, entry: FeedEntry | None, num_steps: int | None, desc: str,
          one_step_rows: str) -> dict:
    """Run `num_steps` steps (None: until the feed's epoch ends) through `loop`,
    a bar named `desc` on a terminal. Returns {"loss": mean loss over the steps,
    "steps": steps run, "num_samples": examples trained on (every replica's
    batches; 0 when get_batch's batches have no leading dimension),
    "skipped_steps": steps skipped here (non-finite gradients), "epoch_ended":
    the dataset's epoch ended (Ray Data, num_steps=None), "train_s": wall time,
    "step_s": median seconds per step, "data_s": median seconds the slowest
    worker spent getting its step's batches, "samples_per_s", "step": steps
    applied in all, "failures": failures recovered in all, "mean_times": mean
    seconds per step of step_s/data_s/compute_s/apply_s/exchange_s, "workers":
    per worker (worker order) {"num_samples", "batch_count", "sums": {metric:
    sum over steps of value x samples}, "last": {metric: last step's value},
    "dropped_batches", "dropped_samples"}, the metrics being "loss" and any
    others get_loss returns; "dropped_batches"/"dropped_samples": in all
    workers, batches and rows left out of the steps' means (backup workers;
    a late worker's get_batch batch is counted when its report reaches the
    driver: one still computing when train() returns counts in a later call)}.
    With backup workers a worker's "num_samples"/"batch_count"/metrics are
    those of the steps it contributed to.
    `one_step_rows` describes one step's rows, for the error when the data is
    smaller than that."""
    until_epoch_end = num_steps is None
    start = time.perf_counter()
    tally = Tally(loop.stragglers)
    ended_at = None
    with progress_bar.bar(None if until_epoch_end else int(num_steps), desc) as bar:
        step_start = time.perf_counter()
        for result in loop.run(entry, None if until_epoch_end else int(num_steps)):
            if result.epoch_end:
                if until_epoch_end and tally.steps:
                    break
                if ended_at == tally.steps:
                    raise ValueError(f"{entry.dataset!r} is empty or has fewer rows than one step needs "
                                     f"({one_step_rows})")
                ended_at = tally.steps
                continue  # the next step starts the next epoch
            tally.add(result, time.perf_counter() - step_start)
            step_start = time.perf_counter()
            if tally.losses:
                bar.set_postfix(loss=f"{tally.losses[-1]:.4f}",
                                samples_s=f"{tally.samples / (time.perf_counter() - start):.0f}",
                                refresh=False)
            bar.update()
    return tally.summary(loop.progress, until_epoch_end, time.perf_counter() - start,
                         loop.stragglers)


class Tally:
    """What train() reports: per step the loss and timings, per worker (in
    worker order) its samples, batches, and for every metric (the loss too)
    the sum of value x samples and the last value; a worker's value of a step
    is the mean over its replicas."""

    def __init__(self, stragglers=None):
        self.steps, self.skipped, self.samples = 0, 0, 0
        self._dropped_at_start = _dropped(stragglers)
        self.losses, self.times = [], {k: [] for k in ("step_s", "data_s", "compute_s",
                                                        "apply_s", "exchange_s")}
        self.workers: list[dict] = []

    def add(self, result: StepResult, step_s: float) -> None:
        infos = result.infos
        self.steps += 1
        self.skipped += result.skipped
        # Steps that ran in one call (one worker) come together: their share of its time.
        step_s = result.step_s if result.step_s is not None else step_s
        self.times["step_s"].append(step_s)
        if result.summary is not None:  # every worker's totals, one row (WorkerSteps)
            self._add_summary(result, step_s)
            return
        if infos is None:  # the step was applied before a failure interrupted it
            return
        self._add_times(step_s, max(info.data_s for info in infos),
                        max(info.compute_s for info in infos),
                        max(result.apply_s, default=0.0))
        self.losses.append(float(np.mean([x for info in infos for x in info.losses])))
        slots = result.contributors if result.contributors is not None else range(len(infos))
        while len(self.workers) <= max(slots):
            self.workers.append(reports.worker_tally())
        for slot, info in zip(slots, infos):
            self.samples += reports.add_step(self.workers[slot], info)

    def _add_times(self, step_s: float, data_s: float, compute_s: float, apply_s: float) -> None:
        """A step's slowest data, compute and apply times; the rest of step_s is the exchange."""
        for key, value in (("data_s", data_s), ("compute_s", compute_s), ("apply_s", apply_s),
                           ("exchange_s", max(0.0, step_s - compute_s - apply_s))):
            self.times[key].append(value)

    def _add_summary(self, result: StepResult, step_s: float) -> None:
        summary = result.summary
        self._add_times(step_s, summary.data_s, summary.compute_s, summary.apply_s)
        self.losses.append(summary.loss)
        self.samples += summary.samples
        for slot, tally in sorted((result.tallies or {}).items()):
            while len(self.workers) <= slot:
                self.workers.append(reports.worker_tally())
            reports.merge(self.workers[slot], tally)

    def summary(self, progress: Progress, epoch_ended: bool, train_s: float,
                stragglers=None) -> dict:
        times = {k: float(np.mean(v)) if v else float("nan") for k, v in self.times.items()}
        batches, samples = _dropped(stragglers)
        start_batches, start_samples = self._dropped_at_start
        for slot in sorted(set(batches) | set(samples)):
            while len(self.workers) <= slot:
                self.workers.append(reports.worker_tally())
            self.workers[slot]["dropped_batches"] = batches.get(slot, 0) - start_batches.get(slot, 0)
            self.workers[slot]["dropped_samples"] = samples.get(slot, 0) - start_samples.get(slot, 0)
        return {"loss": float(np.nanmean(self.losses)) if self.losses else float("nan"),
                "steps": self.steps, "num_samples": self.samples,
                "skipped_steps": self.skipped, "epoch_ended": epoch_ended, "train_s": train_s,
                "step_s": float(np.median(self.times["step_s"])) if self.steps else float("nan"),
                "data_s": float(np.median(self.times["data_s"])) if self.times["data_s"]
                else float("nan"),
                "samples_per_s": self.samples / train_s if train_s > 0 else 0.0,
                "step": progress.steps_done, "failures": len(progress.failures),
                "dropped_batches": sum(w["dropped_batches"] for w in self.workers),
                "dropped_samples": sum(w["dropped_samples"] for w in self.workers),
                "mean_times": times, "workers": self.workers}


def _dropped(stragglers) -> tuple[dict, dict]:
    """(dropped batches, dropped rows) per slot so far (backup workers)."""
    if stragglers is None:
        return {}, {}
    return dict(stragglers.dropped_batches), dict(stragglers.dropped_samples)


def epoch_steps(entry: FeedEntry | None, config, num_workers: int, for_model) -> int | None:
    """Steps of one epoch of `entry`'s data (None: the replicas' get_batch, whose
    `steps_per_epoch()` `for_model` asks), or None: until the data says its epoch
    ended. Raises ValueError when neither says how long an epoch is."""
    if entry is None:
        steps = for_model(
            lambda m: m.steps_per_epoch() if hasattr(m, "steps_per_epoch") else None)
        if steps is None:
            raise ValueError("train() without a dataset needs num_steps: the replicas' "
                             "steps_per_epoch() does not say how long one epoch of their "
                             "own data (get_batch) is")
    else:
        # With backup workers every slot keeps its share of each step's rows.
        steps = entry.feed.steps_per_epoch(config.num_workers if config.backup_workers
                                           else num_workers)
        if steps is None:
            if not entry.feed.reports_epoch_end:
                raise ValueError("dataset is streaming data of unknown length (a generator "
                                 "or iterator): pass num_steps")
            return None
    if steps < 1:
        raise ValueError(f"one epoch of {'the dataset' if entry else 'the replicas own data'} "
                         "is 0 steps (fewer batches than workers/replicas?): pass num_steps")
    return steps


def step_stats(result: StepResult, step_s: float, progress: Progress, config,
               slots: list[int]) -> dict:
    """`DistributedSGD.step(fetch_stats=True)`'s dict for one step's `result`
    (see its docstring), `step_s` its wall time and `slots` the live workers'."""
    infos = result.infos
    if result.summary is not None:  # the workers' own exchange: every worker's totals
        losses, compute_s = [result.summary.loss], result.summary.compute_s
    else:
        losses = [x for info in infos for x in info.losses] if infos else [float("nan")]
        compute_s = max(info.compute_s for info in infos) if infos else 0.0
    apply_s = max(result.apply_s, default=0.0)
    stats = {"loss": float(np.mean(losses)), "compute_s": compute_s,
             "exchange_s": max(0.0, step_s - compute_s - apply_s), "apply_s": apply_s,
             "step_s": step_s, "step": progress.steps_done, "skipped": result.skipped,
             "skipped_steps": progress.skipped_steps, "num_workers": len(slots),
             "failures": len(progress.failures)}
    if config.backup_workers:
        if result.contributors is not None:
            stats["contributors"], stats["dropped"] = result.contributors, result.dropped
        else:  # one live worker (the others dead, being replaced): its own step
            stats["contributors"] = slots
            stats["dropped"] = [s for s in range(config.num_workers) if s not in slots]
    return stats
