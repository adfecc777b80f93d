"""What the rank-1 op holds for the backward pass, and that it loses nothing.

The per-row path's ``x o s`` is recomputed in the backward pass (by the one autograd node of a known map,
``rank1_op._Rank1Map``, else by ``bayesify/layers/_recompute.py``); the folded path holds each block's
weight once (``fold_weight`` is one autograd node). Checked here:
the gradients are those of the plain path (the same ops, so the same numbers), the step holds less,
an in-place change of a used input is an error rather than a wrong gradient, it stands aside under
activation checkpointing, and ``fold_weight``'s own backward is right (gradcheck, float64).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import bayesify
from bayesify.cost import HeldBytes, op_calls
from bayesify.layers import rank1_op
from bayesify.layers.folded import fold_weight

K = 4


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.up(F.relu(self.conv2(x))))
        return self.head(x.mean((2, 3)))


class _TokenMLP(nn.Module):  # F.linear on [B, T, C]: the saved input is a reshaped view of x o s
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(12, 32), nn.Linear(32, 12), nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(F.gelu(self.fc1(x))).mean(1))


MODELS = {
    "conv": (_ConvNet, (8, 3, 8, 8)),
    "tokens": (_TokenMLP, (8, 6, 12)),
}


def _converted(name: str, sampling: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    cls, shape = MODELS[name]
    model = bayesify.convert(cls().double(), components=K, sampling=sampling)
    with torch.no_grad():  # members that differ, so a wrong factor would show
        for _, layer in bayesify.rank1_layers(model):
            for _, factor in layer.rank1_factors():
                factor.loc.copy_(1 + 0.3 * torch.randn_like(factor.loc))
    return model.train(), torch.randn(*shape, dtype=torch.float64)


@contextlib.contextmanager
def _plain_path() -> Iterator[None]:
    """The reference: the per-row op as autograd's own ops (not one node: ``rank1_op._one_node`` off), under an
    outer saved-tensor hook, which makes bayesify save everything as usual."""
    with mock.patch.object(rank1_op, "_one_node", lambda *tensors: False), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        yield


def _grads(model: nn.Module, x: torch.Tensor, plain: bool) -> dict[str, torch.Tensor]:
    """One seeded training step's gradients; ``plain``: by the reference path (:func:`_plain_path`)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with _plain_path() if plain else contextlib.nullcontext():
        loss = F.cross_entropy(model(x), torch.arange(x.shape[0]) % 5)
    (loss + bayesify.kl_divergence(model) / 100).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("sampling", ["example", "component", "auto"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_are_those_of_the_plain_path(name: str, sampling: str) -> None:
    model, x = _converted(name, sampling)
    recomputed, plain = _grads(model, x, plain=False), _grads(model, x, plain=True)
    assert recomputed.keys() == plain.keys() and any("rank1_s" in n for n in plain)
    for n in plain:
        torch.testing.assert_close(recomputed[n], plain[n], rtol=1e-12, atol=1e-12, msg=n)


def _held(model: nn.Module, x: torch.Tensor, plain: bool) -> int:
    record = HeldBytes()
    with record, _plain_path() if plain else contextlib.nullcontext():
        loss = model(x).square().mean()
    held = record.held()
    loss.backward()
    return held


def test_the_per_row_path_holds_no_scaled_input() -> None:
    # a Linear on [B, T, C]: the plain path holds x o s for each of the 3 layers (as a view F.linear saves)
    model, x = _converted("tokens", "example")
    batch, tokens = x.shape[:2]
    scaled = (batch * tokens * (12 + 32) + batch * 12) * 8  # fc1 and fc2 on every token; the head on the mean
    _held(model, x, plain=False)  # a first pass learns how the layers take the draws (the router's needs)
    plain, recomputed = _held(model, x, plain=True), _held(model, x, plain=False)
    assert plain - recomputed >= scaled


def test_the_fold_holds_no_weight_sized_intermediate(monkeypatch: pytest.MonkeyPatch) -> None:
    # fold_weight is one autograd node keeping W, r and s; the same maths through autograd keeps the
    # weight-sized outer product r s^T (a Linear's) of every block for the backward pass
    from bayesify.layers import folded

    torch.manual_seed(0)
    layers = [nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)]
    model = bayesify.convert(nn.Sequential(*layers).double(), components=K, sampling="component").train()
    x = torch.randn(8, 64, dtype=torch.float64)
    one_node = _held(model, x, plain=False)
    monkeypatch.setattr(folded._FoldWeights, "apply", lambda w, rows, columns, groups: folded._fold(w, rows, columns, groups))
    chained = _held(model, x, plain=False)
    assert chained - one_node >= K * (64 * 256 + 256 * 256 + 256 * 4) * 8


def test_the_benchmark_counts_each_held_storage_once() -> None:
    a = torch.randn(1000, requires_grad=True)

    def loss() -> torch.Tensor:
        b = a.exp()  # saved by exp (its result) and twice by the product: one storage
        return (b * b).sum()

    record = HeldBytes()
    with record:
        total = loss()
    assert record.held() == 1000 * 4 + 4  # b, and the loss itself
    total.backward()


def test_an_input_changed_in_place_before_backward_is_an_error() -> None:
    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), components=K, sampling="example")
    x = torch.randn(8, 4)
    hidden = model[1](model[0](x))
    out = model[2](hidden)
    hidden.add_(1)  # the second layer's input, which its backward pass needs
    with pytest.raises(RuntimeError, match="modified (in place|by an inplace)"):
        out.sum().backward()


def test_activation_checkpointing_is_left_to_do_its_own_saving() -> None:
    model, x = _converted("conv", "example")
    reference = _grads(model, x, plain=True)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)

    class Checkpointed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(model, x, use_reentrant=False, preserve_rng_state=True)

    loss = F.cross_entropy(Checkpointed()(x), torch.arange(x.shape[0]) % 5)
    (loss + bayesify.kl_divergence(model) / 100).backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, reference[n], rtol=1e-10, atol=1e-10, msg=n)


@pytest.mark.parametrize(
    "shape, groups, transposed",
    [((6, 4), 1, False), ((6, 2, 3, 3), 3, False), ((4, 6, 2, 2, 2), 1, False), ((6, 4, 3), 1, True), ((6, 2, 3, 3), 2, True)],
    ids=["linear", "grouped-conv2d", "conv3d", "transposed-conv1d", "grouped-transposed-conv2d"],
)
def test_fold_weight_gradients(shape: tuple[int, ...], groups: int, transposed: bool) -> None:
    torch.manual_seed(0)
    outs, ins = (shape[1] * groups, shape[0]) if transposed else (shape[0], shape[1] * groups)
    w = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    r = torch.randn(outs, dtype=torch.float64, requires_grad=True)
    s = torch.randn(ins, dtype=torch.float64, requires_grad=True)

    def fold(w: torch.Tensor, r: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return fold_weight(w, r, s, groups=groups, transposed=transposed)

    assert torch.autograd.gradcheck(fold, (w, r, s))
    assert torch.autograd.gradgradcheck(fold, (w, r, s))
    with torch.no_grad():  # the plain maths: the same values
        torch.testing.assert_close(fold(w, r, s), fold_weight(w.detach(), r.detach(), s.detach(), groups=groups, transposed=transposed))


def test_a_core_that_changes_its_input_in_place_keeps_what_it_saved() -> None:
    # a layer whose own forward scales its input in place before its map saves it: the saved tensor is
    # no longer x o s, so it must be kept as it is, not recomputed
    class InPlace(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.mul_(2.0))

    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), InPlace(6, 5)).double(), components=K,
                             sampling="example").train()  # fmt: skip
    x = torch.randn(8, 4, dtype=torch.float64)
    recomputed, plain = _grads(model, x, plain=False), _grads(model, x, plain=True)
    for n in plain:
        torch.testing.assert_close(recomputed[n], plain[n], rtol=1e-12, atol=1e-12, msg=n)


def test_fold_weight_with_factors_of_another_dtype() -> None:
    # the weight in float64, the factors in float32: the same gradients as the plain maths through autograd
    from bayesify.layers.folded import _fold

    torch.manual_seed(0)
    w = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    r, s = torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)
    grads = []
    for fold in (lambda: fold_weight(w, r, s, groups=3), lambda: _fold(w, r[None], s[None], 3)[0]):
        out = fold()
        torch.autograd.backward(out, torch.ones_like(out))
        grads.append([t.grad.clone() for t in (w, r, s)])
        for t in (w, r, s):
            t.grad = None
    for mine, reference in zip(*grads):
        assert mine.dtype == reference.dtype
        torch.testing.assert_close(mine, reference)


# The per-row op of a layer whose map is known (a zero-padded convolution, nn.Linear, Hugging Face Conv1D) runs as
# one autograd node with the map's backward written out (rank1_op._Rank1Map): checked against autograd's own ops.
def _known_layers() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    layers = {
        "linear-2d": (nn.Linear(5, 7), (6, 5)),
        "linear-3d": (nn.Linear(5, 7), (6, 3, 5)),
        "conv2d-strided-grouped": (nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, groups=2), (6, 4, 7, 7)),
        "conv1d-dilated": (nn.Conv1d(3, 4, 3, padding=2, dilation=2), (6, 3, 9)),
        "conv3d": (nn.Conv3d(2, 3, 2, padding=(1, 0, 1)), (6, 2, 3, 4, 3)),
    }
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return layers
    layers["hf-conv1d"] = (Conv1D(7, 5), (6, 3, 5))
    return layers


KNOWN = _known_layers()


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_the_one_node_op_is_the_plain_ops(name: str) -> None:
    torch.manual_seed(0)
    layer, shape = KNOWN[name]
    model = bayesify.convert(nn.Sequential(layer).double(), components=K, sampling="example").train()
    with torch.no_grad():
        model[0].rank1_bias.copy_(torch.randn_like(model[0].rank1_bias))  # an offset to differentiate as well
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(plain: bool) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(1)
        with _plain_path() if plain else contextlib.nullcontext():
            out = model(x)
            grads = torch.autograd.grad(out.square().sum(), [x, *params], create_graph=True)
            # the second order too: the gradient's own gradient (double backward through the node)
            again = torch.autograd.grad(sum(g.square().sum() for g in grads), [x, *params])
        return (out, *grads, *again)

    calls = []
    original = rank1_op._Rank1Map.apply
    with mock.patch.object(rank1_op._Rank1Map, "apply", lambda *a: calls.append(1) or original(*a)):
        one_node = run(plain=False)
    assert calls, "the known map did not take the one-node path"
    for got, want in zip(one_node, run(plain=True)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_the_one_node_op_under_autocast_gives_the_plain_ops_gradients() -> None:
    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 4)),
                             components=K, sampling="example").train()  # fmt: skip
    x = torch.randn(8, 3, 6, 6)

    def grads(plain: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with _plain_path() if plain else contextlib.nullcontext(), torch.autocast("cpu", torch.bfloat16):
            out = model(x)
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
        return [p.grad for p in model.parameters()]

    for got, want in zip(grads(False), grads(True)):  # the same ops in the same dtypes: bitwise
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_one_node_op_saves_two_ops_a_layer() -> None:
    # the recomputing hooks' unpack dispatches a detach per tensor the map saved: two per layer and step
    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)),
                             components=K, sampling="example").train()  # fmt: skip
    x = torch.randn(8, 3, 6, 6)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    step()
    one_node = op_calls(step)
    with mock.patch.object(rank1_op, "_one_node", lambda *tensors: False):
        step()
        two_nodes = op_calls(step)
    assert two_nodes - one_node >= 2 * 2
