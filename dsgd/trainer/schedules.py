"""Learning-rate schedulers of the Trainer (RaySGD TorchTrainer's `schedulers=`,
the Keras way).

A scheduler, registered with `TrainingOperator.register(schedulers=...)`,
drives the learning rate of the optimizer at the same position (scheduler i ->
optimizer i). Three kinds:

- a `keras.optimizers.schedules.LearningRateSchedule` S: the learning rate is
  S(count);
- a callable f(count, lr) -> new lr, as `keras.callbacks.LearningRateScheduler`
  takes it;
- a `ReduceLROnPlateau` rule on a reported metric (Keras's semantics).

`count` depends on `Trainer(scheduler_step_freq=...)`: "epoch": the 0-based
epoch, at the start of each epoch (as Keras's callback); "batch": the
optimizer's applied steps so far, before each step (as a Keras optimizer reads
a LearningRateSchedule), computed inside the compiled step; "manual": the
number of `Trainer.update_scheduler()` calls, at each call. A schedule also
sets the learning rate to S(0) when it is registered.

Every replica computes the same learning rate from the same replicated state
(the optimizer's learning rate and iteration variables, and one "last count
stepped" variable per scheduler, all copied to replacement workers and saved
in checkpoints), so weights stay identical; the last-count guard makes a
repeated call (a step or epoch start run again after a recovery) change
nothing. Plateau rules run in the driver, which sees the averaged metrics, and
set the new rate on every replica; their counters are saved by `Trainer.save`.
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger("dsgd")

STEP_FREQS = ("epoch", "batch", "manual")


class ReduceLROnPlateau:
    """Reduce the learning rate when a metric has stopped improving: Keras's
    `keras.callbacks.ReduceLROnPlateau`, as a Trainer scheduler.

    Args:
        monitor: the metric, as `Trainer.train()` or `validate()` reports it
            ("val_loss", "val_accuracy", "train_loss", ...). A "val_" metric is
            checked after every `validate()`, any other after every `train()`
            (with scheduler_step_freq="manual": at `update_scheduler(metric)`).
        factor: new lr = lr * factor, in (0, 1).
        patience: checks without improvement before the rate is reduced.
        mode: "min", "max" or "auto" (max if the name holds "acc", else min).
        min_delta: the smallest change that counts as an improvement.
        cooldown: checks to wait after a reduction before counting again.
        min_lr: the rate is never reduced below it.

    The Trainer (in the driver) checks it on the metric averaged over workers
    and sets the new rate on every replica; its counters are saved by
    `Trainer.save`.

    Raises:
        TypeError: `monitor` is not a metric name.
        ValueError: an argument out of range.
    """

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10,
                 mode: str = "auto", min_delta: float = 1e-4, cooldown: int = 0,
                 min_lr: float = 0.0):
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"ReduceLROnPlateau: monitor must be a metric name, got {monitor!r}")
        if not isinstance(factor, (int, float)) or not 0.0 < factor < 1.0:
            raise ValueError(f"ReduceLROnPlateau: factor must be in (0, 1), got {factor!r}")
        for name, value in (("patience", patience), ("cooldown", cooldown)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ReduceLROnPlateau: {name} must be an int >= 0, got {value!r}")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"ReduceLROnPlateau: mode must be 'auto', 'min' or 'max', got {mode!r}")
        for name, value in (("min_delta", min_delta), ("min_lr", min_lr)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"ReduceLROnPlateau: {name} must be a number >= 0, got {value!r}")
        self.monitor, self.factor, self.patience = monitor, float(factor), patience
        self.mode, self.min_delta, self.cooldown = mode, abs(float(min_delta)), cooldown
        self.min_lr = float(min_lr)
        self.maximize = mode == "max" or (mode == "auto" and "acc" in monitor)
        self.best = -math.inf if self.maximize else math.inf
        self.wait = 0
        self.cooldown_counter = 0

    @property
    def on_validation(self) -> bool:
        """Checked after validate() (a "val_" metric) rather than after train()."""
        return self.monitor.startswith("val_")

    def step(self, current: float, lr: float) -> float | None:
        """One check (Keras's `on_epoch_end`); the Trainer calls it.

        Args:
            current: the metric's value.
            lr: the learning rate now.

        Returns:
            The new learning rate, or None to keep it.
        """
        import numpy as np

        current = float(current)
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        improved = (current > self.best + self.min_delta if self.maximize
                    else current < self.best - self.min_delta)
        if improved:
            self.best, self.wait = current, 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.patience and lr > np.float32(self.min_lr):
                self.cooldown_counter, self.wait = self.cooldown, 0
                return max(lr * self.factor, self.min_lr)
        return None

    def state_dict(self) -> dict:
        """The rule's counters (best value, wait, cooldown), JSON-serialisable."""
        return {"best": self.best, "wait": self.wait, "cooldown_counter": self.cooldown_counter}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""
        self.best = float(state["best"])
        self.wait, self.cooldown_counter = int(state["wait"]), int(state["cooldown_counter"])

    def __repr__(self) -> str:
        return (f"ReduceLROnPlateau(monitor={self.monitor!r}, factor={self.factor}, "
                f"patience={self.patience}, mode={self.mode!r}, min_delta={self.min_delta}, "
                f"cooldown={self.cooldown}, min_lr={self.min_lr})")


def kind_of(scheduler, index: int) -> str:
    """"schedule", "callable" or "plateau"; TypeError naming schedulers[index] otherwise."""
    import keras

    if isinstance(scheduler, ReduceLROnPlateau):
        return "plateau"
    if isinstance(scheduler, keras.optimizers.schedules.LearningRateSchedule):
        return "schedule"
    if callable(scheduler):
        return "callable"
    raise TypeError(f"register: schedulers[{index}] must be a keras.optimizers.schedules."
                    "LearningRateSchedule, a callable (epoch_or_step, lr) -> lr, or a "
                    f"dsgd.ReduceLROnPlateau, got {type(scheduler).__name__}")


def check_optimizer(optimizer, index: int) -> None:
    """ValueError if optimizer `index` cannot take a scheduler: its learning
    rate is itself a schedule (it then steps by itself, per batch)."""
    import keras

    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if isinstance(getattr(inner, "_learning_rate", None),
                  keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError(f"register: optimizers[{index}] has a LearningRateSchedule as its "
                         "learning_rate; give it a constant rate and register the schedule as "
                         "schedulers[...], or keep it in the optimizer without schedulers")


def next_rate(scheduler, kind: str, count, lr):
    """The learning rate after stepping `scheduler` to `count` from `lr` (eager
    floats or, inside the compiled step, tensors)."""
    return scheduler(count) if kind == "schedule" else scheduler(count, lr)
