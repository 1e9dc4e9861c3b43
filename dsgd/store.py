"""Object-store accounting: how much of Ray's shared-memory store is in use.

Used by the leak tests and benchmarks. It reads the raylets' memory stats
through Ray's internal API (the same call `ray memory --stats-only` makes).
"""

from __future__ import annotations


def usage(timeout_s: float = 30.0) -> dict:
    """{"bytes_used": int, "num_objects": int} summed over the cluster's object
    stores (primary copies and secondary copies alike). Blocks for one RPC."""
    import ray
    from ray._private import internal_api

    state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)
    reply = internal_api.get_memory_info_reply(state, timeout_seconds=timeout_s)
    return {"bytes_used": int(reply.store_stats.object_store_bytes_used),
            "num_objects": int(reply.store_stats.num_local_objects)}


def drained_usage(timeout_s: float = 60.0, interval_s: float = 0.1) -> dict:
    """`usage()` once the store has emptied, or the last reading after `timeout_s`.

    Ray frees objects asynchronously: right after a step, that step's shards are
    typically still in the store for about half a second (measured on 2 cores).
    When nothing holds a reference, the store must drain to empty; a store that
    does not is leaking."""
    import gc
    import time

    gc.collect()  # drop unreachable ObjectRefs held in reference cycles
    deadline = time.monotonic() + timeout_s
    reading = usage()
    while reading["num_objects"] and time.monotonic() < deadline:
        time.sleep(interval_s)
        reading = usage()
    return reading
