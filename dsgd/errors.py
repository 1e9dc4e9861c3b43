"""Exceptions raised by dsgd. All derive from DsgdError."""


class DsgdError(RuntimeError):
    """Base class of dsgd's own errors."""


class StepTimeoutError(DsgdError, TimeoutError):
    """A remote call did not answer in time; the message names who and what."""


class ResourceError(DsgdError, ValueError):
    """The cluster cannot hold the requested workers; says what was asked and what exists."""


class ModelMismatchError(DsgdError, ValueError):
    """Replicas (or a checkpoint) disagree on variable count, shape or dtype."""


class CheckpointError(DsgdError, ValueError):
    """A checkpoint is truncated or corrupt; the message names the file. Nothing was changed."""


class NonFiniteError(DsgdError, FloatingPointError):
    """A gradient had NaN or Inf; names the step, worker and replica. Nothing was applied."""
