"""Property-based tests: random layer configurations and random small compositions."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import bayesify

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(model: nn.Module, x: torch.Tensor, components: int) -> None:
    """Identity at init for every component, unchanged output shapes, gradients everywhere."""
    model = model.double().eval()
    x = x.double()
    ref = model(x)
    bayesify.convert(model, components=components, task="regression")  # arbitrary features: their mean
    with bayesify.mode(model, route="tile", noise=False):
        members = model(x)
    torch.testing.assert_close(members, torch.cat([ref] * components))
    assert model(x).shape == ref.shape  # evaluation: mixture of the members
    model.train()
    out = model(x)
    assert out.shape == ref.shape
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"No finite gradient for {name}"


@st.composite
def conv_configs(draw: st.DrawFn) -> tuple[nn.Module, torch.Tensor]:
    dims = draw(st.integers(1, 3))
    transposed = draw(st.booleans())
    groups = draw(st.sampled_from([1, 2, 3]))
    cin = groups * draw(st.integers(1, 3))
    cout = groups * draw(st.integers(1, 3))
    kernel = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 2))
    dilation = draw(st.integers(1, 2))
    bias = draw(st.booleans())
    size = draw(st.integers(kernel * dilation + 1, 7 if dims == 3 else 9))
    if transposed:
        cls = [nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d][dims - 1]
        padding = draw(st.integers(0, (kernel - 1) * dilation // 2))
        layer = cls(cin, cout, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups, bias=bias)
    else:
        cls = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1]
        padding_mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
        padding = draw(st.integers(0, min(kernel, 2) - 1 + 1))
        if padding_mode != "zeros":
            padding = min(padding, size - 1)
        layer = cls(
            cin, cout, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups, bias=bias,
            padding_mode=padding_mode,
        )  # fmt: skip
    batch = draw(st.integers(1, 3))
    return layer, torch.randn(batch, cin, *([size] * dims))


@SETTINGS
@given(conv_configs(), st.integers(1, 4))
def test_random_convolutions(config: tuple[nn.Module, torch.Tensor], components: int) -> None:
    layer, x = config
    _check(layer, x, components)


@st.composite
def sequentials(draw: st.DrawFn) -> tuple[nn.Module, torch.Tensor]:
    width = draw(st.integers(2, 6))
    layers: list[nn.Module] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["linear", "act", "norm", "dropout"]))
        if kind == "linear" or not layers:
            new = draw(st.integers(2, 6))
            layers.append(nn.Linear(width, new, bias=draw(st.booleans())))
            width = new
        elif kind == "act":
            layers.append(draw(st.sampled_from([nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU]))())
        elif kind == "norm":
            layers.append(nn.LayerNorm(width))
        else:
            layers.append(nn.Dropout(0.0))
    shape = draw(st.sampled_from([(4,), (3, 2), (2, 2, 3)]))
    first = next(m for m in layers if isinstance(m, nn.Linear))
    return nn.Sequential(*layers), torch.randn(*shape, first.in_features)


@SETTINGS
@given(sequentials(), st.integers(1, 4))
def test_random_sequentials(config: tuple[nn.Module, torch.Tensor], components: int) -> None:
    model, x = config
    _check(model, x, components)
