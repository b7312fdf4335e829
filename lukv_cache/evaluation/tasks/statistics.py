"""The statistics of per-sample scores: a mean and its standard error."""

from __future__ import annotations

import math
from collections.abc import Sequence


def mean_and_sem(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n); 0 for n = 1).

    >>> mean_and_sem([1.0, 0.0, 1.0, 0.0])
    (0.5, 0.28867513459481287)
    """
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)
