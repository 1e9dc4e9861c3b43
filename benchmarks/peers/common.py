"""What every peer shares: the model, its synthetic data, the timing loop and
the result line. Each peer runs in its own process(es), started by `run.py`,
and prints one line `RESULT {json}` that `run.py` collects.

Configurations (same model, same per-replica batch for every peer):
    compute  ResNet-50, 64x64 images, batch 8 per replica: compute-bound on 2 cores
    comm     ResNet-50, 32x32 images, batch 2 per replica: ~100 MB of gradients per
             step against little compute, so the exchange shows
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CONFIGS = {
    "compute": {"model": "ResNet50", "image_size": 64, "batch_size": 8},
    "comm": {"model": "ResNet50", "image_size": 32, "batch_size": 2},
}
NUM_CLASSES = 1000
LEARNING_RATE = 0.01


def build_model(config: str):
    """The Keras model of `config` (weights=None, 1000 classes)."""
    import keras

    c = CONFIGS[config]
    return getattr(keras.applications, c["model"])(
        weights=None, input_shape=(c["image_size"], c["image_size"], 3), classes=NUM_CLASSES)


def make_optimizer():
    import keras

    return keras.optimizers.SGD(LEARNING_RATE, momentum=0.9)


def make_loss_fn():
    import keras

    return keras.losses.SparseCategoricalCrossentropy()


def synthetic_batch(config: str, seed: int):
    """(images, labels) made once, on the current device: no input pipeline is measured."""
    import tensorflow as tf

    c = CONFIGS[config]
    images = tf.random.stateless_uniform([c["batch_size"], c["image_size"], c["image_size"], 3],
                                         seed=[seed, 0])
    labels = tf.random.stateless_uniform([c["batch_size"]], seed=[seed, 1], maxval=NUM_CLASSES,
                                         dtype=tf.int64)
    return images, labels


def time_steps(step, warmup: int, steps: int, label: str = "") -> list[float]:
    """Run `step()` (which must block until the step is done) warmup + steps
    times; returns the measured steps' wall times in seconds."""
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
        print(f"{label}{'warm-up' if i < warmup else 'step'} {i + 1}/{warmup + steps}: "
              f"{1000 * elapsed:.0f} ms", flush=True)
    return times


def summarize(config: str, num_workers: int, step_times_s: list[float], **extra) -> dict:
    """Images/s of a synchronous peer: global batch / median step time."""
    batch = CONFIGS[config]["batch_size"] * num_workers
    median = statistics.median(step_times_s)
    return {"config": config, "num_workers": num_workers, "global_batch": batch,
            "median_step_s": median, "images_per_s": batch / median,
            "step_s": step_times_s, **extra}


def report(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def peer_args(description: str, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", choices=sorted(CONFIGS), default="comm")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--strategy", choices=["simple", "ps"], default="ps", help="dsgd only")
    p.add_argument("--compression", choices=["fp16", "bf16"], default=None, help="dsgd ps only")
    p.add_argument("--worker-index", type=int, default=None, help="internal: a launched worker process")
    p.add_argument("--cluster", default=None, help="internal: JSON cluster spec for launched processes")
    return p.parse_args(argv)


def launch_or_work(description: str, launch, work, argv=None) -> None:
    """main() of a multi-process peer: without --worker-index this process
    launches the workers (`launch(args)`), with it it is one (`work(args)`)."""
    args = peer_args(description, argv)
    (launch if args.worker_index is None else work)(args)


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on localhost."""
    import socket

    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
