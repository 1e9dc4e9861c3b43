"""Waiting on remote work with a deadline, naming whoever is late.

Every remote wait of the package that blocks is a `Deadline`'s `wait`
(benchmarks/structure.py counts the others; the target is none):
- `Deadline`: one wait's name (`what`), its end, and its stall reports. Its
  `wait` blocks until refs are ready, at most until the next stall report or
  the end; a stall report names `what` and the owners still pending (or the
  wait's own `on_stall` says who is late); `expired` is the StepTimeoutError
  naming them. Loops that decide themselves what to do with each answer (a
  worker's PS exchange, the driver's backup step) call `wait` in their loop.
- `await_all` / `get_all` / `next_all`: a `Deadline` on every answer of a set
  of actors; at the end `StepTimeoutError` names the late owners and carries
  them in its `late` attribute (the driver kills and replaces hung actors from
  it).
- `ready`: which of some refs are ready now, without blocking.
- `fetch` / `outcomes`: the values of refs, with a deadline (`FETCH_S` for refs
  `ready` found ready; else the time a caller's `Deadline` has left); a timeout
  is a `StepTimeoutError` naming what was fetched.
- `Deadline.pause`: a poll of something that is not a ref (Ray's free
  resources), within the deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from dsgd.errors import StepTimeoutError

logger = logging.getLogger("dsgd")


def actor_died_errors() -> tuple:
    """Ray's errors that mean an actor (or the node under it) is gone."""
    from ray import exceptions as rx

    return tuple(getattr(rx, n) for n in ("RayActorError", "ObjectLostError", "OwnerDiedError",
                                          "WorkerCrashedError", "NodeDiedError") if hasattr(rx, n))


# A ref found ready is fetched within this (its object may be on another node).
FETCH_S = 10.0


def ready(refs: Sequence, *, fetch_local: bool = True) -> tuple[list, list]:
    """`(ready, pending)` of the ObjectRefs (or streaming generators) `refs`, in
    their order, now: never blocks (a wait that blocks is a `Deadline`'s).
    Fetches nothing (`fetch_local=False`: not even into this node's store) and
    raises nothing."""
    import ray

    refs = list(refs)
    if not refs:
        return [], []
    return ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=fetch_local)


class Deadline:
    """One remote wait, named: `what` is waited for, for at most `timeout_s`
    seconds from now (or from `start`, a `time.monotonic()` value).

    `wait` is the one way the package blocks on refs. While refs are pending,
    a stall report is logged every `stall_s` seconds (None: never) naming `what`
    and the owners still pending (`name_of` names an owner), or `on_stall(pending,
    waited_s)` is called instead when given (a wait that knows better who is
    late: the PS actors say which workers an exchange misses). `expired` is the
    StepTimeoutError to raise at the end, naming the late."""

    def __init__(self, what: str, timeout_s: float, *, stall_s: float | None = None,
                 name_of: Callable = str, on_stall: Callable | None = None,
                 start: float | None = None):
        self.what = what
        self.timeout_s = float(timeout_s)
        self.stall_s = stall_s
        self.name_of = name_of
        self.on_stall = on_stall
        self.start = time.monotonic() if start is None else start
        self._reported = self.start

    def waited(self) -> float:
        """Seconds since the wait began."""
        return time.monotonic() - self.start

    def left(self) -> float:
        """Seconds until the end (0 once it has passed)."""
        return max(0.0, self.timeout_s - self.waited())

    def over(self) -> bool:
        """Whether the end has passed (within a millisecond)."""
        return self.left() <= 0.001

    def wait(self, refs: Sequence, *, num_returns: int | None = None,
             owners: Sequence | None = None, slice_s: float | None = None,
             fetch_local: bool = True) -> tuple[list, list]:
        """`(ready, pending)` of `refs`, in their order, once `num_returns` of
        them (default: all) are ready, or after at most `slice_s` seconds (a loop
        that polls something else too), the time to the next stall report or the
        end, whichever comes first. `owners[k]` produces `refs[k]` (named in the
        stall report; default: the refs are counted, not named). Fetches nothing
        and raises nothing: the caller raises `expired()` when `over()`."""
        import ray

        refs = list(refs)
        if not refs:
            return [], []
        now = time.monotonic()
        timeout = self.left()
        if slice_s is not None:
            timeout = min(timeout, slice_s)
        if self.stall_s:
            timeout = min(timeout, max(0.0, self._reported + self.stall_s - now))
        done, pending = ray.wait(refs, num_returns=len(refs) if num_returns is None
                                 else min(num_returns, len(refs)),
                                 timeout=timeout, fetch_local=fetch_local)
        now = time.monotonic()
        if pending and self.stall_s and now - self._reported >= self.stall_s \
                and not self.over():
            self._reported = now
            if self.on_stall is not None:
                self.on_stall(pending, now - self.start)
            else:
                self._log_stall(refs, pending, owners)
        return done, pending

    def _log_stall(self, refs: list, pending: list, owners: Sequence | None) -> None:
        if owners is None:
            who = f"{len(pending)} of {len(refs)} answers have"
        else:
            late = _unique([owners[_index(refs, r)] for r in pending])
            who = ", ".join(sorted(self.name_of(o) for o in late)) + \
                (" has" if len(late) == 1 else " have")
        logger.warning("stall: %s: %s not answered after %.0f s (%d answered); "
                       "StepTimeoutError after %.0f s", self.what, who, self.waited(),
                       len(refs) - len(pending), self.timeout_s)

    def pause(self, seconds: float) -> None:
        """Sleep `seconds`, or until the end if that comes first: a poll of
        something that is not a ref (Ray's free resources)."""
        time.sleep(min(seconds, self.left()))

    def expired(self, late: Sequence = (), detail: str = "") -> StepTimeoutError:
        """The StepTimeoutError of a wait that ended: `late` (owners) are named
        and carried in its `late` attribute; `detail` is said after."""
        late = _unique(list(late))
        names = f" from {', '.join(sorted(self.name_of(o) for o in late))}" if late else ""
        return StepTimeoutError(f"{self.what}: no answer after {self.timeout_s:.1f} s"
                                f"{names}{detail}", late)


def fetch(refs, what: str, timeout_s: float = FETCH_S):
    """`ray.get` of one ObjectRef or a list of them within `timeout_s` seconds;
    remote errors propagate as `ray.get` raises them, and a timeout is a
    `StepTimeoutError` naming `what` (with no `late` actors: it is raised, not
    recovered from). The values are the store's (read-only arrays stay views of
    the object while they live)."""
    import ray

    try:
        return ray.get(refs, timeout=max(0.0, timeout_s))
    except ray.exceptions.GetTimeoutError:
        raise StepTimeoutError(f"{what}: no answer after {timeout_s:.1f} s") from None


def outcomes(refs: Sequence, what: str, timeout_s: float = FETCH_S) -> list:
    """`fetch` of each ref in `refs` alone: its value, or the exception it raised
    (a timeout included), in order, within `timeout_s` in all. For loops that
    sort answers from errors."""
    deadline = Deadline(what, timeout_s)
    out = []
    for ref in refs:
        try:
            out.append(fetch(ref, what, deadline.left()))
        except Exception as e:  # noqa: BLE001 - returned, for the caller to sort
            out.append(e)
    return out


def await_all(refs: Sequence, owners: Sequence, what: str, timeout_s: float, *,
              name_of: Callable = str, stall_s: float | None = None,
              answers: dict | None = None) -> None:
    """Block until every ObjectRef (or streaming generator) in `refs` is ready;
    `owners[k]` is who produces `refs[k]`. Raises StepTimeoutError after
    `timeout_s` seconds naming the owners still pending (`error.late`: those
    owners, each once). Does not fetch anything (errors surface at `ray.get`),
    unless `answers` is given: then each ObjectRef that is ready while others
    are still pending is fetched into `answers` (ref -> value or the error),
    and a worker's own StepTimeoutError naming the peers it waited for in an
    exchange (`late_workers`: positions in `owners`) ends the wait at once,
    naming them, rather than when the others' calls time out."""
    import ray

    deadline = Deadline(what, timeout_s, stall_s=stall_s, name_of=name_of)
    pending = list(refs)
    while pending:
        if answers is not None and len(pending) < len(refs):
            _peek(refs, owners, pending, answers, what, name_of)
        if deadline.over():
            raise deadline.expired([owners[_index(refs, r)] for r in pending],
                                   f". Cluster resources available now: "
                                   f"{ray.available_resources()}")
        _, pending = deadline.wait(pending, owners=[owners[_index(refs, r)] for r in pending])


def get_all(refs: Sequence, owners: Sequence, what: str, timeout_s: float, *,
            name_of: Callable = str, stall_s: float | None = None) -> list:
    """`await_all`, then `ray.get` of every ref (remote errors propagate). A
    worker whose exchange timed out naming late peers ends the wait early
    (`await_all`'s `answers`)."""
    import ray

    answers: dict = {}
    await_all(refs, owners, what, timeout_s, name_of=name_of, stall_s=stall_s, answers=answers)
    rest = [r for r in refs if r.hex() not in answers]
    fetched = dict(zip([r.hex() for r in rest],
                       ray.get(rest, timeout=max(1.0, timeout_s)) if rest else []))
    for ref in refs:  # the first error, in order, as ray.get of the list would raise it
        if ref.hex() in answers and isinstance(answers[ref.hex()], _Failed):
            raise answers[ref.hex()].error
    return [answers[r.hex()] if r.hex() in answers else fetched[r.hex()] for r in refs]


class _Failed:
    """An answer that was an error (kept to raise in order)."""

    def __init__(self, error: BaseException):
        self.error = error


def _peek(refs: Sequence, owners: Sequence, pending: list, answers: dict, what: str,
          name_of: Callable) -> None:
    """Fetch the answers that are in while others are pending; a StepTimeoutError
    from one naming its late peers (positions in `owners`) is raised at once."""
    import ray

    waiting = {r.hex() for r in pending}
    for k, ref in enumerate(refs):
        if not isinstance(ref, ray.ObjectRef) or ref.hex() in waiting or ref.hex() in answers:
            continue
        try:
            answers[ref.hex()] = ray.get(ref, timeout=0)
        except Exception as e:  # noqa: BLE001 - kept, raised by get_all in order
            answers[ref.hex()] = _Failed(e)
            cause = getattr(e, "cause", e)
            ranks = getattr(cause, "late_workers", None)
            if isinstance(cause, StepTimeoutError) and ranks:
                late = _unique([owners[r] for r in ranks if 0 <= r < len(owners)
                                and refs[r].hex() in waiting])
                if late:
                    raise StepTimeoutError(
                        f"{what}: {name_of(owners[k])} waited for "
                        f"{', '.join(sorted(name_of(o) for o in late))} in an exchange "
                        f"({str(cause).splitlines()[0]})", late) from None


def next_all(streams: Sequence, owners: Sequence, what: str, timeout_s: float, *,
             name_of: Callable = str, stall_s: float | None = None) -> list:
    """The next ObjectRef of each streaming generator, within `timeout_s`."""
    await_all(streams, owners, what, timeout_s, name_of=name_of, stall_s=stall_s)
    refs = []
    for stream, owner in zip(streams, owners):
        try:
            refs.append(next(stream))
        except StopIteration:
            # A stream cut short: the actor was killed while writing it (Ray ends the
            # generator instead of raising). Reported as a death, for the recovery.
            from ray.exceptions import ActorDiedError

            error = ActorDiedError()
            error.add_note(f"{what}: {name_of(owner)} ended its shard stream early")
            raise error from None
    return refs


def dead_owners(refs: Sequence, owners: Sequence) -> list:
    """The owners whose refs failed because their actor died (after a `ray.get`
    of them raised), each once."""
    import ray

    dead = []
    for ref, owner in zip(refs, owners):
        try:
            ray.get(ref, timeout=0.1)
        except actor_died_errors():
            dead.append(owner)
        except Exception:  # noqa: BLE001 - only the dead ones are named
            pass
    return _unique(dead)


def _index(refs: Sequence, ref) -> int:
    return list(refs).index(ref)  # ObjectRefs compare by object id


def _unique(owners: list) -> list:
    """Each owner once, in order (actor handles by identity, indices by value)."""
    return list({o if isinstance(o, (int, str)) else id(o): o for o in owners}.values())
