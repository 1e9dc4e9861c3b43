"""dsgd.ReduceLROnPlateau's rule without a cluster (the Trainer steps it in the
driver: dsgd/trainer/schedules.py): the learning rates it sets for a sequence of
metric values equal those keras.callbacks.ReduceLROnPlateau sets when fed the
same values, over mode, patience, min_delta, cooldown and min_lr; one sequence
also by hand. (The Trainer's use of it, on validation losses, with its counters
saved: test_trainer_schedules.py.)"""

import numpy as np
import pytest

import dsgd

# Keras reads its optimizer's rate through np.array(variable), which numpy 2 warns about.
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")

LR = 0.1
LOSSES = [1.0, 0.8, 0.79995, 0.85, 0.8, 0.9, 0.7, 0.71, 0.72, 0.6, 0.61, 0.61, 0.5, 0.62,
          0.63, 0.64, 0.65, 0.66]
ACCURACIES = [0.5, 0.6, 0.6, 0.55, 0.62, 0.62, 0.62, 0.7, 0.69, 0.69, 0.69, 0.69, 0.8, 0.7,
              0.7, 0.7, 0.7, 0.7]


def dsgd_rates(values, **kwargs) -> list[float]:
    """The rate after each check, as the Trainer runs the rule: it reads the rate
    from the optimizer's float32 variable and assigns the new one to it."""
    rule = dsgd.ReduceLROnPlateau(**kwargs)
    lr, rates = float(np.float32(LR)), []
    for value in values:
        new = rule.step(value, lr)
        if new is not None:
            lr = float(np.float32(new))
        rates.append(lr)
    return rates


def keras_rates(values, **kwargs) -> list[float]:
    """keras.callbacks.ReduceLROnPlateau's rate after each epoch end, fed `values`."""
    import keras

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    callback = keras.callbacks.ReduceLROnPlateau(verbose=0, **kwargs)
    callback.set_model(model)
    callback.on_train_begin()
    rates = []
    for epoch, value in enumerate(values):
        callback.on_epoch_end(epoch, {kwargs["monitor"]: value})
        rates.append(float(model.optimizer.learning_rate.numpy()))
    return rates


CASES = {
    "min": (LOSSES, dict(monitor="val_loss", mode="min", factor=0.5, patience=1)),
    "min_patience_2_min_delta": (LOSSES, dict(monitor="val_loss", mode="min", factor=0.5,
                                              patience=2, min_delta=0.05)),
    "max": (ACCURACIES, dict(monitor="val_accuracy", mode="max", factor=0.5, patience=1)),
    "max_min_delta": (ACCURACIES, dict(monitor="val_accuracy", mode="max", factor=0.5,
                                       patience=1, min_delta=0.05)),
    "max_on_a_loss": (LOSSES, dict(monitor="val_loss", mode="max", factor=0.5, patience=2)),
    "cooldown": (LOSSES, dict(monitor="val_loss", mode="min", factor=0.5, patience=1,
                              cooldown=2)),
    "cooldown_patience_2": (ACCURACIES, dict(monitor="val_accuracy", mode="max", factor=0.7,
                                             patience=2, cooldown=1)),
    "min_lr_reached_exactly": (LOSSES, dict(monitor="val_loss", mode="min", factor=0.5,
                                            patience=1, min_lr=0.025)),
    "min_lr_clips": (LOSSES, dict(monitor="val_loss", mode="min", factor=0.3, patience=1,
                                  min_lr=0.02)),
    "auto_on_a_loss": (LOSSES, dict(monitor="val_loss", mode="auto", factor=0.5, patience=1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rates_equal_the_keras_callbacks(case):
    values, kwargs = CASES[case]
    want = keras_rates(values, **kwargs)
    assert dsgd_rates(values, **kwargs) == want
    assert len(set(want)) >= 2, "the case must reduce the rate at least once"


def test_auto_maximises_a_metric_named_acc():
    """mode="auto": max for a name holding "acc" (Keras 3 asks the compiled
    metric instead; for an accuracy both say max)."""
    kwargs = dict(monitor="val_accuracy", factor=0.5, patience=1)
    assert dsgd_rates(ACCURACIES, mode="auto", **kwargs) == keras_rates(ACCURACIES, mode="max",
                                                                        **kwargs)
    assert dsgd_rates(ACCURACIES, mode="auto", **kwargs) != dsgd_rates(ACCURACIES, mode="min",
                                                                       **kwargs)


def test_cooldown_and_min_lr_by_hand():
    """patience 1, factor 0.5, cooldown 2, min_lr 0.02 on LOSSES[:11]. A cooldown
    of 2 skips one check (as Keras counts it, the check that ends the cooldown
    counts again). Best 1.0, then 0.8; 0.79995 is within min_delta (1e-4): 0.05;
    0.85 skipped; 0.8 is no improvement: 0.025; 0.9 skipped; 0.7 improves; 0.71:
    max(0.0125, min_lr) = 0.02; 0.72 skipped; 0.6 improves; 0.61 would reduce,
    but the rate is min_lr already."""
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    kwargs = dict(monitor="val_loss", factor=0.5, patience=1, cooldown=2, min_lr=0.02)
    rates = dsgd_rates(LOSSES[:11], **kwargs)
    assert rates == [f32(x) for x in (0.1, 0.1, 0.05, 0.05, 0.025, 0.025, 0.025, 0.02, 0.02,
                                      0.02, 0.02)]
    assert rates == keras_rates(LOSSES[:11], **kwargs)


def test_loaded_counters_continue_the_sequence():
    """state_dict mid-sequence (best, wait, cooldown), loaded into a new rule,
    which then gives the same rates as the uninterrupted one."""
    kwargs = dict(monitor="val_loss", factor=0.5, patience=2, cooldown=1)
    whole = dsgd_rates(LOSSES, **kwargs)
    first = dsgd.ReduceLROnPlateau(**kwargs)
    lr = float(np.float32(LR))
    for value in LOSSES[:9]:
        new = first.step(value, lr)
        lr = lr if new is None else float(np.float32(new))
    assert lr == whole[8]
    second = dsgd.ReduceLROnPlateau(**kwargs)
    second.load_state_dict(first.state_dict())
    rates = []
    for value in LOSSES[9:]:
        new = second.step(value, lr)
        lr = lr if new is None else float(np.float32(new))
        rates.append(lr)
    assert rates == whole[9:]


@pytest.mark.parametrize("kwargs,error,message", [
    ({"monitor": ""}, TypeError, "monitor must be a metric name"),
    ({"factor": 1.0}, ValueError, r"factor must be in \(0, 1\)"),
    ({"patience": -1}, ValueError, "patience must be an int >= 0"),
    ({"cooldown": 1.5}, ValueError, "cooldown must be an int >= 0"),
    ({"mode": "up"}, ValueError, "mode must be 'auto', 'min' or 'max'"),
    ({"min_delta": -0.1}, ValueError, "min_delta must be a number >= 0"),
    ({"min_lr": -1}, ValueError, "min_lr must be a number >= 0"),
])
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        dsgd.ReduceLROnPlateau(**kwargs)
