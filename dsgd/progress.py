"""What dsgd shows on the terminal: progress bars for long loops (tqdm on
stderr, drawn only on a terminal) and its own log lines (the "dsgd" logger)."""

from __future__ import annotations

import logging
import sys

LOGGER = "dsgd"
# The "dsgd" logger's level while nobody set one: INFO passes, and a distinct number
# tells it from a level the program set itself (which then rules alone).
_DEFAULT_LEVEL = logging.INFO - 1


def bar(total: int | None, desc: str, unit: str = "step", **kwargs):
    """A `tqdm.tqdm` over `total` units (None: unknown), drawn on stderr when it
    is a terminal and silent otherwise (logs and CI stay clean; `bar.write(...)`
    still prints, above the bar). Use as a context manager, `update(n)` per
    unit done and `set_postfix(...)` for live numbers such as the loss."""
    from tqdm.auto import tqdm

    kwargs.setdefault("disable", None)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, **kwargs)


def write(message: str) -> None:
    """A line on stderr that does not break a bar being drawn."""
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)


class _UntilConfigured(logging.StreamHandler):
    """dsgd's INFO lines on stderr as `dsgd: ...` (Ray shows its own the same way)
    while the program has configured no logging (the root logger has no
    handler). Once it has, this handler is silent and dsgd's records reach the
    program's handlers by propagation, at the root logger's level."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("dsgd: %(message)s"))

    def emit(self, record):
        if not logging.getLogger().handlers:
            super().emit(record)


def _follows_root(record: logging.LogRecord) -> bool:
    """While the program has set no level on the "dsgd" logger, a record below
    WARNING passes if logging is unconfigured or the root logger's level lets it
    through."""
    root = logging.getLogger()
    return logging.getLogger(LOGGER).level != _DEFAULT_LEVEL \
        or record.levelno >= logging.WARNING or not root.handlers \
        or record.levelno >= root.getEffectiveLevel()


def show_log_lines() -> None:
    """Give the "dsgd" logger its default output (INFO and above, see
    `_UntilConfigured`) unless the program set it up itself. Idempotent."""
    logger = logging.getLogger(LOGGER)
    if logger.handlers or logger.level != logging.NOTSET:
        return
    logger.setLevel(_DEFAULT_LEVEL)
    logger.addFilter(_follows_root)
    logger.addHandler(_UntilConfigured())
