"""`DsgdTrainer`: Ray Train's DataParallelTrainer with dsgd's backend."""

from __future__ import annotations

from ray.train.data_parallel_trainer import DataParallelTrainer as _V1Trainer

from dsgd.ray_private import ray_train_v2_enabled
from dsgd.train.config import DsgdConfig

if ray_train_v2_enabled():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
else:  # Ray Train v1 (RAY_TRAIN_V2_ENABLED=0)
    DataParallelTrainer = _V1Trainer


class DsgdTrainer(DataParallelTrainer):
    """Run `train_loop_per_worker` on Ray Train's workers with dsgd's gradient
    exchange: inside it, use `ray.train` itself (`get_context`,
    `get_dataset_shard`, `report`) and `dsgd.train.DistributedGradientTape`,
    `DistributedOptimizer`, `broadcast_variables`. Ray Train owns the worker
    group, dataset sharding, checkpoints, failure restarts (dsgd's PS actors are
    started again with the group) and Tune; `fit()` returns its `Result`.

    Args:
        train_loop_per_worker (Callable): `fn()` or `fn(config)`, run in every
            Ray Train worker; it travels pickled.
        train_loop_config: the `config` passed to it.
        dsgd_config: a `dsgd.train.DsgdConfig` (default: one PS per worker).
        scaling_config (ray.train.ScalingConfig | None): as
            DataParallelTrainer's (one worker per rank).
        run_config (ray.train.RunConfig | None): as DataParallelTrainer's.
        datasets (dict | None): as DataParallelTrainer's.
        **kwargs (Any): DataParallelTrainer's other arguments.

    Raises:
        TypeError: `dsgd_config` is not a `DsgdConfig`.
    """

    def __init__(self, train_loop_per_worker, *, train_loop_config: dict | None = None,
                 dsgd_config: DsgdConfig | None = None, scaling_config=None, run_config=None,
                 datasets=None, **kwargs):
        if dsgd_config is not None and not isinstance(dsgd_config, DsgdConfig):
            raise TypeError(f"dsgd_config must be a dsgd.train.DsgdConfig, got {dsgd_config!r}")
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config,
                         backend_config=dsgd_config or DsgdConfig(), scaling_config=scaling_config,
                         run_config=run_config, datasets=datasets, **kwargs)
