"""Starting a DistributedSGD's actors (driver side): workers (replicas built,
signatures compared, step compiled), the topology (shard plan, PS layout), PS
actors beside the workers, and the start-up weight broadcast.

`Launcher` is the one builder: it turns the Config into its ActorSet (the
worker actors' arguments and Ray options come from the config alone) and, in
`start`, into the started actors and the Topology; after a membership change
(recovery, elastic growth, a background replacement) the same object starts
the replacements (`start_workers`, `check_joiner`) and the missing PS actors
(`ensure_ps`), so start-up and rebuild read the same way. The module
functions below are its steps.

Every function blocks until its actors have answered, each wait at most
`start_timeout_s` (start-up) or `step_timeout_s`.
"""

from __future__ import annotations

from dsgd import constants
from dsgd.comm import store
from dsgd.comm.param_server import default_num_ps, ps_nodes
from dsgd.comm.sharding import ExchangeLayout, exchange_layout, spread_plan, whole_plan
from dsgd.config import Config
from dsgd.engine.actors import ActorSet
from dsgd.engine.resources import check_resources, check_store, wait_for_room
from dsgd.engine.state import Topology
from dsgd.errors import ModelMismatchError
from dsgd.worker.records import Configured


class Launcher:
    """A Config's actors, started and restarted in one place (see the module
    docstring). `actors`: the ActorSet (empty until `start`); `topology`: set by
    `start`. `suffix`: the last part of every actor name (this instance's id)."""

    def __init__(self, config: Config, suffix: str):
        self.config = config
        self.actors = ActorSet(worker_args(config),
                               {} if config.local else worker_options(config), suffix,
                               config.stall_report_s, local=config.local,
                               ps_world=config.num_workers)
        self.topology: Topology | None = None

    def start(self) -> tuple[ActorSet, Topology]:
        """Every worker, the topology, the PS actors, worker 0's state everywhere.
        Blocks. On any error the actors started so far are shut down."""
        try:
            self.topology = start(self.config, self.actors)
        except BaseException:
            self.actors.shutdown()
            raise
        return self.actors, self.topology

    def start_workers(self, slots: list[int]) -> None:
        """Workers for `slots` (replacements or growth), checked against the
        topology and compiled; their state is copied by the caller. Blocks."""
        start_workers(self.config, self.actors, self.topology, slots)

    def check_joiner(self, info: dict, slot: int) -> None:
        """ModelMismatchError unless a worker started in the background for `slot`
        (its setup `info`) builds the running workers' model."""
        check_signatures([self.topology.signature, info],
                         ["the running workers", f"replacement worker {slot}"])

    def ensure_ps(self) -> None:
        """Start the topology's missing PS actors (dead or never started). Blocks."""
        ensure_ps(self.config, self.actors, self.topology)


def worker_args(config: Config) -> tuple:
    """A worker actor's constructor arguments after its slot (Worker.__init__):
    from the config, with `gpu` as decided (`Config.with_gpu`), not as asked."""
    return (config.model_creator, config.devices_per_worker, bool(config.gpu),
            config.all_reduce_alg, config.worker_init)


def worker_options(config: Config) -> dict:
    """Ray options of a worker actor. Inside a placement group (a Ray Tune trial's
    resources are one; actors only land in it when asked) workers go into any of
    its bundles with room; otherwise they spread over the cluster, after
    checking that it can hold them (ResourceError)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = {"num_cpus": config.num_cpus_per_worker}
    if config.gpu:
        options["num_gpus"] = config.devices_per_worker
    group = ray.util.get_current_placement_group()
    if group is None:
        check_resources(config.num_workers, config.devices_per_worker, config.gpu,
                        config.num_cpus_per_worker)
        options["scheduling_strategy"] = "SPREAD"
    else:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=-1, placement_group_capture_child_tasks=False)
    return options


def start(config: Config, actors: ActorSet) -> Topology:
    """Start every worker, fix the topology from their model, start the PS
    actors and broadcast worker 0 / replica 0's state. Blocks."""
    slots = list(range(config.num_workers))
    wait_for_room(actors.worker_options, len(slots), actors.suffix, constants.START_ROOM_WAIT_S)
    infos = _set_up(config, actors, slots)
    check_signatures(infos, [f"worker {s}" for s in slots])
    worker_nodes = [actors.info(s)["node_id"] for s in slots]
    # On several nodes the shards are cut so that every PS (one per node by default)
    # gets an equal share: sharding.spread_plan.
    spread = (config.num_ps or len(set(worker_nodes))) if len(set(worker_nodes)) > 1 else 1
    plan = (spread_plan(infos[0]["shapes"], infos[0]["dtypes"], config.grad_shard_bytes, spread,
                        compression=config.compression)
            if config.strategy == "ps" else whole_plan(infos[0]["shapes"], infos[0]["dtypes"]))
    check_store(plan, config.num_workers)
    warm_bytes = store.warm_bytes(plan, config.num_workers)
    configured = _configure(config, actors, slots, plan, warm_bytes)
    if config.uses_ps:
        layout = exchange_layout(plan, config.num_ps or default_num_ps(
            plan.num_shards, config.num_workers, worker_nodes))
    else:  # one group per shard; with one worker nothing is exchanged
        layout = ExchangeLayout(plan, tuple((j,) for j in range(plan.num_shards)))
    topology = Topology(
        signature={k: infos[0][k] for k in SIGNATURE_KEYS if k in infos[0]}, layout=layout,
        # Apply each PS group's mean as it arrives where the optimizers allow it;
        # replacements run the same model_creator.
        per_group_blocker=next((c.per_group_blocker for c in configured
                                if c.per_group_blocker), None),
        warm_store_bytes=warm_bytes)
    ensure_ps(config, actors, topology)
    broadcast_state(config, actors)
    return topology


def start_workers(config: Config, actors: ActorSet, topology: Topology, slots: list[int]) -> None:
    """Start workers for `slots` (replacements, or growth with elastic=True), check
    that their model matches the topology's and compile their step. Their
    state is copied by the caller. Blocks, at most `start_timeout_s`."""
    infos = _set_up(config, actors, slots)
    check_signatures([topology.signature] + infos,
                     ["the running workers"] + [f"replacement worker {s}" for s in slots])
    _configure(config, actors, slots, topology.plan, topology.warm_store_bytes)


def ensure_ps(config: Config, actors: ActorSet, topology: Topology) -> None:
    """Start every PS actor of the topology that is missing (never started, or
    dead), PS j on the j-th distinct worker node round-robin (`ps_nodes`)."""
    ps = actors.ps + [None] * (topology.num_ps - len(actors.ps))
    missing = [j for j, p in enumerate(ps) if p is None]
    if not missing:
        return
    nodes = ps_nodes(missing, [actors.info(s)["node_id"] for s in actors.slots])
    handles = actors.start_ps(missing, nodes, topology.warm_store_bytes,
                              rendezvous_timeout_s=config.first_steps_timeout_s)
    infos = actors.wait([p.ready.remote() for p in handles], handles, "starting PS actors",
                        config.start_timeout_s, config.start_stall_report_s)
    actors.ps_ready(handles, infos)


def broadcast_state(config: Config, actors: ActorSet) -> None:
    """Every replica takes worker 0 / replica 0's full model state (one object)."""
    import ray

    workers = actors.workers
    state = actors.wait([workers[0].get_state.remote()], workers[:1],
                        "reading worker 0's weights", config.step_timeout_s)[0]
    ref = ray.put(state)
    actors.wait([w.set_state.remote(ref) for w in workers[1:]] +
                [workers[0].set_state.remote(ref)], workers[1:] + workers[:1],
                "broadcasting worker 0's weights", config.step_timeout_s)


# What workers' models must agree on (Replicas.setup's info); "names" only inform.
SIGNATURE_KEYS = ("names", "shapes", "dtypes", "optimizers", "groups")


def check_signatures(infos: list[dict], labels: list[str] | None = None) -> None:
    """ModelMismatchError unless every worker's setup info (`shapes` and `dtypes`
    of its variables, its `optimizers` and their variable `groups`) matches the
    first one's; the message names both (`labels[i]`, default "worker i") and
    the first difference. The caller shuts the workers down."""
    labels = labels or [f"worker {i}" for i in range(len(infos))]
    first = infos[0]
    for i, info in enumerate(infos[1:], start=1):
        if info["shapes"] != first["shapes"] or info["dtypes"] != first["dtypes"]:
            k = next((k for k, (a, b) in enumerate(zip(info["shapes"], first["shapes"]))
                      if a != b or info["dtypes"][k] != first["dtypes"][k]),
                     min(len(info["shapes"]), len(first["shapes"])))
            raise ModelMismatchError(
                f"model_creator disagrees across workers: {labels[i]}'s replicas have "
                f"{len(info['shapes'])} variables, {labels[0]}'s have {len(first['shapes'])}; "
                f"first difference at variable {k}: {_describe(info, k)} vs {_describe(first, k)}")
        for key, what in (("optimizers", "optimizer(s)"),
                          ("groups", "optimizer variable groups (variable indices)")):
            if key in info and key in first and info[key] != first[key]:
                raise ModelMismatchError(
                    f"model_creator disagrees across workers: {labels[i]}'s replicas have "
                    f"{what} {info[key]}, {labels[0]}'s have {first[key]}")


def _set_up(config: Config, actors: ActorSet, slots: list[int]) -> list[dict]:
    """Create the workers of `slots` and build their replicas; returns their setup infos."""
    handles = actors.start_workers(slots)
    infos = actors.wait([w.setup.remote() for w in handles], handles,
                        "starting (setup: import TensorFlow, build replicas)",
                        config.start_timeout_s, config.start_stall_report_s)
    actors.set_up(slots, infos)
    return infos


def _configure(config: Config, actors: ActorSet, slots: list[int], plan,
               warm_bytes: int) -> list[Configured]:
    """Compile the step of the workers of `slots`; returns their answers, in order."""
    handles = [actors.worker(s) for s in slots]
    return actors.wait([w.configure.remote(plan, config.on_nonfinite, warm_bytes)
                        for w in handles], handles, "compiling the step",
                       config.start_timeout_s, config.start_stall_report_s)


def _describe(info: dict, k: int) -> str:
    if k >= len(info["shapes"]):
        return "(missing)"
    return f"{info['names'][k]} {info['dtypes'][k]}{tuple(info['shapes'][k])}"
