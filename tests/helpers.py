"""What many test modules need: replica equality, the dsgd actors alive on the
cluster, waiting for a condition, and putting a shared instance back to a known
state so that tests of one module can share its actors (each construction
starts worker processes that import TensorFlow: seconds each on 2 cores)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np


def replica_weights(sgd) -> list[list[np.ndarray]]:
    """Every replica's weights (a `DistributedSGD` or a `Trainer`), worker-major."""
    sgd = getattr(sgd, "sgd", sgd)
    return sgd.foreach_model(lambda m: m.get_weights())


def assert_replicas_identical(sgd) -> list[np.ndarray]:
    """Every replica holds bit-identical weights; returns replica 0's."""
    first, *rest = replica_weights(sgd)
    for r, other in enumerate(rest, start=1):
        assert len(other) == len(first), f"replica {r} has {len(other)} variables, not {len(first)}"
        for a, b in zip(first, other):
            np.testing.assert_array_equal(a, b, err_msg=f"replica {r} differs from replica 0")
    return first


def dsgd_actor_names(prefixes=("dsgd-worker-", "dsgd-ps-"), instance_id: str | None = None) -> set[str]:
    """Names of live dsgd actors (all namespaces), optionally of one instance (its
    id ends every name; a replacement's name carries `-<id>-r`)."""
    import ray

    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(prefixes)}
    if instance_id is not None:
        names = {n for n in names if n.endswith(instance_id) or f"-{instance_id}-r" in n}
    return names


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.2) -> bool:
    """Poll `predicate()` until it is true (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)


def actors_gone(instance_id: str | None = None, prefixes=("dsgd-worker-", "dsgd-ps-"),
                before: set[str] = frozenset(), timeout_s: float = 20.0) -> set[str]:
    """Wait (at most `timeout_s`) for killed actors to leave the name list; returns
    the names still alive beyond `before` (empty when all went)."""
    left = lambda: dsgd_actor_names(prefixes, instance_id) - set(before)  # noqa: E731
    wait_until(lambda: not left(), timeout_s)
    return left()


class Reset:
    """A shared `DistributedSGD` put back to the state it had when this was made:
    weights, optimizer state and step count from a checkpoint (`restore_checkpoint`),
    then `replica_reset(model)` on every replica for the replicas' own counters
    (e.g. `tiny.TinyModel.steps`, which keys its batches)."""

    def __init__(self, sgd, path: str, replica_reset=None):
        self.sgd, self.path, self.replica_reset = sgd, path, replica_reset
        sgd.save_checkpoint(path)

    def __call__(self):
        self.sgd.restore_checkpoint(self.path)
        if self.replica_reset is not None:
            self.sgd.foreach_model(self.replica_reset)
        return self.sgd


def reset_tiny_steps(model) -> None:
    """`Reset`'s replica_reset for `tiny.TinyModel`: its batches start again at step 0."""
    model.steps = 0


def ready_patch(ready: int):
    """Patch, in a worker's process, `StepExchange.ready_prefix` to say `ready` (how
    many buckets are in when the step is decided: 1 of 2 applies the step in two
    updates, bucket 1's mean read between them) whatever the timing, and count
    the replicas' applies at once ("whole") and in parts ("part"). `unpatch`
    undoes it."""
    def patch(worker):
        from dsgd.comm import ps_client

        ps_client.StepExchange._real = {"ready_prefix": ps_client.StepExchange.ready_prefix}
        ps_client.StepExchange.ready_prefix = lambda self: ready
        worker.applies = {"whole": 0, "part": 0}
        replicas = worker.replicas
        whole, part = replicas.apply, replicas.apply_stage

        def count(kind, fn):
            def counted(*args):
                worker.applies[kind] += 1
                return fn(*args)
            return counted

        replicas.apply, replicas.apply_stage = count("whole", whole), count("part", part)
    return patch


def unpatch(worker):
    from dsgd.comm import ps_client

    for name, real in getattr(ps_client.StepExchange, "_real", {}).items():
        setattr(ps_client.StepExchange, name, real)
    ps_client.StepExchange._real = {}
    for name in ("apply", "apply_stage"):
        worker.replicas.__dict__.pop(name, None)
    worker.__dict__.pop("_apply_deferred", None)


def kill_ps_before_sending(bucket: int, pid: int):
    """Patch, in a worker's process, `StepExchange.send` so that the worker about to
    send `bucket` of the next step first kills the PS process `pid` (the first
    to get there kills it, the other finds it dead)."""
    def patch(worker):
        from dsgd.comm import ps_client

        real = ps_client.StepExchange.send
        ps_client.StepExchange._real = {"send": real}
        first: list = []

        def send(self, g, part):
            first.append(self.seq)
            if g == bucket and self.seq == first[0]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                for _ in range(200):
                    if gone(pid):
                        break
                    time.sleep(0.05)
            return real(self, g, part)

        ps_client.StepExchange.send = send
        worker.buckets_averaged_before = worker.buckets_averaged_here
        worker.flushes = []  # at each call's end: whether a decided step was still to apply
        flush = worker._apply_deferred

        def flushing():
            worker.flushes.append(worker._deferred is not None)
            flush()

        worker._apply_deferred = flushing
    return patch


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


# -- object-store accounting (the leak tests) -------------------------------------------
# It reads the raylets' memory stats (what `ray memory --stats-only` prints), a
# private Ray API: see dsgd/ray_private.py.
def usage(timeout_s: float = 30.0) -> dict:
    """{"bytes_used": int, "num_objects": int} summed over the cluster's object
    stores (primary copies and secondary copies alike). Blocks for one RPC."""
    from dsgd import ray_private

    return ray_private.object_store_stats(timeout_s)


def holders() -> str:
    """What `ray memory` prints (a private Ray API, like `usage`): each object in the
    stores, with the process that holds it and how; a leak check's failure
    message. Blocks for one RPC per node."""
    import ray
    from ray._private import internal_api

    return internal_api.memory_summary(ray.get_runtime_context().gcs_address, line_wrap=False,
                                       num_entries=40)


def drained_usage(timeout_s: float = 60.0, interval_s: float = 0.1,
                  baseline: dict | None = None, settle_s: float = 0.5) -> dict:
    """`usage()` once the store has drained down to `baseline`'s object count
    (default: empty) and two readings `settle_s` apart agree, or the last reading
    after `timeout_s`.

    Ray frees objects asynchronously: right after a step, that step's shards are
    typically still in the store for a moment (benchmarks/design_measurements.md).
    When nothing holds a reference, the store must drain back to what it held
    before (objects of others, e.g. blocks Ray Data keeps for a dataset); a store
    that does not is leaking. The settling matters where `baseline` is stale:
    objects of others freed since it was read put the store below it at once,
    with this caller's last objects still being freed (CI, 2026-11-29: a reading
    taken at once held the last steps' 19 objects)."""
    import gc
    import time

    target = (baseline or {}).get("num_objects", 0)
    gc.collect()  # drop unreachable ObjectRefs held in reference cycles
    deadline = time.monotonic() + timeout_s
    reading = usage()
    while reading["num_objects"] > target and time.monotonic() < deadline:
        time.sleep(interval_s)
        reading = usage()
    if reading["num_objects"] > target:
        return reading
    return settled_usage(max(0.0, deadline - time.monotonic()), settle_s)


def settled_usage(timeout_s: float = 30.0, interval_s: float = 0.5) -> dict:
    """`usage()` once two readings `interval_s` apart agree (objects others were
    freeing are gone): the baseline a leak check compares against."""
    import gc
    import time

    gc.collect()
    deadline = time.monotonic() + timeout_s
    reading = usage()
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        again = usage()
        if again == reading:
            return again
        reading = again
    return reading


def pack(plan, flat_arrays) -> list[np.ndarray]:
    """numpy reference of a plan's shard buffers (padding zeroed) for the flat
    variables `flat_arrays`, in each shard's wire dtype."""
    from dsgd.comm.sharding import to_wire

    shards = []
    for s in plan.shards:
        out = np.zeros(s.num_elements, s.wire_numpy_dtype)
        for p in s.pieces:
            out[p.shard_offset:p.shard_offset + p.length] = to_wire(
                flat_arrays[p.var_index][p.var_offset:p.var_offset + p.length], s.dtype)
        shards.append(out)
    return shards
