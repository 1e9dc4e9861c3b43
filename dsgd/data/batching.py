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
    if isinstance(nest, dict):
        return [x for k in nest for x in leaves(nest[k])]
    if isinstance(nest, (tuple, list)):
        return [x for v in nest for x in leaves(v)]
    return [nest]


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
                             f"has {_show(examples[0])}: every example must have the same one")

    def stack_leaf(path: tuple):
        values = [_at(e, path) for e in examples]
        try:
            return np.stack([np.asarray(v) for v in values])
        except ValueError as e:
            shapes = sorted({np.shape(v) for v in values})
            raise ValueError(f"examples {describe(0)}..{describe(len(examples) - 1)} cannot be "
                             f"stacked at position {list(path)}: shapes {shapes[:4]} ({e})") from None

    return _build(examples[0], (), stack_leaf)


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
