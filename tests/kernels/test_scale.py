"""The fused per-row kernels (``bayesify/kernels``) against the torch ops they replace, in Triton's interpreter on
CPU tensors (``conftest.py``): values and gradients for float32 / bfloat16 / float16 (and float64, with gradcheck),
the layouts the families produce (tokens ``[B, T, C]`` and ``[T, B, C]``, NCHW and channels-last images, ``[B, C]``
rows, one unbatched example), ragged sizes and split reductions; through converted layers; and where they stand
aside (the switch, layouts that do not collapse, a double backward, ``torch.compile``).

The interpreter rounds float32 to bfloat16 by truncation (a GPU rounds to nearest, as torch does), so bfloat16 is
compared within a few units in the last place, never bitwise. Sizes are small: the interpreter runs every program
in Python.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesify
from bayesify import kernels
from bayesify.layers import rank1_op
from tests._rank1 import perturb

# name: (activation shape, batch axis, channel axis, channels-last memory)
LAYOUTS = {
    "tokens": ((3, 7, 5), 0, -1, False),
    "tokens-TBC": ((7, 3, 5), 1, -1, False),  # MultiheadAttention's [L, B, E]
    "nchw": ((3, 5, 3, 5), 0, 1, False),
    "nchw-channels-last": ((3, 5, 3, 5), 0, 1, True),
    "rows": ((3, 5), 0, -1, False),
    "unbatched": ((7, 5), None, -1, False),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
# max |kernel - torch| relative to the largest value (bf16: the interpreter truncates where torch rounds)
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float64: 1e-12}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=TOL[dtype], atol=TOL[dtype] * scale)


def _activation(layout: str, dtype: torch.dtype) -> tuple[torch.Tensor, int | None, int]:
    shape, batch_axis, channel_axis, channels_last = LAYOUTS[layout]
    x = torch.randn(shape, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, batch_axis, channel_axis


def _per_row(x: torch.Tensor, batch_axis: int | None, channel_axis: int, rows: str, mean: float = 1.0) -> torch.Tensor:
    """Per-row values shaped to broadcast against ``x`` (``rows``: one per row, or one for all)."""
    n = 1 if rows == "shared" or batch_axis is None else x.shape[batch_axis]
    v = mean + 0.3 * torch.randn(n, x.shape[channel_axis], dtype=x.dtype)
    return v.view(rank1_op._row_shape(v, x.dim(), batch_axis, channel_axis) or v.shape)


class _Spy:
    """Counts the kernels' launches (a test that they ran, not only that the numbers agree)."""

    def __init__(self, scale, monkeypatch) -> None:
        self.forward = self.backward = 0
        fwd, bwd = scale.scale_shift, scale.scale_shift_backward

        def forward(*args, **kwargs):
            self.forward += 1
            return fwd(*args, **kwargs)

        def backward(*args, **kwargs):
            self.backward += 1
            return bwd(*args, **kwargs)

        monkeypatch.setattr(scale, "scale_shift", forward)
        monkeypatch.setattr(scale, "scale_shift_backward", backward)


@pytest.fixture
def spy(interpreted, monkeypatch):
    return _Spy(interpreted, monkeypatch)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_forward_values_equal_torch(interpreted, spy, layout, dtype):
    x, batch_axis, channel_axis = _activation(layout, dtype)
    for rows in ("per-row", "shared"):
        v = _per_row(x, batch_axis, channel_axis, rows)
        for offset in (None, "per-row", "shared"):
            o = None if offset is None else _per_row(x, batch_axis, channel_axis, offset, mean=0.0)
            plan = kernels.plan(x, v, o, batch_axis, channel_axis)
            assert plan is not None, (layout, rows, offset)
            y = kernels.scale_shift(plan, x, v, o)
            expected = x * v if o is None else torch.addcmul(o, x, v)
            _close(y, expected, dtype)
            assert y.stride() == x.stride()  # the input's memory format kept
    assert spy.forward == 6


def _affine(x, s, r, o, batch_axis, channel_axis):
    # a core that mixes nothing across rows, so every layout can take it; the scalings are what is tested
    return rank1_op.rank1_affine(x, lambda v: v * 1.5, s, r, o, batch_axis=batch_axis, channel_axis=channel_axis)


def _grads(layout: str, dtype: torch.dtype, rows: str, fused: bool, monkeypatch) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x, batch_axis, channel_axis = _activation(layout, dtype)
    s = _per_row(x, batch_axis, channel_axis, rows)
    r = _per_row(x, batch_axis, channel_axis, rows)
    o = _per_row(x, batch_axis, channel_axis, "shared", mean=0.0)  # a bias: one row for all
    w = torch.randn_like(x)
    leaves = [t.requires_grad_() for t in (x, s, r, o)]
    with monkeypatch.context() as mp:
        mp.setenv(kernels.SWITCH, "1" if fused else "0")
        y = _affine(x, s, r, o, batch_axis, channel_axis)
        (y * w).sum().backward()
    return [y.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("rows", ["per-row", "shared"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_values_and_gradients_equal_torch(interpreted, spy, monkeypatch, layout, dtype, rows):
    fused = _grads(layout, dtype, rows, True, monkeypatch)
    assert (spy.forward, spy.backward) == (2, 2)  # x o s and y o r + offset, each one launch forward and back
    reference = _grads(layout, dtype, rows, False, monkeypatch)
    assert (spy.forward, spy.backward) == (2, 2)  # the switch off: the torch ops
    for name, a, b in zip(("y", "x", "s", "r", "offset"), fused, reference):
        try:
            _close(a, b, dtype)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_backward_only_switch(interpreted, spy, monkeypatch):
    # BAYESIFY_KERNELS=backward: the forward scalings as torch ops, their backward by the kernels
    monkeypatch.setenv(kernels.SWITCH, "backward")
    torch.manual_seed(1)
    x, batch_axis, channel_axis = _activation("nchw", torch.float32)
    s, r, o = (_per_row(x, batch_axis, channel_axis, "per-row", mean=m) for m in (1.0, 1.0, 0.0))
    leaves = [t.requires_grad_() for t in (x, s, r, o)]
    y = _affine(x, s, r, o, batch_axis, channel_axis)
    y.square().sum().backward()
    assert (spy.forward, spy.backward) == (0, 2)
    grads = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    monkeypatch.setenv(kernels.SWITCH, "0")
    expected = _affine(x, s, r, o, batch_axis, channel_axis)
    expected.square().sum().backward()
    assert torch.equal(y, expected)
    for a, t in zip(grads, leaves):
        _close(a, t.grad, torch.float32)


@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize(
    "shape, batch_axis, channel_axis",
    [((2, 37, 100), 0, -1), ((2, 3, 40, 41), 0, 1)],  # several blocks per row, a ragged last one
    ids=["tokens", "nchw"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_reductions(interpreted, shape, batch_axis, channel_axis, splits, dtype):
    g = torch.randn(shape, dtype=dtype)
    a = torch.randn(shape, dtype=dtype)
    v = _per_row(a, batch_axis, channel_axis, "per-row")
    plan = kernels.plan(a, v, None, batch_axis, channel_axis)
    da = torch.empty_like(g)
    rows = shape[batch_axis]
    dv, do = interpreted.scale_shift_backward(g, plan.a, a, plan.a, v, plan.v, da, plan.a, rows, 1, splits=splits)
    inner = tuple(i for i in range(len(shape)) if i not in (batch_axis, channel_axis % len(shape)))
    g64, a64 = g.double(), a.double()
    _close(da, g * v, dtype)
    _close(dv, (g64 * a64).sum(inner).to(dtype).view(rows, -1), dtype)
    _close(do, g64.sum((batch_axis, *inner)).to(dtype).view(1, -1), dtype)


@pytest.mark.parametrize(
    "shape, batch_axis, channel_axis, channels_last",
    [((2, 3, 3), 0, -1, False), ((3, 2, 3), 1, -1, False), ((2, 3, 2, 2), 0, 1, True)],
    ids=["tokens", "tokens-TBC", "nchw-channels-last"],
)
def test_gradcheck_float64(interpreted, spy, shape, batch_axis, channel_axis, channels_last):
    x = torch.randn(shape, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    inputs = [t.requires_grad_() for t in (x, *(_per_row(x, batch_axis, channel_axis, "per-row") for _ in range(3)))]
    fn = lambda x, s, r, o: _affine(x, s, r, o, batch_axis, channel_axis)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)
    assert spy.backward > 0
    if batch_axis == 0 and not channels_last:
        # a double backward records a graph through the gradients: the torch ops take it
        assert torch.autograd.gradgradcheck(fn, inputs, fast_mode=True)


class _Net(nn.Module):
    """The families' layouts: a convolution (NCHW), a linear layer on tokens, attention on [L, B, E]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc = nn.Linear(6, 8)
        self.attention = nn.MultiheadAttention(8, 2)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x)).flatten(2).transpose(1, 2)  # [B, HW, C]
        h = F.gelu(self.fc(h)).transpose(0, 1)  # [HW, B, E]
        h, _ = self.attention(h, h, h, need_weights=False)
        return self.head(h.mean(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_converted_layers_equal_the_torch_path(interpreted, spy, monkeypatch, dtype):
    torch.manual_seed(0)
    model = perturb(bayesify.convert(_Net(), components=4, sampling="example")).to(dtype)
    x = torch.randn(4, 3, 4, 4, dtype=dtype)

    def step(fused: bool):
        net = copy.deepcopy(model)
        with monkeypatch.context() as mp:
            mp.setenv(kernels.SWITCH, "1" if fused else "0")
            torch.manual_seed(1)  # the same draws
            out = net(x)
            (out.float() ** 2).sum().backward()
        return out.detach(), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}

    out, grads = step(True)
    # every converted layer scaled its input and output by the kernels, forward and back
    layers = 3 + 4  # conv, fc, head; the attention's q, k, v and out projections
    assert spy.backward == 2 * layers and spy.forward >= 2 * layers  # (and the recomputed x o s of some)
    ref_out, ref_grads = step(False)
    _close(out, ref_out, dtype)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        try:
            _close(grads[name], ref_grads[name], dtype)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_compiled_graphs_keep_the_torch_ops(interpreted, spy):
    torch.manual_seed(0)
    model = perturb(bayesify.convert(_Net(), components=4, sampling="example"))
    x = torch.randn(4, 3, 4, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    torch.manual_seed(1)
    out = compiled(x)
    out.sum().backward()
    assert (spy.forward, spy.backward) == (0, 0)
    torch.manual_seed(1)
    eager = copy.deepcopy(model)
    expected = eager(x)
    assert spy.forward > 0  # the eager pass takes the kernels
    torch.testing.assert_close(out, expected)


def test_where_the_kernels_stand_aside(interpreted, monkeypatch):
    x = torch.randn(2, 4, 3, 5)
    v = _per_row(x, 0, 1, "per-row")
    assert kernels.plan(x, v, None, 0, 1) is not None
    # the switch
    monkeypatch.setenv(kernels.SWITCH, "0")
    assert kernels.plan(x, v, None, 0, 1) is None
    monkeypatch.delenv(kernels.SWITCH)
    assert kernels.plan(x, v, None, 0, 1) is None  # off unless asked for
    monkeypatch.setenv(kernels.SWITCH, "1")
    # a view whose other axes do not collapse into one stride
    assert kernels.plan(x[..., :3], v, None, 0, 1) is None
    # values varying along another axis than the batch and the channels, or another dtype
    assert kernels.plan(x, torch.ones(2, 4, 3, 1), None, 0, 1) is None
    assert kernels.plan(x, v.double(), None, 0, 1) is None
    # integers, and a device the dispatch does not take (the meta device stands for any other)
    assert kernels.plan(x.int(), v.int(), None, 0, 1) is None
    assert kernels.plan(x.to("meta"), v.to("meta"), None, 0, 1) is None
    # forward-mode AD
    with torch.autograd.forward_ad.dual_level():
        assert kernels.plan(x, v, None, 0, 1) is None
    # a gradient laid out so that its other axes do not collapse: the backward takes the torch ops
    plan = kernels.plan(x, v, None, 0, 1)
    g = torch.randn(2, 4, 3, 8)[..., :5]
    with torch.no_grad():  # (as in a backward pass)
        assert kernels.scale_shift_backward(plan, g, x, v, (True, True, False), v.shape, None) is None
        assert kernels.scale_shift_backward(plan, g.contiguous(), x, v, (True, True, False), v.shape, None) is not None
    # grad mode in a backward pass: create_graph, whose gradients must themselves be differentiable
    assert kernels.scale_shift_backward(plan, g.contiguous(), x, v, (True, True, False), v.shape, None) is None


def test_the_cpu_takes_the_torch_ops_outside_the_tests():
    # without the test hook the dispatch takes CUDA tensors only
    assert "cpu" not in kernels._DEVICES
    x = torch.randn(2, 3, 5)
    assert kernels.plan(x, torch.ones(2, 1, 5), None, 0, -1) is None
