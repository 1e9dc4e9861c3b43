"""dsgd: synchronous data-parallel SGD for TensorFlow/Keras on Ray."""

from dsgd.errors import (CheckpointError, DsgdError, ModelMismatchError, NonFiniteError,
                         ResourceError, StepTimeoutError)
from dsgd.model import KerasModel, Model
from dsgd.sgd import DistributedSGD

__version__ = "0.1.0"

__all__ = [
    "DistributedSGD",
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
