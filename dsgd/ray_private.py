"""Every private Ray API dsgd calls, in one place.

Ray 2.60 has no public equivalent for these three questions: what each node has
free right now (`ray.available_resources()` sums over the cluster, `ray.nodes()`
and `ray.util.state.list_nodes()` give totals only), how much of the object
store is in use (what `ray memory --stats-only` prints), and whether Ray Train
v2 is on (which DataParallelTrainer `dsgd.train.DsgdTrainer` must extend).
Everything else dsgd asks Ray goes through public APIs.

Private APIs change without notice between Ray releases. Each call here is
wrapped so that a Ray upgrade that moves or changes one fails loudly, with a
`DsgdError` naming the call and the Ray version, never a silent wrong answer;
tests/test_ray_private.py calls each one on a live cluster.
"""

from __future__ import annotations

from typing import Callable

from dsgd.errors import DsgdError

TESTED_RAY = "2.60"


def _broken(call: str, error: BaseException) -> DsgdError:
    import ray

    return DsgdError(f"Ray's private API {call} failed or changed under Ray {ray.__version__} "
                     f"(dsgd was tested with Ray {TESTED_RAY}): {type(error).__name__}: {error}")


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """{node id: {resource: amount free now}} of every alive node. Blocks for
    one GCS call."""
    call = "ray._private.state.available_resources_per_node()"
    try:
        from ray._private.state import available_resources_per_node as private_call

        result = private_call()
    except (ImportError, AttributeError, TypeError) as e:
        raise _broken(call, e) from e
    return _checked(call, result, lambda r: isinstance(r, dict) and all(
        isinstance(k, str) and isinstance(v, dict) for k, v in r.items()),
        "a dict of node id -> dict of resources")


def object_store_stats(timeout_s: float = 30.0) -> dict[str, int]:
    """{"bytes_used", "num_objects"} summed over the cluster's object stores
    (primary and secondary copies alike). Blocks for one RPC, at most `timeout_s`."""
    call = "ray._private.internal_api.get_memory_info_reply(...).store_stats"
    try:
        import ray
        from ray._private import internal_api

        state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)
        reply = internal_api.get_memory_info_reply(state, timeout_seconds=timeout_s)
        stats = {"bytes_used": int(reply.store_stats.object_store_bytes_used),
                 "num_objects": int(reply.store_stats.num_local_objects)}
    except (ImportError, AttributeError, TypeError) as e:
        raise _broken(call, e) from e
    return _checked(call, stats, lambda r: min(r.values()) >= 0, "non-negative counts")


def ray_train_v2_enabled() -> bool:
    """Ray Train v2 (the default since Ray 2.49) or v1 (RAY_TRAIN_V2_ENABLED=0)."""
    call = "ray.train.v2._internal.constants.is_v2_enabled()"
    try:
        from ray.train.v2._internal.constants import is_v2_enabled

        result = is_v2_enabled()
    except (ImportError, AttributeError, TypeError) as e:
        raise _broken(call, e) from e
    return _checked(call, result, lambda r: isinstance(r, bool), "a bool")


def _checked(call: str, result, valid: Callable, expected: str):
    if not valid(result):
        raise _broken(call, TypeError(f"expected {expected}, got {result!r:.200}"))
    return result
