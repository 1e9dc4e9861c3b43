"""One local Ray cluster for the whole session; multi-node tests run last on their own.

Test helper modules are pickled by value so that Ray's worker processes, which
cannot import `tests/`, receive them with the model_creator.
"""

import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # inherited by Ray's worker processes
sys.path.insert(0, os.path.dirname(__file__))

import counting  # noqa: E402
import helpers  # noqa: E402
import raytrain_loops  # noqa: E402
import tiny  # noqa: E402
import trainer_ops  # noqa: E402
from ray import cloudpickle  # noqa: E402

for _helper in (tiny, counting, helpers, trainer_ops, raytrain_loops):
    cloudpickle.register_pickle_by_value(_helper)


def split_driver_cpu(num_devices: int = 2) -> None:
    """Give this (the pytest) process `num_devices` logical CPU devices, as a
    worker with devices_per_worker=2 has, so that replicas can be built in-process
    (tests without a cluster). Must run before TensorFlow initialises its devices."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)])


split_driver_cpu()

# 4 logical CPUs on a 2-core machine: 2 workers (1 CPU each) plus room; PS actors take none.
LOCAL_CPUS = 4
OBJECT_STORE_BYTES = 256 * 2**20


def start_local_ray():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=LOCAL_CPUS, object_store_memory=OBJECT_STORE_BYTES,
                 include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="session")
def ray_local():
    """The shared single-node cluster (started on first use)."""
    start_local_ray()
    yield


def pytest_collection_modifyitems(config, items):
    # Test modules define models too; Ray's workers cannot import them by name.
    for module in {item.module for item in items if getattr(item, "module", None)}:
        cloudpickle.register_pickle_by_value(module)
    # The multi-node module shuts the shared cluster down; run it after everything else.
    items.sort(key=lambda item: item.get_closest_marker("multinode") is not None)


# -- what the run cost: worker and PS actors started, per test file ---------------------------
# Starting a worker (a process that imports TensorFlow and traces its step) is most of a
# test's time on 2 cores; this count is the suite's budget that noise does not move.
_STARTED: dict[str, list[int]] = {}


def _count_starts():
    from dsgd.engine.actors import ActorSet

    def counted(method, index):
        def start(self, slots_or_missing, *args, **kwargs):
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[0]
            _STARTED.setdefault(test, [0, 0])[index] += len(slots_or_missing)
            return method(self, slots_or_missing, *args, **kwargs)
        return start

    ActorSet.start_workers = counted(ActorSet.start_workers, 0)
    ActorSet.start_ps = counted(ActorSet.start_ps, 1)


_count_starts()


# Under pytest-xdist (the default: two test processes, pyproject.toml's addopts) each worker
# process counts its own starts and hands them to the controller, which reports the sum.
def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["dsgd_started"] = dict(_STARTED)


def pytest_testnodedown(node, error):
    for test, (workers, ps) in getattr(node, "workeroutput", {}).get("dsgd_started", {}).items():
        counts = _STARTED.setdefault(test, [0, 0])
        counts[0] += workers
        counts[1] += ps


def pytest_terminal_summary(terminalreporter):
    if not _STARTED:
        return
    rows = sorted(_STARTED.items(), key=lambda kv: -kv[1][0])
    terminalreporter.write_sep("-", "dsgd actors started (workers, PS) per test file")
    for test, (workers, ps) in rows:
        terminalreporter.write_line(f"{workers:5d} {ps:5d}  {test}")
    workers, ps = (sum(c[i] for c in _STARTED.values()) for i in (0, 1))
    terminalreporter.write_line(f"{workers:5d} {ps:5d}  in all")
