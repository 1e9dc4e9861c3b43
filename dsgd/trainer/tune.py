"""`Trainer.as_trainable`: a Trainer as a Ray Tune trainable.

A trial's resources are one placement group: bundle 0 for the trainable itself
(the Trainer's driver), then one bundle per worker. DistributedSGD places its
workers inside the current placement group (dsgd/engine/launch.py), so they never
escape the trial's resources; its PS actors take no CPU. Ray Data's tasks run
outside trial placement groups: leave CPUs for them.
"""

from __future__ import annotations

import os

CHECKPOINT_NAME = "trainer"


def trainable(trainer_cls, training_operator_cls, *, num_workers: int = 1,
              use_gpu: bool | None = None, devices_per_worker: int = 1,
              num_cpus_per_worker: float = 1, config: dict | None = None, **trainer_kwargs):
    """A `ray.tune.Trainable` class: the trial's config (merged over `config`)
    goes to the operator's setup; each training iteration is `train()` then
    `validate()` (if validation data is registered), reporting both results
    merged; Tune checkpoints go through `Trainer.save`/`load`."""
    from ray import tune

    base_config = dict(config or {})
    options = dict(trainer_kwargs, num_workers=num_workers, use_gpu=use_gpu,
                   devices_per_worker=devices_per_worker, num_cpus_per_worker=num_cpus_per_worker)

    class DsgdTrainable(tune.Trainable):
        @classmethod
        def default_resource_request(cls, config):
            import ray

            from dsgd.engine.resources import cluster_gpus_hold

            worker = {"CPU": num_cpus_per_worker}
            # None: GPUs when the cluster's could hold every worker, the engine's rule for
            # gpu=None (the trial's Trainer then finds them in its group).
            if use_gpu or (use_gpu is None and ray.is_initialized()
                           and cluster_gpus_hold(num_workers, devices_per_worker)):
                worker["GPU"] = devices_per_worker
            return tune.PlacementGroupFactory([{"CPU": 1}] + [worker] * num_workers)

        def setup(self, config):
            self.trainer = trainer_cls(training_operator_cls, config={**base_config, **config},
                                       **options)

        def step(self):
            result = dict(self.trainer.train())
            if self.trainer._validation_data is not None:
                result.update(self.trainer.validate())
            return result

        def save_checkpoint(self, checkpoint_dir):
            self.trainer.save(os.path.join(checkpoint_dir, CHECKPOINT_NAME))
            return checkpoint_dir

        def load_checkpoint(self, checkpoint_dir):
            self.trainer.load(os.path.join(checkpoint_dir, CHECKPOINT_NAME))

        def cleanup(self):
            self.trainer.shutdown()

    DsgdTrainable.__name__ = DsgdTrainable.__qualname__ = f"Dsgd{training_operator_cls.__name__}"
    return DsgdTrainable
