"""Horovod's TF2 custom-loop MNIST, ported: `import dsgd.train as hvd` and the launcher.

    python -m dsgd.train.run -np 2 dsgd/examples/horovod/tf2_mnist.py [--steps 200]

Each rank trains the CNN on its own shuffle of the 5,000 offline MNIST digits
(dsgd/examples/data), gradients averaged by `hvd.DistributedGradientTape` inside the
compiled step; on the first batch, inside that same `tf.function`, rank 0's
model and optimizer variables are broadcast (Horovod's pattern). The learning
rate is scaled by `hvd.size()`; rank 0 logs and writes the checkpoint.
"""

import argparse
import os

import tensorflow as tf

import dsgd.train as hvd
from dsgd.examples.mnist import build_cnn, load_mnist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200, help="steps in all (split over the ranks)")
parser.add_argument("--batch-size", type=int, default=64, help="per rank")
parser.add_argument("--checkpoint-dir", default=os.path.join(os.getcwd(), "checkpoints"))
args = parser.parse_args()

hvd.init()
x_train, y_train, x_test, y_test = load_mnist()
dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat()
           .shuffle(10000, seed=hvd.rank()).batch(args.batch_size))
model = build_cnn()
loss_fn = tf.losses.SparseCategoricalCrossentropy(from_logits=True)
opt = tf.optimizers.Adam(0.001 * hvd.size())  # the rate scaled by the number of workers
checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        loss_value = loss_fn(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    # Horovod's first-batch broadcast, inside the compiled step: every rank goes on
    # from rank 0's model and optimizer state (the optimizer's exist only now).
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss_value


for batch, (images, labels) in enumerate(dataset.take(args.steps // hvd.size())):
    loss_value = training_step(images, labels, batch == 0)
    if batch % 10 == 0 and hvd.local_rank() == 0:
        print(f"Step #{batch}\tLoss: {float(loss_value):.6f}", flush=True)

if hvd.rank() == 0:  # only rank 0 writes: the other ranks' weights are the same
    accuracy = tf.reduce_mean(tf.cast(
        tf.argmax(model(x_test, training=False), axis=1) == y_test, tf.float32))
    path = checkpoint.save(os.path.join(args.checkpoint_dir, "ckpt"))
    print(f"test accuracy {float(accuracy):.4f}; checkpoint {path}", flush=True)
