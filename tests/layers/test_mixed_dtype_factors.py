"""A bf16 model whose rank-1 factors and bias offsets are kept in fp32 (bf16 factors at 1.0 do not move at a
learning rate of 1e-3). The per-row path cast them to the activations' dtype, but the folded path promoted the
folded weights to fp32, and F.linear, a convolution or dense_blocks' bmm refused them next to a bf16 input: it
crashed from the batch size at which sampling="auto" folds up, in evaluation and in training. Every path now
computes in the layer's dtype and returns it (and an fp32 model with bf16 factors in fp32)."""

import copy

import pytest
import torch
from torch import nn

import bayesify

K = 4
BATCHES = (1, 2, 8, 9, 16, 21, 22, 33, 64)  # auto folds the linear net's layers from 9 and 22 rows up
PATHS = ("example", "component", "auto")  # per row everywhere, folded wherever rows come in blocks, by the byte count


def _linear() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3))


# (the network, an input of B rows, convert's batch_dim): a dense layer on equal blocks runs one batched matmul
# (dense_blocks), a time-major one (batch at 1) and a convolution run the map once per block
FAMILIES = {
    "linear": (_linear, lambda b: torch.randn(b, 16), 0),
    "linear-time-major": (_linear, lambda b: torch.randn(3, b, 16), 1),
    "conv2d": (_conv, lambda b: torch.randn(b, 3, 6, 6), 0),
}


def _converted(plain: nn.Module, sampling: str, batch_dim: int, factors: torch.dtype) -> nn.Module:
    torch.manual_seed(0)  # the same factors for every path
    model = bayesify.convert(
        copy.deepcopy(plain), task="regression", components=K, init="normal", sampling=sampling, batch_dim=batch_dim
    )
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("rank1_bias"):  # bias offsets away from 0, so that the offsets' dtype shows
            p.data = 0.1 * torch.randn(p.shape, generator=g)
    for p in bayesify.rank1_parameters(model):
        p.data = p.data.to(factors)
    return model


def _run(model: nn.Module, x: torch.Tensor, training: bool) -> torch.Tensor:
    """Evaluation: the mixture at the posterior means. Training: the K members at their posterior means (the
    values of every path are then the same function), with a backward pass to the fp32 factors."""
    if not training:
        with torch.no_grad():
            return model.eval()(x)
    model.train()
    with bayesify.mode(model, route="tile", noise=False):
        out = model(x)
    model.zero_grad()
    out.float().square().mean().backward()
    for name, p in model.named_parameters():
        if name.endswith((".loc", "rank1_bias")):  # (the scales take no gradient at the means)
            assert p.grad is not None and p.grad.dtype == p.dtype and p.grad.isfinite().all(), name
    return out.detach()


@pytest.mark.parametrize(
    ("weights", "factors"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
    ids=["bf16-fp32", "fp32-bf16"],
)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_mixed_dtype_factors_give_every_path_the_same_output_in_the_layers_dtype(family, training, weights, factors):
    make, inputs, batch_dim = FAMILIES[family]
    torch.manual_seed(0)
    plain = make().to(weights)
    models = {path: _converted(plain, path, batch_dim, factors) for path in PATHS}
    # the reference: the same weights and factors (as rounded to their dtypes), all in fp32, per row (a copy, not a
    # conversion of its own: how a factor is drawn at init may depend on the weight's dtype, as in torch 2.9)
    reference = copy.deepcopy(models["example"]).float()
    for b in BATCHES:
        torch.manual_seed(b)
        x = inputs(b).to(weights)
        expected = _run(reference, x.float(), training)
        for path, model in models.items():
            out = _run(model, x, training)
            assert out.dtype == weights, (path, b)
            torch.testing.assert_close(out.float(), expected, rtol=0.03, atol=0.03, msg=f"{path} at batch {b}")


def test_a_merged_member_of_a_bf16_model_with_fp32_factors_is_a_bf16_model() -> None:
    """``merge`` folds fp32 factors into the bf16 weights in the weights' dtype; the bias plus its fp32 offset came
    back fp32, a model of two dtypes that a bf16 input then failed in."""
    torch.manual_seed(0)
    net = _converted(_linear().to(torch.bfloat16), "auto", 0, torch.float32)
    merged = bayesify.merge(net, component=1)
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    with torch.no_grad(), bayesify.mode(net, component=1, noise=False):
        torch.testing.assert_close(merged(x).float(), net(x).float(), rtol=0.03, atol=0.03)
