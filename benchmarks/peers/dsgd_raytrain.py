"""Peer: dsgd as a Ray Train backend. `dsgd.train.DsgdTrainer` runs Horovod's
loop (a compiled step with `DistributedGradientTape`) in `num_workers` Ray
Train workers on an embedded local Ray cluster; gradients are averaged through
dsgd's PS actors, worker-driven (no driver in the step)."""

from __future__ import annotations

import json
import os
import tempfile

import common


def train_loop(config):
    import ray.train
    import tensorflow as tf

    import dsgd.train as dt

    rank = ray.train.get_context().get_world_rank()
    model = common.build_model(config["config"])
    optimizer, loss_fn = common.make_optimizer(), common.make_loss_fn()
    images, labels = common.synthetic_batch(config["config"], seed=rank)
    optimizer.build(model.trainable_variables)
    dt.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = dt.DistributedGradientTape(tape)  # the one-line port from Horovod
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    times = common.time_steps(lambda: train_step().numpy(), config["warmup"], config["steps"],
                              f"[dsgd ray train rank {rank}] ")
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump(common.summarize(config["config"], config["num_workers"], times), f)


def main(argv=None):
    args = common.peer_args(__doc__, argv)
    import ray
    from ray.train import RunConfig, ScalingConfig

    import dsgd.train as dt

    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.num_workers),
             include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(common)
    out = os.path.join(tempfile.mkdtemp(prefix="dsgd-peer-"), "result.json")
    config = {"config": args.config, "num_workers": args.num_workers, "steps": args.steps,
              "warmup": args.warmup, "out": out}
    result = dt.DsgdTrainer(train_loop, train_loop_config=config,
                            scaling_config=ScalingConfig(num_workers=args.num_workers),
                            run_config=RunConfig(storage_path=os.path.dirname(out),
                                                 name="peer")).fit()
    if result.error is not None:
        raise SystemExit(f"dsgd ray train: fit failed: {result.error}")
    with open(out) as f:
        common.report(json.load(f))


if __name__ == "__main__":
    main()
