"""Peer: Horovod 0.28.1 over Gloo, `hvd.DistributedGradientTape` in a compiled
custom loop (its Keras 3 `DistributedOptimizer` + `model.fit` fails on TF 2.21),
one local process per worker started with `horovodrun --gloo`.

Optional: build Horovod first with `bash benchmarks/peers/setup_horovod.sh`.
Without it this peer exits with status 3 and says so; `run.py` skips it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import common

UNAVAILABLE = 3
LAUNCH_TIMEOUT_S = 900


def launch(args) -> None:
    try:
        import horovod.tensorflow  # noqa: F401
    except ImportError as e:
        print(f"horovod: not installed ({e}); build it with bash benchmarks/peers/setup_horovod.sh",
              flush=True)
        raise SystemExit(UNAVAILABLE)
    horovodrun = shutil.which("horovodrun") or os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "--gloo", "-np", str(args.num_workers), "-H", f"localhost:{args.num_workers}",
           sys.executable, __file__, "--config", args.config, "--num-workers", str(args.num_workers),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--worker-index", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    # horovodrun prefixes each line with "[rank]<stdout>:"; relay rank 0's result.
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            print(line[line.index("RESULT "):], flush=True)
    if out.returncode:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"horovod: horovodrun exited with {out.returncode}")


def work(args) -> None:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    model = common.build_model(args.config)
    optimizer, loss_fn = common.make_optimizer(), common.make_loss_fn()
    images, labels = common.synthetic_batch(args.config, seed=hvd.rank())
    optimizer.build(model.trainable_variables)
    # Everyone starts from rank 0. (hvd.broadcast_variables wants tf.Variables;
    # Keras 3 variables wrap theirs, so broadcast the values one by one.)
    for v in model.variables + optimizer.variables:
        v.assign(hvd.broadcast(tf.convert_to_tensor(v), root_rank=0, name=f"bcast_{id(v)}"))

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)  # averages over ranks (allreduce, Average)
        # Horovod keys sources by tf.Variable.ref(): pass the tf.Variables that
        # Keras 3's variables wrap.
        grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    times = common.time_steps(lambda: train_step().numpy(), args.warmup, args.steps,
                              f"[horovod rank {hvd.rank()}] ")
    if hvd.rank() == 0:
        common.report(common.summarize(args.config, hvd.size(), times))


def main(argv=None):
    common.launch_or_work(__doc__, launch, work, argv)


if __name__ == "__main__":
    main()
