"""What an output means decides how evaluation reduces the members: checked against per-member loops by hand.

Every head kind: class logits (last axis, and segmentation's channel axis), independent sigmoids,
regression means, Gaussian (mean, log-variance) heads, members; models that say their task
(timm, torchvision classification / segmentation / detection, Hugging Face) and models that do
not (an error naming the option, never a guess).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesify
from tests._rank1 import perturb
from bayesify.predictive import Binary, Classification, Gaussian, Members, Regression, TaskMap, infer_task

DT = torch.float64
K = 3


def _randomise(model: nn.Module) -> None:
    """Distinct components (delta posterior: exact per-member references)."""
    perturb(model, offset_std=0.1)


def _members_by_hand(model: nn.Module, *args) -> list:
    """Each component's output, one pass each with route='component' (no tiling involved)."""
    out = []
    for k in range(K):
        with torch.no_grad(), bayesify.mode(model, component=k, noise=False):
            out.append(model(*args))
    return out


def _mlp(outputs: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, outputs)).to(DT)


def test_a_model_that_does_not_say_gets_an_error_naming_the_option_not_a_guess() -> None:
    model = bayesify.convert(_mlp(2), components=K).eval()
    with pytest.raises(ValueError, match=r"does not know what the output of shape \(4, 2\) of Sequential means.*task="):
        model(torch.randn(4, 5, dtype=DT))
    # training, tiling and predict need no task
    assert bayesify.predict(model, torch.randn(4, 5, dtype=DT)).shape == (K, 4, 2)
    with bayesify.mode(model, task="classification"):
        assert model(torch.randn(4, 5, dtype=DT)).shape == (4, 2)


@pytest.mark.parametrize(
    "task, reference",
    [
        ("classification", lambda m: torch.logsumexp(torch.stack([z.log_softmax(-1) for z in m]), 0) - math.log(K)),
        ("multilabel", lambda m: torch.logit(torch.stack([z.sigmoid() for z in m]).mean(0))),
        ("binary", lambda m: torch.logit(torch.stack([z.sigmoid() for z in m]).mean(0))),
        ("regression", lambda m: torch.stack(m).mean(0)),
    ],
)
def test_each_task_reduces_as_its_formula(task: str, reference) -> None:
    model = bayesify.convert(_mlp(4 if task != "binary" else 1), components=K, posterior="delta", task=task)
    _randomise(model)
    x = torch.randn(6, 5, dtype=DT)
    with torch.no_grad(), bayesify.mode(model, noise=False):
        mixture = model.eval()(x)
    torch.testing.assert_close(mixture, reference(_members_by_hand(model, x)))


def test_gaussian_head_reduces_by_the_law_of_total_variance() -> None:
    model = bayesify.convert(_mlp(4), components=K, posterior="delta", task="gaussian")  # 2 means, 2 log-variances
    _randomise(model)
    x = torch.randn(6, 5, dtype=DT)
    with torch.no_grad(), bayesify.mode(model, noise=False):
        mixture = model.eval()(x)
    members = torch.stack(_members_by_hand(model, x))  # [K, 6, 4]
    means, variances = members[..., :2], members[..., 2:].exp()
    total = variances.mean(0) + ((means - means.mean(0)) ** 2).mean(0)
    torch.testing.assert_close(mixture[..., :2], means.mean(0))
    torch.testing.assert_close(mixture[..., 2:].exp(), total)
    u = bayesify.uncertainty(model, x, samples=1, noise=False)
    torch.testing.assert_close(u.total_variance, total)
    torch.testing.assert_close(u.epistemic_variance, ((means - means.mean(0)) ** 2).mean(0))
    # at the means every sample is the same: one pass per component whatever `samples` says
    again = bayesify.uncertainty(model, x, noise=False)
    assert again.member_means.shape[0] == K
    torch.testing.assert_close(again.total_variance, total)


class _MeanAndLogVar(nn.Module):
    """A (mean, log-variance) pair returned as a tuple: two outputs, not one Gaussian head."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp(2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        return out[:, :1], out[:, 1:]


@pytest.mark.parametrize("head", ["three wide", "one wide", "tuple"])
def test_a_head_that_is_not_one_gaussian_tensor_is_refused_naming_the_options_there_are(head: str) -> None:
    net = {"three wide": lambda: _mlp(3), "one wide": lambda: _mlp(1), "tuple": _MeanAndLogVar}[head]()
    model = bayesify.convert(net, components=K, task="gaussian").eval()
    # the fixes there are: one tensor torch.cat([mean, log_var], -1), Gaussian(axis=...) (gaussian_head's axis= is
    # no option of a task), a mean-only head's task='regression'
    message = (
        r"task='gaussian' .* on axis -1, but an output of shape \(6, [13]\) has [13] values? there; return "
        r"torch.cat\(\[mean, log_var\], -1\) \(a \(mean, log_var\) tuple is two outputs\), name another axis "
        r"with task=bayesify.predictive.Gaussian\(axis=...\), or use task='regression' for a mean-only head."
    )
    x = torch.randn(6, 5, dtype=DT)
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(x)
    with pytest.raises(ValueError, match=message):
        bayesify.uncertainty(model, x)
    with pytest.raises(ValueError, match=message):  # the training loss says the same
        Gaussian().log_likelihood(torch.randn(6, 3 if head == "three wide" else 1), torch.randn(6))
    with pytest.raises(ValueError, match=r"torch.cat\(\[mean, std\], -1\)"):  # the head's own variance parameter
        Gaussian("std").log_likelihood(torch.randn(6, 3), torch.randn(6))


def test_gaussian_axis_names_a_head_whose_means_and_variances_lie_on_another_axis() -> None:
    torch.manual_seed(0)
    net = nn.Conv1d(3, 4, 1).to(DT)  # [B, 2 * D, L]: D = 2 means, then 2 log-variances, per position
    model = bayesify.convert(net, components=K, posterior="delta", task=Gaussian(axis=1))
    _randomise(model)
    x = torch.randn(6, 3, 7, dtype=DT)
    with torch.no_grad(), bayesify.mode(model, noise=False):
        mixture = model.eval()(x)
    members = torch.stack(_members_by_hand(model, x))
    means, variances = members[:, :, :2], members[:, :, 2:].exp()
    torch.testing.assert_close(mixture[:, :2], means.mean(0))
    torch.testing.assert_close(mixture[:, 2:].exp(), variances.mean(0) + means.var(0, unbiased=False))


def test_one_task_reduces_every_output_with_member_rows_as_the_module_doc_says() -> None:
    class LogitsAndFeatures(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp(4)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            z = self.net(x)
            return {"logits": z, "feat": 2 * z}

    from bayesify.predictive import tasks

    assert "``feat`` as ``log mean softmax(f)``" in " ".join(tasks.__doc__.split())  # (it said: averaged)
    model = bayesify.convert(LogitsAndFeatures(), components=K, posterior="delta", task="classification")
    _randomise(model)
    x = torch.randn(6, 5, dtype=DT)
    members = _members_by_hand(model, x)
    mixture_of = lambda name: torch.logsumexp(torch.stack([m[name].log_softmax(-1) for m in members]), 0) - math.log(K)
    with torch.no_grad(), bayesify.mode(model, noise=False), pytest.warns(UserWarning, match="2 tensors .* as logits"):
        out = model.eval()(x)
    torch.testing.assert_close(out["feat"], mixture_of("feat"))  # not the members' mean
    named = {"logits": "classification", "feat": "regression"}
    with torch.no_grad(), bayesify.mode(model, noise=False, task=named):
        out = model(x)
    torch.testing.assert_close(out["logits"], mixture_of("logits"))
    torch.testing.assert_close(out["feat"], torch.stack([m["feat"] for m in members]).mean(0))
    with torch.no_grad(), bayesify.mode(model, task={"logits": "classification"}), pytest.raises(ValueError, match="'feat'"):
        model(x)  # an output the dict does not name is refused


def test_a_three_axis_output_needs_its_class_axis() -> None:
    class Conv1dSegmenter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(2, 5, 3, padding=1)

        def forward(self, x):
            return self.conv(x)  # [B, 5 classes, L]

    model = bayesify.convert(Conv1dSegmenter().to(DT), components=K, task="classification").eval()
    x = torch.randn(2, 2, 7, dtype=DT)
    with pytest.raises(ValueError, match="pass class_axis=1 or class_axis=-1"):
        model(x)
    # a time-major [T, B, C] (batch_dim=1) is told which: its axis 1 holds the batch (class_axis=1 was refused next)
    with pytest.raises(ValueError, match=r"time-major \[T, B, C\] output \(batch_dim=1\): class_axis=-1"):
        model(x)
    with torch.no_grad(), bayesify.mode(model, task="classification", class_axis=1, noise=False):
        out = model(x)
    assert out.shape == (2, 5, 7)
    torch.testing.assert_close(out.exp().sum(1), torch.ones(2, 7, dtype=DT))  # probabilities over the class axis


def test_segmentation_at_init_agrees_with_the_original_on_every_pixel() -> None:
    from torchvision.models.segmentation import lraspp_mobilenet_v3_large

    torch.manual_seed(0)
    original = lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=5).eval()
    model = bayesify.convert(copy.deepcopy(original), components=K).eval()
    assert infer_task(model) == TaskMap((("out", Classification(1)), ("aux", Classification(1))))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = original(x)["out"]
        with bayesify.mode(model, noise=False):
            mixture = model(x)["out"]
    assert mixture.shape == expected.shape == (2, 5, 64, 64)
    assert torch.equal(mixture.argmax(1), expected.argmax(1))  # every pixel (it was 17% with the softmax over width)
    torch.testing.assert_close(mixture, expected.log_softmax(1), atol=1e-4, rtol=1e-4)


def test_segmentation_mixture_is_per_pixel_over_classes() -> None:
    from torchvision.models.segmentation import fcn_resnet50

    torch.manual_seed(0)
    model = bayesify.convert(
        fcn_resnet50(weights=None, weights_backbone=None, num_classes=3, aux_loss=True).to(DT),
        components=K, posterior="delta",
    ).eval()  # fmt: skip
    _randomise(model)
    x = torch.randn(1, 3, 32, 32, dtype=DT)
    with torch.no_grad(), bayesify.mode(model, noise=False):
        mixture = model(x)
    members = _members_by_hand(model, x)
    for key in ("out", "aux"):
        expected = torch.logsumexp(torch.stack([m[key].log_softmax(1) for m in members]), 0) - math.log(K)
        torch.testing.assert_close(mixture[key], expected)


def test_detection_gives_members_or_an_error_never_a_tiled_batch() -> None:
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64
    )
    bayesify.convert(model, components=2)
    assert isinstance(bayesify.predictive.infer_task(model), Members)
    images = [torch.rand(3, 64, 64), torch.rand(3, 48, 64)]
    model.eval()
    with pytest.raises(ValueError, match=r"bayesify.predict\(model, inputs\).*fuse_detections"):
        model(images)
    members = bayesify.predict(model, images, samples=2)
    assert len(members) == 4 and all(len(m) == 2 and {"boxes", "labels", "scores"} <= set(m[0]) for m in members)
    fused = bayesify.detection.fuse_detections(members)
    assert len(fused) == 2 and {"agreement", "box_std"} <= set(fused[0])
    model.train()  # one random component per pass: every layer agrees on it, whatever the proposals per image
    targets = [{"boxes": torch.tensor([[4.0, 4.0, 30.0, 30.0]]), "labels": torch.tensor([1])}] * 2
    losses = model(images, targets)
    loss = sum(losses.values()) + bayesify.kl_divergence(model) / 100
    loss.backward()
    assert torch.isfinite(loss)


def test_timm_and_torchvision_classifiers_say_they_are_classifiers() -> None:
    import timm
    import torchvision

    assert infer_task(timm.create_model("resnet18", num_classes=4)) == Classification(-1)
    assert infer_task(timm.create_model("resnet18", num_classes=0)) is None  # features: it must say
    assert infer_task(torchvision.models.resnet18(num_classes=4)) == Classification(-1)
    assert infer_task(nn.Linear(3, 2)) is None


def test_huggingface_loss_is_the_mixtures_nll_and_generate_runs() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    bayesify.convert(model, components=K, init="normal", init_mean_std=0.3)
    assert len(list(bayesify.rank1_layers(model))) == 9  # 8 Conv1D + lm_head
    model.eval()
    ids = torch.randint(50, (2, 6))
    with torch.no_grad():
        out = model(ids, labels=ids, output_hidden_states=True)
    # the mixture's NLL of the next tokens, by hand from the reduced logits
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    assert torch.allclose(out.logits.exp().sum(-1), torch.ones(2, 6), atol=1e-5)
    assert out.hidden_states[-1].shape == (2, 6, 32)  # averaged, not log-softmaxed
    generated = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 9)



def test_huggingface_loss_keeps_the_calls_loss_keywords() -> None:
    """The evaluation loss of a converted language model is computed again on the mixture's logits; it dropped the
    keywords the call hands the model's loss function (transformers' Trainer passes ``num_items_in_batch``, the
    tokens of the global batch: ``Trainer.evaluate`` on 2 processes doubled ``eval_loss``). At init every member is
    the original, so every loss equals the original model's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)  # fmt: skip
    original = transformers.LlamaForCausalLM(config).eval()
    model = copy.deepcopy(original)
    bayesify.convert(model, components=K).eval()
    ids = torch.randint(100, (3, 8))
    shifted = torch.randint(100, (3, 8))
    shifted[:, -1] = -100
    calls = [{}, {"num_items_in_batch": torch.tensor(100)}, {"shift_labels": shifted}, {"ignore_index": int(ids[0, 3])}]
    with torch.no_grad():
        for keywords in calls:
            expected = original(ids, labels=ids, **keywords).loss
            torch.testing.assert_close(model(ids, labels=ids, **keywords).loss, expected, msg=str(list(keywords)))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_beam_search_with_the_kv_cache_equals_beam_search_without_it(family: str) -> None:
    """Beam search reorders the KV cache by the beams' indices (``cache.reorder_cache``); the cache of a converted
    model holds K x B x beams rows, member-major, so it kept member 0's rows alone and the next step failed
    ("Expected size 6 but got size 24"). Each member's rows are reordered alike: the same tokens as without the cache,
    with members that differ."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, pad_token_id=0,
                                         eos_token_id=1, bos_token_id=0)  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
                                          tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=0)  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    bayesify.convert(model, components=K, init="normal", init_mean_std=0.3).eval()
    ids = torch.randint(2, 100, (2, 5))
    settings = dict(max_new_tokens=6, num_beams=3, do_sample=False)
    with torch.no_grad():
        cached = model.generate(ids, **settings)
        uncached = model.generate(ids, use_cache=False, **settings)
    assert cached.shape == (2, 11) and torch.equal(cached, uncached)

def test_tasks_by_name_and_by_object() -> None:
    assert isinstance(bayesify.predictive.parse_task("binary"), Binary)
    assert bayesify.predictive.parse_task("gaussian", gaussian_variance="softplus") == Gaussian("softplus")
    assert isinstance(bayesify.predictive.parse_task(lambda members: members.max(0).values), bayesify.predictive.CustomTask)
    assert bayesify.predictive.parse_task({"out": "classification"}) == TaskMap((("out", Classification()),))
    with pytest.raises(ValueError, match="task='softmax' is not a valid TaskName option"):
        bayesify.predictive.parse_task("softmax")
    model = bayesify.convert(_mlp(3), components=K, task=lambda m: m.max(0).values).eval()
    x = torch.randn(2, 5, dtype=DT)
    with torch.no_grad(), bayesify.mode(model, noise=False):
        assert model(x).shape == (2, 3)
    assert isinstance(Regression().reduce(torch.ones(3, 2)), torch.Tensor)


def test_resolve_task_is_the_one_decision() -> None:
    from bayesify.predictive import Auto, resolve_task

    assert resolve_task("binary") == Binary()
    assert resolve_task(None, stated=Classification(-1)) == Classification(-1)
    assert resolve_task("auto", stated=Classification(-1), class_axis=1) == Classification(1)  # the caller's axis
    assert resolve_task("regression", stated=Classification(-1)) == Regression()  # what the caller says wins
    assert isinstance(resolve_task(None), Auto)
    with pytest.raises(ValueError, match=r"evaluate\(\) does not know what the model's output means; pass task="):
        resolve_task(None, stated=None, needed_by="evaluate()")


def test_tasks_say_what_they_mean_through_methods() -> None:
    members = torch.randn(3, 5, 4)
    log_probs = Classification().member_log_probs(members)
    torch.testing.assert_close(log_probs, members.log_softmax(-1))
    binary = Binary().member_log_probs(torch.randn(3, 5, 2))
    assert binary.shape == (3, 10, 2)
    torch.testing.assert_close(binary.exp().sum(-1), torch.ones(3, 10))
    assert Classification().member_moments(members) is None and Regression().member_log_probs(members) is None
    means, variances = Gaussian().member_moments(torch.randn(3, 5, 2))
    assert means.shape == variances.shape == (3, 5, 1) and bool((variances > 0).all())
    assert Gaussian().output_size(3) == 6 and Classification().output_size(3) == 3
    assert type(Classification().uncertainty(members)).__name__ == "ClassificationUncertainty"
    with pytest.raises(ValueError, match="has no uncertainty decomposition"):
        Members().uncertainty(members)


def test_the_aliases_of_earlier_releases_are_gone() -> None:
    """Release 0.4 removed what 0.3 kept for one release (CHANGELOG): the module and attributes are not there."""
    import importlib

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("bayesify.tasks")
    for name in ("wrappers", "priors", "data"):
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
            getattr(bayesify, name)


def _tiny_huggingface_models(transformers):  # (model, inputs with labels) at conversion equal to the original
    bert = dict(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=32)  # fmt: skip
    ids, pairs = torch.randint(4, 60, (3, 7)), torch.randint(4, 60, (3, 2, 7))
    seq2seq = dict(vocab_size=60, decoder_start_token_id=0, pad_token_id=1)
    yield "t5", transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, **seq2seq)), dict(input_ids=ids, labels=ids[:, :4].clone())
    yield "bart", transformers.BartForConditionalGeneration(transformers.BartConfig(
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, **seq2seq)), dict(input_ids=ids, labels=ids[:, :4].clone())  # fmt: skip
    yield "marian", transformers.MarianMTModel(transformers.MarianConfig(
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, **seq2seq)), dict(input_ids=ids, labels=ids[:, :4].clone())  # fmt: skip
    yield "gpt2", transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=60)), dict(input_ids=ids, labels=ids)
    yield "masked-lm", transformers.BertForMaskedLM(transformers.BertConfig(**bert)), dict(input_ids=ids, labels=ids)
    yield "token", transformers.BertForTokenClassification(transformers.BertConfig(num_labels=4, **bert)), dict(
        input_ids=ids, labels=torch.randint(4, (3, 7)))
    yield "choice", transformers.BertForMultipleChoice(transformers.BertConfig(**bert)), dict(input_ids=pairs, labels=torch.tensor([0, 1, 1]))
    for problem, labels in (("single_label_classification", torch.tensor([0, 2, 1])), ("regression", torch.randn(3, 3)),
                            ("multi_label_classification", torch.randint(2, (3, 3)).float())):  # fmt: skip
        yield problem, transformers.BertForSequenceClassification(transformers.BertConfig(
            num_labels=3, problem_type=problem, **bert)), dict(input_ids=ids, labels=labels)  # fmt: skip
    yield "qa", transformers.BertForQuestionAnswering(transformers.BertConfig(**bert)), dict(
        input_ids=ids, start_positions=torch.tensor([1, 2, 9]), end_positions=torch.tensor([3, 4, 5]))


def test_huggingface_loss_in_evaluation_is_the_models_own_or_refused() -> None:
    """The loss a converted Hugging Face model gives in evaluation is the one its own forward computes (on the
    mixture's outputs): at conversion, where every member is the original, the original's loss. Where bayesify
    does not know how the model computes it (CTC here), it refuses in one line, not another loss under its name."""
    transformers = pytest.importorskip("transformers")
    for name, model, inputs in _tiny_huggingface_models(transformers):
        torch.manual_seed(0)
        model.eval()
        with torch.no_grad():
            expected = model(**inputs).loss
            bayesify.convert(model, components=K)
            got = model(**inputs).loss
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)
    config = transformers.Wav2Vec2Config(vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                                         num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2)  # fmt: skip
    ctc = bayesify.convert(transformers.Wav2Vec2ForCTC(config), components=K).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="cannot recompute Wav2Vec2ForCTC's loss from the mixture"):
        ctc(torch.randn(2, 400), labels=torch.randint(1, 12, (2, 3)))


def test_a_huggingface_loss_of_other_outputs_or_inputs_is_refused_not_dropped() -> None:
    """A loss the model computes from outputs other than ``logits`` (a pre-training head's) or from no ``labels``
    (CLIP's ``return_loss``) came back as None in evaluation, silently."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert = transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))  # fmt: skip
    ids = torch.randint(0, 50, (3, 6))
    clip = transformers.CLIPModel(transformers.CLIPConfig(
        text_config={"vocab_size": 50, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 16, "patch_size": 8}, projection_dim=8))  # fmt: skip
    for model, inputs, name in (
        (bert, {"input_ids": ids, "labels": ids, "next_sentence_label": torch.tensor([0, 1, 1])}, "BertForPreTraining"),
        (clip, {"input_ids": ids, "pixel_values": torch.randn(3, 3, 16, 16), "return_loss": True}, "CLIPModel"),
    ):
        bayesify.convert(model, components=K).eval()
        with torch.no_grad(), pytest.raises(ValueError, match=f"cannot recompute {name}'s loss from the mixture"):
            model(**inputs)
        with torch.no_grad():  # without what the loss is computed from, the outputs as before
            model(**{k: v for k, v in inputs.items() if k not in ("labels", "next_sentence_label", "return_loss")})


def _bert_classifier(transformers, **config):
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, **config))  # fmt: skip


def test_a_multi_label_head_whose_problem_type_transformers_sets_in_training_is_reduced_by_sigmoids() -> None:
    """A sequence classifier made without ``problem_type`` and trained on float multi-hot labels: transformers sets
    ``config.problem_type = "multi_label_classification"`` in the first forward pass with labels, after conversion.
    Evaluation then mixes the members' sigmoids and its loss is the mixture's BCE, as if the config had said so at
    conversion (it was a softmax across the labels: probabilities summing to 1, no warning)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = bayesify.convert(_bert_classifier(transformers, num_labels=4), components=K)
    ids, labels = torch.randint(4, 60, (5, 7)), torch.randint(2, (5, 4)).float()
    model.train()
    model(input_ids=ids, labels=labels).loss.backward()
    assert model.config.problem_type == "multi_label_classification"
    _randomise(model)
    model.eval()
    members = torch.stack([out.logits for out in _members_by_hand(model, ids)])
    mixture = members.sigmoid().mean(0)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits.sigmoid(), mixture)
    torch.testing.assert_close(out.loss, F.binary_cross_entropy(mixture, labels))
    assert "multilabel" in str(bayesify.summary(model)).splitlines()[2]
    assert type(bayesify.uncertainty(model, ids, noise=False)).__name__ == "BinaryUncertainty"


def test_a_task_said_of_a_hugging_face_classifier_keeps_its_loss_recomputed_from_the_mixture() -> None:
    """``convert(bert, task="classification")``: the said task is the logits' and the loss is still the mixture's NLL
    (it was the members' mean loss, with a warning)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _bert_classifier(transformers, num_labels=3)
    with torch.no_grad():
        model.classifier.weight.mul_(30)
    model = bayesify.convert(model, components=K, task="classification", init="normal").eval()
    assert str(bayesify.summary(model)).splitlines()[2] == "output: {'logits': classification (class axis -1)}, other outputs averaged"
    ids = torch.randint(4, 60, (6, 7))
    labels = ids[:, 0] % 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out = model(input_ids=ids, labels=labels)
    mixture = torch.stack([member.logits for member in _members_by_hand(model, ids)]).softmax(-1).mean(0)
    torch.testing.assert_close(out.loss, F.nll_loss(mixture.log(), labels))
    # said at evaluation time (mode's task=) of a model converted with its own: the same (it averaged the members'
    # losses, with a warning)
    stated = bayesify.convert(_bert_classifier(transformers, num_labels=3), components=K).eval()
    stated.load_state_dict(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), bayesify.mode(stated, task="classification"):
            torch.testing.assert_close(stated(input_ids=ids, labels=labels).loss, out.loss)
    assert bayesify.convert(model, task="classification") is model  # the same task said again: as it is
    members = bayesify.convert(_bert_classifier(transformers, num_labels=3), components=K, task="members").eval()
    with torch.no_grad():
        assert members(input_ids=ids).logits.shape == (K, 6, 3)  # "members": no reduction, as said
    # another kind than the head's loss computes (sigmoids said of a softmax head): as said, the loss not recomputed
    binary = bayesify.convert(_bert_classifier(transformers, num_labels=3), components=K, task="binary")
    assert str(bayesify.summary(binary)).splitlines()[2] == "output: binary"


def test_a_headless_hugging_face_models_summary_says_its_outputs_are_averaged() -> None:
    """A ``BertModel`` returns features (``last_hidden_state``, ``pooler_output``), which evaluation averages; the
    summary said only ``{'logits': classification}``, an output the model does not have."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    model = bayesify.convert(transformers.BertModel(config), components=K).eval()
    assert str(bayesify.summary(model)).splitlines()[2] == "output: {'logits': classification (class axis -1)}, other outputs averaged"
    ids = torch.randint(60, (3, 5))
    with torch.no_grad():
        features = model(input_ids=ids).pooler_output
    members = torch.stack([out.pooler_output for out in _members_by_hand(model, ids)])
    torch.testing.assert_close(features, members.mean(0))


def test_an_image_classifier_with_one_label_regresses_from_the_start() -> None:
    # transformers' image (audio, video, sequence) classifiers regress with num_labels=1; a fresh ViT with one label
    # was read as a one-class softmax (refused) until a labelled pass had set problem_type: now regression at once
    transformers = pytest.importorskip("transformers")
    from bayesify.predictive.libraries import infer_task

    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32, num_labels=1)  # fmt: skip
    model = bayesify.convert(transformers.ViTForImageClassification(config), components=K).eval()
    assert infer_task(model) is not None and infer_task(model).get("logits") == bayesify.predictive.Regression()
    with torch.no_grad():
        assert model(pixel_values=torch.randn(3, 3, 16, 16)).logits.shape == (3, 1)
    token = transformers.BertForTokenClassification(transformers.BertConfig(
        vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=1))
    assert infer_task(token).get("logits") == bayesify.predictive.Classification(-1, 1)  # fmt: skip


def test_return_dict_false_gives_the_named_outputs_mixture_as_a_tuple() -> None:
    """``return_dict=False`` (in the call, or in the config) returns the very values of the ``ModelOutput`` as the
    tuple transformers makes of it: the mixture of the logits by their task, and the loss recomputed from it (a
    tuple's positions say nothing of which is which: the logits were averaged, the loss refused for want of rows).
    Training passes return the model's own tuple."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = bayesify.convert(_bert_classifier(transformers, num_labels=3), components=K)
    _randomise(model)
    ids, labels = torch.randint(4, 60, (5, 7)), torch.tensor([0, 2, 1, 1, 0])
    model.eval()
    with torch.no_grad():
        named = model(input_ids=ids, labels=labels)
        (logits,) = model(input_ids=ids, return_dict=False)
        loss, logits_with_loss = model(input_ids=ids, labels=labels, return_dict=False)
    members = torch.stack([out.logits for out in _members_by_hand(model, ids)])
    torch.testing.assert_close(named.logits, members.softmax(-1).mean(0).log())
    torch.testing.assert_close(logits, named.logits)
    torch.testing.assert_close(logits_with_loss, named.logits)
    torch.testing.assert_close(loss, named.loss)
    u = bayesify.uncertainty(model, ids, return_dict=False, noise=False)
    assert type(u).__name__ == "ClassificationUncertainty"
    torch.testing.assert_close(u.probs, named.logits.exp())
    model.config.return_dict = False  # (the config's switch, as from_pretrained(..., return_dict=False) sets it)
    with torch.no_grad():
        (from_config,) = model(input_ids=ids)
    torch.testing.assert_close(from_config, named.logits)
    model.train()
    out = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and out[0].dim() == 0 and out[1].shape == (5, 3)


def test_a_huggingface_segmentation_map_is_a_softmax_over_its_classes_not_its_width() -> None:
    """``*ForSemanticSegmentation`` logits are ``[B, num_labels, H, W]``: read as a classifier's, the mixture was a
    softmax across the map's width, silently; and ``class_axis`` said with the inferred task was ignored."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.SegformerConfig(depths=[1] * 4, hidden_sizes=[8, 16, 16, 16], num_attention_heads=[1, 1, 1, 1],
                                          decoder_hidden_size=16, num_labels=5)  # fmt: skip
    model = bayesify.convert(transformers.SegformerForSemanticSegmentation(config), components=K, init="normal").eval()
    assert str(bayesify.summary(model)).splitlines()[2] == "output: {'logits': classification (class axis 1)}, other outputs averaged"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        members = bayesify.predict(model, pixel_values=x).logits  # [K, B, 5, 8, 8]
        mixture = torch.logsumexp(members.log_softmax(2), 0) - math.log(K)
        torch.testing.assert_close(model(pixel_values=x).logits, mixture)
        assert bayesify.uncertainty(model, pixel_values=x).mutual_information.shape == (2, 8, 8)
    bert = bayesify.convert(_bert_classifier(transformers, num_labels=3), components=K, class_axis=1)
    assert "class axis 1" in str(bayesify.summary(bert)).splitlines()[2]  # said with the inferred task: taken
    with pytest.raises(ValueError, match="class_axis=1 sets the class axis of a classifier's output"):
        bayesify.convert(_bert_classifier(transformers, num_labels=1, problem_type="regression"), class_axis=1)


def test_a_dict_task_takes_class_axis_and_gaussian_variance_for_its_named_entries() -> None:
    # convert(task={0: "classification", 1: "regression"}, class_axis=-1): the dict was parsed without class_axis,
    # and a [B, T, C] output was refused asking for the class_axis that was passed (bayesify's own warning for
    # (logits, hidden) outputs recommends this dict)
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.fc = nn.GRU(8, 16, batch_first=True), nn.Linear(16, 5)

        def forward(self, x):
            out, hidden = self.rnn(x)
            return self.fc(out), hidden

    model = bayesify.convert(Tagger(), task={0: "classification", 1: "regression"}, class_axis=-1).eval()
    with torch.no_grad():
        logits, _ = model(torch.randn(3, 7, 8))
    torch.testing.assert_close(logits.exp().sum(-1), torch.ones(3, 7))
    config = bayesify.Rank1Config(task={"mean": "gaussian"}, gaussian_variance="softplus")
    assert config.resolved_task().for_output("mean") == bayesify.predictive.Gaussian("softplus")
