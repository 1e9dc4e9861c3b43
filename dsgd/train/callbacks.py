"""Horovod's Keras callbacks (`horovod.tensorflow.keras.callbacks`), for Keras 3
`model.fit` inside a dsgd Ray Train worker. Each rank runs the same callbacks
in the same order: their exchanges are collectives (dsgd/train/collectives.py).
"""

from __future__ import annotations

import keras
import numpy as np

from dsgd.train import collectives, exchange


def _inner(optimizer):
    """The optimizer that holds the learning rate and momentum (inside a
    DistributedOptimizer, the wrapped one)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Horovod's: at the end of the first batch, every rank's model and optimizer
    variables are set to rank `root_rank`'s, so all ranks go on from the same
    state (after the first batch, as Horovod: the optimizer's variables exist
    only once it has applied a step). Put it first in `callbacks`. That batch
    end blocks until every rank has reached it.

    Args:
        root_rank: the rank whose state every rank takes.
        device: ignored (Horovod's device hint).
    """

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        collectives.broadcast_variables(self.model.variables, self.root_rank)
        collectives.broadcast_variables(self.model.optimizer.variables, self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Horovod's: at the end of every epoch, each numeric entry of `logs` (loss,
    metrics, validation ones) becomes its mean over all ranks, in place, so
    callbacks after it (checkpoints, early stopping, schedules) see the same
    values on every rank. Put it before them. Each epoch end blocks until every
    rank has reached it; ranks that logged different metrics raise ValueError.

    Args:
        device: ignored (Horovod's device hint).
    """

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0
                      and isinstance(np.asarray(v).item(), (int, float)))
        values = np.array([float(logs[k]) for k in keys], np.float64)
        every = exchange.gather((keys, values))
        if any(k != keys for k, _ in every):
            raise ValueError("MetricAverageCallback: ranks logged different metrics: "
                             + "; ".join(f"rank {r}: {k}" for r, (k, _) in enumerate(every)))
        mean = np.sum([v for _, v in every], axis=0) / len(every)
        for k, v in zip(keys, mean):
            logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's: from `start_epoch` to `end_epoch` the learning rate is
    `initial_lr * multiplier(epoch)`; outside [start_epoch, end_epoch) it is
    left as it is. Local to each rank (no exchange); the epoch's rate is
    added to `logs` as "lr".

    Args:
        initial_lr (float): the base learning rate, > 0.
        multiplier (float | Callable): a number, or a function of the epoch.
        start_epoch: the first epoch it applies to.
        end_epoch: the first epoch it no longer applies to; None: to the end.
        staircase: True: the rate changes at epoch starts; False: the epoch is
            fractional and the rate changes every batch.
        momentum_correction: (SGD with momentum) a rate change from lr to lr'
            scales the momentum buffers by lr'/lr, which is Horovod's one-step
            momentum * lr'/lr (Keras's momentum is folded into the buffer).
        steps_per_epoch: batches in an epoch (for `staircase=False`); default:
            what fit() says.
        verbose: Keras's verbosity.

    Raises:
        ValueError: `initial_lr` not positive; at `fit()`, no
            `steps_per_epoch` known with `staircase=False`.
    """

    def __init__(self, initial_lr, multiplier, start_epoch: int = 0, end_epoch: int | None = None,
                 staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0):
        super().__init__()
        if initial_lr is None or not float(initial_lr) > 0:
            raise ValueError(f"initial_lr must be a positive number, got {initial_lr!r}")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self.current_epoch = 0

    def _active(self, epoch) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set_lr(self, lr: float) -> None:
        optimizer = _inner(self.model.optimizer)
        old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        optimizer.learning_rate.assign(lr) if hasattr(optimizer.learning_rate, "assign") \
            else setattr(optimizer, "learning_rate", lr)
        if self.momentum_correction and old > 0 and lr != old \
                and getattr(optimizer, "momentums", None):
            for buffer in optimizer.momentums:
                buffer.assign(buffer * (lr / old))

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError(f"{type(self).__name__}: steps_per_epoch is needed (fit() did not "
                             "say how many batches an epoch has)")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            self._set_lr(self.initial_lr * self.multiplier(epoch))

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self._active(self.current_epoch):
            return
        epoch = self.current_epoch + float(batch) / self.steps_per_epoch
        self._set_lr(self.initial_lr * self.multiplier(epoch))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(
                _inner(self.model.optimizer).learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's: over the first `warmup_epochs` epochs the learning rate rises,
    every batch, from `initial_lr / size()` to `initial_lr` (Goyal et al.'s
    gradual warm-up: `initial_lr` is the rate scaled for `size()` workers):
    lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1) at fractional
    epoch e (+1 batch, so each epoch ends on a round value).

    Args:
        initial_lr (float): the rate reached at the end of the warm-up, > 0.
        warmup_epochs: epochs of warm-up.
        momentum_correction: as `LearningRateScheduleCallback`'s.
        steps_per_epoch: batches in an epoch; default: what fit() says.
        verbose: > 0: print when the warm-up ends.
    """

    def __init__(self, initial_lr, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            n = collectives.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{self.initial_lr:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's: Keras' `ModelCheckpoint` with `save_best_only=True`. Horovod's
    Spark estimator set its file path after construction; dsgd has no such
    estimator, so pass `filepath` (or set `.filepath` before `fit`). As with
    Horovod, every rank that has it saves: add it on rank 0 only (`rank() ==
    0`), after `MetricAverageCallback` so that the best is judged on the mean
    over ranks.

    Args:
        monitor: the logged value compared (Keras' `ModelCheckpoint`'s, as the
            next four; Horovod's order and defaults).
        verbose: > 0: say when a model is saved.
        save_weights_only: save the weights only (`filepath` then ends in
            `.weights.h5`).
        mode: "auto", "min" or "max": which way is better.
        save_freq (str | int): "epoch", or every that many batches.
        filepath: where to save (`.keras`, or `.weights.h5` with
            save_weights_only).

    Raises:
        ValueError: at `fit`'s start if no file path was given.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto", save_freq="epoch",
                 filepath: str | None = None):
        # (Keras checks the path's extension at construction: a placeholder until it is set)
        placeholder = "unset.weights.h5" if save_weights_only else "unset.keras"
        super().__init__(filepath or placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint: no filepath: pass filepath=... (Horovod's "
                             "Spark estimator set it; dsgd has none) or set .filepath before fit")
        super().on_train_begin(logs)
