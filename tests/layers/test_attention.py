"""Rank-1 nn.MultiheadAttention and the Transformer layers built on it, against torch per member."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import bayesify

K = 3
E, HEADS, L, S, B = 8, 2, 3, 5, 2
DT = torch.float64


def _randomise(model: nn.Module) -> None:
    with torch.no_grad():
        for _, layer in bayesify.rank1_layers(model):
            for name, p in layer.named_parameters(recurse=False):
                if name.startswith("rank1_bias") and p is not None:
                    p.normal_(0.0, 0.3)
            for _, factor in layer.rank1_factors():
                factor.loc.normal_(1.0, 0.3)


def _scaled(layer: nn.Module, name: str, weight: Tensor, k: int) -> Tensor:
    r = getattr(layer, f"rank1_r_{name}").loc[k]
    s = getattr(layer, f"rank1_s_{name}").loc[k]
    return weight * r[:, None] * s[None, :]


def member_model(model: nn.Module, k: int) -> nn.Module:
    """A plain copy of a converted model whose weights are member k's: W o (r_k s_k^T), b + delta_k."""
    plain = copy.deepcopy(model)
    with torch.no_grad():
        for _, layer in list(bayesify.rank1_layers(plain)):
            if isinstance(layer, nn.MultiheadAttention):
                p = layer._parameters
                if p.get("in_proj_weight") is not None:
                    parts = p["in_proj_weight"].chunk(3)
                    p["in_proj_weight"].copy_(torch.cat([_scaled(layer, n, w, k) for n, w in zip("qkv", parts)]))
                else:
                    for n in "qkv":
                        p[f"{n}_proj_weight"].copy_(_scaled(layer, n, p[f"{n}_proj_weight"], k))
                if p.get("in_proj_bias") is not None:
                    p["in_proj_bias"].add_(layer.rank1_bias_in[k])
                layer.out_proj.weight.copy_(_scaled(layer, "out", layer.out_proj.weight, k))
                if layer.out_proj.bias is not None:
                    layer.out_proj.bias.add_(layer.rank1_bias_out[k])
            elif isinstance(layer, nn.Linear):
                layer.weight.mul_(layer.rank1_r.loc[k][:, None] * layer.rank1_s.loc[k][None, :])
                if layer.bias is not None:
                    layer.bias.add_(layer.rank1_bias[k])
    return bayesify.revert(plain)


def _inputs(batch_first: bool, separate: bool, unbatched: bool) -> tuple[Tensor, Tensor, Tensor]:
    kdim, vdim = (6, 7) if separate else (E, E)

    def make(n: int, d: int) -> Tensor:
        t = torch.randn(B, n, d, dtype=DT) if batch_first else torch.randn(n, B, d, dtype=DT)
        return (t[0] if batch_first else t[:, 0]) if unbatched else t

    q = make(L, E)
    if separate:
        return q, make(S, kdim), make(S, vdim)
    return q, q, q  # self-attention: the same tensor (torch's packed in-projection path)


def _masks(kind: str, unbatched: bool, src: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "kpm" in kind:
        m = torch.zeros(B, src, dtype=torch.bool)
        m[0, -1] = True
        out["key_padding_mask"] = m[0] if unbatched else m
    if "causal" in kind:
        out["attn_mask"] = torch.triu(torch.ones(L, src, dtype=torch.bool), 1)
        out["is_causal"] = True
    elif "3d" in kind:
        mask = torch.rand((1 if unbatched else B) * HEADS, L, src) < 0.3
        mask[..., 0] = False  # no query attends to nothing (softmax of all -inf is NaN, in torch too)
        out["attn_mask"] = mask
    return out


def _split(t: Tensor, axis: int, k: int, unbatched: bool) -> Tensor:
    if unbatched:
        return t.select(axis, k)
    return t.narrow(axis, k * B, B)


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
@pytest.mark.parametrize("separate", [False, True], ids=["fused", "kdim-vdim"])
@pytest.mark.parametrize("bias,bias_kv,zero_attn", [(True, False, False), (False, False, False), (True, True, True)])
@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize("masks", ["none", "kpm", "3d", "kpm-causal"])
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_attention_members_match_torch(
    batch_first: bool, separate: bool, bias: bool, bias_kv: bool, zero_attn: bool, unbatched: bool, masks: str,
    need_weights: bool, average: bool,
) -> None:  # fmt: skip
    kw = {"kdim": 6, "vdim": 7} if separate else {}
    reference = nn.MultiheadAttention(
        E, HEADS, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, batch_first=batch_first, **kw
    ).to(DT)
    layer = bayesify.convert(copy.deepcopy(reference), components=K, posterior="delta")
    q, k, v = _inputs(batch_first, separate, unbatched)
    options = {**_masks(masks, unbatched, S if separate else L), "need_weights": need_weights, "average_attn_weights": average}
    expected = reference(q, k, v, **options)

    for train in (True, False):  # torch's shapes in training and in evaluation (the mixture)
        layer.train(train)
        got = layer(q, k, v, **options)
        assert [None if t is None else t.shape for t in got] == [None if t is None else t.shape for t in expected]
    layer.eval()

    out_axis = 0 if batch_first else 1  # an unbatched input's members are inserted there too
    with bayesify.mode(layer, route="tile", noise=False):
        out, weights = layer(q, k, v, **options)
    for member in range(K):
        torch.testing.assert_close(_split(out, out_axis, member, unbatched), expected[0], atol=1e-10, rtol=0)
        if need_weights:
            torch.testing.assert_close(_split(weights, 0, member, unbatched), expected[1], atol=1e-10, rtol=0)

    _randomise(layer)
    with bayesify.mode(layer, route="tile", noise=False):
        out, weights = layer(q, k, v, **options)
    for member in range(K):
        plain_out, plain_weights = member_model(layer, member)(q, k, v, **options)
        torch.testing.assert_close(_split(out, out_axis, member, unbatched), plain_out, atol=1e-10, rtol=0)
        if need_weights:
            torch.testing.assert_close(_split(weights, 0, member, unbatched), plain_weights, atol=1e-10, rtol=0)


@pytest.mark.parametrize("separate", [False, True], ids=["fused", "kdim-vdim"])
def test_attention_gradients_reach_every_parameter(separate: bool) -> None:
    kw = {"kdim": 6, "vdim": 7} if separate else {}
    layer = bayesify.convert(nn.MultiheadAttention(E, HEADS, batch_first=True, dropout=0.1, **kw).to(DT), components=K)
    q, k, v = _inputs(True, separate, False)
    layer.train()
    with bayesify.mode(layer, route="tile"):
        out, weights = layer(q, k, v)
    (out.square().sum() + weights.sum()).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"No gradient for {name}"
        if name.startswith("rank1_"):
            assert p.grad.abs().sum() > 0, f"Zero gradient for {name}"


def test_attention_dropout_only_in_training() -> None:
    layer = bayesify.convert(nn.MultiheadAttention(E, HEADS, dropout=0.5).to(DT), components=K)
    q = torch.randn(L, B, E, dtype=DT)
    with bayesify.mode(layer, component=0, noise=False):
        layer.train()
        a, b = layer(q, q, q)[0], layer(q, q, q)[0]
        layer.eval()
        c, d = layer(q, q, q)[0], layer(q, q, q)[0]
    assert not torch.allclose(a, b)
    torch.testing.assert_close(c, d)


@pytest.fixture
def no_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's fused inference kernels raise: a converted model must never reach them."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a converted model took torch's deterministic fast path")

    for name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention", "_nested_tensor_from_mask"):
        monkeypatch.setattr(torch, name, refuse)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_in_eval_no_grad_is_rank1(no_fast_path: None, norm_first: bool, activation: str) -> None:
    """eval + no_grad is where TransformerEncoderLayer would take its fused fast path."""
    reference = nn.TransformerEncoderLayer(
        E, HEADS, dim_feedforward=16, batch_first=True, norm_first=norm_first, activation=activation
    ).to(DT)
    model = bayesify.convert(copy.deepcopy(reference), components=K, posterior="delta")
    _randomise(model)
    model.eval()
    x = torch.randn(B, L, E, dtype=DT)
    mask = torch.tensor([[False, False, True], [False, False, False]])
    with torch.no_grad(), bayesify.mode(model, route="tile", noise=False):
        out = model(x, src_key_padding_mask=mask)
    for member in range(K):
        plain = member_model(model, member).eval()
        with torch.no_grad(), _fastpath_off():  # the plain reference would take the (refused) fast path
            expected = plain(x, src_key_padding_mask=mask)
        torch.testing.assert_close(out[member * B : (member + 1) * B], expected, atol=1e-8, rtol=0)
    with torch.no_grad():  # the default evaluation route (mixture) too
        assert model(x, src_key_padding_mask=mask).shape == x.shape


def test_encoder_layer_called_on_its_own_is_rank1(no_fast_path: None) -> None:
    """A converted encoder layer used outside the converted root's forward (no routing is live)."""
    model = nn.Sequential(nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=16, batch_first=True), nn.Linear(E, 3))
    model = bayesify.convert(model.to(DT), components=K)
    _randomise(model)
    model.eval()
    x = torch.randn(B, L, E, dtype=DT)
    with torch.no_grad(), bayesify.mode(model, component=1, noise=False):
        out = model[0](x)  # would raise in the refused fused kernel without the pre-hook
    seen = []
    handle = model[0].register_forward_hook(lambda m, a, o: seen.append(o))
    with torch.no_grad(), bayesify.mode(model, route="tile", noise=False):
        model(x)  # the whole model's members: member 1's rows of the encoder layer's output
    handle.remove()
    assert out.shape == x.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, seen[0][B : 2 * B])
    with pytest.raises(RuntimeError, match=r"outside the forward pass of its converted model.*bayesify.mode\(model, component=k\)"):
        model[0](x)  # evaluation's mixture needs the root's forward: said, not guessed
    layer = model[0].self_attn
    bayesify.revert(model)
    assert type(layer) is nn.MultiheadAttention and not layer._forward_pre_hooks


class _fastpath_off:
    def __enter__(self) -> None:
        self.before = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch.backends.mha.set_fastpath_enabled(self.before)


def test_encoder_stack_with_padding_mask_skips_nested_tensors(no_fast_path: None) -> None:
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=16, batch_first=True), 2, enable_nested_tensor=True
    ).to(DT)
    model = bayesify.convert(encoder, components=K)
    x = torch.randn(B, L, E, dtype=DT)
    mask = torch.tensor([[False, False, True], [False, False, False]])
    with torch.no_grad():
        assert model.eval()(x, src_key_padding_mask=mask).shape == x.shape
    report = bayesify.summary(model, x)
    assert "every converted layer ran" in str(report)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_members_match_torch(no_fast_path: None, batch_first: bool) -> None:
    reference = nn.Transformer(E, HEADS, 1, 1, 16, dropout=0.0, batch_first=batch_first).to(DT)
    model = bayesify.convert(copy.deepcopy(reference), components=K, posterior="delta", batch_dim=0 if batch_first else 1)
    _randomise(model)
    src = torch.randn(B, S, E, dtype=DT) if batch_first else torch.randn(S, B, E, dtype=DT)
    tgt = torch.randn(B, L, E, dtype=DT) if batch_first else torch.randn(L, B, E, dtype=DT)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=DT)
    model.eval()
    with torch.no_grad(), bayesify.mode(model, route="tile", noise=False):
        out = model(src, tgt, tgt_mask=tgt_mask, tgt_is_causal=True)
    axis = 0 if batch_first else 1
    for member in range(K):
        with torch.no_grad(), _fastpath_off():
            expected = member_model(model, member).eval()(src, tgt, tgt_mask=tgt_mask, tgt_is_causal=True)
        torch.testing.assert_close(out.narrow(axis, member * B, B), expected, atol=1e-8, rtol=0)
    model.train()
    model(src, tgt, tgt_mask=tgt_mask).sum().backward()
    assert all(p.grad is not None for p in bayesify.rank1_parameters(model))


def test_revert_restores_attention() -> None:
    layer = nn.MultiheadAttention(E, HEADS, kdim=6, vdim=7)
    before = {n: p for n, p in layer.named_parameters()}
    bayesify.convert(layer, components=K)
    assert {"rank1_s_k", "rank1_r_out"} <= {n for n, _ in layer.rank1_factors()}
    assert {"rank1_bias_in", "rank1_bias_out"} <= set(layer.rank1_state.packed)  # bias offsets drawn with a group
    assert {"rank1_s_k.loc", "rank1_s_k.rho", "rank1_bias_in"} <= set(layer.state_dict())  # the layer's own
    bayesify.revert(layer)
    assert type(layer) is nn.MultiheadAttention
    assert {n: p for n, p in layer.named_parameters()} == before


class _TimeMajorInside(nn.Module):
    """A batch-first model around torch's time-major encoder (``batch_first=False``, torch's default): older code
    transposes in and out."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=16, dropout=0.0), 1,
                                             enable_nested_tensor=False)  # fmt: skip
        self.head = nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x.transpose(0, 1)).transpose(0, 1).mean(1))


@pytest.mark.parametrize("length", [B, 4], ids=["length-equals-batch", "other-length"])
def test_a_time_major_encoder_inside_a_batch_first_model_keeps_each_member_its_own(no_fast_path: None, length: int) -> None:
    """The encoder layer's feed-forward Linears see ``[T, B, C]``: they took dimension 0 (the model's batch_dim) as
    the batch and mixed the members, warned where T differed from the rows and silent where it equalled them. They
    take their batch at dimension 1, as the layer's attention does: every member of the tiled pass is its own."""
    torch.manual_seed(0)
    model = bayesify.convert(_TimeMajorInside().to(DT), components=K, posterior="delta", task="classification")
    _randomise(model)
    model.eval()
    x = torch.randn(B, length, E, dtype=DT)
    with torch.no_grad(), bayesify.mode(model, route="tile", noise=False):
        out = model(x)
    for member in range(K):
        with torch.no_grad(), _fastpath_off():
            expected = member_model(model, member).eval()(x)
        torch.testing.assert_close(out[member * B : (member + 1) * B], expected, atol=1e-8, rtol=0)
    assert model.encoder.layers[0].linear1.rank1_batch_axis(x.transpose(0, 1)) == 1
    assert "members mixed" not in str(bayesify.summary(model, x))  # (it named both Linears)
