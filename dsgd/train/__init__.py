"""dsgd as a Ray Train backend, and Horovod's TF2 API on it: a training loop
runs in Ray Train's workers and exchanges through dsgd's sharded PS actors
(docs/raytrain.md).

    from dsgd.train import DsgdTrainer, DsgdConfig   # the Ray Train trainer
    import dsgd.train as hvd                         # in the loop or script: Horovod's names
    python -m dsgd.train.run -np 2 train.py          # horovodrun's place
"""

from dsgd.train.collectives import (Adasum, Average, Compression, Max, Min, Product, Sum,
                                    allgather, allgather_object, allreduce, broadcast,
                                    broadcast_object, broadcast_object_fn, broadcast_variables,
                                    cross_rank, cross_size, global_process_set, grouped_allgather,
                                    grouped_allreduce, init, is_homogeneous, is_initialized,
                                    local_rank, local_size, rank, shutdown, size)
from dsgd.train.introspection import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                      mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                                      rocm_built)
from dsgd.train.config import DsgdBackend, DsgdConfig
from dsgd.train.tape import DistributedGradientTape, DistributedOptimizer
from dsgd.train.trainer import DsgdTrainer

__all__ = ["DsgdTrainer", "DsgdConfig", "DsgdBackend", "DistributedGradientTape",
           "DistributedOptimizer", "broadcast_variables", "init", "is_initialized", "shutdown",
           "size", "rank", "local_rank", "local_size", "cross_rank", "cross_size",
           "is_homogeneous", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather",
           "broadcast", "broadcast_object", "broadcast_object_fn", "allgather_object", "Average",
           "Sum", "Min", "Max", "Product", "Adasum", "Compression", "global_process_set",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
           "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "callbacks"]

# Horovod names a port may use that dsgd does not provide: an AttributeError that says so
# (docs/raytrain.md, "Not provided") instead of a bare "no attribute".
_NOT_PROVIDED = {
    "alltoall": "", "reducescatter": "", "grouped_reducescatter": "", "join": "",
    "barrier": "", "elastic": "", "ProcessSet": " (dsgd has no process sets)",
    "add_process_set": " (dsgd has no process sets)",
    "remove_process_set": " (dsgd has no process sets)",
    "PartialDistributedGradientTape": " (every gradient a wrapper returns is averaged)",
    "PartialDistributedOptimizer": " (every gradient a wrapper returns is averaged)",
    "start_timeline": "", "stop_timeline": "",
    "load_model": " (keras.models.load_model(path, compile=False), then compile with "
                  "DistributedOptimizer)",
    "broadcast_global_variables": " (TF1 sessions; use broadcast_variables or "
                                  "callbacks.BroadcastGlobalVariablesCallback)",
    "BroadcastGlobalVariablesHook": " (a TF1 session hook; use broadcast_variables or "
                                    "callbacks.BroadcastGlobalVariablesCallback)",
    "broadcast_": " (in-place broadcast of one variable; use broadcast_variables([v], root_rank))",
    "SyncBatchNormalization": " (statistics synchronised across ranks; use "
                              "keras.layers.BatchNormalization: each rank normalises over its "
                              "own batch)",
    "size_op": " (use size(): a Python int, a constant inside tf.function)",
    "local_size_op": " (use local_size(): a Python int, a constant inside tf.function)",
    "rank_op": " (use rank(): a Python int, a constant inside tf.function)",
    "local_rank_op": " (use local_rank(): a Python int, a constant inside tf.function)",
    "process_set_included_op": " (dsgd has no process sets: every rank takes part)",
    "gpu_available": " (use tf.config.list_physical_devices('GPU'))",
    "LocalGradientAggregationHelper": " (backward_passes_per_step: see DistributedOptimizer)",
}


def __getattr__(name):
    if name == "callbacks":  # imports Keras: loaded on first use
        import importlib

        return importlib.import_module("dsgd.train.callbacks")
    if name in _NOT_PROVIDED:
        raise AttributeError(f"dsgd.train does not provide Horovod's {name}{_NOT_PROVIDED[name]}: "
                             "see docs/raytrain.md, 'Not provided'")
    raise AttributeError(f"module 'dsgd.train' has no attribute {name!r}")
