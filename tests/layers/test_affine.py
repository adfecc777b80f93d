"""Rank-1 Linear / Conv against a per-member loop of plain layers (the reference's own test idea)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesify


def _randomise_factors(model: nn.Module) -> None:
    # locations away from 1 so that the K members really differ
    with torch.no_grad():
        for _, layer in bayesify.rank1_layers(model):
            for _, factor in layer.rank1_factors():
                factor.loc.normal_(1.0, 0.5)
            if layer.rank1_bias is not None:
                layer.rank1_bias.normal_(0.0, 0.5)


def _member_weight(layer: nn.Module, k: int, transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W o (r_k s_k^T) laid out like the layer's own weight, and b + delta_k."""
    w = layer.weight.detach()
    r, s = layer.rank1_r.loc[k].detach(), layer.rank1_s.loc[k].detach()
    groups = getattr(layer, "groups", 1)
    if transposed:  # weight [in, out/groups, ...]
        in_pg = w.shape[0] // groups
        out_index = torch.stack([g * w.shape[1] + torch.arange(w.shape[1]) for g in range(groups)])  # [groups, out/g]
        r_full = r[out_index[torch.arange(w.shape[0]) // in_pg]]  # [in, out/groups]
        scale = s[:, None] * r_full
    else:  # weight [out, in/groups, ...]
        out_pg = w.shape[0] // groups
        in_index = torch.stack([g * w.shape[1] + torch.arange(w.shape[1]) for g in range(groups)])
        s_full = s[in_index[torch.arange(w.shape[0]) // out_pg]]  # [out, in/groups]
        scale = r[:, None] * s_full
    scale = scale.reshape(*scale.shape, *([1] * (w.dim() - 2)))
    bias = None if layer.bias is None else layer.bias.detach() + layer.rank1_bias[k].detach()
    return w * scale, bias


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 6), (5, 3, 6), (6,)])
def test_linear_matches_member_loop(bias: bool, shape: tuple[int, ...]) -> None:
    layer = nn.Linear(6, 4, bias=bias).double()
    reference = nn.Linear(6, 4, bias=bias).double()
    bayesify.convert(layer, components=3, posterior="delta")
    _randomise_factors(layer)
    x = torch.randn(*shape, dtype=torch.float64)
    with bayesify.mode(layer, route="tile"):
        out = layer(x)
    # an unbatched input is one example: its K members become the batch, [K, 4]
    members = out.view(3, *shape[:-1], 4)
    for k in range(3):
        w, b = _member_weight(layer, k, transposed=False)
        reference.weight.data, reference.bias = w, None if b is None else nn.Parameter(b)
        torch.testing.assert_close(members[k], F.linear(x, w, b))


CONV_CASES = [
    # (cls, in, out, kwargs, spatial)
    (nn.Conv1d, 4, 6, dict(kernel_size=3), (9,)),
    (nn.Conv2d, 4, 6, dict(kernel_size=3, stride=2, padding=1), (7, 8)),
    (nn.Conv2d, 4, 6, dict(kernel_size=3, groups=2, dilation=2, padding="same"), (9, 9)),
    (nn.Conv2d, 4, 8, dict(kernel_size=1, groups=4, padding_mode="reflect", padding=1), (5, 5)),
    (nn.Conv2d, 3, 5, dict(kernel_size=3, padding=2, padding_mode="circular"), (6, 6)),
    (nn.Conv3d, 2, 4, dict(kernel_size=2), (4, 4, 4)),
    (nn.ConvTranspose1d, 4, 6, dict(kernel_size=3, stride=2), (5,)),
    (nn.ConvTranspose2d, 4, 6, dict(kernel_size=3, stride=2, groups=2, output_padding=1), (5, 5)),
    (nn.ConvTranspose3d, 2, 4, dict(kernel_size=2, stride=2), (3, 3, 3)),
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0].__name__}-{c[3]}")
def test_conv_matches_member_loop(case: tuple, bias: bool) -> None:
    cls, cin, cout, kwargs, spatial = case
    layer = cls(cin, cout, bias=bias, **kwargs).double()
    plain = cls(cin, cout, bias=bias, **kwargs).double()
    bayesify.convert(layer, components=3, posterior="delta")
    _randomise_factors(layer)
    x = torch.randn(2, cin, *spatial, dtype=torch.float64)
    with bayesify.mode(layer, route="tile"):
        out = layer(x)
    members = out.view(3, 2, *out.shape[1:])
    transposed = cls.__name__.startswith("ConvTranspose")
    for k in range(3):
        w, b = _member_weight(layer, k, transposed)
        with torch.no_grad():
            plain.weight.copy_(w)
            if bias:
                plain.bias.copy_(b)
        torch.testing.assert_close(members[k], plain(x))


def test_conv_unbatched_input() -> None:
    layer = nn.Conv2d(3, 4, 3)
    x = torch.randn(3, 8, 8)
    ref = layer(x)
    bayesify.convert(layer, components=2)
    with bayesify.mode(layer, route="component", component=1, noise=False):
        torch.testing.assert_close(layer(x), ref)


def test_conv_transpose_output_size_passes_through() -> None:
    layer = nn.ConvTranspose2d(3, 2, 3, stride=2)
    x = torch.randn(2, 3, 4, 4)
    ref = layer(x, output_size=[10, 10])
    bayesify.convert(layer, components=2)
    with bayesify.mode(layer, route="tile", noise=False):
        out = layer(x, output_size=[10, 10])
    assert out.shape == (4, 2, 10, 10)
    torch.testing.assert_close(out[:2], ref)


@pytest.mark.parametrize("posterior,prior", [("normal", "normal"), ("cauchy", "cauchy"), ("normal", "cauchy")])
def test_sample_route_uses_one_component_per_example(posterior: str, prior: str) -> None:
    """In training, each example goes through one component, the same one in every layer."""
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    bayesify.convert(net, components=4, posterior="delta")
    _randomise_factors(net)
    x = torch.randn(64, 4, dtype=torch.float64)
    with bayesify.mode(net, route="tile"):
        members = net(x).view(4, 64, 3)
    net.train()
    out = net(x)  # sample route, noise is irrelevant for a delta posterior
    # every row equals the output of exactly one member (consistent routing across both layers)
    match = (out.unsqueeze(0) - members).abs().amax(-1) < 1e-10  # [K, B]
    assert bool((match.sum(0) == 1).all())
    assert len(set(match.float().argmax(0).tolist())) > 1  # and components do vary across examples


def test_noise_is_per_example_and_fresh() -> None:
    layer = nn.Linear(5, 5)
    bayesify.convert(layer, components=1, init_std=0.2, sampling="example")  # the reference's noise per example
    x = torch.ones(1, 5).expand(8, 5)
    with bayesify.mode(layer, route="sample"):
        a, b = layer(x), layer(x)
    assert not torch.allclose(a[0], a[1])  # different examples, different samples
    assert not torch.allclose(a, b)  # a fresh draw on every call
    with bayesify.mode(layer, route="sample", noise=False):
        c = layer(x)
    torch.testing.assert_close(c[0], c[1])


def test_additive_perturbation_is_identity_at_init_and_matches_formula() -> None:
    layer = nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    ref = layer(x)
    bayesify.convert(layer, components=2, perturbation="additive")
    assert torch.all(layer.rank1_s.loc == 0) and torch.all(layer.rank1_r.loc == 0)
    with bayesify.mode(layer, route="tile", noise=False):
        torch.testing.assert_close(layer(x), torch.cat([ref, ref]))
    with torch.no_grad():
        layer.rank1_s.loc.normal_()
        layer.rank1_r.loc.normal_()
    with bayesify.mode(layer, route="component", component=1, noise=False):
        out = layer(x)
    s, r = layer.rank1_s.loc[1], layer.rank1_r.loc[1]
    torch.testing.assert_close(out, F.linear(x + s, layer.weight, layer.bias) + r)


def test_gradients_reach_every_new_and_shared_parameter() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 2))
    bayesify.convert(net, components=2)
    net.train()
    loss = net(torch.randn(4, 3, 8, 8)).square().mean() + bayesify.kl_divergence(net) / 100
    loss.backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"No finite gradient for {name}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda: nn.Linear(7, 5), (3, 7)),
        (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), (3, 4, 6, 6)),
        (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2), (3, 4, 5)),
    ],
)
def test_every_component_reproduces_the_original(make, shape, dtype: torch.dtype) -> None:
    layer = make().to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    ref = layer(x)
    bayesify.convert(layer, components=4)
    with bayesify.mode(layer, route="tile", noise=False):
        out = layer(x)
    torch.testing.assert_close(out, torch.cat([ref] * 4))



@pytest.mark.parametrize("sampling", ["example", "component"])
def test_forward_mode_ad_through_a_converted_model_without_gradients(sampling: str) -> None:
    """Forward-mode AD (``torch.autograd.forward_ad``) under ``no_grad``, per-row and folded: the JVP is the
    directional derivative (an in-place ``out=`` op in evaluation once broke this)."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), task="members", sampling=sampling)
    model = model.double().eval()
    x, v = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with torch.no_grad(), bayesify.mode(model, route="tile", noise=False):
        with fwAD.dual_level():
            jvp = fwAD.unpack_dual(model(fwAD.make_dual(x, v))).tangent
        step = 1e-6
        numeric = (model(x + step * v) - model(x - step * v)) / (2 * step)
    torch.testing.assert_close(jvp, numeric, rtol=1e-6, atol=1e-8)
