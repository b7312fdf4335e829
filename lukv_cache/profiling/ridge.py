"""Sufficient statistics of a ridge regression: how a linear KVzap surrogate is trained from a corpus
without holding it (:func:`lukv_cache.profiling.kvzap.train_surrogate`)."""

from __future__ import annotations

import torch

from ..errors import ConfigurationError


class RidgeStats:
    """Sufficient statistics of a ridge regression, summed over batches of rows (float64, ``O(F^2)``
    memory whatever the number of rows): a layer's surrogate is trained from a corpus without holding it.

    >>> stats = RidgeStats(3, 1)
    >>> x = torch.randn(500, 3)
    >>> stats.add(x[:200], x[:200, :1] * 2 + 1)
    >>> stats.add(x[200:], x[200:, :1] * 2 + 1)
    >>> weight, bias, mean, std = stats.solve(alpha=0.0)
    >>> torch.allclose((x - mean) / std @ weight + bias, x[:, :1] * 2 + 1, atol=1e-4)
    True
    """

    def __init__(self, features: int, targets: int):
        self.n = 0
        self.sx = torch.zeros(features, dtype=torch.float64)
        self.sy = torch.zeros(targets, dtype=torch.float64)
        self.sxx = torch.zeros(features, features, dtype=torch.float64)
        self.sxy = torch.zeros(features, targets, dtype=torch.float64)
        self.syy = torch.zeros(targets, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add rows ``x [N, F]`` with targets ``y [N, H]``."""
        x, y = x.double().cpu(), y.double().cpu()
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.sxx += x.T @ x
        self.sxy += x.T @ y
        self.syy += (y * y).sum(0)

    def _moments(self) -> tuple[torch.Tensor, ...]:
        """float64 input mean ``[F]``, target mean ``[H]``, input covariance ``[F, F]`` and input std ``[F]``."""
        mean, y_mean = self.sx / self.n, self.sy / self.n
        cov = self.sxx / self.n - torch.outer(mean, mean)
        return mean, y_mean, cov, cov.diagonal().clamp_min(0).sqrt().clamp_min(1e-6)

    def solve(self, alpha: float = 1.0) -> tuple[torch.Tensor, ...]:
        """fp32 ``weight [F, H]``, ``bias [H]``, ``mean [F]``, ``std [F]``: ridge on standardised inputs
        (``alpha`` per row of data, so its strength does not depend on the corpus size)."""
        if self.n < 2:
            raise ConfigurationError("A surrogate needs at least two scored tokens to train on.")
        mean, y_mean, cov, std = self._moments()
        cov_xy = self.sxy / self.n - torch.outer(mean, y_mean)
        gram = cov / torch.outer(std, std) + alpha / self.n * torch.eye(len(std), dtype=torch.float64)
        weight = torch.linalg.solve(gram, cov_xy / std[:, None])
        return weight.float(), y_mean.float(), mean.float(), std.float()

    def prediction_scale(self, weight: torch.Tensor) -> torch.Tensor:
        """fp32 ``[H]``: ``std(target) / std(prediction)`` on the rows added, for a ``weight [F, H]`` from
        :meth:`solve`. Ridge predictions spread less than their targets (by ``R``, less where the fit is
        worse); multiplying a head's weights by this makes them spread as much, leaving its ranking and its
        mean as they are (what `global`, which compares heads, needs).

        >>> stats = RidgeStats(2, 1)
        >>> x = torch.randn(4000, 2)
        >>> stats.add(x, x[:, :1] + torch.randn(4000, 1))  # R^2 = 1/2: predictions spread sqrt(2) less
        >>> scale = stats.prediction_scale(stats.solve(alpha=0.0)[0])
        >>> bool(abs(scale.item() - 2**0.5) < 0.1)
        True
        """
        _, y_mean, cov, std = self._moments()
        w = weight.double()
        predicted = ((cov / torch.outer(std, std)) @ w * w).sum(0)  # variance of the centred predictions
        target = (self.syy / self.n - y_mean * y_mean).clamp_min(0)
        return (target / predicted.clamp_min(1e-12)).sqrt().float()
