"""Peer: `tf.distribute.MultiWorkerMirroredStrategy` (collective ring allreduce),
one local process per worker on loopback, a custom training loop (Keras 3's
`model.fit` under this strategy fails on TF 2.21).

Run without `--worker-index` it launches `num_workers` copies of itself with
`TF_CONFIG` set, waits for them (with a timeout) and relays worker 0's result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import common

LAUNCH_TIMEOUT_S = 900


def launch(args) -> None:
    ports = common.free_ports(args.num_workers)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = []
    for i in range(args.num_workers):
        cmd = [sys.executable, __file__, "--config", args.config, "--num-workers",
               str(args.num_workers), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--worker-index", str(i), "--cluster", json.dumps(cluster)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                                      text=True))
    try:
        out, _ = procs[0].communicate(timeout=LAUNCH_TIMEOUT_S)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    sys.stdout.write(out)
    if any(p.returncode for p in procs):
        raise SystemExit(f"mwms: worker exit codes {[p.returncode for p in procs]}")


def work(args) -> None:
    os.environ["TF_CONFIG"] = json.dumps({"cluster": json.loads(args.cluster),
                                          "task": {"type": "worker", "index": args.worker_index}})
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = common.build_model(args.config)
        optimizer = common.make_optimizer()
    loss_fn = common.make_loss_fn()
    images, labels = common.synthetic_batch(args.config, seed=args.worker_index)
    replicas = strategy.num_replicas_in_sync

    def replica_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
            scaled = loss / replicas  # Keras' optimizer all-reduces with SUM
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step():
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, strategy.run(replica_step), axis=None)

    label = f"[mwms worker {args.worker_index}] "
    times = common.time_steps(lambda: train_step().numpy(), args.warmup, args.steps, label)
    if args.worker_index == 0:
        common.report(common.summarize(args.config, args.num_workers, times))


def main(argv=None):
    common.launch_or_work(__doc__, launch, work, argv)


if __name__ == "__main__":
    main()
