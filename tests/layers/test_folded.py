"""The folded path (one weight per block of one component) is the per-row path's function, and its gradients.

Checked in float64 against the per-example path (``sampling='example'``) on the same parameters,
with noise off (the same means) so the two must agree to rounding: outputs and the gradients of
every parameter; and ``torch.autograd.gradcheck`` on the op itself. Every foldable family and
option: Linear, Conv1-3d, grouped / dilated / strided / padding modes, Hugging Face Conv1D, weights
used directly (``F.linear(x, layer.weight)``); the tile, component and sample routes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesify
from tests._rank1 import perturb
from bayesify.layers.folded import fold_weight, rank1_folded

DT = torch.float64
K = 3


def _randomise(model: nn.Module) -> None:
    perturb(model)


def _pair(module: nn.Module, task: str = "regression") -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    folded = bayesify.convert(copy.deepcopy(module).to(DT), components=K, sampling="component", task=task)
    _randomise(folded)
    return folded, _per_row(folded)


def _per_row(folded: nn.Module) -> nn.Module:
    """A copy of ``folded`` whose layers take the per-row path: the same routing and draws, another computation."""
    reference = copy.deepcopy(folded)
    for _, layer in bayesify.rank1_layers(reference):
        layer._rank1_folds = lambda draw, x, weight: False  # (an instance attribute: the copy's layers only)
    return reference


def _check(folded: nn.Module, reference: nn.Module, x: torch.Tensor, route: str) -> None:
    outputs, grads = [], []
    for model in (folded, reference):
        model.zero_grad()
        torch.manual_seed(1)  # the same component order for the sample route
        with bayesify.mode(model, route=route, noise=False, **({"component": 1} if route == "component" else {})):
            out = model.train()(x)
        out.square().sum().backward()
        outputs.append(out)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outputs[0], outputs[1])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=f"gradient of {name}")


LAYERS = {
    "linear": (lambda: nn.Linear(5, 4), (6, 5)),
    "linear-seq": (lambda: nn.Linear(5, 4), (6, 3, 5)),
    "linear-uneven-blocks": (lambda: nn.Linear(5, 4), (7, 5)),  # the sample route's blocks of 3, 2, 2 rows
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=1), (6, 4, 9)),
    "conv2d-grouped-strided": (lambda: nn.Conv2d(4, 6, 3, stride=2, groups=2, bias=False), (6, 4, 9, 9)),
    "conv2d-depthwise-dilated": (lambda: nn.Conv2d(6, 6, 3, dilation=2, padding=2, groups=6), (6, 6, 8, 8)),
    "conv2d-reflect": (lambda: nn.Conv2d(3, 5, 3, padding=1, padding_mode="reflect"), (6, 3, 7, 7)),
    "conv2d-same": (lambda: nn.Conv2d(3, 5, 4, padding="same"), (6, 3, 7, 7)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2), (6, 2, 4, 4, 4)),
}


@pytest.mark.parametrize("route", ["tile", "component", "sample"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_folded_equals_per_row(name: str, route: str) -> None:
    make, shape = LAYERS[name]
    folded, reference = _pair(nn.Sequential(make(), nn.Tanh()))
    _check(folded, reference, torch.randn(*shape, dtype=DT), route)


def test_huggingface_conv1d_and_intercepted_weights_fold() -> None:
    transformers = pytest.importorskip("transformers")

    class Uses(nn.Module):  # uses its Linear's weight directly, as timm's EVA does
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(5, 4)
            self.dense = transformers.pytorch_utils.Conv1D(3, 4)

        def forward(self, x):
            return self.dense(F.linear(x, self.proj.weight, self.proj.bias).tanh())

    folded, reference = _pair(Uses())
    _check(folded, reference, torch.randn(6, 5, dtype=DT), "tile")


def test_a_bias_given_by_the_caller_of_an_intercepted_weight_folds() -> None:
    class SwinLike(nn.Module):  # timm's SwinV2: F.linear(x, qkv.weight, bias=cat(q_bias, k_bias, v_bias))
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(5, 6, bias=False)
            self.q_bias = nn.Parameter(torch.randn(6))

        def forward(self, x):
            return F.linear(x, weight=self.qkv.weight, bias=self.q_bias).tanh()

    folded, reference = _pair(SwinLike())
    _check(folded, reference, torch.randn(6, 5, dtype=DT), "tile")


@pytest.mark.parametrize("posterior,prior", [("normal", "normal"), ("cauchy", "cauchy"), ("delta", "normal")])
@pytest.mark.parametrize("perturbation", ["multiplicative", "additive"])
def test_every_posterior_and_perturbation_agrees_with_the_reference_path(
    posterior: str, prior: str, perturbation: str
) -> None:
    """Additive perturbations are not weights: they keep the per-row path, which must hold too."""
    module = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.ConvTranspose2d(4, 2, 2, stride=2), nn.Flatten(),
                           nn.Linear(2 * 8 * 8, 3))  # fmt: skip
    torch.manual_seed(0)
    folded = bayesify.convert(
        copy.deepcopy(module).to(DT), components=K, sampling="component", task="regression",
        posterior=posterior, prior=prior, perturbation=perturbation,
    )  # fmt: skip
    _randomise(folded)
    reference = _per_row(folded)
    _check(folded, reference, torch.randn(4, 3, 4, 4, dtype=DT), "tile")


def test_the_fold_is_w_times_r_s_transposed_for_groups() -> None:
    weight = torch.randn(6, 2, 3, dtype=DT)  # 6 outputs, 3 groups of 2 inputs
    r, s = torch.randn(6, dtype=DT), torch.randn(6, dtype=DT)
    expected = torch.empty_like(weight)
    for o in range(6):
        group = o // 2
        for i in range(2):
            expected[o, i] = weight[o, i] * r[o] * s[group * 2 + i]
    torch.testing.assert_close(fold_weight(weight, r, s, groups=3), expected)


def test_gradcheck_of_the_folded_op() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 6, dtype=DT, requires_grad=True)
    weight = torch.randn(4, 3, 2, dtype=DT, requires_grad=True)
    s = torch.randn(2, 3, dtype=DT, requires_grad=True)
    r = torch.randn(2, 4, dtype=DT, requires_grad=True)
    offset = torch.randn(2, 4, dtype=DT, requires_grad=True)
    blocks = ((0, 2), (2, 5))

    def op(x, weight, s, r, offset):
        return rank1_folded(x, blocks, weight, F.conv1d, s, r, offset)

    assert torch.autograd.gradcheck(op, (x, weight, s, r, offset))


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "hf-conv1d"])
@pytest.mark.parametrize("blocks", [((0, 2), (2, 4), (4, 6)), ((0, 3), (3, 5), (5, 6))], ids=["equal", "uneven"])
def test_gradcheck_of_the_folded_dense_op(transposed: bool, blocks: tuple) -> None:
    # equal blocks run as one batched matmul on views of x; uneven ones block by block: the same function
    torch.manual_seed(0)
    x = torch.randn(6, 2, 3, dtype=DT, requires_grad=True)
    weight = torch.randn(*((3, 4) if transposed else (4, 3)), dtype=DT, requires_grad=True)
    s, r, offset = (torch.randn(3, n, dtype=DT, requires_grad=True) for n in (3, 4, 4))

    def apply(v: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return v @ w + b if transposed else F.linear(v, w, b)

    def op(x, weight, s, r, offset):
        return rank1_folded(x, blocks, weight, apply, s, r, offset, transposed=transposed, dense=True)

    def looped(x, weight, s, r, offset):
        return rank1_folded(x, blocks, weight, apply, s, r, offset, transposed=transposed)

    assert torch.autograd.gradcheck(op, (x, weight, s, r, offset))
    assert torch.autograd.gradgradcheck(op, (x, weight, s, r, offset))
    torch.testing.assert_close(op(x, weight, s, r, offset), looped(x, weight, s, r, offset))


def _ops(run) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            self.names.append(f"{func.overloadpacket.__name__}{list(out.shape) if isinstance(out, torch.Tensor) else ''}")
            return out

    log = Log()
    with log:
        run()
    return log.names


@pytest.mark.parametrize("route", ["tile", "component", "tile-samples"])
def test_dense_layers_run_their_blocks_as_one_batched_matmul(route: str) -> None:
    """Linear layers on equal blocks: no copy of the activations into blocks and back (one ``bmm`` per layer),
    in training and in evaluation at the means, with the per-row path's function."""
    folded, reference = _pair(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)))
    x = torch.randn(4, 3, 5, dtype=DT)
    # tile-samples: 2 members per component, so the blocks' components repeat (0, 0, 1, 1, 2, 2)
    kwargs = {"component": 2} if route == "component" else {"samples": 2} if route == "tile-samples" else {}
    route = route.split("-")[0]
    for train in (True, False):
        outs = []
        for model in (folded, reference):
            with torch.set_grad_enabled(train), bayesify.mode(model.train(train), route=route, noise=False, **kwargs):
                outs.append(model(x))
                ops = _ops(lambda: model(x))
            if model is folded:  # no cat of the layers' outputs (the model's input is tiled by one for the tile route)
                rows = outs[0].shape[0]  # the rows the layers see (members x examples)
                assert not {f"cat[{rows}, 3, 8]", f"cat[{rows}, 3, 3]"} & set(ops), ops
                assert sum(op.startswith("baddbmm") for op in ops) == 2, ops
        torch.testing.assert_close(outs[0], outs[1])


def test_component_sampling_draws_one_sample_per_block() -> None:
    layer = bayesify.convert(nn.Linear(4, 4), components=2, sampling="component", init_std=0.5, task="regression")
    x = torch.ones(2, 4)
    with torch.no_grad(), bayesify.mode(layer, route="tile", samples=2):
        out = layer(x).view(4, 2, 4)  # 4 members (2 components x 2 samples), 2 identical examples each
    torch.testing.assert_close(out[:, 0], out[:, 1])  # one network per member
    assert not torch.allclose(out[0], out[1])  # two samples of component 0 differ


def _folding_layers(model: nn.Module, run) -> set[int]:
    """The ids of the weights ``run()`` folds into K members at the means (``affine.fold_weights``)."""
    import bayesify.layers.affine as affine

    seen: set[int] = set()
    original = affine.fold_weights

    def recording(weight, *args, **kwargs):
        seen.add(id(weight))
        return original(weight, *args, **kwargs)

    affine.fold_weights = recording
    try:
        run()
    finally:
        affine.fold_weights = original
    return seen


def test_evaluation_at_the_means_folds_each_member_and_follows_every_weight_change() -> None:
    """No noise, no gradients, members fixed by the route: the K members' weights are folded on every call, from
    the Parameters as they are, so every way PyTorch offers to change one is seen by the next call (nothing is
    kept between calls: issue 26)."""
    folded, reference = _pair(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3)))
    x = torch.randn(5, 3, 7, 7, dtype=DT)
    folded.eval()
    reference.eval()

    def members(model: nn.Module) -> torch.Tensor:
        with torch.no_grad(), bayesify.mode(model, route="tile", noise=False):
            return model(x)

    assert id(folded[0].weight) in _folding_layers(folded, lambda: members(folded))
    torch.testing.assert_close(members(folded), members(reference))
    for model in (folded, reference):  # through .data: no version counter moves
        model[0].rank1_s.loc.data.mul_(1.5)
        model[0].weight.data = model[0].weight.data + 0.1
    torch.testing.assert_close(members(folded), members(reference))


def test_auto_evaluation_folds_only_the_layers_where_folding_pays() -> None:
    """``sampling="auto"`` at the means: a convolution with large activations next to its weight keeps K folded
    weights; a wide Linear on a few rows runs the per-row path (K small matmuls would cost more than one of
    K*B rows); both give the members' function."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 30 * 30, 64), nn.Linear(64, 3))
    auto = bayesify.convert(copy.deepcopy(model).to(DT), components=K, task="classification")
    _randomise(auto)
    per_row = bayesify.convert(copy.deepcopy(model).to(DT), components=K, task="classification", sampling="example")
    per_row.load_state_dict(auto.state_dict())
    x = torch.randn(3, 3, 32, 32, dtype=DT)
    with torch.no_grad():
        out = auto.eval()(x)
        torch.testing.assert_close(out, per_row.eval()(x))
    with torch.no_grad():
        folds = _folding_layers(auto, lambda: auto(x))
    assert id(auto[0].weight) in folds  # conv: 4*3*3*3 weights, 3*3*32*32 + 3*4*30*30 activations
    assert id(auto[3].weight) not in folds and id(auto[4].weight) not in folds


def test_auto_counts_a_strided_convolutions_real_output_and_folds_a_stem_in_training() -> None:
    """``sampling="auto"`` weighs the bytes each path moves: a ViT's patch embedding (stride 16) has 256 times fewer
    output positions than input positions, and was counted as if it had as many (it folded K weights of 49k values
    where the per-row path scales 53k activations). In training a convolution whose input takes no gradient (a
    stem) folds while its input factor trains: the per-row path would take the input's gradient (for the factor's), a
    second convolution the original never runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 16, stride=16), nn.Flatten(), nn.Linear(64 * 4, 3))
    auto = bayesify.convert(model, components=K, task="classification")
    patch = auto[0]
    decisions: list[bool] = []
    decide = patch._rank1_folds
    patch._rank1_folds = lambda *args: decisions.append(decide(*args)) or decisions[-1]
    x = torch.randn(16, 3, 32, 32)
    with torch.no_grad():
        auto.eval()(x)
    auto.train()
    auto(x).sum().backward()
    auto(x.clone().requires_grad_()).sum().backward()  # an input that takes a gradient: the byte count decides
    patch.rank1_s.requires_grad_(False)  # a frozen s: the per-row path takes no input gradient either
    auto(x).sum().backward()
    assert decisions == [False, True, False, False]
    assert patch.rank1_output_numel(x) == patch(x).numel() == 16 * 64 * 2 * 2


@pytest.mark.parametrize(
    "conv, shape",
    [
        (nn.Conv2d(3, 8, 7, stride=2, padding=3), (2, 3, 17, 17)),
        (nn.Conv2d(4, 6, 3, padding="same", dilation=2), (2, 4, 9, 9)),
        (nn.Conv1d(4, 6, 3, dilation=2, padding="valid"), (4, 11)),
        (nn.Conv3d(2, 3, 2, stride=2, groups=1), (1, 2, 4, 6, 8)),
        (nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1), (2, 4, 5, 5)),
        (nn.ConvTranspose1d(4, 2, 4, stride=3, dilation=2), (3, 4, 7)),
    ],
)
def test_a_convolutions_output_size_is_counted_exactly(conv: nn.Module, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    expected = conv(x).numel()
    bayesify.convert(nn.Sequential(conv), components=K, task="regression")
    assert conv.rank1_output_numel(x) == expected


def test_a_sampled_predictive_draws_for_each_example_at_any_batch_size() -> None:
    """``uncertainty()`` (the sampled members, no gradients) at a batch size where ``sampling="auto"`` folds a
    convolution: folded, one draw per member served the whole batch, so copies of one example got the same mutual
    information and a score ranked across batches (the OOD set apart from the test set) compared two draws. Each
    example draws its own, as in a small batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 30 * 30, 5))
    model = bayesify.convert(model, components=K, task="classification").eval()
    _randomise(model)
    x = torch.randn(1, 3, 32, 32).expand(64, -1, -1, -1)
    information = bayesify.uncertainty(model, x, samples=2).mutual_information
    assert information.unique().numel() == 64
    with torch.no_grad(), bayesify.mode(model, route="tile", noise=False):  # at the means folding stays (exact)
        assert id(model[0].weight) in _folding_layers(model, lambda: model(x))
