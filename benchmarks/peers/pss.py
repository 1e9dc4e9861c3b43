"""Peer: `tf.distribute.ParameterServerStrategy` with a `ClusterCoordinator`:
variables on PS tasks, steps scheduled onto workers. ASYNCHRONOUS by design:
each worker applies its own gradient to the PS variables without waiting for
the others, so its throughput is not comparable one-to-one with synchronous SGD.

`num_workers` worker servers and `num_workers` PS servers run as local processes
on loopback; this process is the chief (coordinator). Reported images/s: all of
`steps` x `num_workers` steps scheduled at once, images / wall time to `join()`
(its natural, pipelined mode). Also reported: `round_images_per_s`, from rounds of
one step per worker joined after each round (`step_s` holds those rounds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

import common

SERVER_START_TIMEOUT_S = 120


def serve(args) -> None:
    """A worker or PS server process: runs until killed."""
    import tensorflow as tf

    job, index = args.cluster_job, args.worker_index
    cluster = tf.train.ClusterSpec(json.loads(args.cluster))
    server = tf.distribute.Server(cluster, job_name=job, task_index=index, protocol="grpc",
                                  start=True)
    server.join()


def coordinate(args) -> None:
    import tensorflow as tf

    n = args.num_workers
    ports = common.free_ports(2 * n + 1)
    cluster = {"worker": [f"localhost:{p}" for p in ports[:n]],
               "ps": [f"localhost:{p}" for p in ports[n:2 * n]],
               "chief": [f"localhost:{ports[-1]}"]}
    servers, ok = [], False
    for job in ("worker", "ps"):
        for i in range(n):
            servers.append(subprocess.Popen(
                [sys.executable, __file__, "--serve", job, "--worker-index", str(i),
                 "--cluster", json.dumps(cluster)], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
    try:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = common.build_model(args.config)
            optimizer = common.make_optimizer()
        loss_fn = common.make_loss_fn()
        config = args.config

        def dataset_fn(context=None):
            images, labels = common.synthetic_batch(config, seed=0)
            return tf.data.Dataset.from_tensors((images, labels)).repeat()

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        @tf.function
        def train_step(iterator):
            def replica_step(images, labels):
                with tf.GradientTape() as tape:
                    loss = loss_fn(labels, model(images, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            images, labels = next(iterator)
            return strategy.run(replica_step, args=(images, labels))

        def run_steps(steps_per_worker: int) -> float:
            start = time.perf_counter()
            for _ in range(steps_per_worker * n):
                coordinator.schedule(train_step, args=(iterator,))
            coordinator.join()
            return time.perf_counter() - start

        run_steps(args.warmup)
        times = []
        for i in range(args.steps):  # one round of n scheduled steps = one "step" of all workers
            times.append(run_steps(1))
            print(f"[pss] round {i + 1}/{args.steps}: {1000 * times[-1]:.0f} ms", flush=True)
        total_s = run_steps(args.steps)
        result = common.summarize(args.config, n, times, asynchronous=True)
        # Its natural mode: all steps scheduled at once, workers never wait for each other.
        result["round_images_per_s"] = result["images_per_s"]
        result["images_per_s"] = n * args.steps * common.CONFIGS[config]["batch_size"] / total_s
        common.report(result)
        ok = True
    except BaseException:
        traceback.print_exc()
    finally:
        for s in servers:
            s.kill()
        for s in servers:
            s.wait(timeout=30)
        # The coordinator's background threads would keep retrying the dead servers
        # and print connection errors; nothing is left to clean up in this process.
        sys.stdout.flush()
        os._exit(0 if ok else 1)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--serve" in argv:
        k = argv.index("--serve")
        job = argv[k + 1]
        del argv[k:k + 2]
        args = common.peer_args(__doc__, argv)
        args.cluster_job = job
        serve(args)
    else:
        coordinate(common.peer_args(__doc__, argv))


if __name__ == "__main__":
    main()
