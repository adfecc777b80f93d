"""KL divergences against numerical integration of q log(q / p), in float64."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import bayesify

from bayesify.options import Posterior, Prior
from bayesify.variational import kl_cauchy_cauchy, kl_divergence, kl_normal_cauchy, kl_normal_normal, log_prob


def _numerical_kl(q: str, loc_q: float, scale_q: float, p: str, loc_p: float, scale_p: float) -> float:
    # x = loc_q + scale_q * tan(theta) maps (-pi/2, pi/2) onto the real line, so heavy tails are covered
    theta = torch.linspace(-math.pi / 2, math.pi / 2, 400_001, dtype=torch.float64)[1:-1]
    x = loc_q + scale_q * torch.tan(theta)
    jacobian = scale_q / torch.cos(theta) ** 2
    log_q = log_prob(Posterior(q), x, loc_q, scale_q)
    log_p = log_prob(Prior(p), x, loc_p, scale_p)
    integrand = torch.exp(log_q) * (log_q - log_p) * jacobian
    return float(torch.trapezoid(integrand, theta))


CASES = [(1.0, 0.03, 1.0, 0.1), (0.7, 0.5, 1.0, 0.1), (1.3, 0.01, 1.0, 1.0), (-2.0, 2.0, 1.0, 0.05)]


@pytest.mark.parametrize("loc_q,scale_q,loc_p,scale_p", CASES)
def test_normal_normal(loc_q: float, scale_q: float, loc_p: float, scale_p: float) -> None:
    value = kl_normal_normal(torch.tensor(loc_q, dtype=torch.float64), torch.tensor(scale_q, dtype=torch.float64), loc_p, scale_p)
    assert math.isclose(float(value), _numerical_kl("normal", loc_q, scale_q, "normal", loc_p, scale_p), rel_tol=1e-5)


@pytest.mark.parametrize("loc_q,scale_q,loc_p,scale_p", CASES)
def test_cauchy_cauchy_closed_form(loc_q: float, scale_q: float, loc_p: float, scale_p: float) -> None:
    value = kl_cauchy_cauchy(torch.tensor(loc_q, dtype=torch.float64), torch.tensor(scale_q, dtype=torch.float64), loc_p, scale_p)
    assert math.isclose(float(value), _numerical_kl("cauchy", loc_q, scale_q, "cauchy", loc_p, scale_p), rel_tol=1e-4)


@pytest.mark.parametrize("loc_q,scale_q,loc_p,scale_p", [(1.0, 0.03, 1.0, 0.1), (0.7, 0.2, 1.0, 0.1), (3.0, 1.0, 1.0, 1.0)])
def test_normal_cauchy_quadrature(loc_q: float, scale_q: float, loc_p: float, scale_p: float) -> None:
    value = kl_normal_cauchy(torch.tensor(loc_q, dtype=torch.float64), torch.tensor(scale_q, dtype=torch.float64), loc_p, scale_p)
    assert math.isclose(float(value), _numerical_kl("normal", loc_q, scale_q, "cauchy", loc_p, scale_p), rel_tol=1e-4)


def test_kl_is_zero_at_the_prior_and_positive_elsewhere() -> None:
    loc, scale = torch.tensor([1.0, 1.5]), torch.tensor([0.1, 0.1])
    for posterior, prior in [(Posterior.NORMAL, Prior.NORMAL), (Posterior.CAUCHY, Prior.CAUCHY)]:
        kl = kl_divergence(posterior, loc[:1], scale[:1], prior, 1.0, 0.1)
        assert abs(float(kl)) < 1e-6
        assert float(kl_divergence(posterior, loc, scale, prior, 1.0, 0.1)) > 0.1
    assert float(kl_divergence(Posterior.DELTA, loc, None, Prior.NORMAL, 1.0, 0.1)) == 0.0


def test_extreme_parameters_stay_finite_with_finite_gradients() -> None:
    loc = torch.tensor([1e6, -1e6, 1.0, 1.0], requires_grad=True)
    scale = torch.tensor([1e-7, 1e6, 1e-7, 1e6], requires_grad=True)
    for fn in (kl_normal_normal, kl_cauchy_cauchy, kl_normal_cauchy):
        value = fn(loc, scale, 1.0, 0.1).sum()
        (g_loc, g_scale) = torch.autograd.grad(value, (loc, scale))
        assert torch.isfinite(value), fn.__name__
        assert torch.isfinite(g_loc).all() and torch.isfinite(g_scale).all(), fn.__name__


def test_cauchy_posterior_with_normal_prior_is_refused() -> None:
    with pytest.raises(ValueError, match="prior='cauchy'"):
        kl_divergence(Posterior.CAUCHY, torch.zeros(1), torch.ones(1), Prior.NORMAL, 1.0, 0.1)


@pytest.mark.parametrize(
    "options",
    [{}, {"prior": "cauchy"}, {"posterior": "cauchy", "prior": "cauchy"}, {"posterior": "delta"}, {"embeddings": True}],
)
def test_model_kl_is_the_sum_of_its_layers_kl(options) -> None:
    # bayesify.kl_divergence(model) concatenates factors that share a prior; the total is unchanged
    model = nn.Sequential(nn.Embedding(7, 6), nn.Linear(6, 5), nn.LSTM(5, 4), nn.Conv1d(4, 3, 2))
    bayesify.convert(model, components=3, exclude="1", **options)
    # a second prior (a second conversion takes the model's layer options not said: these are said)
    bayesify.convert(model, components=3, include="1", prior="normal", posterior="normal", prior_std=0.3, prior_mean=0.5)
    with torch.no_grad():
        for p in bayesify.rank1_parameters(model):
            p.add_(0.3 * torch.randn_like(p))
    per_layer = torch.stack([layer.kl_divergence() for _, layer in bayesify.rank1_layers(model)]).sum()
    total = bayesify.kl_divergence(model)
    torch.testing.assert_close(total, per_layer, rtol=1e-5, atol=1e-6)
    assert total > 0  # layer "1" has a Normal posterior whatever the others have
    total.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".rho" in n or "rank1_std" in n)


@pytest.mark.parametrize("prior_mean,prior_std", [(1.0, 0.1), (0.0, 0.3)])
def test_summed_normal_kl_equals_the_elementwise_formula(prior_mean: float, prior_std: float) -> None:
    # the model's KL takes the default pair as one autograd Function (fewer ops); its value and gradients
    # are those of kl_normal_normal after the softplus, and its gradient's gradient too
    from bayesify.variational.distributions import scale as positive_scale
    from bayesify.variational.divergence import normal_kl_sum

    torch.manual_seed(0)
    loc = (prior_mean + 0.3 * torch.randn(4, 7, dtype=torch.float64)).requires_grad_()
    raw = (torch.randn(4, 7, dtype=torch.float64) - 3.0).requires_grad_()
    fused = normal_kl_sum(loc, raw, prior_mean, prior_std)
    plain = kl_normal_normal(loc, positive_scale(raw), prior_mean, prior_std).sum()
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(fused, (loc, raw)), torch.autograd.grad(plain, (loc, raw))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    fn = lambda l, r: normal_kl_sum(l, r, prior_mean, prior_std)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (loc, raw))
    assert torch.autograd.gradgradcheck(fn, (loc, raw))
    with torch.no_grad():
        assert float(normal_kl_sum(loc, raw, prior_mean, prior_std)) == pytest.approx(float(plain), rel=1e-12)
    # float32, extreme values: finite, and the value as the elementwise formula's
    loc32 = torch.tensor([1e6, -1e6, 1.0, 1.0], requires_grad=True)
    raw32 = torch.tensor([-100.0, 1e6, -100.0, 1e6], requires_grad=True)
    value = normal_kl_sum(loc32, raw32, prior_mean, prior_std)
    g_loc, g_raw = torch.autograd.grad(value, (loc32, raw32))
    assert torch.isfinite(value) and torch.isfinite(g_loc).all() and torch.isfinite(g_raw).all()
    expected = kl_normal_normal(loc32.double(), positive_scale(raw32.double()), prior_mean, prior_std).sum()
    assert float(value.detach()) == pytest.approx(float(expected), rel=1e-5)
