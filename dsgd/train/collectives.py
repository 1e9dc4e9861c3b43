"""Horovod's TF2 API (`horovod.tensorflow`) on dsgd's exchange, so that
`import dsgd.train as hvd` ports a Horovod script: the same names, arguments
and results, eagerly and inside `tf.function`.

Every collective is an exchange through the run's PS actors
(dsgd/train/exchange.py): every rank must make the same collective calls in
the same order (as with Horovod). Inside a `tf.function` a collective is one
stateful `tf.numpy_function`; TensorFlow runs stateful ops in program order,
so the order holds there too. Each call blocks until every rank has made it,
at most `DsgdConfig.timeout_s` (then an error names the missing ranks).
"""

from __future__ import annotations

import numpy as np

from dsgd.train import exchange

Average = 0
"""Reduction op (`op=`): the mean over ranks. Horovod's value and the default."""
Sum = 1
"""Reduction op (`op=`): the sum over ranks. Horovod's value."""
Adasum = 2
"""Horovod's Adasum op: not supported. Named so that a port fails with a clear
ValueError at the call, not a NameError."""
Min = 3
"""Reduction op (`op=`): the element-wise minimum over ranks. Horovod's value."""
Max = 4
"""Reduction op (`op=`): the element-wise maximum over ranks. Horovod's value."""
Product = 5
"""Reduction op (`op=`): the element-wise product over ranks (in rank order). Horovod's value."""
# Min, Max and Product are not sums: their tensors are gathered (every rank's, through PS 0)
# and reduced on each rank, so their bytes per rank grow with the ranks. Meant for metrics
# and flags, not gradients.
_GATHERED_OPS = {Min: np.minimum, Max: np.maximum, Product: np.multiply}


class _Compressor:
    """A gradient compression as Horovod names it (`hvd.Compression.fp16`). dsgd
    does not cast in the graph: the exchange sends float32 values as the wire
    type, sums them in float32 and rounds the mean once (as the engine's
    `compression`). `compress`/`decompress` are Horovod's casts, for code that
    calls them itself."""

    wire: str | None = None
    dtype_name: str | None = None

    @classmethod
    def compress(cls, tensor):
        import tensorflow as tf

        if cls.dtype_name is None or not tensor.dtype.is_floating:
            return tensor, None
        return tf.cast(tensor, tf.as_dtype(cls.dtype_name)), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        import tensorflow as tf

        return tensor if ctx is None else tf.cast(tensor, ctx)


class NoneCompressor(_Compressor):
    """No compression: gradients travel in their own dtype."""


class FP16Compressor(_Compressor):
    """float32 gradients travel as float16 (the mean is summed in float32)."""

    wire, dtype_name = "fp16", "float16"


class BF16Compressor(_Compressor):
    """float32 gradients travel as bfloat16 (the mean is summed in float32)."""

    wire, dtype_name = "bf16", "bfloat16"


class Compression:
    """Horovod's `hvd.Compression`, the `compression=` of the exchanges:
    `Compression.none` (gradients travel in their own dtype), `.fp16` and
    `.bf16` (float32 gradients travel as that 16-bit type; the mean is summed
    in float32 and rounded once, as the engine's `compression`). dsgd does not
    cast in the graph; each also has Horovod's `compress(tensor) -> (tensor,
    ctx)` and `decompress(tensor, ctx)` casts, for code that calls them
    itself."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def wire_of(compression) -> str | None:
    """The exchange's compression name of a `Compression.*` (or None, "fp16", "bf16")."""
    if compression is None or compression in (None, "fp16", "bf16"):
        return compression
    if isinstance(compression, type) and issubclass(compression, _Compressor):
        return compression.wire
    raise ValueError(f"compression must be dsgd.train.Compression.none, .fp16 or .bf16, got "
                     f"{compression!r}")


global_process_set = None
"""Horovod's `hvd.global_process_set`, the process set of every rank: the only
one dsgd has (every collective spans all ranks), so it is None, and
`process_set=global_process_set` (or `process_set=None`) is what every name
accepts."""

# Horovod arguments with nothing to steer in dsgd (devices, name scopes, TF1 sessions):
# accepted, so that a port keeps working, and ignored. process_set only as None (the
# global process set): dsgd has no process sets (every collective spans all ranks).
HINTS = ("device_dense", "device_sparse", "ignore_name_scope", "session", "process_set")


def check_hints(kwargs: dict, where: str, accepted: str, hints: tuple = HINTS) -> None:
    """Refuse a keyword argument that is neither `accepted` nor one of Horovod's
    `hints`, and a `process_set` other than None: a misspelt argument would
    otherwise change nothing, silently.

    Raises:
        TypeError: an unknown keyword argument (named, with what is accepted).
        ValueError: `process_set` is not None.
    """
    unknown = sorted(set(kwargs) - set(hints))
    if unknown:
        raise TypeError(f"{where}: unexpected argument(s) {unknown}; accepted: {accepted}, and "
                        f"Horovod's hints {list(hints)} (ignored; process_set only as None)")
    if kwargs.get("process_set") is not None:
        raise ValueError(f"{where}: process_set={kwargs['process_set']!r} is not supported: dsgd "
                         "has no process sets (every collective spans all ranks); leave it "
                         "out or pass None (hvd.global_process_set)")


# -- the run's shape --------------------------------------------------------------
def init(*args, **kwargs) -> None:
    """Horovod's `hvd.init()`: nothing to start inside a dsgd Ray Train worker
    (the backend started the PS actors). Arguments are accepted and ignored.

    Raises:
        DsgdError: outside a dsgd Ray Train worker; says how to launch.
    """
    exchange.context()


def is_initialized() -> bool:
    """Whether this process is a dsgd Ray Train worker (a `DsgdTrainer` loop,
    or a script run with `python -m dsgd.train.run`)."""
    return exchange.installed()


def shutdown() -> None:
    """Horovod's `hvd.shutdown()`: nothing to do (the backend stops the PS actors
    when the run ends)."""


def size() -> int:
    """Number of workers (ranks) in the run. Raises `DsgdError` outside a dsgd
    Ray Train worker, as do `rank`, `local_rank`, `local_size`, `cross_rank`,
    `cross_size` and `is_homogeneous`."""
    return exchange.topology()["size"]


def rank() -> int:
    """This worker's rank, 0 .. size() - 1."""
    return exchange.topology()["rank"]


def local_rank() -> int:
    """This worker's index among the run's workers on its node."""
    return exchange.topology()["local_rank"]


def local_size() -> int:
    """Number of the run's workers on this worker's node."""
    return exchange.topology()["local_size"]


def cross_rank() -> int:
    """This worker's node's index among the run's nodes."""
    return exchange.topology()["cross_rank"]


def cross_size() -> int:
    """Number of nodes holding a worker of this worker's local rank (with the
    same number of workers on every node: the number of nodes)."""
    return exchange.topology()["cross_size"]


def is_homogeneous() -> bool:
    """Whether every node holds the same number of the run's workers."""
    return len(set(exchange.context()["node_sizes"] or [0])) == 1


# -- collectives -------------------------------------------------------------------
def _op_of(op, average) -> int:
    if average is not None:
        if op is not None:
            raise ValueError("allreduce: pass op= or the older average=, not both")
        return Average if average else Sum
    if op is None:
        return Average
    if op == Adasum:
        raise ValueError("op=Adasum is not supported by dsgd; use op=Average or op=Sum")
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"op must be dsgd.train.Average, Sum, Min, Max or Product, got {op!r}")
    return op


def _run(fn, inputs: list, out_dtypes: list, out_shapes: list, name: str) -> list:
    """`fn(*numpy arrays) -> list of numpy arrays`, eagerly or as one stateful
    `tf.numpy_function` inside a `tf.function`; the results get `out_shapes`."""
    import tensorflow as tf

    if tf.executing_eagerly():
        results = fn(*[t.numpy() for t in inputs])
        return [tf.convert_to_tensor(np.asarray(r), dtype=d) for r, d in zip(results, out_dtypes)]
    results = tf.numpy_function(lambda *arrays: list(fn(*arrays)), inputs, out_dtypes,
                                stateful=True, name=name)
    if not isinstance(results, (list, tuple)):
        results = [results]
    for tensor, shape in zip(results, out_shapes):
        tensor.set_shape(shape)
    return list(results)


def _dense(tensor):
    import tensorflow as tf

    if isinstance(tensor, tf.IndexedSlices):  # Horovod's sparse_as_dense
        return tf.convert_to_tensor(tensor)
    return tf.convert_to_tensor(tensor)


def grouped_allreduce(tensors, average=None, compression=Compression.none, op=None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, **hints) -> list:
    """Horovod's `hvd.grouped_allreduce`: the mean or sum over all ranks of each
    tensor, in one exchange.

    Floating tensors are averaged as the engine averages (float32 sums,
    16-bit values summed in float32 and rounded once); integer tensors are
    summed exactly in float64 (|values| < 2**53), and their Average is that
    sum times 1/size() in float64, by the same PS kernel (a float64 result, as
    Horovod's `sum / size()` gives, to within one unit in the last place).
    Works eagerly and inside `tf.function`. Blocks until every rank has made
    the call (at most `DsgdConfig.timeout_s` seconds). The inputs are only
    read; the results are tensors of their own, valid while referenced.

    Args:
        tensors (list): tensors, or `tf.IndexedSlices` (made dense first,
            Horovod's `sparse_as_dense`), with the same shapes and dtypes on
            every rank.
        average (bool | None): Horovod's older form of `op` (True: Average).
        compression (type): `Compression.none`, `.fp16` or `.bf16`: the wire
            type of floating tensors.
        op (int | None): `Average` (the default), `Sum`, or `Min`, `Max`,
            `Product` (gathered from every rank and reduced on each: exact,
            in the tensor's dtype; their bytes per rank grow with the ranks,
            for metrics and flags rather than gradients).
        prescale_factor: multiplies each tensor before the exchange.
        postscale_factor: multiplies each result after it.
        name: the op's name inside a `tf.function`.
        **hints (Any): Horovod's `device_dense`, `device_sparse`,
            `ignore_name_scope`, `session` (ignored) and `process_set` (only
            None).

    Returns:
        One result per tensor, in order.

    Raises:
        ValueError: `op=Adasum` or an unknown op, both `op` and `average`, or
            a bad `compression`.
        TypeError: a tensor that is neither floating nor integer.
        TimeoutError: a rank did not make the call within
            `DsgdConfig.timeout_s` (names the missing ranks), or a PS did not
            answer (`StepTimeoutError`).
        DsgdError: a PS actor died, or no dsgd backend in this process.
    """
    import tensorflow as tf

    check_hints(hints, "grouped_allreduce", "tensors, average, compression, op, prescale_factor, "
                "postscale_factor, name")
    op = _op_of(op, average)
    wire = wire_of(compression)
    tensors = [_dense(t) for t in tensors]
    for t in tensors:
        if not (t.dtype.is_floating or t.dtype.is_integer):
            raise TypeError(f"allreduce: tensors must be floating or integer, got {t.dtype.name}")
    if prescale_factor != 1.0:
        tensors = [t * tf.cast(prescale_factor, t.dtype) for t in tensors]
    if not tensors:
        return []
    if op in _GATHERED_OPS:
        return _gathered_reduce(tensors, op, postscale_factor, name)
    return _summed(tensors, op, wire, postscale_factor, name)


def _summed(tensors: list, op: int, wire, postscale_factor: float, name: str | None) -> list:
    """`grouped_allreduce` with Average or Sum: the floating tensors in one
    exchange (`wire`: their wire type), the integer ones as float64 in a second
    (summed exactly; an integer Average stays float64, as TensorFlow divides
    integers)."""
    import tensorflow as tf

    floats = [k for k, t in enumerate(tensors) if t.dtype.is_floating]
    ints = [k for k, t in enumerate(tensors) if not t.dtype.is_floating]
    sent = [tensors[k] for k in floats] + [tf.cast(tensors[k], tf.float64) for k in ints]

    def reduce(*arrays):
        arrays = list(arrays)
        out = []
        if floats:
            out += exchange.allreduce(arrays[:len(floats)], average=op == Average,
                                      compression=wire)
        if ints:  # summed exactly in float64 (and scaled by 1/size for Average)
            out += exchange.allreduce(arrays[len(floats):], average=op == Average,
                                      compression=None)
        return out

    results = _run(reduce, sent, [t.dtype for t in sent], [t.shape for t in sent],
                   name or "dsgd_allreduce")
    out: list = [None] * len(tensors)
    for k, result in zip(floats + ints, results):
        if k in ints and op != Average:
            result = tf.cast(result, tensors[k].dtype)
        if postscale_factor != 1.0:
            result = result * tf.cast(postscale_factor, result.dtype)
        out[k] = result
    return out


def _gathered_reduce(tensors: list, op: int, postscale_factor: float, name: str | None) -> list:
    """`grouped_allreduce` with Min, Max or Product: every rank's tensors in one
    gather through PS 0, reduced here element-wise in rank order (exact, in
    each tensor's own dtype; compression does not apply)."""
    import tensorflow as tf

    reduce = _GATHERED_OPS[op]

    def gathered(*arrays):
        every = exchange.gather([np.asarray(a) for a in arrays])
        out = []
        for k, mine in enumerate(arrays):
            parts = [rank_arrays[k] for rank_arrays in every]
            if any(p.shape != np.shape(mine) or p.dtype != np.asarray(mine).dtype for p in parts):
                raise ValueError(f"allreduce: tensor {k}'s shape or dtype differs between ranks: "
                                 + ", ".join(f"rank {r}: {p.shape} {p.dtype}"
                                             for r, p in enumerate(parts)))
            result = parts[0]
            for part in parts[1:]:
                result = reduce(result, part)
            out.append(np.asarray(result, dtype=np.asarray(mine).dtype))
        return out

    results = _run(gathered, tensors, [t.dtype for t in tensors], [t.shape for t in tensors],
                   name or "dsgd_allreduce")
    if postscale_factor != 1.0:
        results = [r * tf.cast(postscale_factor, r.dtype) for r in results]
    return results


def allreduce(tensor, average=None, device_dense: str = "", device_sparse: str = "",
              compression=Compression.none, op=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None, **hints):
    """Horovod's `hvd.allreduce`: the mean (default) or sum of `tensor` over all
    ranks; `grouped_allreduce` of one tensor (same arguments, blocking and
    errors).

    Args:
        tensor (tf.Tensor | tf.IndexedSlices): same shape and dtype on every rank.
        average (bool | None): Horovod's older form of `op`.
        device_dense: ignored (Horovod's device hint).
        device_sparse: ignored (Horovod's device hint).
        compression (type): `Compression.none`, `.fp16` or `.bf16`.
        op (int | None): `Average` (the default), `Sum`, `Min`, `Max` or
            `Product` (see `grouped_allreduce`).
        prescale_factor: multiplies the tensor before the exchange.
        postscale_factor: multiplies the result after it.
        name: the op's name inside a `tf.function`.
        **hints (Any): Horovod's `device_dense`, `device_sparse`,
            `ignore_name_scope`, `session` (ignored) and `process_set` (only
            None).

    Returns:
        (tf.Tensor): The reduced tensor, of `tensor`'s shape.
    """
    check_hints(hints, "allreduce", "tensor, average, device_dense, device_sparse, compression, "
                "op, prescale_factor, postscale_factor, name")
    return grouped_allreduce([tensor], average=average, compression=compression, op=op,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             name=name)[0]


def allgather(tensor, name: str | None = None, **hints):
    """Horovod's `hvd.allgather`: every rank's `tensor` concatenated on the first
    axis, in rank order. Eagerly or inside `tf.function`; blocks until every
    rank has made the call (at most `DsgdConfig.timeout_s` seconds).

    Args:
        tensor (tf.Tensor): at least one dimension. The first dimension may
            differ between ranks; the others and the dtype may not.
        name: the op's name inside a `tf.function`.
        **hints (Any): Horovod's `device_dense`, `device_sparse`,
            `ignore_name_scope`, `session` (ignored) and `process_set` (only
            None).

    Returns:
        (tf.Tensor): A new tensor.

    Raises:
        ValueError: a scalar `tensor`, or ranks whose trailing dimensions or
            dtypes differ (naming them).
    """
    import tensorflow as tf

    check_hints(hints, "allgather", "tensor, name")
    tensor = _dense(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("allgather: the tensor must have at least one dimension (it is "
                         "concatenated on the first); reshape a scalar to [1]")

    def gather(array):
        parts = exchange.gather(np.asarray(array))
        tails = {(p.shape[1:], p.dtype.str) for p in parts}
        if len(tails) != 1:
            raise ValueError("allgather: ranks sent tensors whose dimensions after the first or "
                             "dtypes differ: " + ", ".join(f"rank {r}: {p.shape} {p.dtype}"
                                                           for r, p in enumerate(parts)))
        return [np.concatenate(parts, axis=0)]

    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])
    return _run(gather, [tensor], [tensor.dtype], [shape], name or "dsgd_allgather")[0]


def grouped_allgather(tensors, name: str | None = None, **hints) -> list:
    """Horovod's `hvd.grouped_allgather`: `allgather` of each tensor, in one
    exchange (same arguments, blocking and errors as `allgather`).

    Returns:
        One new tensor per input, in order.
    """
    import tensorflow as tf

    check_hints(hints, "grouped_allgather", "tensors, name")
    tensors = [_dense(t) for t in tensors]
    if not tensors:
        return []
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError("grouped_allgather: every tensor must have at least one dimension "
                             "(each is concatenated on the first); reshape a scalar to [1]")

    def gather(*arrays):
        every = exchange.gather([np.asarray(a) for a in arrays])
        out = []
        for k in range(len(arrays)):
            parts = [rank_arrays[k] for rank_arrays in every]
            if len({(p.shape[1:], p.dtype.str) for p in parts}) != 1:
                raise ValueError(f"grouped_allgather: tensor {k}'s dimensions after the first or "
                                 "dtypes differ: " + ", ".join(
                                     f"rank {r}: {p.shape} {p.dtype}" for r, p in enumerate(parts)))
            out.append(np.concatenate(parts, axis=0))
        return out

    shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in tensors]
    return _run(gather, tensors, [t.dtype for t in tensors], shapes,
                name or "dsgd_grouped_allgather")


def broadcast(tensor, root_rank: int, name: str | None = None, **hints):
    """Horovod's `hvd.broadcast`: rank `root_rank`'s value of `tensor` on every
    rank. Eagerly or inside `tf.function`; blocks until every rank has made
    the call (at most `DsgdConfig.timeout_s` seconds).

    Args:
        tensor (tf.Tensor): each rank's must have the root's shape and dtype.
        root_rank: the rank whose value is sent.
        name: the op's name inside a `tf.function`.
        **hints (Any): Horovod's `device_dense`, `device_sparse`,
            `ignore_name_scope`, `session` (ignored) and `process_set` (only
            None).

    Returns:
        (tf.Tensor): The root's value, as a new tensor (`tensor` is unchanged).

    Raises:
        ValueError: `root_rank` out of range, or a shape or dtype that differs
            from the root's.
    """
    check_hints(hints, "broadcast", "tensor, root_rank, name")
    return _broadcast_tensors([_dense(tensor)], root_rank, name or "dsgd_broadcast")[0]


def _broadcast_tensors(tensors: list, root_rank: int, name: str) -> list:
    exchange._check_root(root_rank, size())

    def bcast(*arrays):
        values = exchange.broadcast([np.asarray(a) for a in arrays], root_rank)
        for k, (mine, root) in enumerate(zip(arrays, values, strict=True)):
            if np.shape(mine) != np.shape(root) or np.asarray(mine).dtype != root.dtype:
                raise ValueError(f"broadcast: tensor {k} is {np.shape(mine)} "
                                 f"{np.asarray(mine).dtype} here but {root.shape} {root.dtype} "
                                 f"on root rank {root_rank}")
        return values

    if not tensors:
        return []
    return _run(bcast, tensors, [t.dtype for t in tensors], [t.shape for t in tensors], name)


def broadcast_variables(variables, root_rank: int = 0, inplace: bool = False, **hints):
    """Horovod's `hvd.broadcast_variables`: set every rank's `variables` to rank
    `root_rank`'s values, in one exchange (values assigned into the
    variables). Eagerly, or inside a `tf.function` (Horovod's first-batch
    pattern). Blocks until every rank has made the call (at most
    `DsgdConfig.timeout_s` seconds).

    Args:
        variables (Iterable): tf or Keras variables, the same list (shapes,
            dtypes) on every rank.
        root_rank: the rank whose values are sent.
        inplace: accepted, with no effect: dsgd always assigns the root's
            values into the variables (`assign`), so they keep their identity
            and their buffers either way, as Horovod's in-place broadcast
            does; the values received are a temporary copy, freed after the
            assignment.
        **hints (Any): Horovod's `process_set` (only None, that is
            `hvd.global_process_set`) and device hints (ignored).

    Returns:
        (tf.Operation | None): None eagerly; inside a `tf.function`, the op
            that assigns them.

    Raises:
        TypeError: an unknown keyword argument.
        ValueError: `root_rank` out of range, a variable whose shape or dtype
            differs from the root's, or a `process_set` other than None.
    """
    import tensorflow as tf

    check_hints(hints, "broadcast_variables", "variables, root_rank, inplace")
    variables = list(variables)
    values = [tf.convert_to_tensor(v) for v in variables]
    new = _broadcast_tensors(values, root_rank, "dsgd_broadcast_variables")
    assigns = [v.assign(x) for v, x in zip(variables, new, strict=True)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])


def broadcast_object(obj, root_rank: int = 0, name: str | None = None, **hints):
    """Horovod's `hvd.broadcast_object`: rank `root_rank`'s picklable `obj` on
    every rank (eagerly; not inside `tf.function`). Blocks until every rank has
    made the call (at most `DsgdConfig.timeout_s` seconds).

    Args:
        obj (Any): the root's value (the other ranks' are ignored).
        root_rank: the rank whose `obj` is sent.
        name: ignored.
        **hints (Any): Horovod's `device_dense`, `device_sparse`,
            `ignore_name_scope`, `session` (ignored) and `process_set` (only
            None).

    Returns:
        (Any): The root's object, an unpickled copy (with one rank, `obj`
            itself).

    Raises:
        ValueError: `root_rank` out of range.
    """
    check_hints(hints, "broadcast_object", "obj, root_rank, name")
    exchange._check_root(root_rank, size())
    return exchange.broadcast(obj, root_rank)


def broadcast_object_fn(root_rank: int = 0, session=None, name: str | None = None, **hints):
    """Horovod's `hvd.broadcast_object_fn`: a function `fn(obj)` that is
    `broadcast_object(obj, root_rank)` (`session` is TF1's, ignored)."""
    check_hints(hints, "broadcast_object_fn", "root_rank, session, name")
    return lambda obj: broadcast_object(obj, root_rank)


def allgather_object(obj, name: str | None = None, **hints) -> list:
    """Horovod's `hvd.allgather_object`: every rank's picklable `obj`, in rank
    order (eagerly; not inside `tf.function`). Blocks until every rank has made
    the call (at most `DsgdConfig.timeout_s` seconds).

    Args:
        obj (Any): this rank's value.
        name: ignored.
        **hints (Any): Horovod's `device_dense`, `device_sparse`,
            `ignore_name_scope`, `session` (ignored) and `process_set` (only
            None).

    Returns:
        One unpickled copy of each rank's object, in rank order (with one
            rank, `[obj]`).
    """
    check_hints(hints, "allgather_object", "obj, name")
    return exchange.gather(obj)
