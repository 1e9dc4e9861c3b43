"""Loader of dsgd's TensorFlow op library (csrc/tf_ops) and its thin wrappers.

The library is built at install time against the TensorFlow of the build
environment and only loaded here (never built at import, so concurrent first
imports on many workers cannot race). A different TensorFlow at run time is an
ImportError naming both versions: checked from package metadata when dsgd is
imported, and from `tf.__version__` when the library is loaded.
"""

from __future__ import annotations

import functools
import os
from importlib import metadata


_HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY_PATH = os.path.join(_HERE, "_dsgd_ops.so")
VERSION_PATH = os.path.join(_HERE, "_tf_version.txt")
_TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel")


def built_tf_version() -> str:
    try:
        with open(VERSION_PATH) as f:
            return f.read().strip()
    except FileNotFoundError:
        raise ImportError(f"dsgd's TensorFlow op library is missing ({VERSION_PATH}): dsgd was not "
                          "built; install it with `pip install -e .` (or `pip install .`)") from None


def check_versions(built: str, running: str) -> None:
    if built != running:
        raise ImportError(f"dsgd's TensorFlow ops were built against TensorFlow {built}, but "
                          f"TensorFlow {running} is installed; rebuild dsgd against it with "
                          "`pip install --force-reinstall --no-deps -e .`")


def _installed_tf_version() -> str | None:
    for name in _TF_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_installed_tf() -> None:
    """Cheap check at `import dsgd` (no TensorFlow import)."""
    running = _installed_tf_version()
    if running is not None:
        check_versions(built_tf_version(), running)


@functools.lru_cache(maxsize=None)
def library():
    """The loaded op library (loaded once per process)."""
    import tensorflow as tf

    check_versions(built_tf_version(), tf.__version__)
    lib = tf.load_op_library(LIBRARY_PATH)
    tf.no_gradient("DsgdReadShards")  # reads raw memory: nothing to differentiate
    tf.no_gradient("DsgdAllFinite")
    return lib


def read_shards(addresses, byte_sizes, plan, var_ids=None) -> list:
    """The variables' gradients (in plan variable order, shaped, of the variables'
    dtypes) read from shard buffers: `addresses[j]`/`byte_sizes[j]` (int64
    tensors) locate shard j, laid out as `plan.shards[j]`. With `var_ids`, only
    those variables are read (the others' entries are None) and only the shards
    holding their pieces are touched: the others' addresses may be 0.

    Zero-copy where a variable sits whole in one shard at a 64-byte-aligned
    address (the tensor aliases the buffer); copied otherwise, and always for
    compressed (16-bit) shards, which are widened to float32 in that one copy.
    Ownership: the caller keeps every buffer alive and unchanged until
    TensorFlow is done with the returned tensors (in dsgd, until the compiled
    apply step returns).
    """
    import tensorflow as tf

    lib = library()
    outputs: list = [None] * len(plan.shapes)
    wire = plan.wire_dtypes
    wanted = set(range(len(plan.shapes)) if var_ids is None else var_ids)
    for wire_dtype, dtype in sorted({(wire[v], plan.dtypes[v]) for v in wanted}):
        var_ids_here = [v for v, d in enumerate(plan.dtypes)
                        if d == dtype and wire[v] == wire_dtype and v in wanted]
        holding = {j for v in var_ids_here for j, _ in plan.pieces_of(v)}
        shard_ids = [j for j, s in enumerate(plan.shards) if s.dtype == wire_dtype
                     and (var_ids is None or j in holding)]
        local_shard = {j: k for k, j in enumerate(shard_ids)}
        pieces = []
        for k, v in enumerate(var_ids_here):
            for j, p in plan.pieces_of(v):
                pieces += [k, p.var_offset, p.length, local_shard[j], p.shard_offset]
        index = tf.constant(shard_ids, tf.int32)
        results = lib.dsgd_read_shards(
            addresses=tf.gather(addresses, index), byte_sizes=tf.gather(byte_sizes, index),
            T=tf.as_dtype(dtype), wire=tf.as_dtype(wire_dtype), num_outputs=len(var_ids_here),
            shapes=[list(plan.shapes[v]) for v in var_ids_here],
            shard_elements=[plan.shards[j].num_elements for j in shard_ids], pieces=pieces)
        for v, tensor in zip(var_ids_here, results):
            outputs[v] = tensor
    return outputs


def all_finite(tensors: list):
    """Scalar bool tensor: no element of any of `tensors` (CPU tensors of half,
    bfloat16, float32 or float64) is Inf or NaN. One single-threaded read of
    each tensor, nothing else written (TensorFlow's `reduce_all(is_finite(t))`
    writes and re-reads a bool tensor of every size). Usable inside
    `tf.function`; one op per tensor lets the executor run the checks in
    parallel, each as soon as its tensor exists."""
    if not tensors:
        raise ValueError("all_finite: `tensors` is empty; pass at least one floating tensor")
    return library().dsgd_all_finite(tensors)
