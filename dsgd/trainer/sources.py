"""What a Trainer worker reads in a custom epoch or a validation: one record per
worker, made by the driver (dsgd/trainer/trainer.py) and read on the worker
(dsgd/trainer/replica.py `worker_batches`, dsgd/trainer/custom.py `batches`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class RowsSource:
    """This worker's batches of a `dsgd.Dataset`: each a `RowSpans` of the
    driver's blocks in the object store (fetched within `timeout_s` seconds)."""
    batches: list
    transform: Callable | None
    timeout_s: float


@dataclasses.dataclass(frozen=True)
class RaySplitSource:
    """This worker's split of a Ray Dataset (`streaming_split`), read in batches
    of `batch_size` rows; `drop_last` (training): as many batches on every worker."""
    iterator: Any
    batch_size: int
    transform: Callable | None
    drop_last: bool = False


@dataclasses.dataclass(frozen=True)
class OwnSource:
    """Each replica reads its own tf.data shard; `steps` (training): how many
    batches each replica reads (None: validation, the whole shard)."""
    steps: int | None = None
