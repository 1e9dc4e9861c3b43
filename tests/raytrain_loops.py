"""Training loops run inside Ray Train's workers by tests/test_raytrain.py
(pickled by value, like tiny.py)."""

import os

import numpy as np

import tiny


def exactness_loop(config):
    """Shards, ranks, DistributedGradientTape (SGD+momentum, Adam, in tf.function)
    and DistributedOptimizer + model.fit; every worker saves what it saw and its
    weights under config["out"]; rank 0 reports metrics and a checkpoint."""
    import ray
    import ray.train
    import tensorflow as tf

    import dsgd.train as dt

    out, context = config["out"], ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    ids = [int(i) for batch in ray.train.get_dataset_shard("train").iter_batches(batch_size=7)
           for i in batch["id"]]
    from dsgd.train import exchange

    saved = {"ids": np.array(ids), "world": np.array(world),
             # each PS actor's classes (Ray subclasses the actor's class)
             "ps_classes": np.array(ray.get(
                 [ps.__ray_call__.remote(lambda p: ",".join(f"{c.__module__}.{c.__qualname__}"
                                                            for c in type(p).__mro__))
                  for ps in exchange.context()["ps"]], timeout=60))}
    for name in ("sgdm", "adam"):
        model, optimizer = tiny.make_keras_model(seed=rank), tiny.make_optimizer(name)
        dt.broadcast_variables(model.trainable_variables, root_rank=0)
        saved[f"{name}_initial_0"] = model.get_weights()[0]

        @tf.function
        def step(x, y, model=model, optimizer=optimizer):
            with tf.GradientTape() as tape:
                loss = tiny.mse(model, x, y)
            grads = dt.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        for t in range(config["steps"]):
            step(*tiny.make_batch(rank, t, config["batch"]))
        for k, w in enumerate(model.get_weights()):
            saved[f"{name}_{k}"] = w
    # Keras fit: the model compiled with DistributedOptimizer, batches in order.
    model = tiny.make_keras_model(seed=rank)
    dt.broadcast_variables(model.trainable_variables, root_rank=0)
    model.compile(optimizer=dt.DistributedOptimizer(tiny.make_optimizer("sgdm")), loss="mse")
    batches = [tiny.make_batch(rank, t, config["batch"]) for t in range(config["steps"])]
    history = model.fit(np.concatenate([b[0] for b in batches]),
                        np.concatenate([b[1] for b in batches]),
                        batch_size=config["batch"], epochs=1, shuffle=False, verbose=0)
    for k, w in enumerate(model.get_weights()):
        saved[f"fit_{k}"] = w
    np.savez(os.path.join(out, f"rank{rank}.npz"), **saved)
    checkpoint = None
    if rank == 0:
        directory = os.path.join(out, "checkpoint")
        os.makedirs(directory, exist_ok=True)
        np.savez(os.path.join(directory, "weights.npz"), *model.get_weights())
        checkpoint = ray.train.Checkpoint.from_directory(directory)
    ray.train.report({"fit_loss": float(history.history["loss"][-1]), "world": world},
                     checkpoint=checkpoint)


def _wait_for_a_registered_checkpoint(run_dir, timeout_s=120.0):
    """Ray Train's controller registers reported checkpoints asynchronously (when it
    polls the workers); a worker that dies first restarts the run from an older
    checkpoint or none. Wait until the controller's checkpoint-manager snapshot
    names a latest checkpoint, so the restart under test has one to resume from."""
    import json
    import time

    path = os.path.join(run_dir, "checkpoint_manager_snapshot.json")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                if json.load(f).get("latest_checkpoint_result"):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no checkpoint registered in {path} after {timeout_s:.0f} s")


def resuming_loop(config):
    """4 epochs of one step each (SGD with momentum, every rank from the same
    initial weights), a checkpoint (weights, optimizer state, epoch) reported
    after each; resumes from `ray.train.get_checkpoint()` after a restart. Rank 1
    SIGKILLs itself at epoch 2, once (config["marker"]), after the controller
    has registered a checkpoint. Rank 0 appends each epoch it reports to
    <out>/epochs.txt; each rank saves its final weights to <out>/final<rank>.npz."""
    import signal
    import tempfile

    import ray.train
    import tensorflow as tf

    import dsgd.train as dt

    rank = ray.train.get_context().get_world_rank()
    model, optimizer = tiny.make_keras_model(seed=0), tiny.make_optimizer("sgdm")
    optimizer.build(model.trainable_variables)
    state = model.weights + optimizer.variables
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            saved = np.load(os.path.join(directory, "state.npz"))
            for k, v in enumerate(state):
                v.assign(saved[f"v{k}"])
            start = int(saved["epoch"]) + 1
    for epoch in range(start, 4):
        if epoch == 2 and rank == 1 and not os.path.exists(config["marker"]):
            _wait_for_a_registered_checkpoint(config["run_dir"])
            open(config["marker"], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        with tf.GradientTape() as tape:
            loss = tiny.mse(model, *tiny.make_batch(rank, epoch, 4))
        grads = dt.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = None
            if rank == 0:
                np.savez(os.path.join(directory, "state.npz"), epoch=epoch,
                         **{f"v{k}": v.numpy() for k, v in enumerate(state)})
                checkpoint = ray.train.Checkpoint.from_directory(directory)
                with open(os.path.join(config["out"], "epochs.txt"), "a") as f:
                    f.write(f"{epoch}\n")
            ray.train.report({"epoch": epoch, "loss": float(loss), "resumed_from": start},
                             checkpoint=checkpoint)
    np.savez(os.path.join(config["out"], f"final{rank}.npz"), *model.get_weights())


def timeline_loop(config):
    """Three allreduces of a [1000] float32 tensor and one broadcast_object."""
    import tensorflow as tf

    import dsgd.train as dt

    for k in range(3):
        dt.allreduce(tf.fill([1000], float(k + dt.rank())))
    dt.broadcast_object({"done": True}, root_rank=0)
