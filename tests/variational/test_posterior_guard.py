"""Guards on what a training step samples and how its gradient flows (issue 26, item 5).

A refactor of how the factors are stored or drawn must leave the training objective's maths alone:

* every training row gets its own draw of r and s from ITS component's posterior (no noise shared between
  rows, between layers or between passes; the scale of the right component and feature);
* the reparameterisation gradient reaches loc AND rho through the very noise the forward pass used:
  d/d loc = sum of the upstream gradient over the component's rows, d/d rho = the same sum weighted
  by eps * sigmoid(rho);
* ``kl_loss`` is the closed-form Normal KL of the factors, with its gradient;
* every factor's loc and rho are trainable parameters that an optimizer step moves.

The checks read the draws back from the outputs of a net built so that they show them (identity weights,
an input of ones: a layer's output is s * r per row), and use the public API only. Seeded: fast
(a few seconds on one CPU thread) and deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesify

K, D = 4, 32


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

PRIOR_STD = 0.2


class TwoHeads(nn.Module):
    """Two parallel bias-free Linear layers on the same input, outputs side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D, bias=False)
        self.b = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], -1)


def _grad(factor: nn.Module, name: str) -> torch.Tensor | None:
    """A factor's gradient: its own Parameter's."""
    return getattr(factor, name).grad


def _raw(scale: torch.Tensor) -> torch.Tensor:
    """rho with softplus(rho) + 1e-7 == scale."""
    s = scale - 1e-7
    return s + torch.log(-torch.expm1(-s))


# the posterior the checks set: layer a samples s (r nearly fixed), layer b samples r (s nearly fixed);
# the sampled factor's mean tells the component apart (1, 3, 5, 7), its scale differs per component and feature
LOC = (1.0 + 2.0 * torch.arange(K, dtype=torch.float32))[:, None].expand(K, D).contiguous()
SCALE = 0.05 * (1 + torch.arange(K, dtype=torch.float32))[:, None] * (1 + torch.arange(D, dtype=torch.float32) / D)
TINY = 1e-6  # the other factor's scale: s * r == the sampled factor to ~1e-6


def _net(sampling: str) -> nn.Module:
    torch.manual_seed(0)
    net = bayesify.convert(TwoHeads(), components=K, task="regression", sampling=sampling, prior_std=PRIOR_STD)
    layers = dict(bayesify.rank1_layers(net))
    with torch.no_grad():
        for name, noisy in (("a", "rank1_s"), ("b", "rank1_r")):
            layer = layers[name]
            layer.weight.copy_(torch.eye(D))
            for fname in ("rank1_s", "rank1_r"):
                f = getattr(layer, fname)
                if fname == noisy:
                    f.loc.copy_(LOC)
                    f.rho.copy_(_raw(SCALE))
                else:
                    f.loc.fill_(1.0)
                    f.rho.fill_(float(_raw(torch.tensor(TINY))))
    return net.train()


def _noisy(net: nn.Module) -> dict[str, nn.Module]:
    layers = dict(bayesify.rank1_layers(net))
    return {"a": layers["a"].rank1_s, "b": layers["b"].rank1_r}


def _eps(out: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each layer's standardised draw per row and the component each row went through (told by the mean)."""
    eps, comps = {}, {}
    for name, cols in (("a", slice(0, D)), ("b", slice(D, 2 * D))):
        v = out[:, cols].detach()
        k = ((v.mean(1) - 1.0) / 2.0).round().long()
        assert bool(((k >= 0) & (k < K)).all()), "a row's draw is not near any component's mean"
        e = (v - LOC[k]) / SCALE[k]
        assert float(e.abs().max()) < 7, "a row's draw is far from its component's posterior"
        eps[name], comps[name] = e, k
    return eps, comps


def _check_standard(e: torch.Tensor, what: str) -> None:
    n = e.numel()
    assert abs(float(e.mean())) < 5 / math.sqrt(n), f"{what}: noise mean {float(e.mean()):.4f} (n={n})"
    var = float(e.var())
    assert abs(var - 1) < 6 * math.sqrt(2 / n) + 0.01, f"{what}: noise variance {var:.4f}, expected 1 (n={n})"


def _corr(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.flatten() - x.mean(), y.flatten() - y.mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


def test_training_draws_per_row_are_independent_and_scaled_by_their_component() -> None:
    """The reference's route (sampling='example'): one draw per row, from the row's component."""
    torch.manual_seed(1)
    net = _net("example")
    x = torch.ones(2048, D)
    out = net(x)
    eps, comps = _eps(out)
    assert torch.equal(comps["a"], comps["b"]), "the two layers routed a row through different components"
    assert int(torch.bincount(comps["a"], minlength=K).min()) > 400, "a component got (almost) no training rows"
    for name, e in eps.items():
        _check_standard(e, f"layer {name}")
        for k in range(K):  # the scale of the row's own component (not another's, not gathered wrongly)
            _check_standard(e[comps[name] == k], f"layer {name}, component {k}")
        # one draw per row: neighbours, and rows of one component, uncorrelated
        assert abs(_corr(e[1:], e[:-1])) < 0.02, f"layer {name}: consecutive rows share noise"
        assert len(torch.unique(e, dim=0)) == e.shape[0], f"layer {name}: rows with identical draws"
        assert abs(_corr(e[:, 1:], e[:, :-1])) < 0.02, f"layer {name}: features share noise"
    assert abs(_corr(eps["a"], eps["b"])) < 0.02, "the two layers' draws are correlated (one draw shared)"
    # a second pass draws anew
    eps2, _ = _eps(net(x))
    assert abs(_corr(eps["a"], eps2["a"])) < 0.02 and abs(_corr(eps["b"], eps2["b"])) < 0.02, "a pass reused the noise of the last"


def test_training_draws_per_block_are_independent_across_passes_components_and_layers() -> None:
    """sampling='component': one draw per block of rows (= component) and pass, never reused."""
    torch.manual_seed(2)
    net = _net("component")
    x = torch.ones(8, D)
    per_pass = {"a": [], "b": []}
    for _ in range(300):
        eps, comps = _eps(net(x))
        for name, e in eps.items():
            order = torch.argsort(comps[name], stable=True)
            blocks = e[order].view(K, -1, D)  # [K, rows per block, D]: rows of one block share the draw
            assert float((blocks - blocks[:, :1]).abs().max()) < 1e-3, "rows of one block drew differently"
            per_pass[name].append(blocks[:, 0])
    draws = {name: torch.stack(v) for name, v in per_pass.items()}  # [passes, K, D]
    for name, e in draws.items():
        _check_standard(e, f"layer {name}")
        for k in range(K):
            _check_standard(e[:, k], f"layer {name}, component {k}")
        assert abs(_corr(e[1:], e[:-1])) < 0.05, f"layer {name}: a pass reused the last one's draw"
        assert abs(_corr(e[:, 1:], e[:, :-1])) < 0.05, f"layer {name}: components share one draw"
    assert abs(_corr(draws["a"], draws["b"])) < 0.05, "the two layers' draws are correlated (one draw shared)"


@pytest.mark.parametrize("sampling", ["auto", "example", "component"])
def test_reparameterisation_gradient_flows_through_the_noise_used(sampling: str) -> None:
    """d/d loc = sum_rows g; d/d rho = sum_rows g * eps * sigmoid(rho), eps the very draw of the forward pass."""
    torch.manual_seed(3)
    net = _net(sampling)
    x = torch.ones(256, D)
    c = torch.randn(256, 2 * D, generator=torch.Generator().manual_seed(4))
    for step in range(3):  # later passes may take their draws by another path than the first
        net.zero_grad(set_to_none=True)
        out = net(x)
        (c * out).sum().backward()
        eps, comps = _eps(out)
        for (name, f), cols in zip(_noisy(net).items(), (slice(0, D), slice(D, 2 * D))):
            g, e, k = c[:, cols], eps[name], comps[name]
            rho = f.rho.detach()
            want_loc = torch.zeros(K, D).index_add_(0, k, g)
            want_rho = torch.zeros(K, D).index_add_(0, k, g * e) * torch.sigmoid(rho)
            got_loc, got_rho = _grad(f, "loc"), _grad(f, "rho")
            assert got_loc is not None and got_rho is not None, f"layer {name}: no gradient for loc / rho"
            torch.testing.assert_close(got_loc, want_loc, rtol=1e-4, atol=1e-4, msg=lambda m, name=name, step=step: f"{name} loc, pass {step}: {m}")
            torch.testing.assert_close(got_rho, want_rho, rtol=1e-3, atol=1e-4, msg=lambda m, name=name, step=step: f"{name} rho, pass {step}: {m}")


def test_kl_loss_is_the_closed_form_normal_kl_with_its_gradient() -> None:
    torch.manual_seed(5)
    net = _net("auto")
    gen = torch.Generator().manual_seed(6)
    factors = [f for _, layer in bayesify.rank1_layers(net) for f in (layer.rank1_s, layer.rank1_r)]
    with torch.no_grad():
        for f in factors:
            f.loc.copy_(1 + 0.3 * torch.randn(K, D, generator=gen))
            f.rho.copy_(_raw(0.05 + 0.3 * torch.rand(K, D, generator=gen)))
    net.zero_grad(set_to_none=True)
    kl = bayesify.kl_loss(net, 10)
    kl.backward()
    total = 0.0
    for f in factors:
        loc = f.loc.detach().double().requires_grad_()
        rho = f.rho.detach().double().requires_grad_()
        q = F.softplus(rho) + 1e-7
        entry = torch.log(PRIOR_STD / q) + (q**2 + (loc - 1.0) ** 2) / (2 * PRIOR_STD**2) - 0.5
        entry.sum().div(10).backward()
        total += float(entry.detach().sum()) / 10
        torch.testing.assert_close(_grad(f, "loc").double(), loc.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(_grad(f, "rho").double(), rho.grad, rtol=1e-4, atol=1e-7)
    assert math.isclose(float(kl.detach()), total, rel_tol=1e-5), (float(kl), total)


def test_an_optimizer_step_moves_every_factor_loc_and_rho() -> None:
    torch.manual_seed(7)
    net = _net("auto")
    params = list(net.parameters())
    assert len({id(p) for p in params}) == len(params)
    factors = [f for _, layer in bayesify.rank1_layers(net) for f in (layer.rank1_s, layer.rank1_r)]
    before = [(f.loc.detach().clone(), f.rho.detach().clone()) for f in factors]
    opt = torch.optim.Adam(params, lr=1e-2)
    x, y = torch.randn(64, D), torch.randn(64, 2 * D)
    loss = F.mse_loss(net(x), y) + bayesify.kl_loss(net, 64)
    opt.zero_grad()
    loss.backward()
    opt.step()
    for f, (loc, rho) in zip(factors, before):
        assert bool((f.loc.detach() != loc).all()), "a factor's loc entry did not move"
        assert bool((f.rho.detach() != rho).all()), "a factor's rho entry did not move"
