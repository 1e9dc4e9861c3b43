"""`dsgd.Dataset`: data that `DistributedSGD.train(dataset=...)` shards, downloads,
transforms and batches in parallel (seeds raysgd_dataset and ray_data)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from dsgd import constants
from dsgd.config import check_picklable


class Dataset:
    """Training data for `DistributedSGD.train(dataset=...)`.

    Args:
        data: any Python iterable of items (values, paths, examples; a sequence
            has a known length, any other iterable such as a generator is
            streaming data, read once, in order), or a `ray.data.Dataset`.
        download_func: `item -> example`, where an example is one array-like or
            a tuple/list/dict of them (e.g. `(x, y)`). Runs in Ray tasks, at most
            `max_concurrency` at once; results are kept in the object store
            (owned by the driver), so each item is downloaded once. None: items
            are examples. Not for a `ray.data.Dataset` (use its `map`/`map_batches`).
        max_concurrency: download tasks running at once, at most.
        transform: `batch -> batch`, run in the worker actor that trains on the
            batch, before it is split among the worker's replicas. Its input may
            be read-only views of the object store: return new arrays, do not
            modify it in place.
        batch_size: examples per worker per step (a worker with D devices gives
            each replica batch_size / D).
        shuffle: (a Python sequence) take the items in a random order drawn once
            from `seed`, and visit their blocks in a new random order every
            epoch; still every item once per epoch, and batches still a pure
            function of the position. For a `ray.data.Dataset` use its own
            `random_shuffle()` / `randomize_block_order()`.
        seed: the shuffle's seed.

    A batch stacks `batch_size` examples position by position: `(x, y)` examples
    give `(x[batch], y[batch])`; a `ray.data.Dataset` gives Ray Data's dict of
    numpy columns. Each worker reads its own shard, a repeated sequence: for
    data of known length that shards evenly, one epoch is
    `len / (num_workers * batch_size)` steps and every item is seen once per
    epoch. Constructing it starts no Ray work; `train` does. See docs/data.md
    for sharding, epochs and failures.

    Attributes:
        position: rows of a Python iterable's stream consumed by `train` so far
            (where the next `train` on it continues).

    Raises:
        TypeError: (at construction, before any Ray work) a non-iterable
            `data`, or a non-callable or unpicklable function.
        ValueError: (at construction) empty data, a non-positive
            `batch_size`/`max_concurrency`, `download_func` or `shuffle` with a
            `ray.data.Dataset`, `shuffle` with data of unknown length. At the
            first batch that needs it (in `train`): data shorter than one step
            (it would repeat rows within the step; a `ray.data.Dataset` that
            is empty or has fewer rows than one step), examples whose
            structure or shapes differ (in one batch, or between blocks of
            downloaded examples), a `batch_size` that does not split evenly
            among a worker's devices.
        DsgdError: (in `train`) a batch (after `transform`) that is not numeric
            arrays (strings, objects) or whose number of rows `transform`
            changed; names the rows.
    """

    def __init__(self, data: Iterable | Any, *, download_func: Callable | None = None,
                 max_concurrency: int = 1, transform: Callable | None = None,
                 batch_size: int = 32, shuffle: bool = False, seed: int = 0):
        _positive_int("batch_size", batch_size)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {seed!r}")
        _positive_int("max_concurrency", max_concurrency)
        for name, fn, why in (("download_func", download_func, "Ray sends it to the download "
                               "tasks"), ("transform", transform, "Ray sends it to every worker")):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
            if fn is not None:
                check_picklable(name, fn, why)
        self.download_func, self.transform = download_func, transform
        self.max_concurrency, self.batch_size = int(max_concurrency), int(batch_size)
        self.position = 0  # rows of a Python iterable's stream consumed by train()
        self.is_ray_data = is_ray_dataset(data)
        self.shuffle, self.seed = shuffle, int(seed)
        if self.is_ray_data:
            if download_func is not None or shuffle:
                raise ValueError(f"{'download_func' if download_func else 'shuffle'} applies to "
                                 "Python iterables; for a ray.data.Dataset use its map()/"
                                 "map_batches() / random_shuffle()")
            self.data = data
        else:
            self.data = _checked_iterable(data)
            if shuffle and not hasattr(self.data, "__len__"):
                raise ValueError("shuffle=True needs data of known length (a list, range, "
                                 "array...), not a generator or iterator")
        self._stream = None

    @property
    def num_items(self) -> int | None:
        """Items in the data, or None while unknown (streaming data, Ray Data)."""
        if self.is_ray_data:
            return None
        if self._stream is not None:
            return self._stream.length
        return len(self.data) if hasattr(self.data, "__len__") else None

    def _feed(self, devices: int):
        """The driver-side feed for workers of `devices` replicas each (the
        protocol of dsgd/engine/datasets.py)."""
        from dsgd.data.feeds import RayDataFeed, StreamFeed
        from dsgd.data.stream import BlockStream

        if self.batch_size % devices:
            raise ValueError(f"batch_size={self.batch_size} (per worker) does not split evenly "
                             f"among devices_per_worker={devices} replicas; use a multiple "
                             f"of {devices}")
        if self.is_ray_data:
            return RayDataFeed(self)
        if self._stream is None:
            self._stream = BlockStream(self.data, self.download_func, self.max_concurrency,
                                       min(self.batch_size, constants.DATA_BLOCK_MAX_ROWS),
                                       self.seed if self.shuffle else None)
        return StreamFeed(self, self._stream)

    def with_batch_size(self, batch_size: int) -> Dataset:
        """The same data (same position, same downloaded blocks, shared, not
        copied) with another `batch_size`; this Dataset is unchanged.

        Args:
            batch_size: examples per worker per step.

        Returns:
            A new `Dataset`.
        """
        import copy

        _positive_int("batch_size", batch_size)
        other = copy.copy(self)
        other.batch_size = int(batch_size)
        return other

    def _seek(self, rows: int) -> None:
        """(its feed) Rows of the stream consumed so far."""
        self.position = int(rows)

    def __repr__(self) -> str:
        kind = "ray.data.Dataset" if self.is_ray_data else (
            f"{self.num_items} items" if self.num_items is not None else "streaming")
        return f"dsgd.Dataset({kind}, batch_size={self.batch_size}, position={self.position})"


def is_ray_dataset(data) -> bool:
    """A `ray.data.Dataset`, recognised without importing Ray Data."""
    return any(c.__module__.startswith("ray.data") and c.__name__ == "Dataset"
               for c in type(data).__mro__)


def _checked_iterable(data):
    if isinstance(data, dict):
        raise TypeError("data is a dict; pass a sequence of examples (e.g. list(zip(x, y))) "
                        "or a ray.data.Dataset (e.g. ray.data.from_numpy)")
    if isinstance(data, (str, bytes)) or not isinstance(data, Iterable) and \
            not hasattr(data, "__getitem__"):
        raise TypeError(f"data must be an iterable of items (a list, range, array, generator, "
                        f"...) or a ray.data.Dataset, got {type(data).__name__}")
    if hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, dict):
        if len(data) == 0:
            raise ValueError("data is empty: it holds no item")
        return data
    iterator = iter(data)
    try:
        first = next(iterator)
    except StopIteration:
        raise ValueError("data is empty: the iterable yielded no item") from None
    return itertools.chain([first], iterator)


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
