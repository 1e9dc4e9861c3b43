"""The worker actor: one process holding `devices_per_worker` replicas.

The driver wraps `Worker` with `ray.remote`; it only executes what the driver
asks. Call order: `setup()` once, `configure(plan)` once, then per step either
`local_step()` (one worker: no exchange) or `compute(groups)` then
`apply(groups, *group_means)`.

`applied_steps` counts the steps this worker has applied; the driver reads it
(`ping`) after a failure to tell whether the interrupted step was applied.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from dsgd import checkpoint, store
from dsgd.errors import DsgdError
from dsgd.model import Model
from dsgd.replicas import Replicas
from dsgd.sharding import ShardPlan


class Worker:
    def __init__(self, model_creator: Callable[[int, int], Model], worker_index: int,
                 devices_per_worker: int, gpu: bool, all_reduce_alg: str):
        self.worker_index = worker_index
        self.applied_steps = 0
        self._gc_frozen = False
        self.replicas = Replicas(model_creator, worker_index, devices_per_worker, gpu,
                                 all_reduce_alg)

    def setup(self) -> dict:
        """Build the replicas (imports TensorFlow). Returns their variable signature
        (names, shapes, dtypes), devices, node id and pid."""
        import ray

        info = self.replicas.setup()
        info["node_id"] = ray.get_runtime_context().get_node_id()
        return info

    def configure(self, plan: ShardPlan, on_nonfinite: str = "raise",
                  warm_store_bytes: int = 0) -> None:
        """Compile the step for `plan` and warm `warm_store_bytes` of this process's
        object-store mapping (store.warm)."""
        self.replicas.configure(plan, on_nonfinite)
        self.warmed_store_bytes = store.warm(warm_store_bytes)
        self._gc_frozen = False  # new functions: freeze again once they are traced

    def _freeze_gc_once(self) -> None:
        """After the first step (TensorFlow, Keras and the traced step are built),
        move every object alive into Python's permanent GC generation. A worker
        holds ~400 K such objects; a full collection walked all of them about
        once every 10 steps, ~20-25 ms of CPU per step on average (measured on a
        100 MiB model, 2 cores). Objects made later are collected as usual."""
        if not self._gc_frozen:
            import gc

            gc.collect()
            gc.freeze()
            self._gc_frozen = True

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
        self._freeze_gc_once()
        return {"losses": losses.numpy().tolist(), "finite": finite, "applied": applied,
                "compute_s": time.perf_counter() - start}

    def compute(self, groups: tuple[tuple[int, ...], ...]):
        """This step's gradients, averaged across local replicas, streamed group by
        group. A generator (call with num_returns="streaming"): yields the info
        dict, then for each group of shard indices one flat tuple of the pieces of
        its shards, in order. Each yield becomes its own object, in the store as
        soon as it is written, so a PS can sum group g while group g+1 is being
        written."""
        start = time.perf_counter()
        losses, finite, flat_grads = self.replicas.compute()
        pieces = self.replicas.shard_pieces(flat_grads)
        yield {"losses": losses.numpy().tolist(), "finite": finite.numpy().tolist(),
               "compute_s": time.perf_counter() - start}
        for group in groups:  # (Ray's generator wrapper cannot `yield from` a list)
            yield tuple(piece for j in group for piece in pieces[j])

    def apply(self, groups: tuple[tuple[int, ...], ...], *group_means: tuple) -> dict:
        """Apply the global mean gradient to every replica. `group_means[g]` holds
        one 1-D array per shard of `groups[g]`, as a PS returns them: read-only
        object-store views, read during the call, not kept."""
        start = time.perf_counter()
        if len(group_means) != len(groups):
            raise DsgdError(f"worker {self.worker_index}: got {len(group_means)} mean groups "
                            f"for {len(groups)} groups")
        shards: list = [None] * sum(len(g) for g in groups)
        for group, means in zip(groups, group_means):
            if len(means) != len(group):
                raise DsgdError(f"worker {self.worker_index}: a mean group holds {len(means)} "
                                f"arrays for shards {list(group)}")
            for j, mean in zip(group, means):
                shards[j] = mean
        self.replicas.apply(shards)
        self.applied_steps += 1
        self._freeze_gc_once()
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
