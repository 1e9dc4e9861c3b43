"""`DsgdConfig` and its Ray Train `Backend`: start the PS actors when Ray Train
starts (or restarts) its worker group, tell every worker where they are, and
stop them when the group shuts down."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass

from ray.train.backend import Backend, BackendConfig

from dsgd import constants
from dsgd.comm.waits import outcomes

logger = logging.getLogger("dsgd")


@dataclass
class DsgdConfig(BackendConfig):
    """The options of dsgd's Ray Train backend (`DsgdTrainer(dsgd_config=)`,
    or `DataParallelTrainer(backend_config=)`). A dataclass, checked at
    construction.

    Args:
        num_ps: PS actors (default: workers on one node, one per worker; on
            several nodes, one per worker node), round-robin over the workers'
            nodes, taking no CPU slot.
        grad_shard_bytes: largest gradient shard, as the engine's (on several
            nodes cut smaller so that every PS gets an equal share).
        devices_per_worker: devices each Ray Train worker trains on; only 1 is
            supported here (the engine, `dsgd.DistributedSGD`, drives several).
        timeout_s: longest wait of one exchange, in seconds; then an error names
            the PS actor or the ranks that did not answer.
        compression: None, "fp16" or "bf16": float32 gradients travel (and are
            averaged, in float32, then rounded once) as that 16-bit type, as
            the engine's `compression`. A collective's own `compression`
            argument overrides it.
        timeline: a file path: write a Chrome trace of the run there (each
            worker's collectives and their sends, each PS's sums; Horovod's
            `HOROVOD_TIMELINE`), rewritten when Ray Train stops or restarts
            the worker group. Default: the `DSGD_TIMELINE` environment variable
            of the process that makes the config, else its `HOROVOD_TIMELINE`
            (a ported launch line keeps working), else no timeline.

    Raises:
        ValueError: a value out of range (named), or `devices_per_worker`
            other than 1.
    """

    num_ps: int | None = None
    grad_shard_bytes: int = constants.DEFAULT_GRAD_SHARD_BYTES
    devices_per_worker: int = 1
    timeout_s: float = constants.DEFAULT_STEP_TIMEOUT_S
    compression: str | None = None
    timeline: str | None = None

    def __post_init__(self):
        from dsgd.comm import timeline

        if self.timeline is None and not os.environ.get(timeline.ENV):
            self.timeline = os.environ.get("HOROVOD_TIMELINE") or None
        self.timeline = timeline.path_from(self.timeline)  # (ValueError naming it)
        for name in ("grad_shard_bytes", "devices_per_worker"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DsgdConfig: {name} must be a positive int, got {value!r}")
        if self.num_ps is not None and (isinstance(self.num_ps, bool)
                                        or not isinstance(self.num_ps, int) or self.num_ps < 1):
            raise ValueError(f"DsgdConfig: num_ps must be a positive int or None, got {self.num_ps!r}")
        if self.devices_per_worker != 1:
            raise ValueError("DsgdConfig: devices_per_worker must be 1: a Ray Train worker trains "
                             "one replica (ask ScalingConfig for more workers; dsgd.DistributedSGD "
                             "drives several devices per worker)")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"DsgdConfig: timeout_s must be a positive number, got {self.timeout_s!r}")
        if self.compression is not None and self.compression not in constants.COMPRESSIONS:
            raise ValueError(f"DsgdConfig: compression must be None or one of "
                             f"{list(constants.COMPRESSIONS)}, got {self.compression!r}")

    @property
    def backend_cls(self):
        """`DsgdBackend`: what Ray Train instantiates for this config."""
        return DsgdBackend


class DsgdBackend(Backend):
    """The Ray Train `Backend` of `DsgdConfig`; Ray Train calls it, users do not.

    `on_start` (when Ray Train starts or restarts its worker group) starts the
    engine's PS actors (dsgd/comm/param_server.py, placed as the engine places
    them: PS j beside worker j), named `dsgd-ps-<j>-<run id>`, then installs the
    exchange context in every worker; `on_shutdown` kills the PS actors.
    """

    def __init__(self):
        self.ps: list = []
        self.events: list = []  # the timeline's events so far (DsgdConfig.timeline)

    def on_start(self, worker_group, backend_config: DsgdConfig) -> None:
        """Start the PS actors (killing a previous group's first) and install
        the exchange in every worker. Blocks until every PS answers, at most
        `backend_config.timeout_s` seconds."""

        from dsgd.comm.param_server import (ParameterServer, default_num_ps, ps_actor_class,
                                            ps_nodes, ps_options, rendezvous_concurrency)
        from dsgd.comm.waits import get_all
        from dsgd.train.exchange import install

        self.on_shutdown(worker_group, backend_config)  # a restart: the old ones are useless
        workers = worker_group.get_workers()
        worker_nodes = [w.metadata.node_id for w in workers]
        # (The shards are not known yet: the plan is made from the first exchange.)
        num_ps = backend_config.num_ps or default_num_ps(len(workers), len(workers),
                                                         worker_nodes)
        run = uuid.uuid4().hex[:6]
        names = [f"{constants.PS_NAME_PREFIX}{j}-{run}" for j in range(num_ps)]
        nodes = ps_nodes(list(range(num_ps)), worker_nodes)
        remote = ps_actor_class(ParameterServer, len(workers))
        self.ps = [remote.options(name=name, max_concurrency=rendezvous_concurrency(len(workers)),
                                  **ps_options(node)).remote(
            j, rendezvous_timeout_s=backend_config.timeout_s)
            for j, (name, node) in enumerate(zip(names, nodes))]
        get_all([p.ready.remote() for p in self.ps], names, "dsgd.train: starting PS actors",
                backend_config.timeout_s)
        node_ids = [w.metadata.node_id for w in workers]
        node_sizes = [node_ids.count(n) for n in dict.fromkeys(node_ids)]
        worker_group.execute(install, self.ps, names, backend_config.grad_shard_bytes,
                             backend_config.timeout_s, backend_config.compression, node_sizes)
        if backend_config.timeline is not None:
            from dsgd.comm import timeline
            from dsgd.comm.ps_client import enable_timeline

            get_all(enable_timeline(self.ps, True), names, "dsgd.train: starting the timeline",
                    backend_config.timeout_s)
            for i in range(len(workers)):
                worker_group.execute_single(i, timeline.enable, f"worker {i}")
        logger.info("dsgd.train: %d PS actor(s) for %d worker(s): %s", num_ps, len(workers),
                    ", ".join(names))

    def on_shutdown(self, worker_group, backend_config: DsgdConfig) -> None:
        """Kill the PS actors (already dead ones are skipped); with a timeline,
        first collect the workers' and PS actors' events (what a dead one had
        is lost) and rewrite the trace file. Waits at most
        `backend_config.timeout_s` for the events, not for the kills."""
        import ray

        if backend_config.timeline is not None and self.ps:
            self._write_timeline(worker_group, backend_config)
        for handle in self.ps:
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.ps = []

    def _write_timeline(self, worker_group, backend_config: DsgdConfig) -> None:

        from dsgd.comm import timeline
        from dsgd.comm.ps_client import timeline_events

        def drain():
            return timeline.recorder().drain()

        refs = [timeline_events(p) for p in self.ps]
        try:
            refs += worker_group.execute_async(drain)
        except Exception as e:  # noqa: BLE001 - the group is gone (a restart after a death)
            logger.warning("dsgd.train: timeline: the workers' events are lost (%s)", e)
        for answer in outcomes(refs, "timeline events", backend_config.timeout_s):
            if isinstance(answer, Exception):  # a dead actor's events are lost
                logger.warning("dsgd.train: timeline: one process's events are lost (%s: %s)",
                               type(answer).__name__, answer)
            else:
                self.events += answer
        timeline.write(backend_config.timeline, self.events)
        logger.info("dsgd.train: timeline written to %s", backend_config.timeline)
