"""``variational/store.py``: groups of a model's tables, joined once per pass, each table its layer's own Parameter."""

from __future__ import annotations

import torch
from torch import nn

import bayesify
from tests._rank1 import perturb


def _model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    return perturb(bayesify.convert(net, components=3, task="classification"))


def _factor_group(model: nn.Module):
    return next(g for g in model.rank1_model.draws.groups if g.kind == "factor")


def test_a_group_joins_its_layers_own_tables_and_hands_each_its_own_gradient() -> None:
    model = _model()
    group = _factor_group(model)
    tables = group.tables("loc")
    assert all(isinstance(t, nn.Parameter) for t in tables)
    assert {id(t) for t in tables} == {id(f.loc) for _, layer in bayesify.rank1_layers(model) for _, f in layer.rank1_factors()}
    joined = group.joined("loc")
    torch.testing.assert_close(joined, torch.cat(tables, 1), rtol=0, atol=0)
    (joined * torch.arange(joined.numel(), dtype=joined.dtype).view_as(joined)).sum().backward()
    expected = torch.arange(joined.numel(), dtype=joined.dtype).view_as(joined).split(group.sizes, 1)
    for table, grad in zip(tables, expected):
        assert table.grad.is_contiguous() and torch.equal(table.grad, grad)


def test_tables_that_are_not_alike_are_not_joined() -> None:
    model = _model()
    group = _factor_group(model)
    assert group.joined("loc") is not None
    model[2].rank1_s.double()  # one table cast on its own: its layers draw their own
    assert group.joined("loc") is None
    del model[2].rank1_s._parameters["rho"]
    assert group.joined("rho") is None


def test_a_table_drawn_alone_is_the_joined_draws_columns() -> None:
    model = _model()
    group = _factor_group(model)
    components = torch.tensor([2, 0, 1, 1])
    torch.manual_seed(5)
    eps = group.noise(len(components))
    torch.manual_seed(5)
    loc, scale = group.joined("loc"), bayesify.variational.distributions.scale(group.joined("rho"))
    together = group.draw_all(loc, components, True, scale)
    for slot, (start, size) in enumerate(zip(group.starts, group.sizes)):
        torch.testing.assert_close(group.draw_one(slot, components, eps), together[:, start : start + size])


def test_the_kl_reuses_a_training_passs_join_only_while_every_table_is_unchanged() -> None:
    model = _model().train()
    group = _factor_group(model)
    model(torch.randn(6, 5))
    joined = group.joined_again("loc")
    assert joined is group.joined_again("loc")  # the pass's own
    with torch.no_grad():
        model[0].rank1_s.loc.add_(1.0)  # a version counter moves
    assert group.joined_again("loc") is not joined
    model(torch.randn(6, 5))
    joined = group.joined_again("loc")
    model[2].rank1_r.loc.data = model[2].rank1_r.loc.data * 2  # a new tensor behind the Parameter
    again = group.joined_again("loc")
    assert again is not joined and torch.equal(again[:, group.starts[-1]:], model[2].rank1_r.loc)
