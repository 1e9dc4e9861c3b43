"""dsgd: synchronous data-parallel SGD for TensorFlow/Keras on Ray."""

import os as _os

from dsgd.native import installation as _installation

# A source tree without its compiled modules (pip install . run from the repository
# root): a clear ImportError saying what to do, before anything needs them.
_installation.check_compiled(_os.path.dirname(_os.path.abspath(__file__)))

# TensorFlow's start-up probing lines (no CUDA driver, cuInit, oneDNN) are dropped here,
# in every dsgd actor and in a script that imports dsgd first: dsgd/tf_logging.py. Not
# in a PS actor's process, which never uses TensorFlow (constants.PS_RUNTIME_ENV).
from dsgd import constants as _constants  # noqa: E402
from dsgd.tf_logging import import_tensorflow as _import_tensorflow  # noqa: E402

if _os.environ.get(_constants.NO_TENSORFLOW_VARIABLE) != "1":
    _import_tensorflow()

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
