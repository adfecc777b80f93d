"""A user's own layer family through the documented contract alone (no underscore names).

The family is the code block of docs/ARCHITECTURE.md, executed as it stands, so the document
stays true. It must pass the generic checks every built-in family passes: identity at init,
per-row routing through the right member, gradients on every rank-1 parameter, the KL, the L2 of
its bias offset, and revert.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import bayesify
from bayesify.training import l2_penalty

DOC = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"


@pytest.fixture(scope="module")
def family() -> dict:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/ARCHITECTURE.md should hold one python example"
    assert "._" not in blocks[0].replace("__init__", ""), "the example uses only public names"
    namespace: dict = {}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    return namespace


def _fresh(family: dict, **options) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    Dense, Rank1Dense = family["Dense"], family["Rank1Dense"]
    plain = nn.Sequential(Dense(6, 8), nn.ReLU(), Dense(8, 3)).double()
    model = bayesify.convert(copy.deepcopy(plain), mapping={**bayesify.default_mapping(), Dense: Rank1Dense}, **options)
    return plain, model


def test_the_documented_example_converts_every_dense_layer(family: dict) -> None:
    model = family["model"]
    report = bayesify.summary(model, torch.randn(2, 6))
    assert len(report.converted) == 2 and report.skipped == {} and report.bypassed == {}


def test_identity_at_init(family: dict) -> None:
    plain, model = _fresh(family, components=3)
    x = torch.randn(5, 6, dtype=torch.float64)
    with bayesify.mode(model, route="tile", noise=False):
        members = model(x).view(3, 5, 3)
    for k in range(3):
        torch.testing.assert_close(members[k], plain(x))


def test_each_row_goes_through_its_own_member(family: dict) -> None:
    plain, model = _fresh(family, components=3, posterior="delta", init="random_sign")
    with torch.no_grad():
        for _, layer in bayesify.rank1_layers(model):
            layer.rank1_bias.normal_()
    x = torch.randn(7, 6, dtype=torch.float64)
    rows = {}

    def record(module: nn.Module, args: tuple) -> None:
        rows["k"] = module.rank1_state.model.router.rows.clone()

    model[0].register_forward_pre_hook(record)
    out = model.train()(x)
    for e, k in enumerate(rows["k"].tolist()):
        h = x[e]
        for layer, act in ((model[0], True), (model[2], False)):
            w = layer.weight * layer.rank1_s.loc[k][:, None] * layer.rank1_r.loc[k][None, :]  # W o (s r^T), [in, out]
            h = h @ w + layer.bias + layer.rank1_bias[k]
            h = h.relu() if act else h
        torch.testing.assert_close(out[e], h)


def test_gradients_kl_l2_and_revert(family: dict) -> None:
    plain, model = _fresh(family, components=2, init_std=0.2)
    x = torch.randn(4, 6, dtype=torch.float64)
    loss = model.train()(x).square().mean() + bayesify.kl_divergence(model) / 100 + l2_penalty(model)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient for {name}"
    expected = sum(f.kl_divergence() for _, layer in bayesify.rank1_layers(model) for _, f in layer.rank1_factors())
    torch.testing.assert_close(bayesify.kl_divergence(model), expected)
    with torch.no_grad():
        by_hand = sum(float(m.weight.pow(2).sum() + (m.bias + m.rank1_bias).pow(2).sum()) for m in (model[0], model[2]))
    assert float(l2_penalty(model).detach()) == pytest.approx(by_hand, rel=1e-9)
    keys = set(plain.state_dict())
    bayesify.revert(model)
    assert type(model[0]) is family["Dense"] and set(model.state_dict()) == keys
    torch.testing.assert_close(model(x), plain(x))


def test_an_unconverted_checkpoint_loads_strictly(family: dict) -> None:
    # the load pre-hook comes with the contract: a user's family gets it without writing anything
    plain, model = _fresh(family, components=2)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    rank1 = {k: v.clone() for k, v in model.state_dict().items() if ".rank1_" in k}
    assert model.load_state_dict(plain.state_dict(), strict=True).missing_keys == []
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    assert all(torch.equal(state[k], v) for k, v in rank1.items())
