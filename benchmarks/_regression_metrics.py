"""Regression metrics of a Gaussian mixture predictive, for ``benchmarks/quality.py``.

Temporary home: ``bayesify/evaluation/regression.py`` is being written; the benchmark switches to
it once it lands. Members are ``[S, N, 2]`` outputs of a Gaussian head, ``(mean, log variance)``
in standardised target units (``y_std`` brings them back to the data's units); the predictive is
the uniform mixture ``p(y) = mean_s N(y; mu_s, sigma_s^2)``.

* NLL: ``mean_n[-logsumexp_s log N(y_n; mu_s, sigma_s^2) + log S] + log y_std`` (data units);
* RMSE of the mixture mean ``mean_s mu_s`` (data units);
* coverage of the central 90% interval: the fraction of targets whose mixture CDF value lies in
  [0.05, 0.95], and the interval's mean width (quantiles by bisection, data units).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["gaussian_mixture_metrics", "gaussian_nll_members"]

LOG_VAR_RANGE = (-12.0, 8.0)  # keeps exp(log variance) finite for a badly trained head


def _split(members: Tensor) -> tuple[Tensor, Tensor]:
    if members.dim() != 3 or members.shape[-1] != 2:
        raise ValueError(f"members must be [S, N, 2] (mean, log variance), got {tuple(members.shape)}.")
    mean, log_var = members.double().unbind(-1)
    return mean, log_var.clamp(*LOG_VAR_RANGE)


def gaussian_nll_members(members: Tensor, y: Tensor) -> Tensor:
    """Per-member Gaussian NLL ``[S, N]`` in standardised units."""
    mean, log_var = _split(members)
    return 0.5 * (log_var + (y.double() - mean) ** 2 / log_var.exp() + math.log(2 * math.pi))


def _mixture_cdf(mean: Tensor, std: Tensor, value: Tensor) -> Tensor:
    return torch.special.ndtr((value - mean) / std).mean(0)


def _quantile(mean: Tensor, std: Tensor, q: float, iterations: int = 60) -> Tensor:
    lo = (mean - 10 * std).min(0).values
    hi = (mean + 10 * std).max(0).values
    for _ in range(iterations):  # the mixture CDF is monotone: bisection converges to 2^-60 of the range
        mid = (lo + hi) / 2
        below = _mixture_cdf(mean, std, mid) < q
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return (lo + hi) / 2


def gaussian_mixture_metrics(members: Tensor, y: Tensor, y_std: float = 1.0, level: float = 0.9) -> dict[str, float]:
    """NLL, RMSE, coverage and width of the central ``level`` interval of the members' mixture.

    Args:
        members: ``[S, N, 2]`` (mean, log variance) in standardised units.
        y: ``[N]`` standardised targets.
        y_std: the target's training standard deviation (reports in data units).
        level: the central interval's probability (0.9: the 5% and 95% quantiles).

    Example:
        >>> m = torch.zeros(1, 4, 2); gaussian_mixture_metrics(m, torch.zeros(4))["coverage"]
        1.0
    """
    mean, log_var = _split(members)
    std = (0.5 * log_var).exp()
    s = members.shape[0]
    nll = (-torch.logsumexp(-gaussian_nll_members(members, y), 0) + math.log(s)).mean() + math.log(y_std)
    rmse = ((mean.mean(0) - y.double()) ** 2).mean().sqrt() * y_std
    tail = (1 - level) / 2
    cdf = _mixture_cdf(mean, std, y.double())
    covered = ((cdf >= tail) & (cdf <= 1 - tail)).double().mean()
    width = (_quantile(mean, std, 1 - tail) - _quantile(mean, std, tail)).mean() * y_std
    return {"nll": float(nll), "rmse": float(rmse), "coverage": float(covered), "width": float(width)}
