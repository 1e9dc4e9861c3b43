"""Waiting on remote work with a deadline, naming whoever is late.

One implementation for the driver (waiting on workers and PS actors) and for
the Ray Train exchange (a worker waiting on PS actors). While a wait is
pending, a stall report naming the late owners is logged every `stall_s`
seconds; at the deadline `StepTimeoutError` names them and carries them in
its `late` attribute (the driver kills and replaces hung actors from it).
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


def await_all(refs: Sequence, owners: Sequence, what: str, timeout_s: float, *,
              name_of: Callable = str, stall_s: float | None = None) -> None:
    """Block until every ObjectRef (or streaming generator) in `refs` is ready;
    `owners[k]` is who produces `refs[k]`. Raises StepTimeoutError after
    `timeout_s` seconds naming the owners still pending (`error.late`: those
    owners, each once). Does not fetch anything: errors surface at `ray.get`."""
    import ray

    pending = list(refs)
    start = time.monotonic()
    while pending:
        left = timeout_s - (time.monotonic() - start)
        if left <= 0:
            late = _unique([owners[_index(refs, r)] for r in pending])
            raise StepTimeoutError(
                f"{what}: no answer after {timeout_s:.1f} s from "
                f"{', '.join(sorted(name_of(o) for o in late))}. "
                f"Cluster resources available now: {ray.available_resources()}", late)
        _, pending = ray.wait(pending, num_returns=len(pending),
                              timeout=min(left, stall_s or left))
        waited = time.monotonic() - start
        if pending and waited < timeout_s:
            late = _unique([owners[_index(refs, r)] for r in pending])
            logger.warning("stall: %s: %s ha%s not answered after %.0f s (%d answered); "
                           "StepTimeoutError after %.0f s", what,
                           ", ".join(sorted(name_of(o) for o in late)),
                           "s" if len(late) == 1 else "ve", waited, len(refs) - len(pending),
                           timeout_s)


def get_all(refs: Sequence, owners: Sequence, what: str, timeout_s: float, *,
            name_of: Callable = str, stall_s: float | None = None) -> list:
    """`await_all`, then `ray.get` of every ref (remote errors propagate)."""
    import ray

    await_all(refs, owners, what, timeout_s, name_of=name_of, stall_s=stall_s)
    return ray.get(list(refs), timeout=max(1.0, timeout_s))


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
