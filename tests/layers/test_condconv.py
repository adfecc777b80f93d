"""Rank-1 timm CondConv2d: the factors act on the per-example mixed kernel."""

from __future__ import annotations

import copy

import pytest
import torch

import bayesify

timm_layers = pytest.importorskip("timm.layers")

K = 3
DT = torch.float64


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("padding", ["", "same"])
def test_condconv_matches_member_kernels(bias: bool, padding: str) -> None:
    reference = timm_layers.CondConv2d(4, 6, 3, stride=2 if padding == "same" else 1, padding=padding, bias=bias, num_experts=3).to(DT)
    layer = bayesify.convert(copy.deepcopy(reference), components=K, posterior="delta")
    assert isinstance(layer, bayesify.layers.Rank1CondConv2d)
    x = torch.randn(2, 4, 7, 7, dtype=DT)
    routing = torch.rand(2, 3, dtype=DT)
    expected = reference(x, routing)
    with bayesify.mode(layer, route="tile", noise=False):  # identity at init
        out = layer(x, routing)  # the root tiles x and routing weights alike
    for k in range(K):
        torch.testing.assert_close(out[k * 2 : (k + 1) * 2], expected)
    with torch.no_grad():
        for _, factor in layer.rank1_factors():
            factor.loc.normal_(1.0, 0.3)
        if layer.rank1_bias is not None:
            layer.rank1_bias.normal_(0.0, 0.3)
    with bayesify.mode(layer, route="tile", noise=False):
        out = layer(x, routing)
    for k in range(K):
        member = copy.deepcopy(reference)
        r, s = layer.rank1_r.loc[k].detach(), layer.rank1_s.loc[k].detach()
        with torch.no_grad():
            w = member.weight.view(3, 6, 4, 3, 3) * r[None, :, None, None, None] * s[None, None, :, None, None]
            member.weight.copy_(w.reshape(3, -1))
        expected = member(x, routing)
        if bias:
            expected = expected + layer.rank1_bias[k].detach()[None, :, None, None]
        torch.testing.assert_close(out[k * 2 : (k + 1) * 2], expected)


def test_condconv_in_a_timm_model_trains() -> None:
    timm = pytest.importorskip("timm")
    model = timm.create_model("efficientnet_cc_b0_4e", pretrained=False, num_classes=3)
    bayesify.convert(model, include="blocks.4.0")
    kinds = {type(layer).__rank1_base__.__name__ for _, layer in bayesify.rank1_layers(model)}
    assert "CondConv2d" in kinds
    model.train()
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    for p in bayesify.rank1_parameters(model):
        assert p.grad is not None
