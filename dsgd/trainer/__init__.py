"""The Trainer layer above the engine: `Trainer`, `TrainingOperator`, `BATCH_SIZE`."""

from dsgd.trainer.operator import BATCH_SIZE, TrainingOperator
from dsgd.trainer.trainer import Trainer

__all__ = ["BATCH_SIZE", "Trainer", "TrainingOperator"]
