"""dsgd as a Ray Train backend, and Horovod's TF2 API on it: a training loop
runs in Ray Train's workers and exchanges through dsgd's sharded PS actors
(docs/raytrain.md).

    from dsgd.train import DsgdTrainer, DsgdConfig   # the Ray Train trainer
    import dsgd.train as hvd                         # in the loop or script: Horovod's names
    python -m dsgd.train.run -np 2 train.py          # horovodrun's place
"""

from dsgd.train.collectives import (Adasum, Average, Compression, Sum, allgather,
                                    allgather_object, allreduce, broadcast, broadcast_object,
                                    broadcast_variables, cross_rank, cross_size, grouped_allreduce,
                                    init, is_homogeneous, is_initialized, local_rank, local_size,
                                    rank, shutdown, size)
from dsgd.train.config import DsgdBackend, DsgdConfig
from dsgd.train.tape import DistributedGradientTape, DistributedOptimizer
from dsgd.train.trainer import DsgdTrainer

__all__ = ["DsgdTrainer", "DsgdConfig", "DsgdBackend", "DistributedGradientTape",
           "DistributedOptimizer", "broadcast_variables", "init", "is_initialized", "shutdown",
           "size", "rank", "local_rank", "local_size", "cross_rank", "cross_size",
           "is_homogeneous", "allreduce", "grouped_allreduce", "allgather", "broadcast",
           "broadcast_object", "allgather_object", "Average", "Sum", "Adasum", "Compression",
           "callbacks"]


def __getattr__(name):
    if name == "callbacks":  # imports Keras: loaded on first use
        import importlib

        return importlib.import_module("dsgd.train.callbacks")
    raise AttributeError(f"module 'dsgd.train' has no attribute {name!r}")
