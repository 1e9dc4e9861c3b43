"""The worker actor: one process holding `devices_per_worker` replicas.

The driver wraps `Worker` with `ray.remote`; it only executes what the driver
asks. Call order: `setup()` once, `configure(plan)` once, then per step either
`local_step()` (one worker: no exchange) or `compute()` then `apply(*mean_shards)`.

`applied_steps` counts the steps this worker has applied; the driver reads it
(`ping`) after a failure to tell whether the interrupted step was applied.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from dsgd import checkpoint
from dsgd.model import Model
from dsgd.replicas import Replicas
from dsgd.sharding import ShardPlan


class Worker:
    def __init__(self, model_creator: Callable[[int, int], Model], worker_index: int,
                 devices_per_worker: int, gpu: bool, all_reduce_alg: str):
        self.worker_index = worker_index
        self.applied_steps = 0
        self.replicas = Replicas(model_creator, worker_index, devices_per_worker, gpu,
                                 all_reduce_alg)

    def setup(self) -> dict:
        """Build the replicas (imports TensorFlow). Returns their variable signature
        (names, shapes, dtypes), devices, node id and pid."""
        import ray

        info = self.replicas.setup()
        info["node_id"] = ray.get_runtime_context().get_node_id()
        return info

    def configure(self, plan: ShardPlan, on_nonfinite: str = "raise") -> None:
        self.replicas.configure(plan, on_nonfinite)

    def ping(self) -> dict:
        """Liveness and progress; runs after every call queued before it."""
        import os

        return {"applied_steps": self.applied_steps, "pid": os.getpid()}

    def local_step(self) -> dict:
        """A whole step with no exchange (num_workers == 1). Blocks until applied.
        `finite` says which replicas' gradients were finite; `applied` whether
        the update ran (not with a non-finite gradient and on_nonfinite="skip")."""
        start = time.perf_counter()
        losses, finite = self.replicas.local_step()
        finite = finite.numpy().tolist()
        applied = all(finite) or not self.replicas.gate_apply
        self.applied_steps += applied
        return {"losses": losses.numpy().tolist(), "finite": finite, "applied": applied,
                "compute_s": time.perf_counter() - start}

    def compute(self):
        """This step's gradients, averaged across local replicas, streamed shard
        by shard. A generator (call with num_returns="streaming"): yields the info
        dict, then each shard of the plan as a tuple of its pieces. Each yield
        becomes its own object, in the store as soon as it is written, so a PS
        can sum shard j while shard j+1 is being written."""
        start = time.perf_counter()
        losses, finite, flat_grads = self.replicas.compute()
        pieces = self.replicas.shard_pieces(flat_grads)
        yield {"losses": losses.numpy().tolist(), "finite": finite.numpy().tolist(),
               "compute_s": time.perf_counter() - start}
        for shard in pieces:  # (Ray's generator wrapper cannot `yield from` a list)
            yield shard

    def apply(self, *mean_shards: np.ndarray) -> dict:
        """Apply the global mean gradient, in shards, to every replica. The shard
        arrays (read-only object-store views) are read during the call, not kept."""
        start = time.perf_counter()
        self.replicas.apply(mean_shards)
        self.applied_steps += 1
        return {"apply_s": time.perf_counter() - start}

    def get_state(self) -> list[np.ndarray]:
        """Replica 0's full model state (a Keras model's `weights`, non-trainable
        included; else `get_variables()`), for the start-up broadcast."""
        return [np.array(v.numpy()) for v in checkpoint.state_variables(self.replicas.replicas[0])]

    def set_state(self, state: list[np.ndarray]) -> None:
        for replica in self.replicas.replicas:
            for variable, value in zip(checkpoint.state_variables(replica), state, strict=True):
                variable.assign(value)

    def get_full_state(self) -> dict:
        """Everything a replacement worker needs to continue exactly: replica 0's
        model state, its optimizer's variables (iteration count, slots) and
        `applied_steps`. Returned through the object store."""
        optimizer = self.replicas.optimizers[0]
        return {"model": self.get_state(),
                "optimizer": [np.array(v.numpy()) for v in optimizer.variables],
                "applied_steps": self.applied_steps}

    def set_full_state(self, state: dict) -> None:
        """Load a `get_full_state()` into every replica (read, not kept)."""
        self.set_state(state["model"])
        for optimizer in self.replicas.optimizers:
            for variable, value in zip(optimizer.variables, state["optimizer"], strict=True):
                variable.assign(value)
        self.applied_steps = int(state["applied_steps"])

    def get_weights(self) -> list[np.ndarray]:
        return self.replicas.replicas[0].get_weights()

    def set_weights(self, weights: list[np.ndarray]) -> None:
        for replica in self.replicas.replicas:
            replica.set_weights(weights)

    def foreach_model(self, fn: Callable[[Model], Any]) -> list:
        return [fn(replica) for replica in self.replicas.replicas]

    def foreach_worker(self, fn: Callable[["Worker"], Any]) -> Any:
        return fn(self)

    def save_checkpoint(self, step: int) -> dict[str, bytes]:
        """Replica 0's weights and optimizer state as checkpoint files {suffix: bytes}."""
        return checkpoint.save_files(self.replicas.replicas[0], self.replicas.optimizers[0], step)

    def restore_checkpoint(self, files: dict[str, bytes]) -> int:
        """Restore every replica from checkpoint files; returns the saved step."""
        step = checkpoint.restore_files(self.replicas.replicas, self.replicas.optimizers, files)
        self.applied_steps = step
        return step
