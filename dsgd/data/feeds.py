"""How a `dsgd.Dataset` feeds a `DistributedSGD`: a driver-side feed per kind
of data, and the loader it sends to every worker. The engine drives feeds
through the protocol described in dsgd/engine/datasets.py (without importing this
module); the worker calls `loader.batches(arg, num_devices)`, which returns
(one batch per replica, rows in the worker's batch), or None at the end of an
epoch.
"""

from __future__ import annotations

from collections.abc import Callable

from dsgd.comm.waits import fetch
from dsgd.data.batching import check_numeric, num_rows, split, take_rows
from dsgd.data.stream import BlockStream
from dsgd.errors import DsgdError

# A Ray Data worker's step argument without backup workers: the next batch of its split.
NEXT_BATCH = "next batch"

# Steps' worth of rows whose downloads start ahead of the one being trained.
PREFETCH_STEPS = 2


class StreamFeed:
    """A Python iterable: step s of a worker w takes rows [p + w*b, p + (w+1)*b)
    of the stream, p the rows consumed before the step and b the batch size. The
    batch is a function of the position only, so a retried step (after a worker
    died) gets the same rows, in any worker."""

    def __init__(self, dataset, stream: BlockStream):
        self.dataset = dataset
        self.stream = stream

    reports_epoch_end = False  # the stream repeats forever

    @property
    def position(self) -> int:
        return self.dataset.position

    def seek(self, rows: int) -> None:
        self.dataset._seek(rows)

    def loaders(self, num_workers: int, timeout_s: float, ahead: int = 0) -> list:
        return [StreamLoader(self.dataset.transform, timeout_s)] * num_workers

    def steps_per_epoch(self, num_workers: int) -> int | None:
        if self.stream.length is None:
            return None
        return -(-self.stream.length // (num_workers * self.dataset.batch_size))

    def step_args(self, num_workers: int, ahead: int, timeout_s: float) -> list:
        b = self.dataset.batch_size
        rows = num_workers * b
        start = self.dataset.position + ahead * rows
        self.stream.spans(start, rows)  # reads a stream far enough to tell if it is shorter
        if self.stream.length is not None and self.stream.length < rows:
            raise ValueError(f"{self.dataset!r} has {self.stream.length} item(s), fewer than one "
                             f"step takes ({num_workers} worker(s) x batch_size={b} = {rows} "
                             "rows): the step would repeat rows. Use a smaller batch_size, or "
                             "fewer workers, or more data")
        refs = self.stream.ready(start, rows, PREFETCH_STEPS * rows, timeout_s)
        args = []
        for w in range(num_workers):
            first = start + w * b
            spans = self.stream.spans(first, b)
            args.append(RowSpans([refs[k] for k, _, _ in spans],
                                 [(lo, hi) for _, lo, hi in spans], first))
        return args

    def advance(self, num_workers: int) -> None:
        self.dataset._seek(self.dataset.position + num_workers * self.dataset.batch_size)

    def epoch_ended(self) -> None:
        pass  # never reported (reports_epoch_end is False)


class RowSpans:
    """One worker's batch: rows `spans[k]` of the block `refs[k]`, in order;
    `first_row` is the stream row of the first (for messages)."""

    def __init__(self, refs: list, spans: list[tuple[int, int]], first_row: int):
        self.refs, self.spans, self.first_row = refs, spans, first_row

    @property
    def rows(self) -> int:
        return sum(hi - lo for lo, hi in self.spans)


class StreamLoader:
    """(worker side) Reads a `RowSpans` batch from the object store (zero-copy
    views when it sits in one block), applies the transform, splits it among
    the replicas."""

    def __init__(self, transform: Callable | None, timeout_s: float):
        self.transform, self.timeout_s = transform, timeout_s

    def batches(self, arg: RowSpans, num_devices: int):

        blocks = fetch(arg.refs, f"the blocks of rows {arg.first_row}..", self.timeout_s)
        batch = take_rows(blocks, arg.spans)
        where = f"rows {arg.first_row}..{arg.first_row + arg.rows - 1} of the data"
        return finish(batch, self.transform, num_devices, where)


class RayDataFeed:
    """A `ray.data.Dataset`, consumed by Ray Data: `streaming_split(n, equal=True)`
    gives each worker an iterator over its share, and each worker reads batches
    with `iter_batches` (Ray Data prefetches them in the worker). The split is
    made again whenever workers change, and its epoch then starts over. A
    step's argument is (epoch, batch number in the epoch), so that a worker
    that sat steps out (backup workers) skips the batches it missed."""

    position = None
    reports_epoch_end = True  # train() without num_steps runs until the split's epoch ends

    def __init__(self, dataset):
        self.dataset = dataset
        self._epoch, self._batch = 0, 0
        # Backup workers (use_step_positions): steps name their batch, so that a worker
        # that sat steps out skips those batches. Otherwise every worker reads its next
        # batch, into the next epoch too (a step queued ahead of an epoch's end).
        self.positional = False

    def use_step_positions(self) -> None:
        """Steps name their batch (epoch, number) from now on (backup workers)."""
        self.positional = True

    def loaders(self, num_workers: int, timeout_s: float, ahead: int = 0) -> list:
        """New splits; their first batch is the step `ahead` steps after the next."""
        splits = self.dataset.data.streaming_split(num_workers, equal=True)
        self._epoch, self._batch = 0, -ahead
        return [RayDataLoader(s, self.dataset.batch_size, self.dataset.transform) for s in splits]

    def steps_per_epoch(self, num_workers: int) -> None:
        return None  # counting rows would run the whole pipeline: an epoch ends when it ends

    def step_args(self, num_workers: int, ahead: int, timeout_s: float) -> list:
        if not self.positional:
            return [NEXT_BATCH] * num_workers  # not None: None means "use get_batch"
        return [(self._epoch, self._batch + ahead)] * num_workers

    def advance(self, num_workers: int) -> None:
        self._batch += 1

    def epoch_ended(self) -> None:
        self._epoch, self._batch = self._epoch + 1, 0

    def seek(self, rows: int) -> None:
        raise ValueError("a Ray Data feed has no row position to seek")


class RayDataLoader:
    """(worker side) Batch `b` of epoch `e` of this worker's streaming split, for
    the argument (e, b). All workers' batches have the same rows (equal split,
    full batches only). Batches this worker did not train on (it sat steps
    out, backup workers) are read and dropped; the end of the split's epoch is
    reported as None, and the next epoch's first call starts it (a worker
    still in an earlier epoch reads its rest first)."""

    PREFETCH_BATCHES = 2

    def __init__(self, split_iterator, batch_size: int, transform: Callable | None):
        self.split_iterator, self.batch_size, self.transform = split_iterator, batch_size, transform
        self._batches = None  # this epoch's iterator; None: ended (or not started)
        self._epoch = -1      # the epoch of the iterator (or the last one ended)
        self._count = 0       # batches read in that epoch

    def batches(self, arg, num_devices: int):
        if arg == NEXT_BATCH:
            if self._batches is None:
                self._start(self._epoch + 1)
            batch = self._next()
            return None if batch is None else self._finish(batch, num_devices)
        epoch, number = arg
        if epoch != self._epoch or self._batches is None:
            if epoch == self._epoch:  # asked again after this epoch ended: still ended
                return None
            while self._batches is not None and self._next() is not None:
                pass  # the rest of an epoch this worker fell behind in
            self._start(epoch)
        batch = self._next()
        while batch is not None and self._count <= number:
            batch = self._next()  # batches of steps this worker sat out
        if batch is None:
            return None
        return self._finish(batch, num_devices)

    def _start(self, epoch: int) -> None:
        self._batches = iter(self.split_iterator.iter_batches(
            batch_size=self.batch_size, batch_format="numpy", drop_last=True,
            prefetch_batches=self.PREFETCH_BATCHES))
        self._epoch, self._count = epoch, 0

    def _finish(self, batch, num_devices: int):
        return finish(batch, self.transform, num_devices,
                      f"batch {self._count} of this worker's Ray Data split in this epoch")

    def _next(self):
        """The next batch of the epoch (counted), or None at its end."""
        try:
            batch = next(self._batches)
        except StopIteration:
            self._batches = None
            return None
        self._count += 1
        return batch


def finish(batch, transform: Callable | None, num_devices: int, where: str):
    """transform(batch), then one batch per replica, and the worker batch's rows.
    DsgdError naming `where` if the transform raises or changes the number of
    rows, or the batch is not numeric arrays (checked before TensorFlow sees it)."""
    rows_in = None
    if transform is not None:
        rows_in = num_rows(batch)
        try:
            batch = transform(batch)
        except Exception as e:
            raise DsgdError(f"transform raised on {where}: {type(e).__name__}: {e}") from e
    what = f"the batch of {where}{' after transform' if transform else ''}"
    try:
        check_numeric(batch)
        rows = num_rows(batch)
    except (ValueError, TypeError) as e:
        raise DsgdError(f"{what}: {e}") from None
    if rows_in is not None and rows != rows_in:
        raise DsgdError(f"transform changed the number of rows of {where} from {rows_in} to "
                        f"{rows}: it must return one row per row it is given")
    try:
        return split(batch, num_devices), rows
    except ValueError as e:
        raise DsgdError(f"{what}: {e}") from None
