"""Data ingest above the engine: `dsgd.Dataset` and the feeds that give its
batches to `DistributedSGD.train` (see dsgd/data/feeds.py)."""

from dsgd.data.dataset import Dataset

__all__ = ["Dataset"]
