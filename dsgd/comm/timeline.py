"""A timeline of the exchange that users can open: a Chrome trace
(`DistributedSGD(..., timeline="trace.json")`, or the `DSGD_TIMELINE`
environment variable, as Horovod's `HOROVOD_TIMELINE`).

Each process of a run (the driver, every worker, every PS actor) keeps its own
`Recorder` of "complete" events (name, start, duration; Chrome's trace event
format, microseconds of wall-clock time, so that the processes of one machine,
or of NTP-synchronised nodes, line up). The driver collects the workers' and
PS actors' events after each `train()`/`step()` call and rewrites the file
(`write`): open it in https://ui.perfetto.dev or chrome://tracing. One row per
process, named ("driver", "worker 0", "PS 1", ...), and within a worker one
row per kind of work:

- worker, "step": `data` (its batches), `compute` (forward, backward and the
  mean over its replicas, one compiled call; `forward` and `backward` inside
  it, split where the loss exists: Replicas.mark_forward), `exchange` (from the first group
  sent to the last mean read), `apply`; "send": each group's `put + send`;
- PS, "sum": each group's sum over the workers (`sum group`), with the step's
  exchange number;
- driver, "calls": each call of steps it started and read back; under
  strategy "simple" "relay": each group's mean, made once every worker wrote
  it, whose writes are the workers' `write group g` on their "send" row.

Off by default. When off, `recorder()` is `OFF`, whose methods do nothing:
the cost is one attribute test per recorded span.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

ENV = "DSGD_TIMELINE"  # a path: the engine's default for `timeline`


class Recorder:
    """One process's events, in memory until `drain`. Thread-safe."""

    on = True

    def __init__(self, name: str):
        self.name, self.pid = name, os.getpid()
        # `time.perf_counter()` + `to_wall` = `time.time()`: one offset for every span
        # of this process, so that spans read from the two clocks nest as they ran
        # (an offset read per span is off by however long the process was
        # descheduled between its two clock reads: 112 µs seen on a loaded machine).
        self.to_wall = time.time() - time.perf_counter()
        self._events: list[dict] = []
        self._lock = threading.Lock()

    def add(self, name: str, row: str, start_s: float, end_s: float, **args) -> None:
        """An event `name` on row `row` of this process, from `start_s` to `end_s`
        (`time.time()` seconds); `args` are shown with it."""
        event = {"name": name, "ph": "X", "ts": round(start_s * 1e6, 1),
                 "dur": round(max(0.0, end_s - start_s) * 1e6, 1), "pid": self.pid, "tid": row}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    @contextlib.contextmanager
    def span(self, name: str, row: str, **args):
        """An event for the time the `with` block takes."""
        start = time.time()
        try:
            yield
        finally:
            self.add(name, row, start, time.time(), **args)

    def drain(self) -> list[dict]:
        """The events so far (and forgets them), after one naming this process."""
        with self._lock:
            events, self._events = self._events, []
        return [{"name": "process_name", "ph": "M", "pid": self.pid,
                 "args": {"name": self.name}}] + events


class _Off:
    """The recorder of a process that records nothing."""

    on = False
    to_wall = 0.0

    def add(self, *args, **kwargs) -> None:
        pass

    def span(self, *args, **kwargs):
        return contextlib.nullcontext()

    def drain(self) -> list[dict]:
        return []


OFF = _Off()
_current: Recorder | _Off = OFF


def recorder() -> Recorder | _Off:
    """This process's recorder (`OFF` unless `enable` was called)."""
    return _current


def enable(name: str, on: bool = True) -> None:
    """Record this process's events under `name` from now on (`on` False: stop,
    dropping what was not drained). Keeps the events so far if already on."""
    global _current
    if not on:
        _current = OFF
    elif not _current.on:
        _current = Recorder(name)
    else:
        _current.name = name


def path_from(timeline: str | None) -> str | None:
    """The trace file of a run: `timeline`, else the `DSGD_TIMELINE` variable, else None."""
    if timeline is None:
        timeline = os.environ.get(ENV) or None
    if timeline is not None and (not isinstance(timeline, (str, os.PathLike))
                                 or not str(timeline)):
        raise ValueError(f"timeline must be a file path (str) or None, got {timeline!r}")
    return None if timeline is None else os.fspath(timeline)


def write(path: str, events: list[dict]) -> None:
    """Write `events` as a Chrome trace (JSON object format) to `path`, atomically."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
