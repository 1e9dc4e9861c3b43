"""This process's mapping of Ray's shared-memory object store: warming it, and how
much a run should warm."""

from __future__ import annotations

from dsgd.comm.waits import fetch

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
        fetch(ray.put(np.zeros(1024, np.uint8)), "mapping the object store", 30)  # maps it
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
