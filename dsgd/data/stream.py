"""A Python iterable as one stream of rows in the object store (driver side).

Items (values, paths, examples) are taken in order; `download_func(item)`
turns each into an example. Consecutive items form blocks of `block_rows`
examples, stacked (dsgd/data/batching.py) and kept as objects owned by the
driver: downloaded by Ray tasks, never more than `max_concurrency` at once, or,
without a download function, stacked and put by the driver. A block is made
once and kept for the stream's life, so later epochs read it again without
downloading, and a worker that dies never takes data with it.

Row r of the stream is item r mod N (N items; unknown until an iterator is
exhausted), so the stream repeats forever and any range of rows is a pure
function of its position. With a shuffle seed (known length only), items are
put into blocks in an order drawn once from the seed, and every epoch visits
the blocks in an order drawn from (seed, epoch): batches mix the data, every
item is still seen once per epoch, and rows stay a function of the position.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from dsgd.comm.waits import Deadline, fetch, outcomes, ready
from dsgd.data.batching import show_signature, signature, stack
from dsgd.errors import DsgdError, StepTimeoutError

_REMOTE: dict = {}


def _download_block(download_func, items: list, indices: list[int]):
    """(Ray task) `download_func` on each item in turn, stacked into one block;
    `indices` are the items' positions in the data (for messages). Returns
    ((number of examples, the block's signature), block)."""
    examples = []
    for index, item in zip(indices, items):
        try:
            examples.append(download_func(item))
        except Exception as e:
            raise DsgdError(f"download_func raised on item {index} "
                            f"({_short(item)}): {type(e).__name__}: {e}") from e
    block = stack(examples, lambda i: f"item {indices[i]} ({_short(items[i])})")
    return (len(examples), signature(block)), block


def _remote_download():
    if "download" not in _REMOTE:
        import ray

        # num_cpus=0: downloads wait on storage, and max_concurrency (not Ray's CPU
        # count, which the workers have taken) bounds how many run at once.
        _REMOTE["download"] = ray.remote(num_cpus=0, num_returns=2, max_retries=3)(_download_block)
    return _REMOTE["download"]


class BlockStream:
    """The rows of `data` (a sequence, or an iterable read once, in order).

    Args:
        data: the items.
        download_func: item -> example, run in Ray tasks; None: items are examples.
        max_concurrency: download tasks in flight at most.
        block_rows: examples per block (the last block of the data may be shorter).
        shuffle_seed: None, or shuffle as the module docstring says (a sequence only).
    """

    def __init__(self, data: Iterable, download_func: Callable | None, max_concurrency: int,
                 block_rows: int, shuffle_seed: int | None = None):
        self.download_func = download_func
        self.max_concurrency = max_concurrency
        self.block_rows = block_rows
        if _is_sequence(data):
            self.items, self.length, self._iterator = data, len(data), None
        else:
            self.items, self.length, self._iterator = [], None, iter(data)
        self.shuffle_seed = shuffle_seed
        if shuffle_seed is not None:
            if self.length is None:
                raise ValueError("shuffle needs data of known length (a sequence), not a stream")
            self._order = np.random.default_rng(shuffle_seed).permutation(self.length)
            self._epoch_orders: dict[int, tuple] = {}
        self.blocks: dict[int, Any] = {}      # block index -> ObjectRef of the block
        self._pending: dict[int, tuple] = {}  # block index -> (count ref, block ref)
        self._failed: dict[int, BaseException] = {}  # downloads that raised, by block
        self._func_ref = None
        self._signature: tuple | None = None  # (block, signature) of the first block made
        self.downloaded_items = 0

    # -- positions ------------------------------------------------------------------
    def spans(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """(block index, first row, end row) of the blocks holding stream rows
        [start, start + count), in order. Reads the iterator as far as needed."""
        if self.shuffle_seed is not None:
            return self._shuffled_spans(start, count)
        spans, row = [], start
        while row < start + count:
            index = self._item_index(row)
            block, offset = divmod(index, self.block_rows)
            block_end = (block + 1) * self.block_rows
            self._read_items(block_end)  # a stream may end inside this block
            if self.length is not None:
                block_end = min(block_end, self.length)
            take = min(block_end - index, start + count - row)
            spans.append((block, offset, offset + take))
            row += take
        return spans

    def _shuffled_spans(self, start: int, count: int) -> list[tuple[int, int, int]]:
        spans, row = [], start
        while row < start + count:
            epoch, offset = divmod(row, self.length)
            order, starts = self._epoch_order(epoch)
            k = int(np.searchsorted(starts, offset, side="right")) - 1
            block, first = int(order[k]), offset - int(starts[k])
            take = min(self._block_size(block) - first, start + count - row)
            spans.append((block, first, first + take))
            row += take
        return spans

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The blocks in the order epoch `epoch` visits them, and where each starts."""
        if epoch not in self._epoch_orders:
            num_blocks = -(-self.length // self.block_rows)
            order = np.random.default_rng([self.shuffle_seed, epoch]).permutation(num_blocks)
            sizes = [self._block_size(int(b)) for b in order]
            self._epoch_orders = {epoch: (order, np.cumsum([0] + sizes[:-1]))}  # keep one
        return self._epoch_orders[epoch]

    def _block_size(self, block: int) -> int:
        return min(self.block_rows, self.length - block * self.block_rows)

    def _item_index(self, row: int) -> int:
        if self.length is None:
            self._read_items(row + 1)
        if self.length is not None:
            return row % self.length
        return row

    def _read_items(self, wanted: int) -> None:
        """Take items from the iterator until there are `wanted` (or it ends)."""
        if self._iterator is None or len(self.items) >= wanted:
            return
        self.items.extend(itertools.islice(self._iterator, wanted - len(self.items)))
        if len(self.items) < wanted:  # the iterator is exhausted: the length is known
            self._iterator = None
            self.length = len(self.items)
            if not self.length:
                raise ValueError("data is empty: the iterable yielded no item")

    # -- blocks -----------------------------------------------------------------------
    def ready(self, start: int, count: int, ahead: int, timeout_s: float) -> dict[int, Any]:
        """Make sure the blocks of rows [start, start + count) exist, starting the
        downloads of the next `ahead` rows too. Blocks until the first ones are
        made, at most `timeout_s`. Returns {block index: ObjectRef} of those
        rows' blocks. A download of one of them that failed raises its error
        (naming the item); one of a block only prefetched raises when it is needed."""
        needed = list(dict.fromkeys(b for b, _, _ in self.spans(start, count)))
        upcoming = [b for b, _, _ in self.spans(start + count, ahead)] if ahead else []
        wanted = list(dict.fromkeys(needed + upcoming))
        deadline = Deadline(f"download_func: blocks {needed[0]}-{needed[-1]}", timeout_s)
        while True:
            self._start(wanted)
            for block in needed:  # a failed download of a needed block: its error, now
                if block in self._failed:
                    raise self._failed[block]
            missing = [b for b in needed if b not in self.blocks]
            if not missing:
                return {b: self.blocks[b] for b in needed}
            if deadline.over():
                raise StepTimeoutError(f"download_func: block {missing[0]} ({self.block_rows} "
                                       f"items) not downloaded after {timeout_s:.1f} s")
            self._collect(deadline, 1.0)

    def _start(self, wanted: list[int]) -> None:
        for block in wanted:
            if block in self.blocks or block in self._pending or block in self._failed:
                continue
            first, last = self._item_range(block)
            indices = list(range(first, last + 1)) if self.shuffle_seed is None else \
                [int(i) for i in self._order[first:last + 1]]
            items = [self.items[i] for i in indices]
            if self.download_func is None:
                import ray

                examples = stack(items, lambda i: f"item {indices[i]} ({_short(items[i])})")
                self._made(block, signature(examples), ray.put(examples))
                continue
            if len(self._pending) >= self.max_concurrency:
                return
            if self._func_ref is None:
                import ray

                self._func_ref = ray.put(self.download_func)
            self._pending[block] = _remote_download().remote(self._func_ref, items, indices)

    def _collect(self, deadline: Deadline, slice_s: float) -> None:
        """Wait for pending downloads, at most `slice_s` within `deadline`; keep the
        finished ones."""

        if not self._pending:
            return
        counts = {refs[0]: block for block, refs in self._pending.items()}
        done, rest = deadline.wait(list(counts), num_returns=1, slice_s=slice_s)
        if done and rest:
            done += ready(rest)[0]
        for ref in done:
            block = counts[ref]
            try:
                count, block_signature = fetch(ref, f"the count of block {block}")
            except Exception as e:  # noqa: BLE001 - kept, raised when the block is needed
                # the block failed too: read it, so Ray does not log it as unhandled
                outcomes([self._pending.pop(block)[1]], f"block {block}", deadline.left())
                self._failed[block] = e
                continue
            self.downloaded_items += count
            self._made(block, block_signature, self._pending.pop(block)[1])

    def _made(self, block: int, block_signature: tuple, ref) -> None:
        """Keep a block made; one whose examples differ in structure or shape from
        the first block's fails (raised when it is needed): the two could never
        be concatenated into one batch, or would feed the model another shape."""
        if self._signature is None:
            self._signature = (block, block_signature)
        first, first_signature = self._signature
        if block_signature != first_signature:
            made_by = "download_func returned" if self.download_func else "the data holds"
            self._failed[block] = ValueError(
                f"{made_by} examples of different shapes: items {self._items_text(block)} "
                f"have arrays of shape {show_signature(block_signature)} per example, items "
                f"{self._items_text(first)} {show_signature(first_signature)}: every example "
                "must have the same structure and shapes (pad variable-length data)")
            return
        self.blocks[block] = ref

    def _items_text(self, block: int) -> str:
        first, last = self._item_range(block)
        return f"{first}..{last}" if self.shuffle_seed is None else \
            f"{first}..{last} of the shuffled order"

    def _item_range(self, block: int) -> tuple[int, int]:
        """First and last position of a block's items (in the shuffled order, if any)."""
        first = block * self.block_rows
        self._read_items(first + self.block_rows)
        last = first + self.block_rows - 1
        if self.length is not None:
            last = min(last, self.length - 1)
        return first, last


def _is_sequence(data) -> bool:
    return hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, dict)


def _short(item) -> str:
    text = repr(item)
    return text if len(text) <= 80 else text[:77] + "..."
