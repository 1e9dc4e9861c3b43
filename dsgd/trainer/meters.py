"""`dsgd.AverageMeterCollection`: averages of per-batch values for a custom
`train_epoch`/`validate` (as RaySGD's `ray.util.sgd.utils.AverageMeterCollection`)."""

from __future__ import annotations


class AverageMeter:
    """One value's running average, weighted by the number of samples."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.val = 0.0
        self.sum = 0.0
        self.count = 0

    def update(self, val: float, n: int = 1) -> None:
        self.val = float(val)
        self.sum += float(val) * n
        self.count += n

    @property
    def avg(self) -> float:
        return self.sum / self.count if self.count else 0.0


class AverageMeterCollection:
    """Sample-weighted averages of every value of a sequence of per-batch
    results, as the Trainer reports them for `train_batch`/`validate_batch`
    (for a custom `TrainingOperator.train_epoch` or `validate`).

    Attributes:
        n: samples counted so far.

    >>> meters = AverageMeterCollection()
    >>> meters.update({"loss": 2.0}, n=4)
    >>> meters.update({"loss": 1.0, "num_samples": 2})
    >>> meters.summary()
    {'batch_count': 2, 'num_samples': 6, 'loss': 1.6666666666666667, 'last_loss': 1.0}
    """

    def __init__(self):
        self._batch_count = 0
        self.n = 0
        self._meters: dict[str, AverageMeter] = {}

    def update(self, metrics: dict, n: int | None = None) -> None:
        """Add one batch's values.

        Args:
            metrics: numbers, or scalar tensors/arrays (read as floats;
                nothing is kept of them); a "num_samples" entry is the weight,
                not a value.
            n: samples in the batch, the weight (default:
                `metrics["num_samples"]`, else 1).

        Raises:
            TypeError: `metrics` is not a dict, or a value is not a number.
            ValueError: `n` is not an int >= 0.
        """
        if not isinstance(metrics, dict):
            raise TypeError(f"AverageMeterCollection.update takes a dict of numbers, got "
                            f"{type(metrics).__name__}")
        if n is None:
            n = int(metrics.get("num_samples", 1))
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"AverageMeterCollection.update: n must be an int >= 0, got {n!r}")
        self._batch_count += 1
        self.n += n
        for key, value in metrics.items():
            if key == "num_samples":
                continue
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"AverageMeterCollection.update: metrics[{key!r}] must be a "
                                f"number (or a scalar tensor), got {type(value).__name__}") from None
            self._meters.setdefault(key, AverageMeter()).update(value, n)

    def summary(self) -> dict:
        """The averages so far.

        Returns:
            `{"batch_count", "num_samples", <key>: sample-weighted mean,
                "last_<key>": last value}`.
        """
        out = {"batch_count": self._batch_count, "num_samples": self.n}
        for key, meter in self._meters.items():
            out[key] = meter.avg
            out[f"last_{key}"] = meter.val
        return out
