"""``predictive/heads.py``: a Gaussian head's raw output split into mean and variance."""

import pytest
import torch

from bayesify.predictive.heads import gaussian_head


@pytest.mark.parametrize(
    "variance, expected",
    [("log", torch.exp), ("softplus", torch.nn.functional.softplus), ("variance", lambda v: v), ("std", torch.square)],
)
def test_gaussian_head_splits_mean_and_variance(variance, expected):
    raw = torch.rand(3, 4, dtype=torch.float64)  # [B, 2 * D] with D = 2
    mean, var = gaussian_head(raw, variance=variance)
    assert torch.equal(mean, raw[:, :2]) and torch.allclose(var, expected(raw[:, 2:]))


def test_gaussian_head_on_members_and_on_a_channel_axis():
    members = torch.randn(5, 8, 2)
    mean, var = gaussian_head(members)
    assert mean.shape == var.shape == (5, 8, 1) and mean.dtype == torch.float32
    dense = torch.randn(2, 6, 4, 4)  # [B, 2 * 3, H, W]: a per-pixel Gaussian head
    mean, var = gaussian_head(dense, axis=1)
    other_mean, other_var = gaussian_head(dense, axis=-3)
    assert mean.shape == (2, 3, 4, 4) and torch.equal(mean, other_mean) and torch.equal(var, other_var)
    assert torch.equal(mean, dense[:, :3]) and torch.allclose(var, dense[:, 3:].exp())


def test_gaussian_head_rejects_bad_input():
    with pytest.raises(ValueError, match="got size 3"):
        gaussian_head(torch.randn(4, 3))
    # the options it has: axis=, one tensor for a (mean, log_var) pair, a mean-only head's regression_uncertainty
    with pytest.raises(ValueError, match=r"as axis=, .* \(torch.cat\(\[mean, log_var\], axis\)\), .*regression_unc"):
        gaussian_head(torch.randn(4, 1))
    with pytest.raises(ValueError, match="negative values"):
        gaussian_head(torch.tensor([[0.0, -1.0]]), variance="std")
    with pytest.raises(ValueError, match="accepted"):
        gaussian_head(torch.randn(4, 2), variance="logvar")
    with pytest.raises(ValueError, match="axis=2"):
        gaussian_head(torch.randn(4, 2), axis=2)
