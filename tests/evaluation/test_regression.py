"""Regression metrics against hand-computed values, torch's Gaussian NLL, and samples of a known mixture."""

import math

import pytest
import torch

from bayesify.evaluation.regression import CALIBRATION_LEVELS, regression_metrics
from bayesify.predictive import regression_uncertainty


def _normal_log_density(y: float, mu: float, var: float) -> float:
    return -0.5 * (math.log(2 * math.pi * var) + (y - mu) ** 2 / var)


def test_point_metrics_by_hand_and_no_invented_noise_model():
    means = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], dtype=torch.float64)  # predictive mean 2, 2, 2
    targets = torch.tensor([2.0, 4.0, -1.0], dtype=torch.float64)
    m = regression_metrics(means, targets)
    assert m["rmse"] == pytest.approx(math.sqrt((0 + 4 + 9) / 3))
    assert m["mae"] == pytest.approx((0 + 2 + 3) / 3)
    assert m["epistemic_std"] == pytest.approx((1 + 0 + 1) / 3)
    assert m["nll"] is m["coverage"] is m["calibration_error"] is m["sharpness"] is None
    assert "member_variances" in m["note"]


def test_nll_is_the_mixture_density_by_hand():
    means = torch.tensor([[0.0, 1.0], [2.0, 1.5]], dtype=torch.float64)  # 2 members, 2 examples
    variances = torch.tensor([[1.0, 0.5], [4.0, 0.25]], dtype=torch.float64)
    targets = torch.tensor([0.5, 1.2], dtype=torch.float64)
    m = regression_metrics(means, targets, variances)
    expected = 0.0
    for n in range(2):
        density = sum(
            math.exp(_normal_log_density(targets[n].item(), means[s, n].item(), variances[s, n].item()))
            for s in range(2)
        )
        expected += -math.log(density / 2) / 2
    assert m["nll"] == pytest.approx(expected, abs=1e-12)
    assert m["sharpness"] == pytest.approx(float(regression_uncertainty(means, variances).std.mean()), abs=1e-15)


def test_one_member_nll_equals_torch_gaussian_nll():
    generator = torch.Generator().manual_seed(0)
    mean = torch.randn(50, generator=generator, dtype=torch.float64)
    var = torch.rand(50, generator=generator, dtype=torch.float64) + 0.1
    y = torch.randn(50, generator=generator, dtype=torch.float64)
    reference = torch.nn.GaussianNLLLoss(full=True)(mean, y, var)
    assert regression_metrics(mean[None], y, var[None])["nll"] == pytest.approx(float(reference), abs=1e-12)


def test_multi_output_nll_is_the_joint_density_per_example():
    generator = torch.Generator().manual_seed(1)
    means = torch.randn(3, 4, 2, generator=generator, dtype=torch.float64)  # [S, N, D]
    variances = torch.rand(3, 4, 2, generator=generator, dtype=torch.float64) + 0.2
    targets = torch.randn(4, 2, generator=generator, dtype=torch.float64)
    m = regression_metrics(means, targets, variances)
    expected = 0.0
    for n in range(4):
        density = 0.0
        for s in range(3):
            log_joint = sum(
                _normal_log_density(targets[n, d].item(), means[s, n, d].item(), variances[s, n, d].item())
                for d in range(2)
            )
            density += math.exp(log_joint) / 3
        expected += -math.log(density) / 4
    assert m["nll"] == pytest.approx(expected, abs=1e-12)
    assert m["rmse"] == pytest.approx(float((means.mean(0) - targets).square().mean().sqrt()))


def _mixture_and_draws(scale: float, draws: int = 4000) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gaussian members for ``draws`` examples and targets drawn from their mixture with noise times ``scale``."""
    generator = torch.Generator().manual_seed(2)
    means = torch.randn(4, draws, generator=generator, dtype=torch.float64) * 2
    variances = torch.rand(4, draws, generator=generator, dtype=torch.float64) + 0.1
    member = torch.randint(4, (1, draws), generator=generator)
    noise = torch.randn(1, draws, generator=generator, dtype=torch.float64)
    targets = (means.gather(0, member) + scale * variances.gather(0, member).sqrt() * noise)[0]
    return means, variances, targets


def test_targets_from_the_predictive_are_covered_at_each_level_and_calibrated():
    means, variances, targets = _mixture_and_draws(scale=1.0)
    m = regression_metrics(means, targets, variances, levels=(0.5, 0.9, 0.95))
    for level, covered in m["coverage"].items():
        assert abs(covered - level) < 4 * math.sqrt(level * (1 - level) / targets.numel()), (level, covered)
    assert m["calibration_error"] < 0.02
    # twice the noise the members predict: intervals too narrow, coverage low, calibration error large
    means, variances, targets = _mixture_and_draws(scale=2.0)
    too_noisy = regression_metrics(means, targets, variances)
    assert too_noisy["coverage"][0.9] < 0.8 and too_noisy["calibration_error"] > 3 * m["calibration_error"] + 0.03


def test_coverage_is_the_fraction_inside_the_uncertainty_intervals():
    means, variances, targets = _mixture_and_draws(scale=1.5, draws=500)
    m = regression_metrics(means, targets, variances, levels=(0.3, 0.8))
    u = regression_uncertainty(means, variances)
    for level in (0.3, 0.8):
        lower, upper = u.interval(level)
        assert m["coverage"][level] == ((targets >= lower) & (targets <= upper)).double().mean().item()
    calibration = sum(
        abs(p - regression_metrics(means, targets, variances, levels=(p,))["coverage"][p]) for p in CALIBRATION_LEVELS
    )
    assert m["calibration_error"] == pytest.approx(calibration / 19, abs=1e-15)


def test_bad_input_is_refused():
    means, variances = torch.randn(3, 5), torch.rand(3, 5) + 0.1
    with pytest.raises(ValueError, match="squeeze or unsqueeze"):
        regression_metrics(means, torch.randn(5, 1), variances)
    with pytest.raises(ValueError, match="must be > 0"):
        regression_metrics(means, torch.randn(5), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        regression_metrics(means, torch.randn(5), variances, levels=(90,))
    with pytest.raises(ValueError, match="members first"):
        regression_metrics(torch.randn(5), torch.randn(5))
    with pytest.raises(TypeError, match="real-valued"):
        regression_metrics(means, [0.0] * 5)


def test_targets_in_another_layout_than_the_predictions_are_refused_not_reshaped():
    from bayesify.evaluation import task_metrics

    torch.manual_seed(0)
    outputs = torch.randn(4, 6, 2)  # [S, N, D]
    targets = outputs.mean(0)
    exact = task_metrics("regression", outputs, targets)
    with pytest.raises(ValueError, match=r"targets of shape \(2, 6\) do not fit .* predictions of shape \(6, 2\)"):
        task_metrics("regression", outputs, targets.T.contiguous())  # reshaped, it read the values in the wrong order
    with pytest.raises(ValueError, match=r"targets of shape \(6,\) do not fit"):
        task_metrics("regression", outputs, targets[:, 0])
    single = task_metrics("regression", outputs[..., :1], targets[:, 0])  # [N] for [N, 1]: the same targets
    assert single["rmse"] == pytest.approx(task_metrics("regression", outputs[..., :1], targets[:, :1])["rmse"])
    assert exact["rmse"] < 1e-6


def test_the_note_of_a_point_regression_names_the_gaussian_task():
    metrics = regression_metrics(torch.randn(3, 5), torch.randn(5))
    assert "task='gaussian'" in metrics["note"]
