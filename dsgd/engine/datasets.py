"""The datasets a DistributedSGD trains on, as the engine tracks them.

The engine does not import the data layer: `train(dataset=...)` asks a
`dsgd.Dataset` for its *feed* (`dataset._feed(devices_per_worker)`) and drives
it through this protocol (implemented in dsgd/data/feeds.py):

    feed.loaders(num_workers, timeout_s, ahead)
                                           one loader per worker (in worker order),
                                           sent to the workers at first use and again
                                           after workers were replaced or added; the
                                           first step to use them is `ahead` steps
                                           after the next one
    feed.steps_per_epoch(num_workers)      steps in one epoch, or None (unknown)
    feed.step_args(num_workers, ahead, timeout_s)
                                           one small argument per worker for the step
                                           `ahead` steps after the next one, never None
                                           (which tells workers to use get_batch)
    feed.advance(num_workers)              the next step was completed (or skipped)
                                           on that many workers
    feed.epoch_ended()                     a step found the data's epoch ended
    feed.use_step_positions()              (optional; backup workers) steps name their
                                           batch, so that a worker that sat steps out
                                           skips those batches
    feed.position                          rows consumed so far (None: not tracked)
    feed.seek(rows)                        continue from row `rows` (checkpoint restore)
    feed.reports_epoch_end                 True: the loaders tell when an epoch ends

A worker's loader turns its argument into one batch per replica
(`loader.batches(arg, num_devices)`, None at the end of an epoch).
"""

from __future__ import annotations

from collections import OrderedDict


class FeedEntry:
    """One dataset's feed and the membership its loaders were last sent to."""

    def __init__(self, key: int, dataset, feed):
        self.key, self.dataset, self.feed = key, dataset, feed
        self._loaders_membership: int | None = None

    def needs_loaders(self, membership: int) -> bool:
        return self._loaders_membership != membership

    def loaders_sent(self, membership: int) -> None:
        self._loaders_membership = membership


class Feeds:
    """The feeds of the `kept` most recently used datasets (most recent last), so
    that training on a dataset again continues where it stopped; the feed of
    the last step trained from a dataset; and a data position restored from a
    checkpoint before any dataset was used."""

    def __init__(self, kept: int):
        self._kept = kept
        self._entries: OrderedDict[int, FeedEntry] = OrderedDict()
        self._next_key = 0
        self._last: FeedEntry | None = None
        self._pending_position: int | None = None

    def entry(self, dataset, devices_per_worker: int) -> tuple[FeedEntry, list[int]]:
        """`dataset`'s entry, made on first use; and the keys of entries dropped
        to keep `kept` (their loaders should be detached from the workers)."""
        if not hasattr(dataset, "_feed"):
            raise TypeError("dataset must be a dsgd.Dataset (wrap a ray.data.Dataset or an "
                            f"iterable: dsgd.Dataset(data, batch_size=...)), got "
                            f"{type(dataset).__name__}")
        for key, known in self._entries.items():
            if known.dataset is dataset:
                self._entries.move_to_end(key)
                return known, []
        feed = dataset._feed(devices_per_worker)
        if self._pending_position is not None and feed.position is not None:
            feed.seek(self._pending_position)
            self._pending_position = None
        entry = FeedEntry(self._next_key, dataset, feed)
        self._next_key += 1
        self._entries[entry.key] = entry
        dropped = []
        while len(self._entries) > self._kept:
            dropped.append(self._entries.popitem(last=False)[0])
        return entry, dropped

    def used(self, entry: FeedEntry) -> None:
        """A step was submitted with data from `entry`."""
        self._last = entry

    @property
    def position(self) -> int | None:
        """The data position of the dataset last trained on, if it tracks one."""
        return None if self._last is None else self._last.feed.position

    def seek(self, rows: int) -> None:
        """Continue the dataset last trained on from row `rows`; before any
        dataset was used, the next one trained on starts there."""
        if self._last is not None and self._last.feed.position is not None:
            self._last.feed.seek(rows)
        else:
            self._pending_position = int(rows)
