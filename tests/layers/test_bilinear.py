"""Rank-1 nn.Bilinear against a per-member loop of plain F.bilinear calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesify

K = 3
DT = torch.float64


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5,), (5, 2), ()], ids=["batched", "3d", "unbatched"])
@pytest.mark.parametrize("perturbation", ["multiplicative", "additive"])
def test_bilinear_matches_member_loop(bias: bool, shape: tuple[int, ...], perturbation: str) -> None:
    layer = bayesify.convert(nn.Bilinear(3, 4, 2, bias=bias).to(DT), components=K, posterior="delta", perturbation=perturbation)
    x1, x2 = torch.randn(*shape, 3, dtype=DT), torch.randn(*shape, 4, dtype=DT)
    w, b = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    with bayesify.mode(layer, route="tile", noise=False):  # identity at init
        out = layer(x1, x2)
    members = out.view(K, *shape, 2)
    for k in range(K):
        torch.testing.assert_close(members[k], F.bilinear(x1, x2, w, b))
    with torch.no_grad():
        centre = 1.0 if perturbation == "multiplicative" else 0.0
        for _, factor in layer.rank1_factors():
            factor.loc.normal_(centre, 0.3)
        if layer.rank1_bias is not None:
            layer.rank1_bias.normal_(0.0, 0.3)
    with bayesify.mode(layer, route="tile", noise=False):
        members = layer(x1, x2).view(K, *shape, 2)
    for k in range(K):
        s1, s2, r = layer.rank1_s1.loc[k], layer.rank1_s2.loc[k], layer.rank1_r.loc[k]
        bk = None if b is None else b + layer.rank1_bias[k]
        if perturbation == "multiplicative":
            expected = F.bilinear(x1, x2, w * r[:, None, None] * s1[None, :, None] * s2[None, None, :], bk)
        else:
            expected = F.bilinear(x1 + s1, x2 + s2, w, bk) + r
        torch.testing.assert_close(members[k], expected.detach())


def test_bilinear_gradients_and_shapes() -> None:
    reference = nn.Bilinear(3, 4, 2)
    layer = bayesify.convert(nn.Bilinear(3, 4, 2), components=K, task="regression")
    x1, x2 = torch.randn(6, 3), torch.randn(6, 4)
    for train in (True, False):
        assert layer.train(train)(x1, x2).shape == reference(x1, x2).shape
    layer.train()
    with bayesify.mode(layer, route="tile"):
        layer(x1, x2).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"No gradient for {name}"
