"""``variational/factor.py``: one factor's K-component posterior table and its draws."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bayesify.config import Rank1Config
from bayesify.mixture import component_rows
from bayesify.variational import distributions
from bayesify.variational.factor import Rank1Factor, sample_factors


def _factor(features: int, **options) -> Rank1Factor:
    factor = Rank1Factor(features, 4, Rank1Config(**options).layer_options())
    with torch.no_grad():  # components apart, so that a wrong row shows
        factor.loc.copy_(torch.randn_like(factor.loc))
        factor.rho.copy_(torch.randn_like(factor.rho))
    return factor


def test_each_row_draws_from_its_own_component() -> None:
    factor = _factor(6)
    rows = torch.tensor([3, 0, 0, 2])
    torch.testing.assert_close(factor.sample(rows, noise=False), factor.loc[rows])
    torch.manual_seed(0)
    drawn = factor.sample(rows, noise=True)
    torch.manual_seed(0)
    expected = factor.loc[rows] + factor.scale[rows] * torch.randn(4, 6)
    torch.testing.assert_close(drawn, expected.clamp(-10, 10))


def test_factors_drawn_together_take_one_noise_draw_in_their_order() -> None:
    s, r = _factor(3), _factor(5)
    rows = torch.tensor([1, 2, 1])
    torch.manual_seed(0)
    s_drawn, r_drawn = sample_factors((s, r), rows, noise=True)
    torch.manual_seed(0)
    eps = torch.randn(3, 8)
    torch.testing.assert_close(s_drawn, s.loc[rows] + s.scale[rows] * eps[:, :3])
    torch.testing.assert_close(r_drawn, r.loc[rows] + r.scale[rows] * eps[:, 3:])


def test_heavy_tails_are_clipped_to_the_reference_bound() -> None:
    factor = _factor(500, posterior="cauchy", prior="cauchy")
    with torch.no_grad():
        factor.rho.fill_(distributions.raw_scale(5.0))
    torch.manual_seed(0)
    drawn = factor.sample(torch.zeros(64, dtype=torch.long), noise=True)
    assert drawn.abs().max() == 10 and (drawn.abs() == 10).any()


def test_component_rows_is_the_gather_eagerly_and_in_a_compiled_graph() -> None:
    table = torch.randn(4, 5, requires_grad=True)
    rows = torch.tensor([2, 0, 2, 3, 1, 2])
    weights = torch.randn(6, 5)
    values, grads = [], []
    torch._dynamo.reset()
    for gather in (component_rows, torch.compile(component_rows, backend="aot_eager", fullgraph=True)):
        table.grad = None
        out = gather(rows, table)
        (out * weights).sum().backward()
        values.append(out.detach())
        grads.append(table.grad.clone())
    expected = F.embedding(rows, table.detach())
    torch.testing.assert_close(values[0], expected)
    torch.testing.assert_close(values[1], expected)
    torch.testing.assert_close(grads[1], grads[0])  # the gradient per component: the rows' sum
    torch.testing.assert_close(grads[0][2], weights[[0, 2, 5]].sum(0))


def test_component_rows_copies_exactly_under_autocast_in_a_compiled_graph() -> None:
    table = torch.randn(4, 5, requires_grad=True)
    rows = torch.tensor([2, 0, 2, 3, 1, 2])
    torch._dynamo.reset()
    gather = torch.compile(component_rows, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 one-hot product would round the values to 3 digits
        out = gather(rows, table)
    assert out.dtype == torch.float32 and torch.equal(out, table.detach()[rows])
    out.sum().backward()
    assert torch.equal(table.grad, torch.bincount(rows, minlength=4).float()[:, None].expand(4, 5))
