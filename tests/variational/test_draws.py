"""``variational/draws.py``: a pass's draws, made for the whole model ahead of the pass and taken by the layers."""

from __future__ import annotations

import copy

import torch
from torch import nn

import bayesify


def _model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    return bayesify.convert(net, components=4, task="classification").train()


def test_the_first_pass_learns_what_the_layers_take_and_later_passes_take_it_ahead_alike() -> None:
    model, x = _model(), torch.randn(8, 6)
    draws = model.rank1_model.draws
    assert not draws.needs
    outputs = []
    for _ in range(3):
        torch.manual_seed(1)
        outputs.append(model(x))
    assert draws.needs  # learnt from the first pass's requests
    torch.testing.assert_close(outputs[1], outputs[0])  # taken ahead or sliced out: the same values
    torch.testing.assert_close(outputs[2], outputs[0])
    twin = copy.deepcopy(model)  # a copy learns again: what a pass took is not state
    assert not twin.rank1_model.draws.needs
    torch.manual_seed(1)
    torch.testing.assert_close(twin(x), outputs[0])


def test_a_traced_pass_neither_learns_nor_takes_ahead() -> None:
    model, x = _model(), torch.randn(8, 6)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.manual_seed(1)
    traced = compiled(x)
    assert not model.rank1_model.draws.needs  # a graph's requests are not learnt (they would only recompile it)
    torch.manual_seed(1)
    torch.testing.assert_close(traced, model(x))
