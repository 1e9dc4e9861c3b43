"""dsgd: synchronous data-parallel SGD for TensorFlow/Keras on Ray."""

import os as _os

from dsgd import installation as _installation

# A source tree without its compiled modules (pip install . run from the repository
# root): a clear ImportError saying what to do, before anything needs them.
_installation.check_compiled(_os.path.dirname(_os.path.abspath(__file__)))

from dsgd.errors import (CheckpointError, DsgdError, ModelMismatchError, NonFiniteError,
                         ResourceError, StepTimeoutError)
from dsgd.data import Dataset
from dsgd.model import KerasModel, Model
from dsgd.sgd import DistributedSGD

__version__ = "0.1.0"

__all__ = [
    "DistributedSGD",
    "Dataset",
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
