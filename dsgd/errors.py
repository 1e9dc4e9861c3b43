"""Exceptions raised by dsgd. All derive from DsgdError."""


class DsgdError(RuntimeError):
    """Base class of dsgd's own errors. Raised as itself for a run that cannot go
    on: failures beyond `max_failures`, a dead worker that cannot be replaced
    (without `elastic`), a call on a `DistributedSGD` after `shutdown()`, a
    dead PS actor under `dsgd.train`."""


class StepTimeoutError(DsgdError, TimeoutError):
    """A remote call did not answer in time (`step_timeout_s`,
    `start_timeout_s`, `DsgdConfig.timeout_s`); the message names who and
    what. Also a `TimeoutError`.

    Attributes:
        late: the actor handles that did not answer (empty when the wait was
            not on actors, or after the error was pickled), which the driver
            kills and replaces with `replace_hung`.
        late_workers: raised in a worker: the worker positions that did not
            arrive.
        late_ps: raised in a worker: the PS indices that did not answer.
    """

    def __init__(self, message: str, late=(), late_workers=(), late_ps=()):
        super().__init__(message)
        self.late = list(late)
        # Raised in a worker (a custom epoch's exchange): who did not arrive, by
        # worker position and PS index; the driver turns them into `late`.
        self.late_workers, self.late_ps = list(late_workers), list(late_ps)

    def __reduce__(self):  # handles do not travel with the error; indices do
        return type(self), (str(self), (), self.late_workers, self.late_ps)


class ResourceError(DsgdError, ValueError):
    """The cluster cannot hold the requested workers (or its object store cannot
    hold a step); says what was asked and what exists. Also a `ValueError`."""


class ModelMismatchError(DsgdError, ValueError):
    """Replicas (or a checkpoint) disagree on variable count, shape or dtype;
    names the first difference. Also a `ValueError`."""


class CheckpointError(DsgdError, ValueError):
    """A checkpoint is truncated, corrupt or missing a file; the message names
    the file. Nothing was changed. Also a `ValueError`."""


class NonFiniteError(DsgdError, FloatingPointError):
    """A gradient had NaN or Inf (`on_nonfinite="raise"`); names the step,
    worker and replica, and says whether the update was applied: with several
    workers no weight changed; with one worker the check runs alongside the
    update, which was applied. Also a `FloatingPointError`."""


class ExchangeAbandoned(DsgdError):
    """(internal) A PS ended an exchange of an attempt the driver abandoned after a
    failure elsewhere (a dead or hung peer): the worker stops its steps, nothing
    of that step applied, and the step is retried in a new attempt."""


def picklable_error(error: Exception) -> Exception:
    """`error` if it survives pickling, else a DsgdError carrying its traceback
    (the steps reported with it must reach the driver either way)."""
    import pickle
    import traceback

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to round-trip
        text = "".join(traceback.format_exception(error))
        return DsgdError(f"{type(error).__name__}: {error}\n{text}")
