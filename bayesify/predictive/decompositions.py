"""Predictive uncertainty from the members of a Bayesian model: what the mixture says and why.

Every function here is pure: it takes the stacked member outputs of one batch, ``[S, ...]``
with ``S = K * M`` members on the leading axis (component-major, as :func:`bayesify.predict`
returns them; the uniform mixture over members is the predictive), and returns a small
dataclass. No function runs a model (:func:`bayesify.uncertainty` does, and comes here).

* :func:`classification_uncertainty`: softmax classifiers, per example or, for segmentation,
  per pixel. Predictive entropy (total) = expected entropy (aleatoric) + mutual information
  (epistemic), and the variation ratio.
* :func:`binary_uncertainty`: one or several independent sigmoid outputs (binary, multi-label):
  the same decomposition per label with Bernoulli entropies.
* :func:`regression_uncertainty`: mean-only or Gaussian members. Law of total variance:
  total = aleatoric (mean of member variances) + epistemic (variance of member means), and
  predictive intervals (:func:`mixture_quantile`).

Entropies are in nats. Numbers are computed in float64; results are float64 for float64
inputs and float32 for every other floating dtype (float32, float16, bfloat16): reduced-precision
probabilities near 0 and 1 would lose exactly the differences these quantities measure.

Example:
    >>> members = bayesify.predict(model.eval(), x, samples=4)        # [K*4, B, C] logits
    >>> u = classification_uncertainty(members)
    >>> u.mutual_information                                          # [B] epistemic, nats

References:
    Depeweg et al., "Decomposition of Uncertainty in Bayesian Deep Learning for Efficient and
    Risk-sensitive Learning", ICML 2018 (entropy and variance decompositions);
    Gal, "Uncertainty in Deep Learning", PhD thesis, 2016, Sec. 3.3.1 (variation ratio,
    mutual information); Lakshminarayanan et al., "Simple and Scalable Predictive Uncertainty
    Estimation using Deep Ensembles", NeurIPS 2017 (mixture of Gaussian members).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


__all__ = [
    "BinaryUncertainty",
    "ClassificationUncertainty",
    "RegressionUncertainty",
    "binary_uncertainty",
    "classification_uncertainty",
    "mixture_cdf",
    "mixture_quantile",
    "regression_uncertainty",
]

# a mixture quantile is found to 1e-12 of the spread of the members' own quantiles; bisection
# alone would need ~40 steps for that, so the cap is never reached by a converging search
_QUANTILE_TOLERANCE = 1e-12
_MAX_QUANTILE_STEPS = 100


def _result_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_members(members: Tensor, name: str, min_dim: int) -> None:
    if not isinstance(members, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of stacked member outputs, got {type(members).__name__}.")
    if not members.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {members.dtype}; pass the raw outputs.")
    if members.dim() < min_dim:
        raise ValueError(
            f"{name} of shape {tuple(members.shape)} has no member axis in front of the output; stack the members "
            "as [S, ...] (bayesify.predict does; add a leading axis of 1 for a single model)."
        )
    if members.shape[0] == 0:
        raise ValueError(f"{name} of shape {tuple(members.shape)} has no members (its leading axis is 0).")


def _output_class_axis(members: Tensor, class_axis: int) -> int:
    """``class_axis`` of one member's output as a non-negative axis, checked against the members' shape."""
    output_dims = members.dim() - 1
    if isinstance(class_axis, bool) or not isinstance(class_axis, int):
        raise TypeError(f"class_axis={class_axis!r} must be an integer axis of one member's output.")
    if not -output_dims <= class_axis < output_dims:
        raise ValueError(
            f"class_axis={class_axis} is out of range for member outputs of shape {tuple(members.shape[1:])} "
            f"(valid: {-output_dims} to {output_dims - 1}); it counts axes of one member's output, without the "
            "leading member axis."
        )
    return class_axis % output_dims


def _member_log_probs(member: Tensor, axis: int, log_probs: bool, class_axis: int) -> Tensor:
    """One member's float64 log-probabilities over ``axis``, from logits or checked log-probabilities."""
    values = member.to(torch.float64)
    if not log_probs:
        return values.log_softmax(axis)
    total = torch.logsumexp(values, axis)
    # logits passed as log-probabilities would give the entropies of some other distribution
    tolerance = {torch.float64: 1e-6, torch.float32: 1e-4}.get(member.dtype, 1e-2)
    if not torch.all((total.abs() <= tolerance) | total.isnan()):
        worst = float(total.abs().nan_to_num(0.0).max())
        raise ValueError(
            f"log_probs=True but the members' probabilities do not sum to 1 over class_axis={class_axis} "
            f"(|logsumexp| up to {worst:.3g}); pass log_probs=False for logits, or check class_axis."
        )
    return values


def _entropy(log_probs: Tensor, dim: int) -> Tensor:
    """``-sum p log p`` over ``dim``, with ``0 log 0 = 0`` (a class of probability 0 has log-probability -inf); NaN
    stays NaN (an input with a NaN read as certain would rank first in distribution)."""
    probs = log_probs.exp()
    return -torch.where(probs == 0, 0.0, probs * log_probs).sum(dim)


@dataclass
class ClassificationUncertainty:
    """The mixture predictive of a softmax classifier and its uncertainty decomposition.

    Shapes are those of one member's output, with the class axis removed from the per-example
    quantities: ``[B, C]`` probabilities give ``[B]`` entropies; segmentation ``[B, C, H, W]``
    gives ``[B, H, W]`` maps. Entropies are in nats, bounded by ``log C``.

    Attributes:
        probs: ``mean_s p_s``, the mixture predictive, with the class axis where it was.
        predictive_entropy: ``H[mean_s p_s]``: total uncertainty.
        expected_entropy: ``mean_s H[p_s]``: aleatoric uncertainty (what each member expects).
        mutual_information: ``predictive_entropy - expected_entropy`` (>= 0): epistemic
            uncertainty, the members' disagreement; 0 when all members agree.
        variation_ratio: ``1 - (members voting for the most-voted class) / S``, each member voting for its
            argmax (Gal 2016): the members' disagreement among themselves, not with the mixture's argmax
            (members voting 8, 9, 8, 8 give 0.25 whichever class the mixture ranks first).
        class_axis: the (non-negative) class axis of ``probs``.
        member_probs: ``[S, ...]`` member probabilities, only with ``keep_members=True``.
    """

    probs: Tensor
    predictive_entropy: Tensor
    expected_entropy: Tensor
    mutual_information: Tensor
    variation_ratio: Tensor
    class_axis: int
    member_probs: Tensor | None = field(default=None, repr=False)

    @property
    def prediction(self) -> Tensor:
        """The mixture's most probable class (ties: the lowest class index)."""
        return self.probs.argmax(self.class_axis)

    @property
    def confidence(self) -> Tensor:
        """The mixture's largest class probability, ``max_c mean_s p_s(c)``."""
        return self.probs.amax(self.class_axis)


def classification_uncertainty(
    members: Tensor, *, class_axis: int = -1, log_probs: bool = False, keep_members: bool = False
) -> ClassificationUncertainty:
    """Predictive entropy, its aleatoric / epistemic split and the variation ratio of softmax members.

    Args:
        members: ``[S, ...]`` member logits (or log-probabilities with ``log_probs=True``), e.g.
            ``[S, B, C]`` for a classifier, ``[S, B, C, H, W]`` for segmentation.
        class_axis: the class axis of one member's output (without the member axis): -1 for
            ``[B, C]``, 1 for segmentation ``[B, C, H, W]``.
        log_probs: ``members`` are already normalised log-probabilities (checked: each member's
            ``logsumexp`` over classes must be 0).
        keep_members: also return the member probabilities (``S`` times the memory of ``probs``).

    Returns:
        A :class:`ClassificationUncertainty`, float64 for float64 input, else float32.

    Raises:
        ValueError: ``members`` has no member axis, ``class_axis`` is out of range or holds a
            single class (a sigmoid output: :func:`binary_uncertainty`), or ``log_probs=True`` but
            the values are not normalised.

    Example:
        >>> members = torch.randn(8, 2, 21, 64, 64)                 # 8 members, segmentation logits
        >>> u = classification_uncertainty(members, class_axis=1)
        >>> u.mutual_information.shape
        torch.Size([2, 64, 64])

    References:
        Depeweg et al., ICML 2018, Eq. 5 (entropy decomposition); Gal, PhD thesis 2016,
        Sec. 3.3.1 (variation ratio).
    """
    _check_members(members, "members", min_dim=2)
    axis = _output_class_axis(members, class_axis)
    if members.shape[axis + 1] == 1:
        # a softmax over one class is always certain: this is a sigmoid head's single logit
        raise ValueError(
            f"class_axis={class_axis} of member outputs {tuple(members.shape[1:])} holds one class; a single logit "
            "is a sigmoid output: use binary_uncertainty(members) (a converted model: task='binary'), or pick the "
            "class axis."
        )
    dtype = _result_dtype(members)
    # one member at a time: peak memory is a few float64 copies of one member's output rather
    # than of all S (segmentation members are large); the sums are the same
    mixture_log_probs, summed_entropy, kept = None, None, []
    for member in members:
        log_probs_s = _member_log_probs(member, axis, log_probs, class_axis)
        entropy_s = _entropy(log_probs_s, axis)
        if mixture_log_probs is None:
            mixture_log_probs, summed_entropy = log_probs_s, entropy_s
        else:
            mixture_log_probs = torch.logaddexp(mixture_log_probs, log_probs_s)
            summed_entropy = summed_entropy + entropy_s
        if keep_members:
            kept.append(log_probs_s.exp().to(dtype))
    count = members.shape[0]
    mixture_log_probs = mixture_log_probs - math.log(count)
    predictive = _entropy(mixture_log_probs, axis)
    expected = summed_entropy / count
    # >= 0 by Jensen's inequality; the clamp only removes float64 rounding of the difference
    mutual_information = (predictive - expected).clamp_min(0.0)
    # Gal's variation ratio: each member votes for its argmax (softmax keeps the order of the logits, so that of its
    # raw output), and the share of the most-voted class is taken, whatever the mixture's argmax is
    votes = torch.zeros_like(mixture_log_probs)
    for member in members:
        vote = member.argmax(axis, keepdim=True)
        votes.scatter_add_(axis, vote, torch.ones_like(vote, dtype=votes.dtype))
    modal = votes.amax(axis)
    return ClassificationUncertainty(
        probs=mixture_log_probs.exp().to(dtype),
        predictive_entropy=predictive.to(dtype),
        expected_entropy=expected.to(dtype),
        mutual_information=mutual_information.to(dtype),
        variation_ratio=(1.0 - modal / count).masked_fill(predictive.isnan(), math.nan).to(dtype),  # (votes of NaN)
        class_axis=axis,
        member_probs=torch.stack(kept) if keep_members else None,
    )


@dataclass
class BinaryUncertainty:
    """The mixture predictive of independent sigmoid outputs and its decomposition, per label.

    Every entry of one member's output is its own Bernoulli label (a binary classifier's one
    logit, or each of C multi-label logits), so all fields have the shape of one member's
    output. Entropies are in nats, bounded by ``log 2``.

    Attributes:
        probs: ``mean_s sigmoid(z_s)``: the mixture's probability of the positive label.
        predictive_entropy: Bernoulli entropy of ``probs`` (total).
        expected_entropy: ``mean_s`` of the members' Bernoulli entropies (aleatoric).
        mutual_information: their difference (epistemic, >= 0).
        variation_ratio: ``1 - (members voting for the more-voted decision) / S``, each member voting
            ``p_s > 0.5`` (Gal 2016; the share of the minority, whatever the mixture decides).
        member_probs: ``[S, ...]`` member probabilities, only with ``keep_members=True``.
    """

    probs: Tensor
    predictive_entropy: Tensor
    expected_entropy: Tensor
    mutual_information: Tensor
    variation_ratio: Tensor
    member_probs: Tensor | None = field(default=None, repr=False)

    @property
    def prediction(self) -> Tensor:
        """The mixture's decision per label, ``probs > 0.5``."""
        return self.probs > 0.5

    @property
    def confidence(self) -> Tensor:
        """The probability of the mixture's decision, ``max(probs, 1 - probs)``."""
        return torch.maximum(self.probs, 1.0 - self.probs)


def _bernoulli_entropy(log_p: Tensor, log_q: Tensor) -> Tensor:
    """``-(p log p + q log q)`` from ``log p`` and ``log q = log(1 - p)``, each computed stably."""
    return _entropy(torch.stack([log_p, log_q]), 0)


def binary_uncertainty(member_logits: Tensor, *, keep_members: bool = False) -> BinaryUncertainty:
    """The entropy decomposition of independent sigmoid outputs (binary or multi-label), per label.

    Do not use this for softmax class logits: C logits of a softmax and C independent sigmoids
    look alike, and only the model's author knows which one a head is.

    Args:
        member_logits: ``[S, ...]`` member logits; every entry after the member axis is a label.
        keep_members: also return the member probabilities.

    Returns:
        A :class:`BinaryUncertainty`, float64 for float64 input, else float32.

    Example:
        >>> members = torch.randn(8, 32, 5)                   # 8 members, 32 examples, 5 tags
        >>> binary_uncertainty(members).mutual_information.shape
        torch.Size([32, 5])

    References:
        Depeweg et al., ICML 2018, Eq. 5, with Bernoulli entropies.
    """
    _check_members(member_logits, "member_logits", min_dim=1)
    dtype = _result_dtype(member_logits)
    # member by member, as in classification_uncertainty; logsigmoid(z) = log p and
    # logsigmoid(-z) = log(1 - p) stay accurate where p is near 0 or 1
    mixture_log_p, mixture_log_q, summed_entropy, kept = None, None, None, []
    for member in member_logits:
        logits = member.to(torch.float64)
        log_p, log_q = F.logsigmoid(logits), F.logsigmoid(-logits)
        entropy_s = _bernoulli_entropy(log_p, log_q)
        if mixture_log_p is None:
            mixture_log_p, mixture_log_q, summed_entropy = log_p, log_q, entropy_s
        else:
            mixture_log_p = torch.logaddexp(mixture_log_p, log_p)
            mixture_log_q = torch.logaddexp(mixture_log_q, log_q)
            summed_entropy = summed_entropy + entropy_s
        if keep_members:
            kept.append(log_p.exp().to(dtype))
    count = member_logits.shape[0]
    mixture_log_p, mixture_log_q = mixture_log_p - math.log(count), mixture_log_q - math.log(count)
    predictive = _bernoulli_entropy(mixture_log_p, mixture_log_q)
    expected = summed_entropy / count
    mutual_information = (predictive - expected).clamp_min(0.0)
    mixture_probs = mixture_log_p.exp()
    # a member votes "positive" where p_s > 0.5, i.e. where its logit is > 0; Gal's variation ratio, as for classes
    positive = sum((member > 0).to(torch.float64) for member in member_logits)
    minority = torch.minimum(positive, count - positive)
    return BinaryUncertainty(
        probs=mixture_probs.to(dtype),
        predictive_entropy=predictive.to(dtype),
        expected_entropy=expected.to(dtype),
        mutual_information=mutual_information.to(dtype),
        variation_ratio=(minority / count).masked_fill(predictive.isnan(), math.nan).to(dtype),  # (votes of NaN)
        member_probs=torch.stack(kept) if keep_members else None,
    )


def _check_probability(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{name}={value!r} must be a number strictly between 0 and 1 (e.g. 0.95).")


def _normal_quantile(q: float) -> float:
    return statistics.NormalDist().inv_cdf(q)


def _standardize(x: Tensor, means: Tensor, stds: Tensor) -> Tensor:
    """``(x - mu_s) / sigma_s``, or +-inf for a point mass (``sigma_s = 0``) so that its CDF steps at ``mu_s``."""
    point_mass = torch.where(x >= means, math.inf, -math.inf)
    return torch.where(stds > 0, (x - means) / stds, point_mass)


def mixture_cdf(x: Tensor, means: Tensor, stds: Tensor) -> Tensor:
    """``mean_s Phi((x - mu_s) / sigma_s)``: the CDF of a uniform mixture of Gaussians at ``x``.

    ``means`` and ``stds`` are ``[S, ...]``; ``x`` has the shape after the member axis. A member
    with ``sigma_s = 0`` is a point mass (its CDF steps from 0 to 1 at ``mu_s``).
    """
    return torch.special.ndtr(_standardize(x, means, stds)).mean(0)


def mixture_quantile(q: float, means: Tensor, stds: Tensor) -> Tensor:
    """The ``q``-quantile of a uniform mixture of Gaussians (float64 in, float64 out).

    The mixture's quantile lies between the smallest and the largest of the members' own
    ``q``-quantiles (at the smallest every member CDF is <= q, at the largest every one is >= q).
    Starting from that bracket, each step takes Newton's step on ``mixture_cdf(x) = q`` where it
    stays inside the bracket and bisects otherwise (and where the density is 0: point masses),
    shrinking the bracket as it goes, until the steps are below ``1e-12`` of the bracket's width.
    Newton's quadratic convergence needs far fewer evaluations of the CDF than bisection alone
    (which matters for per-pixel intervals); the bracket keeps bisection's guarantee.

    References:
        Press et al., "Numerical Recipes", 3rd ed., Sec. 9.4 (``rtsafe``: Newton with bisection).
    """
    _check_probability(q, "q")
    member_quantiles = means + stds * _normal_quantile(q)
    low, high = member_quantiles.amin(0), member_quantiles.amax(0)
    tolerance = _QUANTILE_TOLERANCE * (high - low)
    x = (low + high) / 2
    for _ in range(_MAX_QUANTILE_STEPS):
        z = _standardize(x, means, stds)
        cdf = torch.special.ndtr(z).mean(0)
        density = torch.where(stds > 0, torch.exp(-0.5 * z.square()) / (math.sqrt(2 * math.pi) * stds), 0.0).mean(0)
        below = cdf < q
        low, high = torch.where(below, x, low), torch.where(below, high, x)
        # inf or nan where the density is 0 (never inside, so bisect); a converged Newton step lands
        # on x, which is now an end of the bracket, so the ends count as inside
        newton = x - (cdf - q) / density
        step = torch.where((newton >= low) & (newton <= high), newton, (low + high) / 2) - x
        x = x + step
        if bool(torch.all((step.abs() <= tolerance) | (high - low <= tolerance))):
            break
    return x


@dataclass
class RegressionUncertainty:
    """The mixture predictive of regression members: mean, variance split and intervals.

    Every field has the shape of one member's output (elementwise over outputs, pixels, ...).

    Attributes:
        mean: ``mean_s mu_s``, the predictive mean.
        total_variance: ``aleatoric_variance + epistemic_variance`` (law of total variance).
        aleatoric_variance: ``mean_s var_s``, the noise the members predict (0 for mean-only members).
        epistemic_variance: ``mean_s (mu_s - mean)^2``, the members' disagreement (population
            variance, divided by S).
        member_means: the ``[S, ...]`` member means (float64), kept for :meth:`interval`.
        member_variances: the ``[S, ...]`` member variances (float64), None for mean-only members.
    """

    mean: Tensor
    total_variance: Tensor
    aleatoric_variance: Tensor
    epistemic_variance: Tensor
    member_means: Tensor = field(repr=False)
    member_variances: Tensor | None = field(default=None, repr=False)

    @property
    def std(self) -> Tensor:
        """The predictive standard deviation, ``sqrt(total_variance)``."""
        return self.total_variance.sqrt()

    def quantile(self, q: float) -> Tensor:
        """The predictive ``q``-quantile, ``0 < q < 1`` (see :meth:`interval` for which predictive)."""
        _check_probability(q, "q")
        if self.member_variances is None:
            if self.member_means.shape[0] == 1:
                raise ValueError(
                    "one mean-only member has no predictive spread, so it has no interval; pass member_variances "
                    "(a Gaussian head, see gaussian_head) or several members (bayesify.predict(..., samples=M))."
                )
            # the moment-matched Gaussian, from the float64 members rather than the rounded fields
            center = self.member_means.mean(0)
            spread = (self.member_means - center).square().mean(0).sqrt()
            return (center + spread * _normal_quantile(q)).to(self.mean.dtype)
        return mixture_quantile(q, self.member_means, self.member_variances.sqrt()).to(self.mean.dtype)

    def interval(self, level: float = 0.95) -> tuple[Tensor, Tensor]:
        """The central predictive interval holding probability ``level``: ``(lower, upper)``.

        With Gaussian members (``member_variances`` given) the bounds are the exact quantiles
        ``(1 - level) / 2`` and ``(1 + level) / 2`` of the mixture of Gaussians
        (:func:`mixture_quantile`: Newton's method safeguarded by bisection). With mean-only members they are those of the moment-matched Gaussian
        ``N(mean, epistemic_variance)``: an interval of the members' disagreement only, with no
        noise model (it covers targets only as far as the members' spread does).

        Example:
            >>> lower, upper = regression_uncertainty(means, variances).interval(0.9)
        """
        _check_probability(level, "level")
        return self.quantile((1.0 - level) / 2), self.quantile((1.0 + level) / 2)


def regression_uncertainty(member_means: Tensor, member_variances: Tensor | None = None) -> RegressionUncertainty:
    """The predictive mean and the law-of-total-variance split of regression members.

    Args:
        member_means: ``[S, ...]`` member predictions (or the means of Gaussian members).
        member_variances: ``[S, ...]`` the Gaussian members' variances (>= 0; see
            :func:`gaussian_head`), or None for mean-only members.

    Returns:
        A :class:`RegressionUncertainty`, float64 for float64 means, else float32.

    Example:
        >>> mean, variance = gaussian_head(bayesify.predict(model.eval(), x, samples=4))  # [S, B, 1] each
        >>> u = regression_uncertainty(mean, variance)
        >>> lower, upper = u.interval(0.95)

    References:
        Depeweg et al., ICML 2018, Eq. 6 (law of total variance);
        Lakshminarayanan et al., NeurIPS 2017, Sec. 2.4 (mixture of Gaussian members).
    """
    _check_members(member_means, "member_means", min_dim=1)
    means = member_means.to(torch.float64)
    mean = means.mean(0)
    epistemic = (means - mean).square().mean(0)
    if member_variances is None:
        variances = None
        aleatoric = torch.zeros_like(mean)
    else:
        _check_members(member_variances, "member_variances", min_dim=1)
        if member_variances.shape != member_means.shape:
            raise ValueError(
                f"member_variances of shape {tuple(member_variances.shape)} must have the shape of member_means "
                f"{tuple(member_means.shape)}; gaussian_head(output) splits a head's output into both."
            )
        variances = member_variances.to(torch.float64)
        if torch.any(variances < 0):
            raise ValueError(
                f"member_variances has negative entries (down to {float(variances.min()):.3g}); pass variances, "
                "not log-variances (gaussian_head(output, variance='log') converts them)."
            )
        aleatoric = variances.mean(0)
    dtype = _result_dtype(member_means)
    return RegressionUncertainty(
        mean=mean.to(dtype),
        total_variance=(aleatoric + epistemic).to(dtype),
        aleatoric_variance=aleatoric.to(dtype),
        epistemic_variance=epistemic.to(dtype),
        member_means=means,
        member_variances=variances,
    )
