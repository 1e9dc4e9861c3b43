"""Progress bars for long loops: tqdm on stderr, drawn only on a terminal."""

from __future__ import annotations

import sys


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
