"""A Horovod-style script (`import dsgd.train as hvd`), run by
tests/test_horovod.py through `python -m dsgd.train.run -np 2`: every name of
Horovod's TF2 API, eagerly and inside `tf.function`; each rank saves what it
got to <out>/rank<r>.npz for the test to check by hand and against one
process. Usage: hvd_collectives.py OUT_DIR STEPS BATCH [--then-rank-1-fails]: with
the flag, once both ranks have saved, rank 1 raises (the launcher's failure path,
checked by the same launch)."""

import os
import sys

import numpy as np
import tensorflow as tf

import dsgd.train as hvd
import tiny

hvd.init()
out, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
r, n = hvd.rank(), hvd.size()
print(f"hvd_collectives: rank {r} of {n}", flush=True)
saved = {"shape": np.array([r, n, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                            hvd.cross_size(), int(hvd.is_initialized())])}

x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1) + 0.1)
ints = tf.constant([1, 2, 3], tf.int32) * (r + 1)
rows = tf.fill([r + 1, 2], float(r))
emb = tf.Variable(tf.ones([4, 2]) * (r + 1))


def sparse_grad():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(emb, [1, 3]) * float(r + 1))
    return tape.gradient(loss, emb)  # IndexedSlices


def collectives():
    return {"avg": hvd.allreduce(x), "sum": hvd.allreduce(x, op=hvd.Sum),
            "old_avg": hvd.allreduce(x, average=True),
            "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
            "int_sum": hvd.allreduce(ints, op=hvd.Sum), "int_avg": hvd.allreduce(ints),
            "fp16": hvd.allreduce(x / 7.0, compression=hvd.Compression.fp16),
            "bf16": hvd.allreduce(x / 7.0, compression=hvd.Compression.bf16),
            "grouped": hvd.grouped_allreduce([x, x * 2.0])[1],
            "sparse": hvd.allreduce(sparse_grad()),
            "gather": hvd.allgather(rows), "bcast": hvd.broadcast(x, root_rank=1),
            "min": hvd.allreduce(x, op=hvd.Min), "max": hvd.allreduce(x, op=hvd.Max),
            "product": hvd.allreduce(ints, op=hvd.Product),
            "max_scaled": hvd.allreduce(x, op=hvd.Max, prescale_factor=2.0, postscale_factor=0.5),
            "grouped_gather": hvd.grouped_allgather([rows, ints])[0],
            "grouped_gather_ints": hvd.grouped_allgather([rows, ints])[1]}


for k, v in collectives().items():
    saved[f"eager_{k}"] = v.numpy()
for k, v in tf.function(collectives)().items():
    saved[f"graph_{k}"] = v.numpy()
saved["object"] = np.array(hvd.broadcast_object({"from": r}, root_rank=1)["from"])
saved["objects"] = np.array([o["r"] for o in hvd.allgather_object({"r": r})])
saved["object_fn"] = np.array(hvd.broadcast_object_fn(root_rank=1)({"from": r})["from"])

# The tape eagerly, plain and fp16-compressed, at rank 0's weights on each rank's batch.
model = tiny.make_keras_model(seed=r)
hvd.broadcast_variables(model.variables, root_rank=0)
for name, compression in (("tape_eager", hvd.Compression.none), ("tape_fp16", hvd.Compression.fp16)):
    with tf.GradientTape() as tape:
        loss = tiny.mse(model, *tiny.make_batch(r, 0, batch))
    grads = hvd.DistributedGradientTape(tape, compression=compression).gradient(
        loss, model.trainable_variables)
    for k, g in enumerate(grads):
        saved[f"{name}_{k}"] = g.numpy()

# DistributedOptimizer(backward_passes_per_step=2, average_aggregated_gradients=True) in
# fit: plain SGD from rank 0's weights, 4 batches = 2 exchanges and applies.
import keras  # noqa: E402

model = tiny.make_keras_model(seed=r)
hvd.broadcast_variables(model.variables, root_rank=0)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                                 average_aggregated_gradients=True,
                                                 gradient_predivide_factor=1.0),
              loss="mse", jit_compile=False)
batches = [tiny.make_batch(r, t, batch) for t in range(4)]
model.fit(np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches]),
          batch_size=batch, epochs=1, shuffle=False, verbose=0)
for k, w in enumerate(model.get_weights()):
    saved[f"passes_{k}"] = w

# Horovod's custom loop: DistributedGradientTape in tf.function, the first-batch
# broadcast of model and optimizer variables inside that same function (with Horovod's
# process_set and inplace arguments, as a port may pass them).
model, opt = tiny.make_keras_model(seed=r), tiny.make_optimizer("sgdm")


@tf.function
def training_step(xb, yb, first_batch):
    with tf.GradientTape() as tape:
        loss = tiny.mse(model, xb, yb)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0,
                                process_set=hvd.global_process_set, inplace=True)
        hvd.broadcast_variables(opt.variables, root_rank=0, process_set=None, inplace=False)
    return loss


for t in range(steps):
    training_step(*tiny.make_batch(r, t, batch), t == 0)
for k, w in enumerate(model.get_weights()):
    saved[f"loop_{k}"] = w

# Keras fit: DistributedOptimizer(backward_passes_per_step=2), the three callbacks.
model = tiny.make_keras_model(seed=r)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                 backward_passes_per_step=2,
                                                 average_aggregated_gradients=True),
              loss="mse", jit_compile=False)
rates, raw_logs = [], []


class Rates(keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None):
        rates.append(float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)))


class RawLogs(keras.callbacks.Callback):  # before MetricAverageCallback: this rank's own
    def on_epoch_end(self, epoch, logs=None):
        raw_logs.append(float(logs["loss"]))


batches = [tiny.make_batch(r, t, batch) for t in range(4)]
history = model.fit(np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches]),
                    batch_size=batch, epochs=2, shuffle=False, verbose=0,
                    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), RawLogs(),
                               hvd.callbacks.MetricAverageCallback(),
                               hvd.callbacks.LearningRateWarmupCallback(0.2, warmup_epochs=2),
                               Rates()])
saved["fit_loss"] = np.array(history.history["loss"])
saved["fit_rates"] = np.array(rates)
saved["fit_raw_loss"] = np.array(raw_logs)
for k, w in enumerate(model.get_weights()):
    saved[f"fit_{k}"] = w
np.savez(os.path.join(out, f"rank{r}.npz"), **saved)

if sys.argv[4:] == ["--then-rank-1-fails"]:
    hvd.allgather_object(r)  # both ranks saved before either ends
    if r == 1:
        raise ValueError("rank 1 fails on purpose")
