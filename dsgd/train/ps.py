"""The PS actor of the Ray Train backend: a rendezvous that averages.

Unlike the engine's PS (dsgd/comm/param_server.py), which the driver calls once every
worker's shards exist, here the workers call it themselves (no driver in the
per-step path): worker r calls `reduce(seq, r, world, shards, pieces)` with the
tuple of its pieces of a group of shards (one object in the store, read here as
zero-copy views); the call waits (asynchronously: this is an async
actor, so the other workers' calls run meanwhile) until all `world` workers'
pieces of exchange `seq` have arrived; the last arrival sums them with the same
native kernel as the engine, and every call returns the mean. Every wait has a
timeout that names the ranks that never came.
"""

from __future__ import annotations

import asyncio

from dsgd.comm import store
from dsgd.comm.means import group_means


class RendezvousPS:
    def __init__(self, ps_index: int, timeout_s: float, warm_store_bytes: int = 0):
        self.ps_index, self.timeout_s = ps_index, timeout_s
        self.warmed_store_bytes = store.warm(warm_store_bytes)
        self._pending: dict = {}  # (kind, seq) -> {"parts", "done", "result", "served"}

    def ready(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id()}

    def ping(self) -> dict:
        import os

        return {"pid": os.getpid(), "pending": len(self._pending)}

    async def reduce(self, seq: int, rank: int, world: int, shards: tuple, pieces: tuple) -> tuple:
        """The mean over `world` workers of a group of shards (see the module
        docstring): one array per shard, laid out as the shard says."""
        entry = await self._arrive(("reduce", seq), rank, world, pieces)
        if entry["result"] is None:
            groups = [entry["parts"][r] for r in range(world)]
            entry["result"] = group_means(shards, groups)
            entry["done"].set()
        return await self._leave(("reduce", seq), entry, world)

    async def broadcast(self, seq: int, rank: int, world: int, root: int, values):
        """`values` of rank `root` (the others pass None), returned to every rank."""
        entry = await self._arrive(("broadcast", seq), rank, world, values, wait_for=(root,))
        entry["result"] = entry["parts"][root]
        entry["done"].set()
        return await self._leave(("broadcast", seq), entry, world)

    async def _arrive(self, key, rank: int, world: int, part, wait_for=None) -> dict:
        entry = self._pending.setdefault(key, {"parts": {}, "done": asyncio.Event(),
                                               "result": None, "served": 0})
        entry["parts"][rank] = part
        needed = range(world) if wait_for is None else wait_for
        if all(r in entry["parts"] for r in needed):
            return entry
        try:
            await asyncio.wait_for(entry["done"].wait(), self.timeout_s)
        except asyncio.TimeoutError:
            missing = sorted(set(needed) - set(entry["parts"]))
            raise TimeoutError(f"dsgd PS {self.ps_index}: {key[0]} {key[1]}: rank(s) {missing} "
                               f"of {world} did not arrive within {self.timeout_s:.0f} s") from None
        return entry

    async def _leave(self, key, entry: dict, world: int):
        entry["served"] += 1
        if entry["served"] == world:
            del self._pending[key]
        return entry["result"]
