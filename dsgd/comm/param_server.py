"""The parameter-server actor: sums one shard from every worker, returns the mean.

Stateless: it holds no model state, so any PS can serve any shard and a dead
one can simply be replaced. The driver wraps `ParameterServer` with `ray.remote`.
"""

from __future__ import annotations

import numpy as np

from dsgd.comm import store
from dsgd.comm.means import mean_shard, split_group
from dsgd.comm.sharding import Shard


class ParameterServer:
    def __init__(self, ps_index: int, warm_store_bytes: int = 0):
        self.ps_index = ps_index
        self.warmed_store_bytes = store.warm(warm_store_bytes)
        # Scratch output buffers, reused step after step so that summing never
        # touches fresh pages (first touch costs more than the sum on a VM).
        # Ray copies the returned array into the store before the next call.
        self._scratch: dict = {}

    def ready(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id()}

    def ping(self) -> dict:
        """Liveness; runs after every call queued before it."""
        import os

        return {"pid": os.getpid()}

    def mean(self, shards: tuple[Shard, ...], *worker_groups: tuple[np.ndarray, ...]) -> tuple:
        """Mean over every worker of a group of shards. Each worker's group arrives
        as one tuple: the pieces of `shards[0]`, then those of `shards[1]`, ...
        (read-only object-store views; read, never kept). Returns a tuple with
        one buffer per shard, laid out as the shard says, padding zeroed; Ray
        writes the tuple into one object."""
        out = []
        for k, shard in enumerate(shards):
            key = (k, shard.dtype, shard.num_elements)
            if key not in self._scratch:
                self._scratch[key] = np.zeros(shard.num_elements, shard.wire_numpy_dtype)
            out.append(self._scratch[key])
        for k, (shard, pieces) in enumerate(zip(shards, split_group(shards, worker_groups))):
            try:
                mean_shard(shard, pieces, out=out[k])
            except ValueError as e:
                raise ValueError(f"PS {self.ps_index}, shard {k} of its group: {e}") from e
        return tuple(out)
