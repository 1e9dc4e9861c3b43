"""The Trainer's pieces that travel to its workers (pickled) or run there, and
the checks of its config that the driver makes before any actor starts."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dsgd.trainer.operator import BATCH_SIZE, TrainingOperator
from dsgd.trainer.replica import OperatorReplica

OWN = "own"  # data read by each replica itself (tf.data)


class ReplicaCreator:
    """model_creator of the Trainer's DistributedSGD (pickled to the workers)."""

    def __init__(self, operator_cls, config, devices_per_worker, world_size, gpu, loss_scaling,
                 step_freq):
        self.operator_cls, self.config = operator_cls, config
        self.devices_per_worker, self.world_size = devices_per_worker, world_size
        self.gpu, self.loss_scaling, self.step_freq = gpu, loss_scaling, step_freq

    def __call__(self, worker_index: int, device_index: int) -> OperatorReplica:
        device = f"/device:{'GPU' if self.gpu else 'CPU'}:{device_index}"
        rank = worker_index * self.devices_per_worker + device_index
        return OperatorReplica(self.operator_cls, dict(self.config), rank, self.world_size, device,
                               self.loss_scaling, self.step_freq)


class WorkerInit:
    """worker_init of the Trainer's DistributedSGD: the user's hook, then the
    Keras precision policy (per process, before any model is built)."""

    def __init__(self, hook: Callable | None, precision: str | None):
        self.hook, self.precision = hook, precision

    def __call__(self) -> None:
        if self.hook is not None:
            self.hook()
        if self.precision is not None:
            import keras

            keras.mixed_precision.set_global_policy(self.precision)


def start_epoch(worker, epoch: int, info: dict | None) -> None:
    """(worker side) Every replica starts `epoch`; the compiled step is traced again
    where train()'s info changed."""
    if any([m.start_epoch(epoch, info) for m in worker.models()]):
        worker.replicas.retrace()


def set_info(worker, info: dict | None) -> None:
    """(worker side) train()'s info for a replacement worker (retraced if it changed)."""
    if any([m.set_info(info) for m in worker.models()]):
        worker.replicas.retrace()


def custom_methods(replica: OperatorReplica) -> tuple[bool, bool]:
    """(worker side) Whether the operator overrides train_epoch / validate."""
    cls = type(replica.operator)
    return (cls.train_epoch is not TrainingOperator.train_epoch,
            cls.validate is not TrainingOperator.validate)


def full_state(worker, first: bool):
    """(worker side) The worker's state (Worker.get_full_state) if `first`, else None."""
    return worker.get_full_state() if first else None


def registered_data(replica: OperatorReplica) -> tuple:
    """(worker side) What the operator registered, as the driver can use it."""
    import tensorflow as tf

    def driver_side(data):
        return OWN if isinstance(data, tf.data.Dataset) else data

    return (driver_side(replica.operator._train_data),
            driver_side(replica.operator._validation_data))


def replica_config(config: dict, num_workers: int, devices_per_worker: int) -> dict:
    replica_config = dict(config)
    if BATCH_SIZE in config:
        batch, replicas = config[BATCH_SIZE], num_workers * devices_per_worker
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ValueError(f"config[dsgd.BATCH_SIZE] must be a positive int, got {batch!r}")
        if batch % replicas:
            raise ValueError(f"config[dsgd.BATCH_SIZE]={batch} (the global batch) does not divide "
                             f"among {num_workers} worker(s) x {devices_per_worker} device(s) = "
                             f"{replicas} replicas; use a multiple of {replicas}")
        replica_config[BATCH_SIZE] = batch // replicas
    return replica_config


def sum_states(per_worker: list) -> list:
    if not per_worker or not per_worker[0]:
        return []
    return [[sum(w[m][v] for w in per_worker) for v in range(len(per_worker[0][m]))]
            for m in range(len(per_worker[0]))]
