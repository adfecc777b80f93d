"""A converted layer whose weight is replaced by one of another shape after ``bayesify.convert``
(``resize_token_embeddings``, pruning, ``layer.weight = nn.Parameter(...)``): its rank1_* parameters were made for
the old shape, so its next call raises one line naming the layer, both shapes and the fix (the check in
``ConvertedLayer.rank1_draw``, which every family asks before its maths), and ``bayesify.summary`` lists it in the
same words. The check is a shape comparison: it dispatches nothing and compiles away (no graph break)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import bayesify
from bayesify.cost import op_calls

# the one line: the layer, the shape now, the shape its rank1_* parameters were made for, and the fix
_ERROR = (
    r"{layer}: its {param} is \[{now}\] now, but its rank1_\* parameters were made for \[{then}\].*bayesify\.revert"
)


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=100, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    torch.manual_seed(0)
    return bayesify.convert(transformers.GPT2LMHeadModel(config))


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return bayesify.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), task="classification")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_language_model_resized_after_convert_raises_naming_its_head(training: bool) -> None:
    model = _gpt2()
    model.resize_token_embeddings(110, mean_resizing=False)  # the tied lm_head gets a [110, 16] weight
    model.train(training)
    ids = torch.randint(0, 110, (2, 8))
    with pytest.raises(
        RuntimeError, match=_ERROR.format(layer="Rank1Linear 'lm_head'", param="weight", now="110, 16", then="100, 16")
    ) as error:
        model(input_ids=ids)
    assert "\n" not in str(error.value)
    # summary lists it, in the error's words (and runs no example pass, which would raise)
    report = bayesify.summary(model, input_ids=ids)
    assert (
        list(report.changed) == ["lm_head"]
        and str(error.value) == f"Rank1Linear 'lm_head': {report.changed['lm_head']}"
    )
    assert "converted, then changed" in str(report) and not report.probed


def test_a_weight_replaced_by_hand_raises_before_any_maths() -> None:
    model = _mlp()
    model[2].weight = nn.Parameter(torch.randn(5, 8))
    with pytest.raises(
        RuntimeError, match=_ERROR.format(layer="Rank1Linear '2'", param="weight", now="5, 8", then="3, 8")
    ):
        model(torch.randn(2, 4))
    model = _mlp()
    model[0].weight = nn.Parameter(torch.randn(8, 6))  # its input width: the input of the new width is refused alike
    for width in (4, 6):
        with pytest.raises(
            RuntimeError, match=_ERROR.format(layer="Rank1Linear '0'", param="weight", now="8, 6", then="8, 4")
        ):
            model(torch.randn(2, width))
    model = _mlp()
    model[2].bias.data = torch.zeros(5)  # a .data write of another shape (as resize_token_embeddings does to a bias)
    with pytest.raises(RuntimeError, match=_ERROR.format(layer="Rank1Linear '2'", param="bias", now="5", then="3")):
        model(torch.randn(2, 4))


def test_revert_then_convert_is_the_fix() -> None:
    model = _gpt2()
    model.resize_token_embeddings(110, mean_resizing=False)
    bayesify.revert(model)
    bayesify.convert(model)
    assert model.lm_head.rank1_r.loc.shape == (4, 110)
    ids = torch.randint(0, 110, (2, 8))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.lm_head.rank1_r.loc.grad is not None
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (2, 8, 110)
    assert not bayesify.summary(model).changed

    model = _mlp()  # by hand: a consistent layer (torch's own forward needs its bias of the new width too)
    model[2].weight, model[2].bias, model[2].out_features = (
        nn.Parameter(torch.randn(5, 8)),
        nn.Parameter(torch.zeros(5)),
        5,
    )
    bayesify.revert(model)
    bayesify.convert(model, task="classification")
    model.train()
    model(torch.randn(3, 4)).square().mean().backward()
    assert model[2].rank1_r.loc.grad.shape == (4, 5)


def _families() -> dict[str, tuple]:
    """``{family: (module, input, how to replace a parameter by one of another shape, what it names)}``."""
    families = {
        "conv": (nn.Conv2d(3, 4, 3), torch.randn(2, 3, 6, 6), lambda m: setattr(m, "weight", nn.Parameter(torch.randn(6, 3, 3, 3))), "weight"),
        "conv_transpose": (nn.ConvTranspose2d(3, 4, 3), torch.randn(2, 3, 6, 6), lambda m: setattr(m, "weight", nn.Parameter(torch.randn(3, 6, 3, 3))), "weight"),
        "bilinear": (nn.Bilinear(4, 5, 3), (torch.randn(2, 4), torch.randn(2, 5)), lambda m: setattr(m, "weight", nn.Parameter(torch.randn(6, 4, 5))), "weight"),
        "attention": (nn.MultiheadAttention(8, 2, batch_first=True), (torch.randn(2, 3, 8),) * 3, lambda m: setattr(m.out_proj, "weight", nn.Parameter(torch.randn(8, 4))), "out_proj.weight"),
        "lstm": (nn.LSTM(4, 6, batch_first=True), torch.randn(2, 3, 4), lambda m: setattr(m, "weight_ih_l0", nn.Parameter(torch.randn(24, 5))), "weight_ih_l0"),
        "embedding": (nn.Embedding(10, 4), torch.randint(0, 10, (2, 3)), lambda m: setattr(m, "weight", nn.Parameter(torch.randn(12, 4))), "weight"),
    }  # fmt: skip
    try:
        from transformers.pytorch_utils import Conv1D

        families["hf_conv1d"] = (
            Conv1D(6, 4),
            torch.randn(2, 3, 4),
            lambda m: setattr(m, "weight", nn.Parameter(torch.randn(4, 7))),
            "weight",
        )
    except ImportError:
        pass
    return families


@pytest.mark.parametrize("family", sorted(_families()))
def test_every_family_refuses_a_parameter_of_another_shape(family: str) -> None:
    layer, x, replace, name = _families()[family]
    model = bayesify.convert(nn.ModuleDict({"layer": layer}), embeddings=True, task="regression")
    args = x if isinstance(x, tuple) else (x,)
    layer.train()
    with bayesify.mode(model, component=0):
        layer(*args)  # runs as converted
        replace(layer)
        with pytest.raises(
            RuntimeError,
            match=rf"{re.escape(type(layer).__name__)} 'layer': its {re.escape(name)} is .* now, but its rank1_\* parameters were made for",
        ):
            layer(*args)
    assert list(bayesify.summary(model).changed) == ["layer"]


def test_the_check_dispatches_nothing_and_compiles_away() -> None:
    model = _mlp()
    model.train()
    x = torch.randn(4, 4)
    assert op_calls(model[2].rank1_check) == 0
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with bayesify.mode(model, noise=False):
        torch.testing.assert_close(compiled(x), model(x))
    assert not counters["graph_break"]
    model[2].weight = nn.Parameter(torch.randn(5, 8))  # a new shape: the guards fail, and the trace raises the one line
    with pytest.raises(
        RuntimeError, match=_ERROR.format(layer="Rank1Linear '2'", param="weight", now="5, 8", then="3, 8")
    ):
        compiled(x)


def test_merge_refuses_a_layer_changed_after_convert_in_the_same_line() -> None:
    # merge folds each member's factors into the weights: with a weight of another shape it failed inside the fold
    model = _mlp()
    model[2].weight = nn.Parameter(torch.randn(5, 8))
    with pytest.raises(
        RuntimeError, match=_ERROR.format(layer="Rank1Linear '2'", param="weight", now="5, 8", then="3, 8")
    ):
        bayesify.merge(model, component=0)
