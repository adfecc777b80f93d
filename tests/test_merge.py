"""``bayesify.merge``: one member folded into a plain copy of the original network.

For every layer family, in float64 with perturbed factors and bias offsets, the merged model's
output equals the converted model's under ``mode(component=k, noise=False)`` for every k; the
merged model is the original architecture (classes, ``state_dict`` keys, no hooks, no rank-1
state) and the converted model is left untouched. Cases the original parameters cannot hold
exactly are refused with an error that names the layer and the reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bayesify

DT = torch.float64
K = 3


def _perturb(model: nn.Module, additive: bool = False) -> None:
    """Factors away from their identity and bias offsets away from zero, so that members differ."""
    with torch.no_grad():  # each factor's loc and each bias offset is a view of the model's store: written through
        for _, layer in bayesify.rank1_layers(model):
            for _, factor in layer.rank1_factors():
                factor.loc.copy_((0.0 if additive else 1.0) + 0.3 * torch.randn_like(factor.loc))
            for name in layer.rank1_state.bias_offsets:
                offset = getattr(layer, name)
                if offset is not None:
                    offset.normal_(0, 0.2)


def _convert(module: nn.Module, **options) -> tuple[nn.Module, nn.Module]:
    """``(a plain copy of the original, the converted model)``, float64, perturbed, in eval mode."""
    torch.manual_seed(0)
    original = copy.deepcopy(module).to(DT).eval()
    converted = bayesify.convert(copy.deepcopy(original), components=K, **options)
    _perturb(converted, additive=options.get("perturbation") == "additive")
    return original, converted


def _assert_plain(merged: nn.Module, original: nn.Module) -> None:
    """The original architecture: classes, state_dict keys, no hooks, nothing of bayesify."""
    assert not bayesify.is_converted(merged)
    assert [type(m) for m in merged.modules()] == [type(m) for m in original.modules()]
    assert list(merged.state_dict()) == list(original.state_dict())
    for module in merged.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks, type(module).__name__
        assert not [n for n in vars(module) if "rank1" in n], type(module).__name__


def _assert_members(original: nn.Module, converted: nn.Module, *inputs: torch.Tensor) -> None:
    """For every component: merge equals mode(component=k, noise=False), and is plain."""
    before = {n: t.clone() for n, t in converted.state_dict().items()}
    members = []
    for k in range(K):
        merged = bayesify.merge(converted, component=k)
        _assert_plain(merged, original)
        with bayesify.mode(converted, component=k, noise=False):
            expected = converted(*inputs)
        torch.testing.assert_close(merged(*inputs), expected, msg=lambda m: f"component {k}: {m}")
        members.append(expected)
    # the converted model is untouched, and its members differ (so the test can fail)
    after = converted.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert bayesify.is_converted(converted)
    first = [t for t in torch.utils._pytree.tree_leaves(members[0]) if isinstance(t, torch.Tensor)][0]
    second = [t for t in torch.utils._pytree.tree_leaves(members[1]) if isinstance(t, torch.Tensor)][0]
    assert (first - second).abs().max() > 1e-3


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DT)


# ---- dense and convolutional layers -------------------------------------------------------------

AFFINE = {
    "mlp": (lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), (6, 5)),
    "linear-no-bias-seq": (lambda: nn.Linear(5, 4, bias=False), (6, 3, 5)),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=1), (5, 4, 9)),
    "conv2d-grouped-strided": (lambda: nn.Conv2d(4, 6, 3, stride=2, groups=2, bias=False), (5, 4, 9, 9)),
    "conv2d-depthwise-dilated": (lambda: nn.Conv2d(6, 6, 3, dilation=2, padding=2, groups=6), (5, 6, 8, 8)),
    "conv2d-reflect": (lambda: nn.Conv2d(3, 5, 3, padding=1, padding_mode="reflect"), (5, 3, 7, 7)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2), (5, 2, 4, 4, 4)),
    "convtranspose1d": (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, output_padding=1), (5, 4, 7)),
    "convtranspose2d-grouped": (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, groups=2), (5, 4, 5, 5)),
    "convtranspose3d": (lambda: nn.ConvTranspose3d(2, 4, 2, bias=False), (5, 2, 3, 3, 3)),
    "cnn": (
        lambda: nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 25, 4)),
        (5, 3, 5, 5),
    ),
}


@pytest.mark.parametrize("name", list(AFFINE))
def test_merge_affine(name: str) -> None:
    make, shape = AFFINE[name]
    original, converted = _convert(make())
    _assert_members(original, converted, _x(*shape))


def test_merge_affine_folded_and_per_example_sampling_alike() -> None:
    # the member does not depend on how the rows run (folded blocks or per example)
    for sampling in ("component", "example"):
        net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(36, 2))
        original, converted = _convert(net, sampling=sampling)
        _assert_members(original, converted, _x(4, 3, 5, 5))


def test_merge_hugging_face_conv1d() -> None:
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    original, converted = _convert(nn.Sequential(pytorch_utils.Conv1D(7, 5), nn.Tanh(), pytorch_utils.Conv1D(3, 7)))
    _assert_members(original, converted, _x(4, 6, 5))


# ---- attention, recurrent, bilinear, CondConv, embeddings ----------------------------------------

ATTENTION = {
    "fused-self-batch-first": (lambda: nn.MultiheadAttention(8, 2, batch_first=True), "self"),
    "separate-kdim-vdim": (lambda: nn.MultiheadAttention(8, 2, kdim=5, vdim=7), "cross"),
    "no-bias": (lambda: nn.MultiheadAttention(8, 2, bias=False), "self"),
    "bias-kv-zero-attn": (lambda: nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True), "self"),
}


@pytest.mark.parametrize("name", list(ATTENTION))
def test_merge_multihead_attention(name: str) -> None:
    make, kind = ATTENTION[name]
    original, converted = _convert(make())
    if kind == "self":
        x = _x(3, 4, 8)
        _assert_members(original, converted, x, x, x)
    else:
        _assert_members(original, converted, _x(3, 4, 8), _x(6, 4, 5), _x(6, 4, 7))


def test_merge_transformer_encoder_layer() -> None:
    # the merged layer may take torch's fused inference path: the same function
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    original, converted = _convert(layer)
    _assert_members(original, converted, _x(4, 5, 8))


RECURRENT = {
    "lstm-2-layers-bidirectional": (
        lambda: nn.LSTM(5, 6, num_layers=2, bidirectional=True, batch_first=True),
        (4, 7, 5),
    ),
    "lstm-proj": (lambda: nn.LSTM(5, 6, proj_size=3), (7, 4, 5)),
    "gru-2-layers-bidirectional": (lambda: nn.GRU(5, 6, num_layers=2, bidirectional=True), (7, 4, 5)),
    "gru-no-bias": (lambda: nn.GRU(5, 6, bias=False, batch_first=True), (4, 7, 5)),
    "rnn-relu": (lambda: nn.RNN(5, 6, nonlinearity="relu", batch_first=True), (4, 7, 5)),
    "lstm-cell": (lambda: nn.LSTMCell(5, 6), (4, 5)),
    "gru-cell": (lambda: nn.GRUCell(5, 6), (4, 5)),
    "rnn-cell": (lambda: nn.RNNCell(5, 6), (4, 5)),
}


@pytest.mark.parametrize("name", list(RECURRENT))
def test_merge_recurrent(name: str) -> None:
    make, shape = RECURRENT[name]
    original, converted = _convert(make())
    _assert_members(original, converted, _x(*shape))


def test_merge_bilinear() -> None:
    original, converted = _convert(nn.Bilinear(4, 5, 3))
    _assert_members(original, converted, _x(6, 4), _x(6, 5))


class _CondNet(nn.Module):
    """timm's CondConv2d with its routing weights computed from the input (as in EfficientNet-CondConv)."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        from timm.layers import CondConv2d

        self.route = nn.Linear(4, 3)
        self.conv = CondConv2d(4, 6, 3, padding=1, groups=2, num_experts=3, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x, torch.sigmoid(self.route(x.mean((2, 3)))))


def test_merge_timm_plain_linear_in_a_real_network() -> None:
    # timm's Linear (mobilenetv3, ghostnet, repghost heads) computes F.linear(x, weight, bias): it merges as
    # nn.Linear does, and the merged copy keeps timm's class
    timm = pytest.importorskip("timm")
    original, converted = _convert(timm.create_model("mobilenetv3_small_100", pretrained=False, num_classes=5))
    assert type(converted.classifier).__rank1_base__ is timm.layers.Linear
    _assert_members(original, converted, _x(2, 3, 32, 32))
    merged = bayesify.merge(converted, component=1)
    assert type(merged.classifier) is timm.layers.Linear
    assert "rank1_known_forwards" not in vars(converted.classifier)  # the converted model's layer is left as it was


def test_merge_condconv() -> None:
    pytest.importorskip("timm")
    original, converted = _convert(_CondNet(bias=False))
    _assert_members(original, converted, _x(5, 4, 6, 6))


def test_merge_condconv_bias_offset_merges_only_when_zero() -> None:
    pytest.importorskip("timm")
    original, converted = _convert(_CondNet(bias=True))
    with pytest.raises(ValueError, match=r"'conv' \(CondConv2d\).*routing weights that need not sum to one"):
        bayesify.merge(converted, component=0)
    with torch.no_grad():
        converted.conv.rank1_bias.zero_()
    _assert_members(original, converted, _x(5, 4, 6, 6))


def test_merge_gaussian_embeddings_use_the_mean() -> None:
    model = nn.Sequential(nn.Embedding(20, 6, padding_idx=0), nn.Linear(6, 3))
    original, converted = _convert(model, embeddings=True)
    with torch.no_grad():
        converted[0].rank1_rho.normal_()
    _assert_members(original, converted, torch.randint(20, (4, 5)))
    torch.testing.assert_close(bayesify.merge(converted, component=1)[0].weight, original[0].weight)


def test_merge_a_converted_layer_that_is_the_model() -> None:
    original, converted = _convert(nn.Linear(5, 3))
    _assert_members(original, converted, _x(4, 5))
    assert type(bayesify.merge(converted, component=0)) is nn.Linear


# ---- the additive perturbation: merged where it is a bias, refused elsewhere ---------------------

ADDITIVE = {
    "linear": (lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), [(6, 5)]),
    "conv-unpadded-grouped": (lambda: nn.Conv2d(4, 6, 3, groups=2), [(5, 4, 7, 7)]),
    "conv-reflect-padded": (lambda: nn.Conv2d(3, 5, 3, padding=1, padding_mode="circular"), [(5, 3, 7, 7)]),
    "attention": (lambda: nn.MultiheadAttention(8, 2, kdim=5, vdim=7), [(3, 4, 8), (6, 4, 5), (6, 4, 7)]),
    "lstm": (lambda: nn.LSTM(5, 6, num_layers=2, bidirectional=True), [(7, 4, 5)]),
    "gru": (lambda: nn.GRU(5, 6, batch_first=True), [(4, 7, 5)]),
    "gru-cell": (lambda: nn.GRUCell(5, 6), [(4, 5)]),
}


@pytest.mark.parametrize("name", list(ADDITIVE))
def test_merge_additive_where_it_is_a_bias(name: str) -> None:
    make, shapes = ADDITIVE[name]
    original, converted = _convert(make(), perturbation="additive")
    _assert_members(original, converted, *[_x(*shape) for shape in shapes])


REFUSED_ADDITIVE = {
    "zero-padded conv": (lambda: nn.Conv2d(3, 5, 3, padding=1), "'0' \\(Conv2d\\): Conv2d pads with zeros"),
    "transposed conv": (lambda: nn.ConvTranspose2d(3, 5, 3), "transposed convolution"),
    "linear without bias": (lambda: nn.Linear(5, 3, bias=False), "no bias"),
    "bilinear": (lambda: nn.Bilinear(4, 5, 3), "terms linear in x1 and in x2"),
    "lstm projection": (lambda: nn.LSTM(5, 6, proj_size=3), "the projection has no bias"),
}


@pytest.mark.parametrize("name", list(REFUSED_ADDITIVE))
def test_merge_additive_refused_where_it_is_not_a_bias(name: str) -> None:
    make, message = REFUSED_ADDITIVE[name]
    _, converted = _convert(nn.Sequential(make()), perturbation="additive")
    with pytest.raises(ValueError, match=f"cannot fold component 1 into .*{message}"):
        bayesify.merge(converted, component=1)


# ---- what cannot be merged, bad input, tied weights ----------------------------------------------


def test_merge_folds_timms_same_padding_convolution() -> None:
    """timm's ``Conv2dSame`` (every ``tf_*`` model's convolutions) pads its input as TensorFlow's "SAME" does and
    applies its weight as it is: its members merge exactly. (It was refused as a forward that may transform its
    weight, so no tf_* model could be merged for deployment.)"""
    timm = pytest.importorskip("timm")
    original, converted = _convert(nn.Sequential(timm.layers.Conv2dSame(3, 4, 3, stride=2), nn.ReLU()))
    _assert_members(original, converted, torch.randn(2, 3, 9, 9, dtype=DT))


@pytest.mark.parametrize("name", ["StdConv2d", "ScaledStdConv2d", "a subclass of timm's Linear"])
def test_merge_refuses_a_layer_that_transforms_its_weight(name: str) -> None:
    timm = pytest.importorskip("timm")

    class Scaled(timm.layers.Linear):  # timm's Linear merges; a subclass with a forward of its own does not
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, 2 * self.weight, self.bias)

    if name.startswith("a subclass"):
        layer, name = Scaled(3, 4), "Scaled"
    else:
        layer = getattr(timm.layers, name)(3, 4, 3)
    _, converted = _convert(nn.Sequential(layer, nn.ReLU()))
    with pytest.raises(ValueError, match=rf"'0' \({name}\): {name} has a forward of its own"):
        bayesify.merge(converted, component=0)


class _Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class _Rank1Dense(bayesify.Rank1Layer):
    def rank1_setup(self, config: bayesify.Rank1Config) -> None:
        self.rank1_s = self.rank1_factor(4)
        self.rank1_r = self.rank1_factor(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        draw = self.rank1_draw(x.shape[0], x.device)
        s, r = draw.sample(self.rank1_s), draw.sample(self.rank1_r)
        return bayesify.layers.rank1_affine(x, lambda v: v @ self.weight, s, r)


def test_merge_names_a_family_without_rank1_merge() -> None:
    model = bayesify.convert(nn.Sequential(_Dense()), mapping={_Dense: _Rank1Dense}, components=K)
    with pytest.raises(NotImplementedError, match=r"into '0' \(_Dense\): _Rank1Dense does not define rank1_merge"):
        bayesify.merge(model, component=0)


@pytest.mark.parametrize("component", [-1, K, 1.0, True, None])
def test_merge_rejects_a_bad_component(component: object) -> None:
    _, converted = _convert(nn.Linear(3, 2))
    with pytest.raises(ValueError, match=rf"component={component!r} must be an integer in \[0, {K}\)"):
        bayesify.merge(converted, component=component)  # type: ignore[arg-type]


def test_merge_rejects_a_model_that_is_not_converted() -> None:
    with pytest.raises(ValueError, match="has no rank-1 layers to merge"):
        bayesify.merge(nn.Linear(3, 2), component=0)


class _TiedLM(nn.Module):
    """A language-model head tied to the token embedding (GPT-2's lm_head / wte)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def test_merge_unties_a_shared_weight_with_a_warning() -> None:
    original, converted = _convert(_TiedLM())
    ids = torch.randint(11, (3, 4))
    with pytest.warns(UserWarning, match=r"head.weight was shared with embed.weight; .* no longer tied"):
        merged = bayesify.merge(converted, component=2)
    with bayesify.mode(converted, component=2, noise=False):
        torch.testing.assert_close(merged(ids), converted(ids))
    assert merged.head.weight is not merged.embed.weight
    torch.testing.assert_close(merged.embed.weight, original.embed.weight)  # the embedding keeps its own values


# ---- Hugging Face language models: a merged head stays untied -------------------------------------


def _merged_lm(make) -> tuple[nn.Module, nn.Module, dict]:
    """``(converted, member 1 merged, inputs)`` of a tiny Hugging Face LM built from a config (no hub)."""
    _, converted = _convert(make())
    ids = torch.randint(3, 100, (2, 5))
    inputs = {"input_ids": ids}
    if converted.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = ids[:, :3]
    with pytest.warns(UserWarning, match=r"merged\.config\.tie_word_embeddings is now False"):
        merged = bayesify.merge(converted, component=1).eval()
    return converted, merged, inputs


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100))


def _bart() -> nn.Module:
    """Three ties under one flag: the head and the encoder's and decoder's token embeddings, all to ``shared``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(
        vocab_size=100, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


@pytest.mark.parametrize("make", [_gpt2, _bart], ids=["gpt2", "bart"])
def test_merge_of_a_tied_hugging_face_head_survives_tying_resizing_and_a_reload(make, tmp_path) -> None:
    converted, merged, inputs = _merged_lm(make)
    with bayesify.mode(converted, component=1, noise=False):
        expected = converted(**inputs).logits
    with bayesify.mode(converted, component=0, noise=False):
        other = converted(**inputs).logits
    assert (other - expected).abs().max() > 1e-2  # the members differ: re-tying the head would show

    assert merged.config.tie_word_embeddings is False and converted.config.tie_word_embeddings is True
    assert "lm_head.weight" not in merged.all_tied_weights_keys
    torch.testing.assert_close(merged(**inputs).logits, expected)
    merged.tie_weights()  # what resize_token_embeddings and from_pretrained call
    torch.testing.assert_close(merged(**inputs).logits, expected)
    merged.save_pretrained(tmp_path)
    reloaded = type(merged).from_pretrained(tmp_path, dtype=DT).eval()
    torch.testing.assert_close(reloaded(**inputs).logits, expected)
    merged.resize_token_embeddings(104)
    torch.testing.assert_close(merged(**inputs).logits[..., :100], expected)


def test_merge_without_a_hugging_face_model_keeps_the_config_out_of_it() -> None:
    _, converted = _convert(_TiedLM())
    with pytest.warns(UserWarning, match=r"no longer tied \(tying them again would undo the merge\)"):
        bayesify.merge(converted, component=0)


def test_a_pruned_layer_is_refused_in_bayesifys_line_not_torchs_copy_error() -> None:
    # merge deep-copies the model first, and torch copies no pruned tensor: its error ("Only Tensors created
    # explicitly by the user ... support the deepcopy protocol") came before the line naming prune.remove
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), task="classification")
    prune.random_unstructured(model[0], "weight", 0.5)
    with pytest.raises(ValueError, match=r"into '0' \(Linear\).*prune.remove\(layer, 'weight'\)"):
        bayesify.merge(model, component=0)
    prune.remove(model[0], "weight")
    bayesify.merge(model, component=0)


class _KeyBiasZeroed(nn.Module):
    """torchvision's SwinV2 attention in small: the projection's weight used by its parent's forward, with a copy of
    its bias whose middle third is zeroed."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(6, 9)
        self.head = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.qkv.bias.clone()
        bias[3:6].zero_()
        return self.head(torch.nn.functional.linear(x, self.qkv.weight, bias).relu())


def test_merge_of_a_layer_whose_user_gives_another_bias_is_the_member() -> None:
    # the bias offsets were added to the bias the parent's code gave (every third), merge folded them into the
    # layer's own bias, which that code then zeroed in part: torchvision's swin_v2_t merged 0.3-0.9 off, silently
    torch.manual_seed(0)
    model = bayesify.convert(_KeyBiasZeroed(), task="classification", components=4)
    _perturb(model)
    x = torch.randn(5, 6)
    model(x).sum().backward()  # (a training step: every parameter takes a gradient, the left-out offsets a zero one)
    assert all(p.grad is not None for p in model.parameters())
    assert torch.count_nonzero(model.qkv.rank1_bias.grad) == 0 and torch.count_nonzero(model.head.rank1_bias.grad) > 0
    model.eval()
    for k in (1, 3):
        with torch.no_grad(), bayesify.mode(model, component=k, noise=False):
            member = model(x)
        torch.testing.assert_close(bayesify.merge(model, component=k).eval()(x), member)
