"""Horovod's Keras MNIST, ported: `import dsgd.train as hvd` and the launcher.

    python -m dsgd.train.run -np 2 dsgd/examples/horovod/keras_mnist.py [--epochs 4]

`model.fit` with `hvd.DistributedOptimizer` (the rate scaled by `hvd.size()`),
Horovod's three callbacks (broadcast of rank 0's state after the first batch,
epoch metrics averaged over the ranks, the rate warmed up from lr/size to lr),
checkpoints and progress output on rank 0 only.
"""

import argparse
import os

import keras
import tensorflow as tf

import dsgd.train as hvd
from dsgd.examples.mnist import build_cnn, load_mnist

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--steps-per-epoch", type=int, default=80, help="steps in all, per epoch")
parser.add_argument("--batch-size", type=int, default=64, help="per rank")
parser.add_argument("--warmup-epochs", type=int, default=2)
parser.add_argument("--checkpoint-dir", default=os.path.join(os.getcwd(), "checkpoints"))
args = parser.parse_args()

hvd.init()
x_train, y_train, x_test, y_test = load_mnist()
dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat()
           .shuffle(10000, seed=hvd.rank()).batch(args.batch_size))
model = build_cnn()
scaled_lr = 0.001 * hvd.size()
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr)),
              metrics=["accuracy"], jit_compile=False)  # XLA cannot compile the exchange
callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),  # before any callback that reads the metrics
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr,
                                             warmup_epochs=args.warmup_epochs,
                                             verbose=1 if hvd.rank() == 0 else 0),
]
if hvd.rank() == 0:
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    callbacks.append(keras.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))
model.fit(dataset, steps_per_epoch=args.steps_per_epoch // hvd.size(), epochs=args.epochs,
          callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
if hvd.rank() == 0:
    print(f"test accuracy {accuracy:.4f}", flush=True)
