"""A worker's replicas and its compiled step (no Ray here).

`Replicas` builds one replica per device, checks that they agree, and owns the
`tf.function`s of a step. The worker actor (dsgd/worker/worker.py) drives it; it can
also be used in-process.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import numpy as np

from dsgd.comm import device_mean
from dsgd.native import dlpack, ops
from dsgd.errors import DsgdError, ModelMismatchError
from dsgd.model import Model, _name, _np_dtype, loss_parts, optimizer_groups
from dsgd.worker.devices import configure_devices
from dsgd.worker.staging import _Stage, _last_group_of_variables, per_group_blocker  # noqa: F401
from dsgd.comm.sharding import ShardPlan


class Replicas:
    def __init__(self, model_creator: Callable[[int, int], Model], worker_index: int,
                 devices_per_worker: int, gpu: bool, all_reduce_alg: str):
        self.model_creator = model_creator
        self.worker_index = worker_index
        self.num_devices = devices_per_worker
        self.gpu = gpu
        self.all_reduce_alg = all_reduce_alg
        self.replicas: list[Model] = []
        self.eager = False  # local mode: steps run uncompiled (`use_eager`)
        # timeline=: the compiled steps note when every replica's forward pass has
        # ended (`forward_at`, perf_counter; None when not noted). Off: no such op.
        self._mark_forward = False
        self.forward_at: float | None = None
        # Built by `setup` (TensorFlow is imported there, not here): per replica.
        self.devices: list[str] = []
        self.optimizers: list[list] = []       # its optimizers
        self.group_indices: list[list] = []    # each optimizer's variable indices
        self.variables: list[list] = []        # its trainable variables
        # Set by `configure` (a shard plan): what the compiled steps are for.
        self.plan: ShardPlan | None = None
        self.wire_dtypes: list = []            # each variable's gradient on the wire
        self.check_finite = True
        self.gate_apply = False
        self.per_group_blocker: str | None = None
        # Made by `retrace` (compiled at their next call).
        self._local_step_fn = self._compute_fn = self._apply_fn = None
        self._stages: dict = {}  # shard groups -> [_Stage], for apply_stage
        self._sending_fns: dict = {}  # shard groups -> compiled compute_sending
        self._sender: Callable | None = None  # compute_sending's receiver, during its call
        self.deferred_applied, self.applied_at = True, None  # compute_sending(deferred=...)

    def use_eager(self) -> None:
        """Local mode (dsgd/engine/local.py): steps run uncompiled, for debuggers."""
        self.eager = True

    def begin_step(self, mark_forward: bool) -> None:
        """Before a compiled step: whether it notes its forward pass's end
        (`mark_forward`), and no end noted yet (`forward_at` None)."""
        self.mark_forward = mark_forward
        self.forward_at = None

    def setup(self) -> dict:
        """Configure devices and build the replicas. Returns the variable signature
        (names, shapes, dtypes) the driver compares across workers."""
        import tensorflow as tf

        self.devices = configure_devices(self.num_devices, self.gpu)
        self.optimizers, self.group_indices = [], []
        for i, device in enumerate(self.devices):
            with tf.device(device), tf.name_scope(f"device_{i}"):
                replica = self.model_creator(self.worker_index, i)
                if not isinstance(replica, Model):
                    raise TypeError(f"model_creator({self.worker_index}, {i}) must return a "
                                    f"dsgd.Model, got {type(replica).__name__}")
                variables = list(replica.get_variables())
                if not variables:
                    raise ModelMismatchError(f"replica (worker {self.worker_index}, device {i}) "
                                             "has no trainable variables")
                optimizers, indices = optimizer_groups(replica, variables,
                                                        f"worker {self.worker_index}, device {i}")
                # Slots are created now, on this device, so that checkpoints and
                # weight broadcasts see the full optimizer state before step 1.
                for optimizer, group in zip(optimizers, indices):
                    optimizer.build([variables[k] for k in group])
            self.replicas.append(replica)
            self.optimizers.append(optimizers)
            self.group_indices.append(indices)
        self.variables = [list(r.get_variables()) for r in self.replicas]
        self._check_replicas_agree()
        return {
            "names": [_name(v) for v in self.variables[0]],
            "shapes": [tuple(int(d) for d in v.shape) for v in self.variables[0]],
            "dtypes": [_dtype_name(v) for v in self.variables[0]],
            # Which optimizer (by type) updates which variables: workers must agree.
            "optimizers": [type(o).__name__ for o in self.optimizers[0]],
            "groups": [list(g) for g in self.group_indices[0]],
            "devices": list(self.devices),
            "pid": os.getpid(),
        }

    def _check_replicas_agree(self) -> None:
        first = self.variables[0]
        seen = {id(v): 0 for v in first}
        for i in range(1, len(self.replicas)):
            where = f"worker {self.worker_index}: replica {i}"
            variables = self.variables[i]
            if len(variables) != len(first):
                raise ModelMismatchError(f"{where} has {len(variables)} variables but replica 0 "
                                         f"has {len(first)}")
            for k, (a, b) in enumerate(zip(first, variables)):
                if tuple(a.shape) != tuple(b.shape) or _dtype_name(a) != _dtype_name(b):
                    raise ModelMismatchError(
                        f"{where}: variable {k} ({_name(b)}) is {_dtype_name(b)}{tuple(b.shape)} but "
                        f"replica 0's ({_name(a)}) is {_dtype_name(a)}{tuple(a.shape)}")
                if id(b) in seen:
                    raise ModelMismatchError(
                        f"{where} shares variable {k} ({_name(b)}) with replica {seen[id(b)]}: "
                        "model_creator must build a new model on every call")
                seen[id(b)] = i
            if any(o is p for o in self.optimizers[i] for ps in self.optimizers[:i] for p in ps):
                raise ModelMismatchError(f"{where} shares its optimizer with another replica: "
                                         "create the optimizer inside model_creator")
            if self.group_indices[i] != self.group_indices[0]:
                raise ModelMismatchError(f"{where} groups its variables among optimizers "
                                         f"differently from replica 0: {self.group_indices[i]} "
                                         f"vs {self.group_indices[0]} (variable indices)")
            types = [[type(o).__name__ for o in self.optimizers[k]] for k in (0, i)]
            if types[1] != types[0]:
                raise ModelMismatchError(f"{where} has optimizer(s) {types[1]} but replica 0 "
                                         f"has {types[0]}")

    def configure(self, plan: ShardPlan, on_nonfinite: str = "raise") -> None:
        """Compile the step functions for this shard plan. Unless `on_nonfinite`
        is "ignore", every replica's gradient is checked for NaN/Inf. With
        "skip", `local_step` applies only finite steps; that gate makes the
        update wait for every gradient (benchmarks/design_measurements.md),
        so with "raise" each variable's update runs right after its own
        gradient's check, whatever the result, and the caller raises afterwards."""

        self.plan = plan
        # The dtype each variable's gradient travels as (its shards'): its own, or
        # float16/bfloat16 for a float32 gradient under compression.
        self.wire_dtypes = plan.wire_dtypes
        self.check_finite = on_nonfinite != "ignore"
        self.gate_apply = on_nonfinite == "skip"
        self.per_group_blocker = per_group_blocker(self.optimizers[0])
        self.retrace()

    def retrace(self) -> None:
        """New compiled step functions (traced again at their next call): for
        when what get_loss reads at trace time has changed."""
        import tensorflow as tf

        def compiled(fn):  # eager in local mode (dsgd/engine/local.py): for debuggers
            return fn if self.eager else tf.function(fn, reduce_retracing=True)

        self._local_step_fn = compiled(self._local_step_graph)
        self._compute_fn = compiled(self._compute_graph)
        self._apply_fn = compiled(self._apply_graph)
        self._stages = {}
        self._sending_fns = {}
        self.deferred_applied, self.applied_at = True, None

    @property
    def mark_forward(self) -> bool:
        """Whether the compiled steps note the end of the forward pass (the
        timeline's `forward`/`backward` spans): one `tf.numpy_function` per
        replica and step, fed by its loss, so only while a timeline records.
        Setting it to a new value compiles the steps again (at their next call)."""
        return self._mark_forward

    @mark_forward.setter
    def mark_forward(self, on: bool) -> None:
        if bool(on) != self._mark_forward:
            self._mark_forward = bool(on)
            if self.plan is not None:
                self.retrace()

    def _forward_done(self, loss: np.ndarray) -> np.ndarray:
        self.forward_at = time.perf_counter()  # (the last replica's, with several)
        return loss

    def local_step(self, batches: list | None = None):
        """Batches (one per replica; None: each replica's `get_batch()`) ->
        gradients -> local mean -> apply, in one compiled call (with
        on_nonfinite="skip", nothing is applied if any replica's gradient is not
        finite). Returns (losses: float32 [D], finite: bool [D], metrics: {name:
        float32 [D]}, the extra values get_loss returned)."""
        return self._local_step_fn(self._tensors(batches))

    def compute(self, batches: list | None = None):
        """Batches (as for `local_step`) -> gradients -> local mean, in one
        compiled call. Returns (losses [D], finite [D], the mean gradient of every
        variable, flattened, as the plan's shards hold it (cast to float16, or to
        bfloat16 and bitcast to uint16, under compression), metrics {name: [D]}).
        Under fp16 compression a mean that overflows float16 counts as not finite
        on every replica."""
        return self._compute_fn(self._tensors(batches))

    def compute_sending(self, groups: tuple[tuple[int, ...], ...], batches: list | None,
                        sender: Callable, deferred: list | None = None):
        """`compute`, but the gradient leaves during the backward pass: for each
        group of shard indices in `groups`, one op of the compiled step, whose
        inputs are the wire gradients of the variables with pieces in those
        shards, calls `sender(g, arrays)` as soon as TensorFlow has them
        (`arrays`: {variable index: 1-D numpy array of its wire gradient}),
        while the rest of the backward pass goes on. The arrays are valid only
        during that call (TensorFlow may reuse their memory afterwards): the
        sender copies what it keeps (into the object store). The calls run on
        TensorFlow's threads, under the GIL, in the order the gradients become
        ready (typically the last layers first); every group's call has
        returned when this returns. A sender that raises fails the step (the
        error is raised here). Returns (losses [D], finite [D], metrics {name:
        [D]}): the step's figures, the gradient itself having left.

        `deferred`: the last step's mean shards (as `apply` takes them, kept
        alive and unchanged by the caller until this returns), applied first in
        the same compiled call, exactly as `apply` would: TensorFlow orders each
        variable's reads after its update within one tf.function, so the forward
        pass of the first layers runs while the later layers' variables are
        still being updated. Afterwards, even after an error,
        `deferred_applied` says whether that update ran whole (True), may have
        run in part (False) or did not run at all (None: the call failed before
        running, e.g. tracing), and `applied_at` (perf_counter) when it was
        done. Not in eager mode."""
        import tensorflow as tf

        key = (groups, deferred is not None)
        fn = self._sending_fns.get(key)
        if fn is None:
            graph = functools.partial(self._compute_sending_graph, groups)
            if deferred is not None:
                if self.eager:
                    raise DsgdError("compute_sending: a deferred apply needs the compiled step "
                                    "(not eager mode)")
                graph = functools.partial(self._apply_then_sending_graph, groups)
            fn = self._sending_fns[key] = graph if self.eager else \
                tf.function(graph, reduce_retracing=True)
        self._sender = sender
        try:
            if deferred is None:
                return fn(self._tensors(batches))
            addresses, byte_sizes = self._shard_addresses(deferred)
            tensors = self._tensors(batches)
            self.deferred_applied, self.applied_at = None, None
            fn.get_concrete_function(tensors, addresses, byte_sizes)  # (a tracing error: none ran)
            self.deferred_applied = False
            return fn(tensors, addresses, byte_sizes)
        finally:
            self._sender = None

    def _apply_then_sending_graph(self, groups, batches, addresses, byte_sizes):
        import tensorflow as tf

        if self.per_group_blocker is None and len(groups) > 1:
            # The variables the forward pass reads first (the last bucket's: the
            # first layers') updated first, then the rest, as one apply (the
            # stages of apply_stage); else TensorFlow may update them last.
            first = (groups[-1], tuple(j for g in groups[:-1] for j in g))
            done: list = []
            for var_ids, _, holds in self._stage_plan(first):
                if var_ids:
                    with tf.control_dependencies(done):
                        grads = ops.read_shards(addresses, byte_sizes, self.plan, var_ids)
                    self._apply_means([grads] * len(self.replicas), var_ids, holds)
                    done = [tf.convert_to_tensor(self.variables[i][v])
                            for i in range(len(self.replicas)) for v in var_ids]
        else:
            self._apply_graph(addresses, byte_sizes)
        # Read after the update of every variable (model and optimizer: tf.function
        # orders them), then note it: the caller learns whether the update ran whole.
        # (The note's input is read from a variable: a constant one would let grappler
        # run the note once, at the first call, and fold it away.)
        reads = [tf.reshape(tf.convert_to_tensor(v), [-1])
                 for i in range(len(self.replicas))
                 for v in (*self.variables[i], *self.optimizer_variables(i))]
        sized = [r for r in reads if r.shape.num_elements() != 0]
        with tf.control_dependencies(reads):
            whole = tf.identity(sized[0][:1]) if sized else tf.zeros([1])
        noted = tf.numpy_function(self._note_applied, [whole], tf.bool, stateful=not sized)
        losses, finite, metrics, sent = self._compute_sending_graph(groups, batches)
        return losses, finite, metrics, tf.concat([sent, tf.reshape(noted, [1])], 0)

    def _note_applied(self, whole) -> np.ndarray:
        self.deferred_applied, self.applied_at = True, time.perf_counter()
        return np.True_

    def _compute_sending_graph(self, groups, batches):
        import tensorflow as tf

        losses, finite, wire, metrics = self._wire_gradients(batches)
        sent = []
        for g, shards in enumerate(groups):
            var_ids = sorted({p.var_index for j in shards for p in self.plan.shards[j].pieces})
            inputs = [wire[v] for v in var_ids]
            if self.gpu:
                # The bucket's copy to host, inside the step, as soon as it exists: into
                # TensorFlow's GPU host allocator (pinned), on the device's copy stream,
                # not `.numpy()` through pageable memory after the step.
                with tf.device("/cpu:0"):
                    inputs = [tf.identity(x) for x in inputs]
            # Stateless (with its output returned): not ordered after the step's
            # other stateful ops by tf.function's automatic control dependencies,
            # so it runs as soon as its own inputs exist.
            sent.append(tf.numpy_function(functools.partial(self._send_hook, g, var_ids),
                                          inputs, tf.bool, stateful=False))
        return losses, finite, metrics, tf.stack(sent) if sent else tf.constant([], tf.bool)

    def _send_hook(self, g: int, var_ids: list[int], *arrays) -> np.ndarray:
        sender = self._sender
        if sender is not None:
            sender(g, dict(zip(var_ids, arrays)))
        return np.True_

    def shard_pieces(self, flat_grads) -> list[tuple[np.ndarray, ...]]:
        """For each shard of the plan, its pieces as numpy views of the gradient
        tensors (no copy; the views keep the tensors alive). Serialising a tuple
        of views (pickle 5, out of band) copies each piece once, into its place
        in the object-store buffer: that copy is the fusion pass."""
        views = [dlpack.tensor_view(g) for g in flat_grads]
        return [tuple(views[p.var_index][p.var_offset:p.var_offset + p.length] for p in shard.pieces)
                for shard in self.plan.shards]

    def apply(self, shards) -> None:
        """Apply mean-gradient shards (1-D C-contiguous numpy arrays laid out as
        the plan's shards, e.g. read-only object-store views) to every replica.
        The op reads them in place where it can, so they must stay alive and
        unchanged until this call returns; they are not kept afterwards."""

        self._apply_fn(*self._shard_addresses(shards))

    def _shard_addresses(self, shards):
        """(addresses, byte sizes) of `apply`'s shards, as int64 tensors, once checked."""
        import tensorflow as tf

        if len(shards) != self.plan.num_shards:
            raise DsgdError(f"worker {self.worker_index}: got {len(shards)} shards, "
                            f"the plan has {self.plan.num_shards}")
        for j, array in enumerate(shards):
            self._check_shard(j, array)
        return (tf.constant([dlpack.buffer_address(a) for a in shards], tf.int64),
                tf.constant([a.nbytes for a in shards], tf.int64))

    def apply_stage(self, groups: tuple[tuple[int, ...], ...], k: int, shards: dict) -> bool:
        """Stage `k` of a step applied group by group (`groups[g]`: the shard
        indices of group g, in the order their means arrive): update every
        variable whose last piece is in group k, reading `shards` {shard index:
        1-D array laid out as the plan's shard} of groups <= k in place (kept
        alive and unchanged by the caller until this returns). Every optimizer's
        iteration count is held at the step's value until the last stage that
        updates one of its variables, so learning-rate schedules, Adam's bias
        correction and every slot are those of one apply of the whole step.
        Only for optimizers `per_group_blocker` accepts. Returns whether any
        variable was updated. Blocks until done."""
        import tensorflow as tf

        stage = self._stages_of(groups)[k]
        if not stage.var_ids:
            return False
        for j in stage.shard_ids:
            self._check_shard(j, shards.get(j), whole=True)
        addresses = [0] * self.plan.num_shards
        byte_sizes = [0] * self.plan.num_shards
        for j in stage.shard_ids:
            addresses[j], byte_sizes[j] = dlpack.buffer_address(shards[j]), shards[j].nbytes
        stage.fn(tf.constant(addresses, tf.int64), tf.constant(byte_sizes, tf.int64))
        return True

    def _check_shard(self, j: int, array, whole: bool = False) -> None:
        """DsgdError unless `array` can be read as shard j: a 1-D C-contiguous
        numpy array of the shard's wire dtype (with `whole`, of its exact size)."""
        shard = self.plan.shards[j]
        size = (shard.num_elements,) if whole else None
        if not isinstance(array, np.ndarray) or array.dtype != shard.wire_numpy_dtype \
                or array.ndim != 1 or not array.flags.c_contiguous \
                or (size is not None and array.shape != size):
            raise DsgdError(f"worker {self.worker_index}: shard {j} must be a 1-D contiguous "
                            f"{shard.wire_numpy_dtype} array"
                            + (f" of {shard.num_elements} elements" if whole else "")
                            + f", got {getattr(array, 'dtype', type(array))}"
                            f"{getattr(array, 'shape', '')}")

    def _stages_of(self, groups) -> list["_Stage"]:
        import tensorflow as tf

        if groups not in self._stages:
            self._stages[groups] = [
                _Stage(var_ids, shard_ids,
                       tf.function(functools.partial(self._apply_stage_graph, var_ids, holds)))
                for var_ids, shard_ids, holds in self._stage_plan(groups)]
        return self._stages[groups]

    def _stage_plan(self, groups) -> list[tuple]:
        """For each group k of shard indices (in the order they are applied): the
        variables whose last piece is in group k, the shards holding them, and
        per optimizer whether it has variables in a later stage (its iteration
        count is then held: apply_stage)."""
        last = _last_group_of_variables(self.plan, groups)
        plan = []
        for k in range(len(groups)):
            var_ids = tuple(v for v in range(len(last)) if last[v] == k)
            shard_ids = tuple(sorted({j for v in var_ids for j, _ in self.plan.pieces_of(v)}))
            holds = [any(last[v] > k for v in group) for group in self.group_indices[0]]
            plan.append((var_ids, shard_ids, holds))
        return plan

    def _apply_stage_graph(self, var_ids, holds, addresses, byte_sizes):
        grads = ops.read_shards(addresses, byte_sizes, self.plan, var_ids)
        self._apply_means([grads] * len(self.replicas), var_ids, holds)

    def optimizer_variables(self, i: int) -> list:
        """Every optimizer variable of replica `i` (iterations, slots), optimizer by optimizer."""
        return [v for optimizer in self.optimizers[i] for v in optimizer.variables]

    def _replica_means(self, batches):
        import tensorflow as tf

        losses, grads, finite, flags, metrics = [], [], [], [], []
        for i, (replica, batch) in enumerate(zip(self.replicas, batches)):
            with tf.device(self.devices[i]), tf.name_scope(f"device_{i}"):
                groups = self.group_indices[i]
                with tf.GradientTape(persistent=len(groups) > 1) as tape:
                    objectives, extra = loss_parts(replica.get_loss(batch), len(groups))
                raw = [None] * len(self.variables[i])
                for objective, group in zip(objectives, groups):
                    for k, g in zip(group, tape.gradient(objective,
                                                         [self.variables[i][k] for k in group])):
                        raw[k] = g
                del tape
                grads.append([tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)
                              for g, v in zip(raw, self.variables[i])])
                loss = tf.add_n([tf.cast(o, tf.float32) for o in objectives])
                if self._mark_forward:
                    # Runs once the loss exists, beside the backward pass; the loss passes
                    # through it (an op whose output fed only a control dependency was
                    # pruned by grappler).
                    loss = tf.reshape(tf.numpy_function(self._forward_done, [loss],
                                                        tf.float32, stateful=False), [])
                losses.append(loss)
                metrics.append(extra)
                flags.append(_finite_flags(grads[-1], self.gpu) if self.check_finite
                             else [None] * len(grads[-1]))
                checked = [f for f in flags[-1] if f is not None]
                finite.append(tf.reduce_all(tf.stack(checked)) if checked else tf.constant(True))
        means = device_mean.mean_across_devices(grads, self.devices, self.all_reduce_alg)
        names = sorted(metrics[0])
        for i, m in enumerate(metrics):
            if sorted(m) != names:
                raise ValueError(f"get_loss must return the same metric names on every replica: "
                                 f"worker {self.worker_index}'s replica {i} returns {sorted(m)}, "
                                 f"its replica 0 {names}")
        stacked = {n: tf.stack([m[n] for m in metrics]) for n in names}
        return tf.stack(losses), tf.stack(finite), means, flags, stacked

    def _apply_means(self, means, var_ids=None, holds=None) -> None:
        """Apply means[i][k] to variable k of replica i: every variable, or only
        `var_ids` (a stage of apply_stage), after which optimizer o's iteration
        count is set back where holds[o] (more of its variables come later)."""
        import tensorflow as tf

        chosen = None if var_ids is None else set(var_ids)
        for i, (optimizers, variables) in enumerate(zip(self.optimizers, self.variables)):
            with tf.device(self.devices[i]):
                for o, (optimizer, group) in enumerate(zip(optimizers, self.group_indices[i])):
                    pairs = [(means[i][k], variables[k]) for k in group
                             if chosen is None or k in chosen]
                    if pairs:
                        optimizer.apply_gradients(pairs)
                        if holds is not None and holds[o]:
                            optimizer.iterations.assign_sub(1)

    def _local_step_graph(self, batches):
        import tensorflow as tf

        losses, finite, means, flags, metrics = self._replica_means(batches)
        if self.gate_apply:
            tf.cond(tf.reduce_all(finite), lambda: self._apply_and_true(means), lambda: False)
        else:
            # Variable k's update runs right after the checks of its gradient, which
            # then reads it from cache (a separate pass over the gradients cost
            # more: benchmarks/design_measurements.md).
            self._apply_means([[_after(g, [f[k] for f in flags]) for k, g in enumerate(m)]
                               for m in means])
        return losses, finite, metrics

    def _apply_and_true(self, means):
        self._apply_means(means)
        return True

    def _compute_graph(self, batches):
        return self._wire_gradients(batches)

    def _wire_gradients(self, batches):
        """(compute's and compute_sending's graphs) The step's figures and each
        variable's mean gradient, flattened, as its shards travel."""
        import tensorflow as tf

        losses, finite, means, _, metrics = self._replica_means(batches)
        cast = [tf.cast(tf.reshape(g, [-1]), tf.as_dtype(d)) for g, d in zip(means[0], self.wire_dtypes)]
        narrowed = [c for c, g in zip(cast, means[0]) if c.dtype != g.dtype]
        if self.check_finite and narrowed:
            # Rounding can overflow (fp16 past 65504, bf16 within 2^-8 of float32's
            # max): such a mean is not finite on any replica. One check per tensor.
            flags = _finite_flags(narrowed, self.gpu)
            finite = tf.logical_and(finite, tf.reduce_all(tf.stack(flags)))
        # bfloat16 travels as its uint16 bits: numpy views them without a copy and
        # the PS needs no bfloat16 type.
        wire = [tf.bitcast(c, tf.uint16) if c.dtype == tf.bfloat16 else c for c in cast]
        return losses, finite, wire, metrics

    def _apply_graph(self, addresses, byte_sizes):
        grads = ops.read_shards(addresses, byte_sizes, self.plan)
        self._apply_means([grads] * len(self.replicas))

    def next_batches(self) -> list:
        """Each replica's `get_batch()` (eager Python, once per step)."""
        return [replica.get_batch() for replica in self.replicas]

    def _tensors(self, batches: list | None) -> list:
        import tensorflow as tf

        if batches is None:
            batches = self.next_batches()
        if len(batches) != len(self.replicas):
            raise DsgdError(f"worker {self.worker_index}: {len(batches)} batches for "
                            f"{len(self.replicas)} replicas")
        return [None if b is None else tf.nest.map_structure(tf.convert_to_tensor, b)
                for b in batches]


def _finite_flags(grads, gpu: bool) -> list:
    """Per gradient: a scalar bool tensor "every element is finite", or None
    (not a floating type). On CPU, dsgd's op checks each gradient in one read,
    as soon as the backward pass produces it; TensorFlow's is_finite +
    reduce_all writes and re-reads a bool tensor per gradient (slower:
    benchmarks/design_measurements.md)."""
    import tensorflow as tf

    native = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
    return [None if not g.dtype.is_floating
            else ops.all_finite([g]) if not gpu and g.dtype in native
            else tf.reduce_all(tf.math.is_finite(g)) for g in grads]


def _after(tensor, flags: list):
    """`tensor`, available only once every (non-None) flag is computed."""
    import tensorflow as tf

    deps = [f for f in flags if f is not None]
    if not deps:
        return tensor
    with tf.control_dependencies(deps):
        return tf.identity(tensor)


def _dtype_name(variable) -> str:
    return _np_dtype(variable).name
