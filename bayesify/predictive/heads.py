"""Output formats of heads: a Gaussian head's ``[..., 2 * D]`` output as a mean and a variance."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bayesify.options import VarianceParameter, parse_option

__all__ = ["VarianceParameter", "gaussian_head"]


def gaussian_head(
    output: Tensor, *, variance: VarianceParameter | str = "log", axis: int = -1
) -> tuple[Tensor, Tensor]:
    """Split a Gaussian head's raw output ``[..., 2 * D, ...]`` into ``(mean, variance)``, each ``[..., D, ...]``.

    The first half of ``axis`` is the mean, the second half the variance parameter. A ``[B, 2]``
    head gives ``[B, 1]`` mean and variance (``.squeeze(-1)`` for ``[B]``). Works on one
    model's output and on stacked members alike; the dtype is kept.

    Args:
        output: the head's output.
        variance: what the second half is: ``"log"`` (log-variance), ``"softplus"``,
            ``"variance"`` or ``"std"``; see :class:`VarianceParameter`.
        axis: the axis of ``output`` that holds ``2 * D`` values.

    Raises:
        ValueError: ``axis`` has an odd size, or a ``"variance"`` / ``"std"`` half is negative.

    Example:
        >>> members = bayesify.predict(model.eval(), x, samples=4)   # [S, B, 2]: mean, log-variance
        >>> mean, var = gaussian_head(members, variance="log")     # [S, B, 1] each
        >>> u = regression_uncertainty(mean, var)
    """
    if not isinstance(output, Tensor) or not output.is_floating_point():
        raise TypeError(f"output must be a floating-point torch.Tensor, got {getattr(output, 'dtype', type(output))}.")
    kind = parse_option(variance, VarianceParameter, "variance")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -output.dim() <= axis < output.dim():
        raise ValueError(f"axis={axis!r} is not an axis of an output of shape {tuple(output.shape)}.")
    size = output.shape[axis]
    if size == 0 or size % 2:
        raise ValueError(
            f"a Gaussian head's axis {axis} must hold 2 * D values (D means, then D variance parameters); "
            f"got size {size} in output shape {tuple(output.shape)}. Pass the axis that holds them as axis=, join a "
            "(mean, log_var) pair into one tensor first (torch.cat([mean, log_var], axis)), or use "
            "regression_uncertainty(output) for a mean-only head."
        )
    mean, raw = output.split(size // 2, dim=axis)
    if kind is VarianceParameter.LOG:
        return mean, raw.exp()
    if kind is VarianceParameter.SOFTPLUS:
        return mean, F.softplus(raw)
    if torch.any(raw < 0):
        raise ValueError(
            f"variance={kind.value!r} but the head's second half has negative values (down to "
            f"{float(raw.min()):.3g}); pass variance='log' or 'softplus' for an unconstrained head (a converted model's option: gaussian_variance)."
        )
    return mean, raw if kind is VarianceParameter.VARIANCE else raw.square()
