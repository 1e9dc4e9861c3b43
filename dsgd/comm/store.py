"""Object-store accounting: how much of Ray's shared-memory store is in use.

Used by the leak tests and benchmarks. It reads the raylets' memory stats
(what `ray memory --stats-only` prints), a private Ray API: see dsgd/ray_private.py.
"""

from __future__ import annotations


def usage(timeout_s: float = 30.0) -> dict:
    """{"bytes_used": int, "num_objects": int} summed over the cluster's object
    stores (primary copies and secondary copies alike). Blocks for one RPC."""
    from dsgd import ray_private

    return ray_private.object_store_stats(timeout_s)


def drained_usage(timeout_s: float = 60.0, interval_s: float = 0.1,
                  baseline: dict | None = None) -> dict:
    """`usage()` once the store has drained down to `baseline`'s object count
    (default: empty), or the last reading after `timeout_s`.

    Ray frees objects asynchronously: right after a step, that step's shards are
    typically still in the store for a moment (benchmarks/design_measurements.md).
    When nothing holds a reference, the store must drain back to what it held
    before (objects of others, e.g. blocks Ray Data keeps for a dataset); a store
    that does not is leaking."""
    import gc
    import time

    target = (baseline or {}).get("num_objects", 0)
    gc.collect()  # drop unreachable ObjectRefs held in reference cycles
    deadline = time.monotonic() + timeout_s
    reading = usage()
    while reading["num_objects"] > target and time.monotonic() < deadline:
        time.sleep(interval_s)
        reading = usage()
    return reading


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


# madvise(2) advice (Linux >= 5.14): fault in every page of a range, writable,
# without reading or writing its contents.
_MADV_POPULATE_WRITE = 23


def store_mappings(shared_memory_only: bool = False) -> list[tuple[int, int]]:
    """(address, length) of this process's mappings of Ray's object store (the
    plasma file in /dev/shm or, when that is too small, in Ray's temp directory;
    with `shared_memory_only`, those in /dev/shm only). Empty where there is none
    (not Linux, or this process has not touched the store yet)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and "/plasma" in fields[5] and fields[1].startswith("rw") \
                and (not shared_memory_only or fields[5].startswith("/dev/shm/")):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end - start))
    return found


def warm(max_bytes: int) -> int:
    """Fault in this process's page-table entries for the first `max_bytes` of
    every object-store mapping, so that writing or reading an object there later
    never pays a first-touch page fault. Blocks, in proportion to `max_bytes`. Contents are
    not touched. Returns the bytes populated (0 where madvise cannot do it:
    kernels before 5.14, no mapping yet, or a store Ray put on disk because
    /dev/shm was too small, where populating would write to disk; the store then
    warms up as it is used).

    Why: Ray places each step's objects wherever its allocator finds room, so
    for the first tens of steps every process kept touching pages of the store
    it had not used before, with the kernel zeroing fresh pages (how many:
    benchmarks/design_measurements.md)."""
    import ctypes

    import numpy as np
    import ray

    if max_bytes <= 0:
        return 0
    if not store_mappings():
        ray.get(ray.put(np.zeros(1024, np.uint8)), timeout=30)  # maps the store
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for address, length in store_mappings(shared_memory_only=True):
        length = min(length, max_bytes)
        if libc.madvise(address, length, _MADV_POPULATE_WRITE) != 0:
            return done
        done += length
    return done


def warm_bytes(plan, num_workers: int) -> int:
    """How much of its store mapping each actor warms: STORE_WARM_STEPS steps of
    objects ((num_workers + 1) x the gradient's bytes each), at most
    STORE_WARM_MAX_BYTES; 0 with one worker, which exchanges nothing through the
    store. Ray's allocator reuses freed room, so a step's objects land within
    the first few steps' worth of the store."""
    from dsgd import constants

    if num_workers <= 1:
        return 0
    step_bytes = (num_workers + 1) * sum(s.nbytes for s in plan.shards)
    return min(constants.STORE_WARM_STEPS * step_bytes, constants.STORE_WARM_MAX_BYTES)
