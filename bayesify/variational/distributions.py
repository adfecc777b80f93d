"""Reparameterised sampling, log-densities and the positive-scale parameterisation of the factors."""

from __future__ import annotations

import math
from collections.abc import Sequence

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
    return noise_of(family, like.shape, like.dtype, like.device)


def noise_of(
    family: Posterior, size: Sequence[int], dtype: torch.dtype, device: torch.device, after: Tensor | None = None
) -> Tensor:
    """:func:`noise` of a shape, dtype and device (no tensor to take them from). ``after``: noise this draw must
    follow in a compiled graph (the op's input, unused: inductor orders two draws with no data between them as it
    likes, and the second would take the first's numbers), so the graph draws in eager's order."""
    if device.type == "cpu" and torch.compiler.is_compiling():
        # (the op takes the shape, not a tensor: a ``like`` made of expanded views is then never written out)
        return torch.ops.bayesify.standard_noise(size, dtype, device, family is Posterior.CAUCHY, after)
    return _standard_noise(size, dtype, device, family is Posterior.CAUCHY)


def _standard_noise(
    size: Sequence[int], dtype: torch.dtype, device: torch.device, cauchy: bool, after: Tensor | None = None
) -> Tensor:
    if cauchy:
        return torch.empty(size, dtype=dtype, device=device).cauchy_()
    return torch.randn(size, dtype=dtype, device=device)  # (one op; randn_like's very numbers)


# The noise in a graph compiled for the CPU: an op inductor calls instead of lowering. Inductor's own CPU random
# numbers are generated element by element (~40 ns each: 5 ms of a 25 ms ViT step at B=32); this runs torch's
# vectorised generator, the eager path's very stream. Tagged as seeded-nondeterministic, the compiler neither
# merges two calls, nor drops one, nor recomputes it in the backward. (On the GPU inductor's generator is fast.)
if not hasattr(torch.ops.bayesify, "standard_noise"):  # (once per process: a reload of this module keeps the op)
    torch.library.define(
        "bayesify::standard_noise",
        "(SymInt[] size, ScalarType dtype, Device device, bool cauchy, Tensor? after=None) -> Tensor",
        tags=(torch.Tag.nondeterministic_seeded,),
    )
    torch.library.impl("bayesify::standard_noise", "CompositeExplicitAutograd")(_standard_noise)
    torch.library.register_fake("bayesify::standard_noise")(
        lambda size, dtype, device, cauchy, after=None: torch.empty(size, dtype=dtype, device=device)
    )


def log_prob(family: Prior | Posterior, value: Tensor, loc: Tensor | float, scale: Tensor | float) -> Tensor:
    """Elementwise log-density of a Normal or Cauchy."""
    z = (value - loc) / scale
    if family.value == "normal":
        return -0.5 * z * z - torch.log(torch.as_tensor(scale, dtype=value.dtype)) - 0.5 * math.log(2 * math.pi)
    if family.value == "cauchy":
        return -torch.log1p(z * z) - torch.log(torch.as_tensor(scale, dtype=value.dtype)) - math.log(math.pi)
    raise ValueError(f"log_prob is defined for 'normal' and 'cauchy', not {family!r}.")
