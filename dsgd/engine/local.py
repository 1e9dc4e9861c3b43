"""Local mode (`DistributedSGD(..., local=True)`, `Trainer(..., local=True)`):
the one worker runs in the driver's own process.

The driver talks to its workers through actor handles (`handle.method.remote(...)`
returning ObjectRefs). `LocalActorClass` stands in for `ray.remote(Worker)`:
its "actor" is a plain `Worker` object in this process, and a method call runs
at once, synchronously, in the calling thread; its result is put in the
object store and the ObjectRef returned, so every driver path (waits, results,
checkpoints, data feeds) is the same as with an actor. An exception raised by
the method propagates from `.remote()` itself, with the user's traceback, and
a debugger stops where the user's code runs. Top-level ObjectRef arguments are
resolved, as Ray does for actor calls. The worker's steps run eagerly (not
compiled), so that tensors hold values in a debugger.
"""

from __future__ import annotations

from typing import Any

from dsgd.comm.waits import fetch


class LocalActorClass:
    """`ray.remote(cls)` for local mode: `.options(...).remote(*args)` builds
    `cls(*args)` here and returns a `LocalActor`."""

    def __init__(self, cls: type):
        self.cls = cls

    def options(self, **_ignored) -> LocalActorClass:
        return self

    def remote(self, *args, **kwargs) -> LocalActor:
        instance = self.cls(*_resolved(args), **_resolved_kwargs(kwargs))
        replicas = getattr(instance, "replicas", None)
        if replicas is not None:
            replicas.use_eager()
        return LocalActor(instance)


class LocalActor:
    """An in-process stand-in for an actor handle: `handle.method.remote(...)`."""

    def __init__(self, instance: Any):
        self._instance = instance

    def __getattr__(self, name: str) -> LocalMethod:
        return LocalMethod(getattr(self._instance, name))

    def __repr__(self) -> str:
        return f"LocalActor({type(self._instance).__name__})"


class LocalMethod:
    def __init__(self, method):
        self._method = method

    def options(self, **_ignored) -> LocalMethod:
        return self

    def remote(self, *args, **kwargs):
        """Run the method now; its result as an ObjectRef. Raises what it raises."""
        import ray

        return ray.put(self._method(*_resolved(args), **_resolved_kwargs(kwargs)))


def _resolved(args: tuple) -> list:
    import ray

    refs = [i for i, a in enumerate(args) if isinstance(a, ray.ObjectRef)]
    out = list(args)
    for i, value in zip(refs, fetch([args[i] for i in refs], "the call's arguments")
                        if refs else []):
        out[i] = value
    return out


def _resolved_kwargs(kwargs: dict) -> dict:
    import ray

    return {k: fetch(v, f"the call's argument {k}") if isinstance(v, ray.ObjectRef) else v
            for k, v in kwargs.items()}
