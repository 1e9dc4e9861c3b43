"""Exceptions raised by dsgd. All derive from DsgdError."""


class DsgdError(RuntimeError):
    """Base class of dsgd's own errors."""


class StepTimeoutError(DsgdError, TimeoutError):
    """A remote call did not answer in time; the message names who and what.
    `late` holds the actor handles that did not answer (empty when the wait
    was not on actors), which the driver kills and replaces with replace_hung."""

    def __init__(self, message: str, late=(), late_workers=(), late_ps=()):
        super().__init__(message)
        self.late = list(late)
        # Raised in a worker (a custom epoch's exchange): who did not arrive, by
        # worker position and PS index; the driver turns them into `late`.
        self.late_workers, self.late_ps = list(late_workers), list(late_ps)

    def __reduce__(self):  # handles do not travel with the error; indices do
        return type(self), (str(self), (), self.late_workers, self.late_ps)


class ResourceError(DsgdError, ValueError):
    """The cluster cannot hold the requested workers; says what was asked and what exists."""


class ModelMismatchError(DsgdError, ValueError):
    """Replicas (or a checkpoint) disagree on variable count, shape or dtype."""


class CheckpointError(DsgdError, ValueError):
    """A checkpoint is truncated or corrupt; the message names the file. Nothing was changed."""


class NonFiniteError(DsgdError, FloatingPointError):
    """A gradient had NaN or Inf; names the step, worker and replica, and says
    whether the update was applied: with several workers no weight changed;
    with one worker the check runs alongside the update, which was applied."""
