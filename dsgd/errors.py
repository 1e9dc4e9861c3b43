"""Exceptions raised by dsgd. All derive from DsgdError."""


class DsgdError(RuntimeError):
    """Base class of dsgd's own errors."""


class StepTimeoutError(DsgdError, TimeoutError):
    """A remote call did not answer in time; the message names who and what."""


class ResourceError(DsgdError, ValueError):
    """The cluster cannot hold the requested workers; says what was asked and what exists."""


class ModelMismatchError(DsgdError, ValueError):
    """Replicas (or a checkpoint) disagree on variable count, shape or dtype."""
