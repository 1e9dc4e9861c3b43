"""A dependency-free progress line for long loops (stderr)."""

from __future__ import annotations

import sys
import time


class Progress:
    """`update(i, **fields)` redraws `[#####.....] i/total  rate  fields` in place on
    a terminal, or prints a line every `every` updates when stderr is not one."""

    def __init__(self, total: int, every: int = 50, width: int = 30, stream=None):
        self.total, self.every, self.width = total, max(1, every), width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()

    def update(self, done: int, **fields) -> None:
        if not self.tty and done % self.every and done != self.total:
            return
        elapsed = time.perf_counter() - self.start
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        extra = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in fields.items())
        line = f"[{bar}] {done}/{self.total}  {done / max(elapsed, 1e-9):.1f} step/s  {extra}"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        if self.tty and done == self.total:
            self.stream.write("\n")
        self.stream.flush()

    def write(self, message: str) -> None:
        """A line that does not disturb the bar."""
        self.stream.write(("\n" if self.tty else "") + message + "\n")
        self.stream.flush()
