"""What the rank-1 op holds for the backward pass, and that it loses nothing.

The per-row path's ``x o s`` is recomputed in the backward pass (``bayesify/layers/_recompute.py``);
the folded path holds each block's weight once (``fold_weight`` is one autograd node). Checked here:
the gradients are those of the plain path (the same ops, so the same numbers), the step holds less,
an in-place change of a used input is an error rather than a wrong gradient, it stands aside under
activation checkpointing, and ``fold_weight``'s own backward is right (gradcheck, float64).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import bayesify
from benchmarks.overhead import HeldBytes
from bayesify.layers.rank1_op import fold_weight

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


def _grads(model: nn.Module, x: torch.Tensor, plain: bool) -> dict[str, torch.Tensor]:
    """One seeded training step's gradients; ``plain``: under an outer saved-tensor hook, which makes
    bayesify save everything as usual (the reference)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    if plain:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = F.cross_entropy(model(x), torch.arange(x.shape[0]) % 5)
    else:
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
    with record:
        if plain:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss = model(x).square().mean()
        else:
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
    from bayesify.layers import rank1_op

    torch.manual_seed(0)
    layers = [nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)]
    model = bayesify.convert(nn.Sequential(*layers).double(), components=K, sampling="component").train()
    x = torch.randn(8, 64, dtype=torch.float64)
    one_node = _held(model, x, plain=False)
    monkeypatch.setattr(rank1_op._FoldWeights, "apply", lambda w, rows, columns, groups: rank1_op._fold(w, rows, columns, groups))
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
    from bayesify.layers.rank1_op import _fold

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
