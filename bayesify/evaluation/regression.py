"""Regression metrics of a Bayesian model's members: accuracy, NLL, interval coverage and calibration.

The predictive is the uniform mixture of the ``S = K * M`` members. With Gaussian members
(``member_variances`` given) it is a mixture of Gaussians and every metric below is exact for
it; with mean-only members there is no noise model, so only the point-prediction metrics are
reported and the result says why the others are missing (no noise model is invented).

* ``rmse``, ``mae``: of the predictive mean, over all examples and output dimensions.
* ``nll``: ``mean_n -log mean_s prod_d N(y_nd | mu_snd, var_snd)`` (logsumexp form), in nats per
  example: the joint density of an example's D outputs, since the mixture does not factorise
  over them.
* ``coverage``: for each level p, the fraction of targets inside the central interval of
  probability p, using the exact quantiles of each output's marginal mixture (through its CDF:
  ``y`` is inside iff ``|F(y) - 1/2| <= p / 2``).
* ``calibration_error``: ``mean_p |p - coverage(p)|`` over p = 0.05, 0.10, ..., 0.95.
* ``sharpness``: the mean predictive standard deviation (smaller is sharper, at equal calibration).

Example:
    >>> mean, var = gaussian_head(bayesify.predict(model.eval(), x, samples=4))   # [S, N, 1] each
    >>> regression_metrics(mean, y[:, None], var)["nll"]

References:
    Kuleshov et al., "Accurate Uncertainties for Deep Learning Using Calibrated Regression",
    ICML 2018 (calibration and sharpness); Lakshminarayanan et al., NeurIPS 2017 (the NLL of a
    mixture of Gaussian members).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from bayesify.predictive.decompositions import RegressionUncertainty, mixture_cdf, regression_uncertainty

__all__ = ["CALIBRATION_LEVELS", "regression_metrics"]

CALIBRATION_LEVELS: tuple[float, ...] = tuple(i / 20 for i in range(1, 20))
"""The interval levels 0.05, 0.10, ..., 0.95 that ``calibration_error`` averages over."""

_NO_VARIANCE_NOTE = (
    "no member_variances: nll, coverage, calibration_error and sharpness need a predictive noise model; "
    "give the model a Gaussian head (convert(model, task='gaussian'), see bayesify.predictive.gaussian_head), or "
    "pass regression_metrics the members' variances (member_variances)."
)


def _check_levels(levels: Sequence[float]) -> tuple[float, ...]:
    levels = tuple(levels)
    for level in levels:
        if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0.0 < level < 1.0:
            raise ValueError(f"levels={levels!r}: every level must be a number strictly between 0 and 1.")
    return levels


def _gaussian_log_density(targets: Tensor, means: Tensor, variances: Tensor) -> Tensor:
    return -0.5 * (torch.log(2 * math.pi * variances) + (targets - means).square() / variances)


def regression_metrics(
    member_means: Tensor,
    targets: Tensor,
    member_variances: Tensor | None = None,
    levels: Sequence[float] = (0.5, 0.9, 0.95),
) -> dict[str, object]:
    """RMSE, MAE, and for Gaussian members the mixture's NLL, interval coverage, calibration and sharpness.

    Args:
        member_means: ``[S, N]`` or ``[S, N, D]`` member predictions (component-major members).
        targets: ``[N]`` or ``[N, D]``, the shape of one member's predictions.
        member_variances: the Gaussian members' variances, shaped like ``member_means`` and > 0;
            None for mean-only members.
        levels: central interval levels whose coverage is reported.

    Returns:
        Python numbers: ``rmse``, ``mae``, ``epistemic_std`` (mean standard deviation of the
        member means), ``nll``, ``coverage`` (``{level: fraction}``), ``calibration_error``,
        ``sharpness``. Without ``member_variances`` the last four are None and ``note`` says why.

    Raises:
        ValueError: shapes that do not match, levels outside (0, 1), or variances that are not > 0.

    Example:
        >>> means, variances = torch.randn(8, 100), torch.rand(8, 100) + 0.1
        >>> m = regression_metrics(means, torch.randn(100), variances)
        >>> sorted(m)
        ['calibration_error', 'coverage', 'epistemic_std', 'mae', 'nll', 'rmse', 'sharpness']

    References:
        Kuleshov et al., ICML 2018, Sec. 3 (calibration, sharpness).
    """
    levels = _check_levels(levels)
    _check_shapes(member_means, targets)
    uncertainty = regression_uncertainty(member_means, member_variances)
    y = targets.to(torch.float64)
    error = uncertainty.mean.to(torch.float64) - y
    out: dict[str, object] = {
        "rmse": float(error.square().mean().sqrt()),
        "mae": float(error.abs().mean()),
        "epistemic_std": float(uncertainty.epistemic_variance.to(torch.float64).sqrt().mean()),
    }
    if uncertainty.member_variances is None:
        missing = dict.fromkeys(("nll", "coverage", "calibration_error", "sharpness"))
        return {**out, **missing, "note": _NO_VARIANCE_NOTE}
    return {**out, **_mixture_metrics(uncertainty, y, levels)}


def _check_shapes(member_means: Tensor, targets: Tensor) -> None:
    """Raise the error :func:`regression_metrics` documents for targets or member means it cannot score."""
    if not isinstance(targets, Tensor) or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be a real-valued torch.Tensor, got {getattr(targets, 'dtype', type(targets))}.")
    if not isinstance(member_means, Tensor) or member_means.dim() < 2:
        shape = tuple(member_means.shape) if isinstance(member_means, Tensor) else type(member_means).__name__
        raise ValueError(
            f"member_means must be [S, N] or [S, N, D] (members first), got {shape}; add a leading axis of 1 for "
            "a single model."
        )
    if targets.shape != member_means.shape[1:]:
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} must have the shape of one member's predictions "
            f"{tuple(member_means.shape[1:])} (member_means is {tuple(member_means.shape)}); squeeze or unsqueeze "
            "the output axis so they match exactly."
        )


def _mixture_metrics(uncertainty: RegressionUncertainty, y: Tensor, levels: tuple[float, ...]) -> dict[str, object]:
    """``nll``, ``coverage``, ``calibration_error`` and ``sharpness`` of the mixture of Gaussian members
    (``uncertainty``: :func:`~bayesify.predictive.decompositions.regression_uncertainty`'s, with member variances;
    ``y``: the targets in float64)."""
    means, variances = uncertainty.member_means, uncertainty.member_variances
    if not torch.all(variances > 0):
        raise ValueError(
            f"member_variances must be > 0 for a likelihood (smallest: {float(variances.min()):.3g}); add a floor "
            "to the head's variance, e.g. softplus(v) + 1e-6."
        )
    count = means.shape[0]
    # the joint density of an example's outputs: sum log-densities over the output axes per member
    log_density = _gaussian_log_density(y, means, variances).reshape(count, y.shape[0], -1).sum(-1)
    nll = (math.log(count) - torch.logsumexp(log_density, 0)).mean()

    # probability integral transform: y is inside the central p-interval iff |F(y) - 1/2| <= p / 2
    distance_from_median = (mixture_cdf(y, means, variances.sqrt()) - 0.5).abs()

    def coverage(level: float) -> float:
        return float((distance_from_median <= level / 2).to(torch.float64).mean())

    return {
        "nll": float(nll),
        "coverage": {level: coverage(level) for level in levels},
        "calibration_error": sum(abs(level - coverage(level)) for level in CALIBRATION_LEVELS)
        / len(CALIBRATION_LEVELS),
        "sharpness": float(uncertainty.total_variance.to(torch.float64).sqrt().mean()),
    }
