"""``predictive/decompositions.py``: the uncertainty decompositions against their formulas on fixed members (float64),
and bad input."""

import importlib
import math
from statistics import NormalDist

import pytest
import torch

from bayesify.predictive.decompositions import (
    BinaryUncertainty,
    ClassificationUncertainty,
    RegressionUncertainty,
    binary_uncertainty,
    classification_uncertainty,
    mixture_cdf,
    mixture_quantile,
    regression_uncertainty,
)

# 2 members, 2 examples, 3 classes, written out so every number below can be checked by hand
P = torch.tensor(
    [
        [[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]],  # member 0
        [[0.1, 0.25, 0.65], [0.5, 0.25, 0.25]],  # member 1: disagrees on example 0, agrees on example 1
    ],
    dtype=torch.float64,
)


def _h(*probs: float) -> float:
    return -sum(p * math.log(p) for p in probs if p > 0)


def test_classification_decomposition_by_hand():
    u = classification_uncertainty(P.log(), log_probs=True)
    assert isinstance(u, ClassificationUncertainty)
    assert torch.allclose(u.probs, torch.tensor([[0.4, 0.225, 0.375], [0.5, 0.25, 0.25]], dtype=torch.float64))
    # example 0: the mixture (.4, .225, .375) and the mean of the two members' entropies
    total0, aleatoric0 = _h(0.4, 0.225, 0.375), (_h(0.7, 0.2, 0.1) + _h(0.1, 0.25, 0.65)) / 2
    # example 1: members agree, so the mixture is the member and there is no epistemic part
    total1 = aleatoric1 = _h(0.5, 0.25, 0.25)
    assert u.predictive_entropy.tolist() == pytest.approx([total0, total1], abs=1e-14)
    assert u.expected_entropy.tolist() == pytest.approx([aleatoric0, aleatoric1], abs=1e-14)
    assert u.mutual_information.tolist() == pytest.approx([total0 - aleatoric0, 0.0], abs=1e-14)
    # the mixture's argmax of example 0 is class 0; member 1 says class 2
    assert u.variation_ratio.tolist() == [0.5, 0.0]
    assert u.prediction.tolist() == [0, 0] and u.confidence.tolist() == pytest.approx([0.4, 0.5])


def test_random_members_match_a_per_member_loop_and_decompose_exactly():
    torch.manual_seed(0)
    logits = 3 * torch.randn(6, 20, 5, dtype=torch.float64)
    u = classification_uncertainty(logits)
    probs = [logits[s].softmax(-1) for s in range(6)]
    mixture = sum(probs) / 6
    for n in range(20):
        expected = sum(_h(*p[n].tolist()) for p in probs) / 6
        assert float(u.predictive_entropy[n]) == pytest.approx(_h(*mixture[n].tolist()), abs=1e-12)
        assert float(u.expected_entropy[n]) == pytest.approx(expected, abs=1e-12)
        votes = [int(p[n].argmax()) for p in probs]
        modal = max(votes.count(c) for c in set(votes))  # Gal's: the most-voted class's share
        assert float(u.variation_ratio[n]) == pytest.approx(1 - modal / 6, abs=1e-15)
    assert torch.allclose(u.predictive_entropy, u.expected_entropy + u.mutual_information, atol=1e-14)
    # bounds: 0 <= aleatoric <= total <= log C, and the epistemic part is at most log S
    assert torch.all(u.expected_entropy >= 0) and torch.all(u.expected_entropy <= u.predictive_entropy)
    assert torch.all(u.predictive_entropy <= math.log(5)) and torch.all(u.mutual_information <= math.log(6))


def test_variation_ratio_is_gals_the_most_voted_class_not_the_mixtures_argmax():
    # members vote 8, 9, 8, 8; member 1 is so sure of 9 that the mixture's argmax is 9
    logits = torch.full((4, 1, 10), -10.0, dtype=torch.float64)
    logits[[0, 2, 3], 0, 8], logits[[0, 2, 3], 0, 9] = 0.0, -0.1
    logits[1, 0, 9] = 10.0
    u = classification_uncertainty(logits)
    assert logits.argmax(-1).flatten().tolist() == [8, 9, 8, 8] and u.prediction.tolist() == [9]
    assert u.variation_ratio.tolist() == [0.25]  # 1 - 3/4; the mixture's argmax would give 1 - 1/4
    # the same votes per label of a sigmoid output: 1 - 3/4 for [+, -, +, +] whatever the mixture decides
    sigmoid = torch.tensor([[0.1], [-20.0], [0.1], [0.1]], dtype=torch.float64)
    b = binary_uncertainty(sigmoid)
    assert b.prediction.tolist() == [False] and b.variation_ratio.tolist() == [0.25]
    # and a sigmoid output as a two-class softmax: the same variation ratio
    as_softmax = classification_uncertainty(torch.stack([torch.zeros_like(sigmoid), sigmoid], -1))
    assert torch.equal(b.variation_ratio, as_softmax.variation_ratio)


def test_mutual_information_is_zero_when_all_members_agree():
    member = torch.randn(1, 7, 4, dtype=torch.float64)
    u = classification_uncertainty(member.expand(5, -1, -1) + torch.randn(5, 1, 1, dtype=torch.float64))
    # adding a per-member constant to all logits of an example leaves its softmax unchanged
    assert torch.all(u.mutual_information.abs() < 1e-14) and torch.all(u.variation_ratio == 0)
    assert torch.allclose(u.predictive_entropy, u.expected_entropy, atol=1e-14)


def test_a_class_of_probability_zero_contributes_zero_entropy():
    log_probs = torch.tensor([[[0.0, -math.inf]], [[math.log(0.5), math.log(0.5)]]], dtype=torch.float64)
    u = classification_uncertainty(log_probs, log_probs=True)
    assert u.expected_entropy.tolist() == pytest.approx([_h(0.5, 0.5) / 2])
    assert u.predictive_entropy.tolist() == pytest.approx([_h(0.75, 0.25)])


@pytest.mark.parametrize("class_axis", [1, -3])
def test_segmentation_class_axis_one_is_per_pixel(class_axis):
    torch.manual_seed(1)
    members = torch.randn(4, 2, 3, 5, 6, dtype=torch.float64)  # [S, B, C, H, W]
    u = classification_uncertainty(members, class_axis=class_axis)
    reference = classification_uncertainty(members.movedim(2, -1))  # classes last: [S, B, H, W, C]
    assert u.class_axis == 1 and u.probs.shape == (2, 3, 5, 6)
    assert torch.allclose(u.probs, reference.probs.movedim(-1, 1))
    for name in ("predictive_entropy", "expected_entropy", "mutual_information", "variation_ratio"):
        assert getattr(u, name).shape == (2, 5, 6)
        assert torch.allclose(getattr(u, name), getattr(reference, name), atol=1e-14), name
    assert torch.equal(u.prediction, u.probs.argmax(1))


def test_log_probs_and_kept_members():
    logits = torch.randn(3, 4, 6, dtype=torch.float64)
    from_logits = classification_uncertainty(logits, keep_members=True)
    from_log_probs = classification_uncertainty(logits.log_softmax(-1), log_probs=True)
    assert torch.allclose(from_logits.predictive_entropy, from_log_probs.predictive_entropy)
    assert torch.allclose(from_logits.member_probs, logits.softmax(-1))
    assert from_log_probs.member_probs is None


def test_result_dtype_is_float64_for_float64_and_float32_otherwise():
    logits = torch.randn(3, 4, 5)
    for dtype, expected in [
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ]:
        u = classification_uncertainty(logits.to(dtype))
        assert u.probs.dtype == u.mutual_information.dtype == u.variation_ratio.dtype == expected
        assert binary_uncertainty(logits.to(dtype)).probs.dtype == expected
        assert regression_uncertainty(logits.to(dtype)).mean.dtype == expected


def test_classification_rejects_bad_input():
    with pytest.raises(ValueError, match="class_axis=2 is out of range"):
        classification_uncertainty(torch.randn(3, 4, 5), class_axis=2)
    with pytest.raises(ValueError, match="no member axis"):
        classification_uncertainty(torch.randn(5))
    with pytest.raises(ValueError, match="log_probs=True"):
        classification_uncertainty(torch.randn(3, 4, 5), log_probs=True)
    with pytest.raises(TypeError, match="floating-point"):
        classification_uncertainty(torch.randint(5, (3, 4, 5)))
    with pytest.raises(TypeError, match="class_axis"):
        classification_uncertainty(torch.randn(3, 4, 5), class_axis=1.0)
    with pytest.raises(ValueError, match="use binary_uncertainty"):
        classification_uncertainty(torch.randn(3, 4, 1))


def test_binary_decomposition_by_hand_and_as_a_two_class_softmax():
    logits = torch.tensor([[[2.0, -1.0]], [[-2.0, -1.0]]], dtype=torch.float64)  # 2 members, 1 example, 2 labels
    u = binary_uncertainty(logits)
    assert isinstance(u, BinaryUncertainty) and u.probs.shape == (1, 2)
    p = torch.sigmoid(logits)
    for label in range(2):
        p0, p1 = float(p[0, 0, label]), float(p[1, 0, label])
        mixture = (p0 + p1) / 2
        assert float(u.probs[0, label]) == pytest.approx(mixture, abs=1e-15)
        assert float(u.predictive_entropy[0, label]) == pytest.approx(_h(mixture, 1 - mixture), abs=1e-14)
        assert float(u.expected_entropy[0, label]) == pytest.approx((_h(p0, 1 - p0) + _h(p1, 1 - p1)) / 2, abs=1e-14)
    # label 0: members decide 1 and 0, the mixture (0.5 exactly) decides 0: one of two members differs
    assert u.variation_ratio.tolist() == [[0.5, 0.0]]
    # sigmoid(z) is the class-1 probability of softmax([0, z]): the same decomposition
    as_softmax = classification_uncertainty(torch.stack([torch.zeros_like(logits), logits], -1))
    assert torch.allclose(u.mutual_information, as_softmax.mutual_information, atol=1e-14)
    assert torch.allclose(u.predictive_entropy, as_softmax.predictive_entropy, atol=1e-14)


def test_binary_is_stable_at_extreme_logits_and_zero_when_members_agree():
    logits = torch.tensor([[80.0, -80.0, 0.3]], dtype=torch.float64).expand(4, 3)
    u = binary_uncertainty(logits)
    assert torch.all(torch.isfinite(u.predictive_entropy)) and torch.all(u.mutual_information.abs() < 1e-15)
    assert u.predictive_entropy[:2].tolist() == pytest.approx([81 * math.exp(-80)] * 2, rel=1e-6)
    assert torch.all(u.predictive_entropy <= math.log(2))


def _gaussian_cdf(x: float, mu: float, var: float) -> float:
    return 0.5 * (1 + math.erf((x - mu) / math.sqrt(2 * var)))


def test_law_of_total_variance_by_hand():
    means = torch.tensor([[1.0, 0.0], [3.0, 0.0], [5.0, 0.0]], dtype=torch.float64)  # 3 members, 2 outputs
    variances = torch.tensor([[0.5, 1.0], [1.0, 2.0], [1.5, 3.0]], dtype=torch.float64)
    u = regression_uncertainty(means, variances)
    assert isinstance(u, RegressionUncertainty)
    assert u.mean.tolist() == [3.0, 0.0]
    assert u.aleatoric_variance.tolist() == [1.0, 2.0]
    assert u.epistemic_variance.tolist() == pytest.approx([8 / 3, 0.0])  # ((-2)^2 + 0 + 2^2) / 3
    assert torch.allclose(u.total_variance, u.aleatoric_variance + u.epistemic_variance)
    # the mixture's variance by its definition: E[y^2] - E[y]^2 with E[y^2] = mean_s(var_s + mu_s^2)
    second_moment = (variances + means**2).mean(0)
    assert torch.allclose(u.total_variance, second_moment - u.mean**2)
    assert torch.allclose(u.std, u.total_variance.sqrt())


def test_mean_only_members_have_no_aleatoric_part_and_a_gaussian_interval():
    means = torch.tensor([[1.0], [2.0], [6.0]], dtype=torch.float64)
    u = regression_uncertainty(means)
    assert u.aleatoric_variance.tolist() == [0.0] and u.epistemic_variance.tolist() == pytest.approx([14 / 3])
    lower, upper = u.interval(0.9)
    z = NormalDist().inv_cdf(0.95)
    assert lower.tolist() == pytest.approx([3 - z * math.sqrt(14 / 3)]) and upper.tolist() == pytest.approx(
        [3 + z * math.sqrt(14 / 3)]
    )
    with pytest.raises(ValueError, match="one mean-only member"):
        regression_uncertainty(means[:1]).interval()


def test_epistemic_variance_is_zero_when_members_agree():
    u = regression_uncertainty(torch.full((4, 3), 2.5, dtype=torch.float64), torch.ones(4, 3, dtype=torch.float64))
    assert torch.all(u.epistemic_variance == 0) and torch.equal(u.total_variance, u.aleatoric_variance)


def test_interval_bounds_are_the_exact_mixture_quantiles():
    means = torch.tensor([[-2.0, 0.0], [1.0, 0.0], [4.0, 10.0]], dtype=torch.float64)
    variances = torch.tensor([[1.0, 0.25], [0.5, 0.25], [4.0, 1.0]], dtype=torch.float64)
    lower, upper = regression_uncertainty(means, variances).interval(0.8)

    def cdf(x: float, d: int) -> float:
        return sum(_gaussian_cdf(x, float(means[s, d]), float(variances[s, d])) for s in range(3)) / 3

    for d in range(2):
        assert cdf(float(lower[d]), d) == pytest.approx(0.1, abs=1e-12)
        assert cdf(float(upper[d]), d) == pytest.approx(0.9, abs=1e-12)
    # one Gaussian member: the textbook mu +- z sigma
    lower, upper = regression_uncertainty(means[:1], variances[:1]).interval(0.95)
    z = NormalDist().inv_cdf(0.975)
    assert torch.allclose(upper, means[0] + z * variances[0].sqrt(), atol=1e-12)
    assert torch.allclose(lower, means[0] - z * variances[0].sqrt(), atol=1e-12)


@pytest.mark.parametrize("level", [0.5, 0.9, 0.95])
def test_interval_covers_samples_of_the_mixture_at_its_level(level):
    generator = torch.Generator().manual_seed(2)
    means = torch.tensor([[-1.0, 3.0], [0.5, 3.0], [2.0, -4.0], [2.5, 3.0]], dtype=torch.float64)
    variances = torch.tensor([[0.3, 1.0], [1.0, 0.1], [0.2, 2.0], [0.5, 0.5]], dtype=torch.float64)
    draws = 40_000
    member = torch.randint(4, (draws, 2), generator=generator)
    samples = means.gather(0, member) + variances.gather(0, member).sqrt() * torch.randn(
        draws, 2, generator=generator, dtype=torch.float64
    )
    lower, upper = regression_uncertainty(means, variances).interval(level)
    covered = ((samples >= lower) & (samples <= upper)).to(torch.float64).mean(0)
    tolerance = 4 * math.sqrt(level * (1 - level) / draws)  # 4 binomial standard errors
    assert torch.all((covered - level).abs() < tolerance), covered


def _bisection_quantile(q: float, means: torch.Tensor, stds: torch.Tensor) -> torch.Tensor:
    """The reference: plain bisection of the mixture CDF on a wide bracket, 200 halvings."""
    low, high = means.amin(0) - 50 * stds.amax(0) - 1, means.amax(0) + 50 * stds.amax(0) + 1
    for _ in range(200):
        middle = (low + high) / 2
        below = mixture_cdf(middle, means, stds) < q
        low, high = torch.where(below, middle, low), torch.where(below, high, middle)
    return (low + high) / 2


@pytest.mark.parametrize("q", [0.01, 0.3, 0.5, 0.975])
def test_mixture_quantile_matches_plain_bisection(q):
    generator = torch.Generator().manual_seed(4)
    means = torch.randn(5, 300, generator=generator, dtype=torch.float64) * 10
    stds = torch.rand(5, 300, generator=generator, dtype=torch.float64) * 3
    stds[0, :100] = 0.0  # point masses
    stds[1, 100:200] = 1e-6  # very narrow members next to wide ones
    means[2, 200:] = 1e4  # one member far from the others
    reference = _bisection_quantile(q, means, stds)
    assert torch.allclose(mixture_quantile(q, means, stds), reference, rtol=0, atol=1e-7)


def test_point_mass_members_have_step_quantiles():
    means, stds = torch.tensor([[0.0], [1.0]], dtype=torch.float64), torch.zeros(2, 1, dtype=torch.float64)
    assert mixture_quantile(0.25, means, stds).item() == pytest.approx(0.0, abs=1e-12)
    assert mixture_quantile(0.75, means, stds).item() == pytest.approx(1.0, abs=1e-12)
    assert mixture_cdf(torch.tensor([0.5], dtype=torch.float64), means, stds).item() == 0.5


def test_regression_rejects_bad_input():
    with pytest.raises(ValueError, match="must have the shape of member_means"):
        regression_uncertainty(torch.randn(3, 4), torch.rand(3, 4, 1))
    with pytest.raises(ValueError, match="negative"):
        regression_uncertainty(torch.randn(3, 4), -torch.rand(3, 4))
    with pytest.raises(ValueError, match="level"):
        regression_uncertainty(torch.randn(3, 4), torch.rand(3, 4)).interval(95)
    with pytest.raises(ValueError, match="no member axis"):
        regression_uncertainty(torch.tensor(1.0))


def test_the_decompositions_are_importable_from_bayesify_uncertainty():
    documented = importlib.import_module("bayesify.uncertainty")  # (the attribute bayesify.uncertainty is the function)

    for fn in (classification_uncertainty, binary_uncertainty, regression_uncertainty, mixture_cdf, mixture_quantile):
        assert getattr(documented, fn.__name__) is fn
    assert documented.gaussian_head.__module__ == "bayesify.predictive.heads"


def test_a_nan_member_output_gives_nan_uncertainty_not_certainty() -> None:
    # 0 * log of a NaN probability was taken as 0 log 0: a NaN input's entropy, mutual information and variation
    # ratio came out 0, the most certain of all (ranked first in distribution by an OOD score)
    logits = torch.randn(4, 3, 5)
    logits[:, 1] = float("nan")
    for u in (classification_uncertainty(logits), binary_uncertainty(logits)):
        for name in ("predictive_entropy", "expected_entropy", "mutual_information", "variation_ratio"):
            value = getattr(u, name)
            assert value[1].isnan().all() and not value[[0, 2]].isnan().any(), name
    zero = torch.full((2, 1, 3), -torch.inf)
    zero[..., 0] = 0.0  # a class of probability 0: 0 log 0 = 0 still
    assert classification_uncertainty(zero).predictive_entropy.item() == 0.0
