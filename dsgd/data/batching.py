"""Batches as nests of numpy arrays: stacking examples, slicing rows, splitting
a worker's batch among its replicas. Pure numpy, no Ray.

An example is one array-like, or a tuple/list/dict of them (e.g. `(x, y)`);
a batch has the same structure with one more leading dimension (rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def map_leaves(fn: Callable, nest: Any) -> Any:
    """`fn` applied to every array of a tuple/list/dict nest, structure kept."""
    if isinstance(nest, dict):
        return {k: map_leaves(fn, v) for k, v in nest.items()}
    if isinstance(nest, (tuple, list)):
        return type(nest)(map_leaves(fn, v) for v in nest)
    return fn(nest)


def leaves(nest: Any) -> list:
    return [leaf for _, leaf in _paths(nest, ())]


def structure(nest: Any):
    """A hashable description of a nest's structure (not of its arrays)."""
    if isinstance(nest, dict):
        return ("dict", tuple((k, structure(v)) for k, v in nest.items()))
    if isinstance(nest, (tuple, list)):
        return (type(nest).__name__, tuple(structure(v) for v in nest))
    return "array"


def stack(examples: Sequence[Any], describe: Callable[[int], str]) -> Any:
    """One batch from examples of the same structure, position by position
    (`(x, y)` examples give `(x[batch], y[batch])`). `describe(i)` names example
    i in errors."""
    first = structure(examples[0])
    for i, example in enumerate(examples):
        if structure(example) != first:
            raise ValueError(f"{describe(i)} has structure {_show(example)}, but {describe(0)} "
                             f"has {_show(examples[0])}: every example must have the same one "
                             "(tuples, lists and dicts are nests of arrays: give variable-length "
                             "data as padded arrays)")

    def stack_leaf(path: tuple):
        values = [_at(e, path) for e in examples]
        try:
            return np.stack([np.asarray(v) for v in values])
        except ValueError as e:
            shapes = sorted({np.shape(v) for v in values})
            raise ValueError(f"examples {describe(0)}..{describe(len(examples) - 1)} cannot be "
                             f"stacked at position {list(path)}: shapes {shapes[:4]} ({e})") from None

    return _build(examples[0], (), stack_leaf)


# Array dtypes a batch may hold: numbers and booleans (numpy kinds).
NUMERIC_KINDS = {"b": "bool", "i": "int", "u": "uint", "f": "float", "c": "complex"}


def check_numeric(batch: Any) -> None:
    """TypeError unless every leaf of the batch is an array (anything with a
    numpy-style `dtype` and `shape`, e.g. numpy or TensorFlow) of at least one
    dimension (rows) with a numeric or boolean dtype; names the position, the
    dtype and a sample value. Strings, Python objects and ragged data fail here,
    before TensorFlow sees them."""
    for path, leaf in _paths(batch, ()):
        dtype = getattr(leaf, "dtype", None)
        shape = getattr(leaf, "shape", None)
        if dtype is None or shape is None:
            raise TypeError(f"{_position(path)} is a {type(leaf).__name__} "
                            f"({_sample(leaf)}), not an array: batches must be (tuples/lists/"
                            "dicts of) numpy arrays with one row per example")
        try:
            kind = np.dtype(getattr(dtype, "as_numpy_dtype", dtype)).kind
        except TypeError:
            kind = "?"
        if kind not in NUMERIC_KINDS:
            first = leaf.flat[0] if isinstance(leaf, np.ndarray) and leaf.size else None
            first = first.item() if isinstance(first, np.generic) else first
            raise TypeError(f"{_position(path)} has dtype {dtype} ({_sample(first)}), not "
                            f"numbers: batches must hold {'/'.join(NUMERIC_KINDS.values())} "
                            "arrays (convert strings, objects and ragged data to padded "
                            "numeric arrays in download_func or transform)")
        if len(shape) == 0:
            raise TypeError(f"{_position(path)} is a scalar ({_sample(leaf)}), not an array "
                            "with one row per example")


def signature(batch: Any) -> tuple:
    """A batch's structure and every array's shape past the rows: batches that
    can be concatenated have the same signature."""
    return structure(batch), tuple(tuple(np.shape(leaf)[1:]) for leaf in leaves(batch))


def show_signature(sig: tuple) -> str:
    """`signature` for messages: the shape of one example per array."""
    return ", ".join(str(s) for s in sig[1])[:200]


def num_rows(batch: Any) -> int:
    """Rows of a batch: the leading dimension of its arrays (all must agree)."""
    sizes = {len(leaf) for leaf in leaves(batch)}
    if len(sizes) != 1:
        raise ValueError(f"batch arrays have different numbers of rows: {sorted(sizes)}")
    return sizes.pop()


def take_rows(blocks: Sequence[Any], spans: Sequence[tuple[int, int]]) -> Any:
    """Rows `spans[k] = (start, stop)` of `blocks[k]`, concatenated in order.
    One span: views of the block, no copy."""
    if len(spans) == 1:
        start, stop = spans[0]
        return map_leaves(lambda a: a[start:stop], blocks[0])
    return _build(blocks[0], (), lambda path: np.concatenate(
        [_at(block, path)[start:stop] for block, (start, stop) in zip(blocks, spans)]))


def split(batch: Any, parts: int) -> list:
    """`parts` equal row ranges of a batch (one per replica); ValueError if the
    rows do not divide."""
    rows = num_rows(batch)
    if rows % parts:
        raise ValueError(f"a batch of {rows} rows does not split evenly among {parts} replicas")
    size = rows // parts
    return [map_leaves(lambda a, k=k: a[k * size:(k + 1) * size], batch) for k in range(parts)]


def _paths(nest: Any, path: tuple):
    """(path, array) of every array of a nest."""
    if isinstance(nest, dict):
        for k, v in nest.items():
            yield from _paths(v, path + (k,))
    elif isinstance(nest, (tuple, list)):
        for i, v in enumerate(nest):
            yield from _paths(v, path + (i,))
    else:
        yield path, nest


def _position(path: tuple) -> str:
    return f"its entry at position {list(path)}" if path else "it"


def _sample(value: Any) -> str:
    text = repr(value)
    return "e.g. " + (text if len(text) <= 40 else text[:37] + "...")


def _at(nest: Any, path: tuple) -> Any:
    for key in path:
        nest = nest[key]
    return nest


def _build(template: Any, path: tuple, leaf_fn: Callable[[tuple], Any]) -> Any:
    if isinstance(template, dict):
        return {k: _build(v, path + (k,), leaf_fn) for k, v in template.items()}
    if isinstance(template, (tuple, list)):
        return type(template)(_build(v, path + (i,), leaf_fn) for i, v in enumerate(template))
    return leaf_fn(path)


def _show(example: Any) -> str:
    return repr(map_leaves(lambda a: f"{np.asarray(a).dtype}{np.shape(a)}", example))[:200]
