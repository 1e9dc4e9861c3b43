"""The Trainer layer above the engine: `Trainer`, `TrainingOperator`, `BATCH_SIZE`,
learning-rate schedulers (`ReduceLROnPlateau`) and `AverageMeterCollection`."""

from dsgd.trainer.meters import AverageMeterCollection
from dsgd.trainer.operator import BATCH_SIZE, TrainingOperator
from dsgd.trainer.schedules import ReduceLROnPlateau
from dsgd.trainer.trainer import Trainer

__all__ = ["BATCH_SIZE", "AverageMeterCollection", "ReduceLROnPlateau", "Trainer",
           "TrainingOperator"]
