"""Reparameterised sampling, log-densities and the positive-scale parameterisation of the factors."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from bayesify.options import Posterior, Prior

__all__ = ["MIN_SCALE", "log_prob", "noise", "raw_scale", "rsample", "scale", "softplus_inverse"]

MIN_SCALE = 1e-7
"""Added to every softplus scale (as the reference): the scale and its log stay finite."""


def softplus_inverse(x: float | Tensor) -> Tensor:
    """The ``rho`` with ``softplus(rho) == x`` (stable for small and large ``x``)."""
    x = torch.as_tensor(x, dtype=torch.float64)
    return torch.where(x > 20, x, torch.log(torch.expm1(x)))


def scale(raw: Tensor) -> Tensor:
    """The positive scale ``softplus(raw) + MIN_SCALE`` of a raw (unconstrained) parameter."""
    return F.softplus(raw) + MIN_SCALE


def raw_scale(value: float) -> float:
    """The raw parameter whose :func:`scale` is ``value`` (the inverse, for initialisation)."""
    with torch.device("cpu"):  # a number, also when converting under `with torch.device("meta")` (no values there)
        return float(softplus_inverse(value - MIN_SCALE))


def rsample(family: Posterior, loc: Tensor, scale: Tensor | None, eps: Tensor | None = None) -> Tensor:
    """One reparameterised sample per entry: ``loc + scale * eps``.

    ``eps`` is standard Normal or standard Cauchy (drawn here unless given: :func:`noise`); a ``delta`` family
    returns ``loc``.
    """
    if family is Posterior.DELTA or scale is None:
        return loc
    if eps is None:
        eps = noise(family, loc)
    return loc + scale * eps


def noise(family: Posterior, like: Tensor) -> Tensor:
    """The standard noise of ``family`` in ``like``'s shape, dtype and device (the random numbers of :func:`rsample`)."""
    if family is Posterior.NORMAL:
        return torch.randn_like(like)
    return torch.empty_like(like).cauchy_()


def log_prob(family: Prior | Posterior, value: Tensor, loc: Tensor | float, scale: Tensor | float) -> Tensor:
    """Elementwise log-density of a Normal or Cauchy."""
    z = (value - loc) / scale
    if family.value == "normal":
        return -0.5 * z * z - torch.log(torch.as_tensor(scale, dtype=value.dtype)) - 0.5 * math.log(2 * math.pi)
    if family.value == "cauchy":
        return -torch.log1p(z * z) - torch.log(torch.as_tensor(scale, dtype=value.dtype)) - math.log(math.pi)
    raise ValueError(f"log_prob is defined for 'normal' and 'cauchy', not {family!r}.")
