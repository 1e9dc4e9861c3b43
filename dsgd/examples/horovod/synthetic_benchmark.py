"""Horovod's synthetic benchmark (tensorflow2_synthetic_benchmark.py), ported:
images/s of a Keras application model on random data, per worker and in total.

    python -m dsgd.train.run -np 2 dsgd/examples/horovod/synthetic_benchmark.py \
        [--model ResNet50] [--image-size 64] [--fp16-allreduce]

Prints, on rank 0, each iteration's images/s per worker, then the mean ± 1.96
standard deviations per worker and the total over all workers, as Horovod's.
"""

import argparse
import timeit

import keras
import numpy as np
import tensorflow as tf

import dsgd.train as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="ResNet50", help="a keras.applications model")
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--image-size", type=int, default=64,
                    help="image side in pixels (Horovod's: 224; 64 keeps a CPU run short)")
parser.add_argument("--num-warmup-batches", type=int, default=2)
parser.add_argument("--num-batches-per-iter", type=int, default=3)
parser.add_argument("--num-iters", type=int, default=3)
parser.add_argument("--fp16-allreduce", action="store_true", help="gradients travel as float16")
args = parser.parse_args()

hvd.init()
model = getattr(keras.applications, args.model)(
    weights=None, input_shape=(args.image_size, args.image_size, 3), classes=1000)
opt = keras.optimizers.SGD(0.01)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
rng = np.random.default_rng(hvd.rank())
data = tf.constant(rng.random((args.batch_size, args.image_size, args.image_size, 3), np.float32))
target = tf.constant(rng.integers(0, 1000, args.batch_size))
loss_fn = keras.losses.SparseCategoricalCrossentropy()


@tf.function
def benchmark_step(first_batch):
    with tf.GradientTape() as tape:
        loss = loss_fn(target, model(data, training=True))
    tape = hvd.DistributedGradientTape(tape, compression=compression)
    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)


def log(text):
    if hvd.rank() == 0:
        print(text, flush=True)


log(f"Model: {args.model}, batch size: {args.batch_size}, image size: {args.image_size}, "
    f"workers: {hvd.size()}")
benchmark_step(first_batch=True)
timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    seconds = timeit.timeit(lambda: benchmark_step(first_batch=False),
                            number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / seconds
    log(f"Iter #{x}: {img_sec:.1f} img/sec per worker")
    img_secs.append(img_sec)
mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log(f"Img/sec per worker: {mean:.1f} +-{conf:.1f}")
log(f"Total img/sec on {hvd.size()} worker(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
