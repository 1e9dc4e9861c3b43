"""dsgd: synchronous data-parallel SGD for TensorFlow/Keras on Ray."""

import os as _os

from dsgd.native import installation as _installation

# A source tree without its compiled modules (pip install . run from the repository
# root): a clear ImportError saying what to do, before anything needs them.
_installation.check_compiled(_os.path.dirname(_os.path.abspath(__file__)))

# TensorFlow's start-up probing lines (no CUDA driver, cuInit, oneDNN) are dropped from
# whichever import of TensorFlow comes first after this one, in a dsgd actor or a user's
# script that imports dsgd first: dsgd/tf_logging.py. Nothing here imports TensorFlow: a
# process that never uses it (a PS actor, a data-download task) does not pay for it.
from dsgd.tf_logging import filter_tensorflow_import as _filter_tensorflow_import  # noqa: E402

_filter_tensorflow_import()

from dsgd.progress import show_log_lines as _show_log_lines  # noqa: E402

_show_log_lines()  # dsgd's INFO lines on stderr until the program configures logging

from dsgd.data import Dataset  # noqa: E402
from dsgd.errors import (CheckpointError, DsgdError, ModelMismatchError,  # noqa: E402
                         NonFiniteError, ResourceError, StepTimeoutError)
from dsgd.model import KerasModel, Model  # noqa: E402
from dsgd.engine.sgd import DistributedSGD  # noqa: E402
from dsgd.trainer import (BATCH_SIZE, AverageMeterCollection, ReduceLROnPlateau,  # noqa: E402
                          Trainer, TrainingOperator)

__version__ = "0.1.0"


def __getattr__(name: str):
    """`dsgd.train` (the Ray Train backend, which imports Ray Train) loads on first use."""
    if name == "train":
        import importlib

        return importlib.import_module("dsgd.train")
    raise AttributeError(f"module 'dsgd' has no attribute {name!r}")

__all__ = [
    "DistributedSGD",
    "Dataset",
    "Trainer",
    "TrainingOperator",
    "BATCH_SIZE",
    "ReduceLROnPlateau",
    "AverageMeterCollection",
    "Model",
    "KerasModel",
    "DsgdError",
    "StepTimeoutError",
    "ResourceError",
    "ModelMismatchError",
    "CheckpointError",
    "NonFiniteError",
    "__version__",
]
