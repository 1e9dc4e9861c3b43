"""The units the step loop (dsgd/engine/loop.py) submits to the workers.

`ExchangeStep`: one step of several workers, in phases: `submit` (each worker
starts `compute`, a streaming generator: its report, then its gradient shard
groups as they are written), `reports` (the reports), `exchange` (each group's
mean from its PS actor, or from the driver under "simple", and every worker's
apply submitted), `finish` (the applies waited for). With strategy "ps" and
several groups, workers apply each group's mean as soon as it is in the store
(`Worker.apply_staged`); a mean whose PS died is computed by the workers
themselves, so the step still completes exactly.

`LocalSteps`: up to `local_steps_per_call` steps of one worker in one call of
`Worker.local_steps` (no exchange): Ray's cost per call is paid once for all.

Both turn what the workers report into `StepResult`s, one per step.
"""

from __future__ import annotations

import dataclasses
import time

from dsgd import constants
from dsgd.comm.means import group_means
from dsgd.config import Config
from dsgd.engine.actors import ActorSet
from dsgd.engine.state import Topology


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One step as the loop yields it.

    infos: each worker's report (losses, finite, metrics, samples, timings), in
        worker order; None for a step that had been applied when a failure
        interrupted it.
    applied: each worker's apply report (`apply_s`, ...); [] at an epoch's end.
    workers: the workers the step ran on (its data: one batch each).
    skipped: not applied (a non-finite gradient under on_nonfinite="skip").
    epoch_end: the data's epoch ended instead of a step.
    step_s: one worker's call of several steps: its wall time per step.
    error: a step of a call of several that raised after the steps before it
        were applied (the loop counts those, then raises this).
    """

    infos: list[dict] | None
    applied: list[dict]
    workers: int
    skipped: bool = False
    epoch_end: bool = False
    step_s: float | None = None
    error: BaseException | None = None


class ExchangeStep:
    """One step of several workers (see the module docstring). `data`: one
    argument per worker (None: each replica's get_batch)."""

    exchanges = True
    size = 1

    def __init__(self, config: Config, actors: ActorSet, topology: Topology, data: list,
                 number: int):
        self.config, self.actors, self.topology = config, actors, topology
        self.data, self.label = data, f"step {number}"
        self.workers = actors.workers
        self.start = time.perf_counter()
        self._streams: list = []
        self._infos: list[dict] | None = None
        self._apply_refs: list | None = None  # submitted applies, not yet waited for

    def time_left(self) -> float:
        return max(0.001, self.config.step_timeout_s - (time.perf_counter() - self.start))

    def submit(self) -> ExchangeStep:
        self._streams = [w.compute.options(num_returns="streaming").remote(self.topology.groups, d)
                         for w, d in zip(self.workers, self.data)]
        return self

    def reports(self) -> list[dict]:
        """Every worker's report of its computed gradients (blocks)."""
        if self._infos is None:
            what = f"{self.label}: computing gradients"
            refs = self.actors.next_all(self._streams, self.workers, what, self.time_left())
            self._infos = self.actors.wait(refs, self.workers, what, self.time_left())
        return self._infos

    def result(self, **flags) -> StepResult:
        """This step, ended before any apply (an epoch end, or a skipped step:
        the streams' shards are dropped)."""
        applied = [] if flags.get("epoch_end") else [{"apply_s": 0.0}]
        return StepResult(self.reports(), applied, len(self.workers), **flags)

    def exchange(self) -> None:
        """Each shard group's mean, as soon as every worker has written the group,
        then every worker's apply submitted (Ray runs them in order behind the
        worker's compute)."""
        import ray

        config, topology, workers = self.config, self.topology, self.workers
        mean_refs, grad_refs = [], []
        for g, shards in enumerate(topology.group_shards):
            refs = self.actors.next_all(self._streams, workers,
                                        f"{self.label}: writing shard group {g}", self.time_left())
            if config.strategy == "ps":
                mean_refs.append(self.actors.ps[topology.ps_of_group(g)].mean.remote(shards, *refs))
                grad_refs.append(refs)
            else:
                worker_groups = self.actors.wait(refs, workers, f"{self.label}: gathering shard "
                                                 f"group {g}", self.time_left())
                mean_refs.append(ray.put(group_means(shards, worker_groups)))
        if per_group(config, topology, self.actors):
            # Every gradient is in the store by now: a worker applies group g while
            # the PS actors still sum the groups after it, and can compute a mean
            # itself if its PS dies. The workers wait a little past the driver, so
            # that a late PS is the driver's StepTimeoutError, and once they have
            # begun to apply a step, another step_timeout_s before they give up.
            self._apply_refs = [w.apply_staged.remote(
                topology.groups, mean_refs, grad_refs,
                self.time_left() + constants.WORKER_WAIT_MARGIN_S, config.step_timeout_s)
                for w in workers]
        else:
            self._apply_refs = [w.apply.remote(topology.groups, *mean_refs) for w in workers]

    @property
    def applies_pending(self) -> bool:
        """Whether applies were submitted and not waited for."""
        return self._apply_refs is not None

    def finish(self) -> list[StepResult]:
        """Waits for the applies (blocks, at most what is left of step_timeout_s)."""
        refs, self._apply_refs = self._apply_refs, None
        applied = self.actors.wait(refs, self.workers, f"{self.label}: applying", self.time_left())
        return [StepResult(self.reports(), applied, len(self.workers))]


class LocalSteps:
    """Several steps of one worker in one actor call (`Worker.local_steps`).
    `run_id` ties the calls of one loop together: after a step that stops the
    call (a non-finite gradient under "raise", or a step that raised), the
    worker runs nothing more of that run."""

    exchanges = False

    def __init__(self, config: Config, actors: ActorSet, data: list, run_id: int,
                 first_number: int):
        self.config, self.actors, self.data, self.run_id = config, actors, data, run_id
        self.label = (f"step {first_number}" if len(data) == 1
                      else f"steps {first_number}-{first_number + len(data) - 1}")
        self.workers = actors.workers
        self.start = time.perf_counter()
        self._ref = None

    @property
    def size(self) -> int:
        return len(self.data)

    def submit(self) -> LocalSteps:
        self._ref = self.workers[0].local_steps.remote(self.data, self.run_id)
        return self

    def started(self) -> None:
        """Its steps begin now (the call before it has ended): restart its clock."""
        self.start = time.perf_counter()

    @property
    def applies_pending(self) -> bool:
        return self._ref is not None

    def finish(self) -> list[StepResult]:
        """One result per step run (fewer than submitted at an epoch's end, after a
        non-finite gradient under "raise", or at a step that raised). Waits at
        most step_timeout_s per step."""
        ref, self._ref = self._ref, None
        timeout = self.config.step_timeout_s * self.size - (time.perf_counter() - self.start)
        infos = self.actors.wait([ref], self.workers, self.label, max(0.001, timeout))[0]
        step_s = (time.perf_counter() - self.start) / max(1, len(infos))
        results = []
        for info in infos:
            if info.get("epoch_end"):
                results.append(StepResult([info], [], 1, epoch_end=True))
            elif "error" in info:
                results.append(StepResult(None, [], 1, error=info["error"]))
            else:
                results.append(StepResult([info], [{"apply_s": 0.0, "step_s": step_s}], 1,
                                          skipped=not info["applied"], step_s=step_s))
        return results


def per_group(config: Config, topology: Topology, actors: ActorSet) -> bool:
    """Whether steps apply each PS group's mean as it arrives: strategy "ps", more
    than one group, optimizers that allow it (Replicas.per_group_blocker), every
    worker on one node, and `apply_per_group`. One node: a worker computes a dead
    PS's mean from the workers' gradient objects, which outlive their processes
    there; a lost node takes its workers' objects with it, and survivors that
    had begun to apply could neither finish nor undo."""
    return (config.apply_per_group and config.strategy == "ps" and len(topology.groups) > 1
            and topology.per_group_blocker is None
            and len({actors.info(s)["node_id"] for s in actors.slots}) == 1)
