"""What the mixture's reduction refuses rather than return a silently wrong number, and what it lets pass.

An inferred classifier whose head was replaced after ``convert`` (features would be softmaxed as logits), an
output with no rows of the tiled batch (the batch taken on the wrong axis: the members' outputs would mix), and a
classification whose class axis is the batch axis (a softmax across the examples): each is refused in one line
naming the value and the fix; the outputs that are what they claim to be pass as before.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import bayesify
from bayesify.predictive import Classification, infer_task

K = 4


def _timm_classifier(classes: int = 10) -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return bayesify.convert(timm.create_model("resnet18", pretrained=False, num_classes=classes), components=K).eval()


# ---- a classifier's head replaced after convert ---------------------------------------------------


def test_a_timm_classifier_states_its_number_of_classes() -> None:
    timm = pytest.importorskip("timm")
    task = infer_task(timm.create_model("resnet18", num_classes=7))
    assert task == Classification(-1) and task.classes == 7
    assert bayesify.predictive.resolve_task("classification").classes is None  # said: nothing to check it against


@pytest.mark.parametrize("when", ["before convert", "after convert"])
def test_a_timm_head_assigned_in_place_states_its_classes(when: str) -> None:
    # model.fc = nn.Linear(512, 5) leaves timm's num_classes at 10: its 5 logits were refused as "not the 10 classes"
    # (the README says a new head the model states is read as its logits, as torchvision's is)
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=10)
    if when == "before convert":
        model.fc = nn.Linear(512, 5)
        model = bayesify.convert(model, components=K)
    else:
        model = bayesify.convert(model, components=K)
        model.fc = nn.Linear(512, 5)
        bayesify.convert(model)
    assert model.num_classes == 10 and infer_task(model).classes == 5
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model.eval()(x).exp().sum(-1), torch.ones(2), atol=1e-5)
        assert bayesify.uncertainty(model, x).probs.shape == (2, 5)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=10)
    vit.head = nn.Linear(192, 3)
    assert infer_task(vit).classes == 3
    vit.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(192, 64), nn.ReLU(), nn.Linear(64, 6))  # a head of its own
    assert infer_task(vit).classes == 6


@pytest.mark.parametrize("replace", ["identity", "reset_classifier(0)"])
def test_features_of_a_replaced_head_are_refused_not_softmaxed(replace: str) -> None:
    model = _timm_classifier(10)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model(x).exp().sum(-1), torch.ones(2), atol=1e-5)  # its logits, as inferred
    if replace == "identity":
        model.fc = nn.Identity()
    else:
        model.reset_classifier(0)
    message = (
        r"output of shape \(2, 512\) of ResNet has 512 entries on its class axis \(dimension 1\), not the 10 "
        r"classes its task was inferred with .* bayesify\.mode\(model, task='regression'\)"
    )
    with torch.no_grad():
        with pytest.raises(ValueError, match=message):
            model(x)
        with pytest.raises(ValueError, match=message):
            bayesify.uncertainty(model, x)
        with bayesify.mode(model, task="regression"):  # the fix the message names: the members' mean features
            assert model(x).shape == (2, 512)
        assert bayesify.predict(model, x).shape == (K, 2, 512)  # each member's



@pytest.mark.parametrize("name, head", [("resnet18", "fc"), ("mobilenet_v3_small", "classifier"), ("squeezenet1_1", "classifier")])
def test_a_torchvision_classifier_whose_head_was_removed_is_refused_not_softmaxed(name: str, head: str) -> None:
    """``model.fc = nn.Identity()`` (the usual way to take a torchvision network's embeddings) after ``convert``: the
    features were softmaxed as 512 "classes", silently (torchvision states no ``num_classes``: its head's width is
    read instead). A new head is its logits; a head removed before ``convert`` states no task."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    assert infer_task(getattr(torchvision.models, name)(num_classes=5)).classes == 5
    model = bayesify.convert(getattr(torchvision.models, name)(num_classes=5), components=K)
    setattr(model, head, nn.Identity())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), pytest.raises(ValueError, match=r"entries on its class axis .* not the 5 classes"):
        model.eval()(x)
    if name == "resnet18":
        model.fc = nn.Linear(512, 3)
        bayesify.convert(model)
        with torch.no_grad():
            assert torch.allclose(model.eval()(x).exp().sum(-1), torch.ones(2), atol=1e-5)
    bare = getattr(torchvision.models, name)(num_classes=5)
    setattr(bare, head, nn.Identity())
    assert infer_task(bare) is None


@pytest.mark.parametrize("cut", ["last Identity", "sliced"])
@pytest.mark.parametrize("name", ["mobilenet_v3_small", "vgg11"])
def test_a_torchvision_head_whose_last_linear_was_cut_off_states_no_task(name: str, cut: str) -> None:
    # classifier[-1] = Identity() (or classifier[:-1]) leaves a hidden Linear last but one: it was read as the head,
    # and the 1024 features were log-softmaxed as "classes", silently; the model now states nothing, and says so
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        model = getattr(torchvision.models, name)(num_classes=5)
    if cut == "last Identity":
        model.classifier[-1] = nn.Identity()
    else:
        model.classifier = model.classifier[:-1]
    assert infer_task(model) is None

def test_a_new_head_the_model_states_is_its_logits() -> None:
    model = _timm_classifier(10)
    model.reset_classifier(5)  # timm now states 5 classes: a classifier still
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 5) and torch.allclose(out.exp().sum(-1), torch.ones(2), atol=1e-5)


def test_a_said_task_or_the_width_inferred_is_never_refused() -> None:
    x = torch.randn(2, 5)
    said = bayesify.convert(nn.Sequential(nn.Linear(5, 3)), components=K, task="classification").eval()
    conv = bayesify.convert(nn.Sequential(nn.Conv2d(5, 3, 1)), components=K).eval()
    with torch.no_grad():
        assert torch.allclose(said(x).exp().sum(-1), torch.ones(2), atol=1e-5)
        with bayesify.mode(said, task=Classification(-1, classes=3)):
            said(x)
        with bayesify.mode(conv, task=Classification(1, classes=3)):  # a segmentation's classes at axis 1
            assert torch.allclose(conv(torch.randn(2, 5, 4, 4)).exp().sum(1), torch.ones(2, 4, 4), atol=1e-5)
        with (
            bayesify.mode(said, task=Classification(-1, classes=4)),
            pytest.raises(ValueError, match=r"\(2, 3\) .* 3 entries on its class axis \(dimension 1\), not the 4 "),
        ):
            said(x)


def test_a_hugging_face_classifier_whose_head_was_replaced_is_refused() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3)  # fmt: skip
    model = bayesify.convert(transformers.BertForSequenceClassification(config), components=K).eval()
    ids = torch.randint(30, (2, 6))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits.exp().sum(-1), torch.ones(2), atol=1e-5)
        model.classifier = nn.Identity()
        with pytest.raises(ValueError, match=r"shape \(2, 16\) of BertForSequenceClassification .* not the 3 classes"):
            model(ids)


# ---- an output with no rows of the tiled batch ----------------------------------------------------


class LSTMClassifier(nn.Module):
    """The classic time-major text classifier: tokens ``[T, B]``, the last layer's final state to a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lstm, self.head = nn.Embedding(50, 16), nn.LSTM(16, 32), nn.Linear(32, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(self.emb(tokens))
        return self.head(h[-1])


@pytest.mark.filterwarnings("ignore:.*does not depend on the batch")  # (the head's warning: the same mistake)
def test_an_output_without_the_member_rows_is_refused_naming_batch_dim() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(50, (7, 3))  # [T=7, B=3]
    model = bayesify.convert(LSTMClassifier(), components=K, task="classification").eval()  # batch_dim left at 0
    # (its LSTM refuses the call first: its time steps are the pass's rows; a model without one, the output does)
    message = r"'lstm' \(batch_first=False\) got an input of shape \(28, 3, 16\) whose 28 time steps .* batch_dim=1"
    with torch.no_grad():
        with pytest.raises(ValueError, match=message):
            model(tokens)
        with pytest.raises(ValueError, match=message):
            bayesify.predict(model, tokens)
        with pytest.raises(ValueError, match=message), bayesify.mode(model, route="tile"):  # (it returned [3, 3])
            model(tokens)
    right = bayesify.convert(LSTMClassifier(), components=K, task="classification", batch_dim=1).eval()
    with torch.no_grad():
        out = right(tokens)
        members = bayesify.predict(right, tokens)  # the output's batch is at 0, the input's at 1: split there
    assert out.shape == (3, 3) and torch.allclose(out.exp().sum(-1), torch.ones(3), atol=1e-5)
    assert members.shape == (K, 3, 3)  # (it was [1, 12, 3])
    with torch.no_grad():
        for k in range(K):
            with bayesify.mode(right, component=k, noise=False):
                torch.testing.assert_close(members[k], right(tokens))


class PackedGRU(nn.Module):
    """A padded batch and its lengths, packed: torch takes the lengths as a list or as a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(3, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, lengths) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return self.head(self.rnn(packed)[1][-1])


@pytest.mark.filterwarnings("ignore:.*does not depend on the batch")
def test_an_input_of_the_batch_that_is_a_list_is_refused_naming_a_tensor() -> None:
    torch.manual_seed(0)
    model = bayesify.convert(PackedGRU(), components=K, task="classification").eval()
    x, lengths = torch.randn(4, 6, 3), [6, 2, 4, 3]
    # a list is not tiled with x: 4 rows came back, not K x 4; batch_dim= is not the fix here
    with torch.no_grad(), pytest.raises(ValueError, match=r"no dimension of 16 rows .* is a list .* pass it as a tensor"):
        model(x, lengths)
    with torch.no_grad():
        out, members = model(x, torch.tensor(lengths)), bayesify.predict(model, x, torch.tensor(lengths))
    assert out.shape == (4, 2) and members.shape == (K, 4, 2)


class WithAuxLoss(nn.Module):
    """Logits and a scalar auxiliary loss (as a mixture-of-experts balancing loss): the loss has no batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(x)
        return logits, logits.square().mean()


def test_a_leaf_without_a_batch_passes_where_the_task_does_not_reduce_it() -> None:
    model = bayesify.convert(WithAuxLoss(), components=K, task="classification").eval()
    # a scalar made over every member's rows (a loss): the members' average, passed on with a warning naming it
    with torch.no_grad(), pytest.warns(UserWarning, match="output 1 of WithAuxLoss is a scalar .* not the mixture's"):
        logits, aux = model(torch.randn(2, 5))
    assert logits.shape == (2, 3) and aux.dim() == 0
    named = bayesify.convert(WithAuxLoss(), components=K, task={0: "classification", 1: "regression"}).eval()
    with torch.no_grad(), pytest.raises(ValueError, match=r"output of shape \(\) of WithAuxLoss has no dimension of 8"):
        named(torch.randn(2, 5))  # a task named for it: it cannot be reduced


# ---- a class axis that is the batch axis ----------------------------------------------------------


def test_classification_of_one_value_per_example_is_refused_not_softmaxed_across_the_batch() -> None:
    model = bayesify.convert(nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)), components=K, task="classification")
    model.eval()
    with torch.no_grad():
        for batch in (5, 1):
            with pytest.raises(ValueError, match=rf"shape \({batch},\) .* holds the batch.*task='binary'.*\[B, C\]"):
                model(torch.randn(batch, 3))
        with pytest.raises(ValueError, match=r"holds the batch.*task='binary'"):
            bayesify.uncertainty(model, torch.randn(5, 3))
        with bayesify.mode(model, task="binary"):
            assert model(torch.randn(5, 3)).shape == (5,)



class _TimeMajorClassifier(nn.Module):
    """``[T, B, F]`` in (nn.LSTM's layout), the last step's ``[B, C]`` logits out: the batch moves axis."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(6, 12), nn.Linear(12, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][-1])


@pytest.mark.parametrize("batch", [5, 3])  # 3: as many examples as classes
def test_a_time_major_classifier_whose_output_has_its_batch_first_is_decomposed_and_evaluated(batch: int) -> None:
    """``batch_dim=1`` for the input, ``[B, C]`` out (README, ``batch_dim``): ``uncertainty`` and ``evaluate`` read
    the batch where the input has it (dimension 1, the classes here) and refused it as a softmax across the batch."""
    from bayesify.evaluation import evaluate
    from bayesify.predictive.decompositions import classification_uncertainty

    torch.manual_seed(0)
    model = bayesify.convert(_TimeMajorClassifier(3), components=K, task="classification", batch_dim=1).eval()
    x, y = torch.randn(7, batch, 6), torch.randint(0, 3, (batch,))
    members = bayesify.predict(model, x)  # [K, B, C] logits
    expected = classification_uncertainty(members)
    found = bayesify.uncertainty(model, x, noise=False)  # at the means, as predict in evaluation
    torch.testing.assert_close(found.mutual_information, expected.mutual_information)
    torch.testing.assert_close(found.predictive_entropy, expected.predictive_entropy)
    loader = torch.utils.data.DataLoader(  # time-major batches
        torch.utils.data.TensorDataset(x.transpose(0, 1), y), batch_size=batch,
        collate_fn=lambda b: (torch.stack([e[0] for e in b], 1), torch.stack([e[1] for e in b])),
    )
    report = evaluate(model, loader, members=False)
    mixture = torch.logsumexp(members.log_softmax(-1), 0) - torch.log(torch.tensor(float(K)))
    assert report["nll"] == pytest.approx(torch.nn.functional.nll_loss(mixture, y).item(), rel=1e-5)
    # one logit per example is still a softmax across the batch wherever the batch lies
    scalar = bayesify.convert(nn.Sequential(_TimeMajorClassifier(1), nn.Flatten(0)), components=K, task="classification", batch_dim=1)
    with pytest.raises(ValueError, match=r"holds the batch.*task='binary'"), torch.no_grad():
        bayesify.uncertainty(scalar.eval(), x)

def test_one_unbatched_example_has_its_classes_on_its_one_axis() -> None:
    model = bayesify.convert(nn.Linear(3, 4), components=K, task="classification").eval()  # a layer as the model
    with torch.no_grad():
        out = model(torch.randn(3))  # one example, no batch axis: [C]
    assert out.shape == (4,) and torch.allclose(out.exp().sum(), torch.tensor(1.0))


class _WithDiscreteOutputs(nn.Module):
    """Logits, their argmax and a boolean mask: the two discrete leaves have no mean over members."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z = self.fc(x)
        return z, z.argmax(-1), z > 0


def test_an_integer_or_boolean_output_is_refused_not_handed_back_with_the_members_rows() -> None:
    """An argmax (or mask) output of a tiled evaluation pass came back with K x B rows, silently; it is refused in one
    line naming the output and the fix, and reduced where the task names its reduction."""
    torch.manual_seed(0)
    model = bayesify.convert(_WithDiscreteOutputs(), components=4, task="classification").eval()
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"output 1 of _WithDiscreteOutputs is torch.int64.*task=\{\.\.\., 1: 'members'\}"):
        model(x)
    vote = lambda members: members.float().mean(0) > 0.5  # noqa: E731 (a majority of the members)
    model = bayesify.convert(_WithDiscreteOutputs(), components=4, task={0: "classification", 1: "members", 2: vote})
    model.eval()
    logits, argmax, mask = model(x)
    members = bayesify.predict(model, x)
    assert logits.shape == (5, 3) and mask.shape == (5, 3) and mask.dtype == torch.bool
    assert torch.equal(argmax, members[1])  # [K, B]: each member's own argmax
    assert torch.equal(mask, members[2].float().mean(0) > 0.5)


class _MeanAndLogVariance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean, self.log_var = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mean(x), self.log_var(x)


def test_a_gaussian_task_on_a_mean_and_log_variance_tuple_is_refused_not_reduced_leaf_by_leaf() -> None:
    """``task="gaussian"`` on ``(mean [B, 2], log_var [B, 2])`` reduced each leaf as a head of its own (its first half
    means, its second variances), silently; refused in one line naming torch.cat and a task per output."""
    model = bayesify.convert(_MeanAndLogVariance(), components=K, task="gaussian").eval()
    with torch.no_grad(), pytest.raises(ValueError, match=r"task='gaussian' takes one tensor .* torch\.cat\(\[mean, log_var\], -1\)"):
        model(torch.randn(3, 4))


def _tiny_clip() -> nn.Module:
    """A converted CLIP of random weights (2 components, spread), in evaluation."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    layers = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    text = {"vocab_size": 50, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1, **layers}
    vision = {"image_size": 32, "patch_size": 8, **layers}
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)
    return bayesify.convert(transformers.CLIPModel(config), components=2, init="normal", init_mean_std=0.3).eval()


def test_a_contrastive_models_similarity_matrices_are_each_members_own_pairs() -> None:
    """CLIP's ``logits_per_image`` / ``logits_per_text`` are ``[B, B]``: a tiled pass makes them ``[K*B, K*B]``, whose
    blocks off the diagonal pair one member's images with another's texts. Reduced on the rows alone, evaluation
    returned ``[B, K*B]``, silently. Each member is now its own diagonal block (equal to ``merge(component=k)``), and
    evaluation their mean, as for every output the task does not name."""
    model = _tiny_clip()
    ids, pixels = torch.randint(0, 50, (4, 6)), torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        mixture = model(input_ids=ids, pixel_values=pixels)
        members = bayesify.predict(model, input_ids=ids, pixel_values=pixels)
        for name in ("logits_per_image", "logits_per_text"):
            assert getattr(members, name).shape == (2, 4, 4) and getattr(mixture, name).shape == (4, 4)
            torch.testing.assert_close(getattr(mixture, name), getattr(members, name).mean(0))
        for k in range(2):
            merged = bayesify.merge(model, component=k).eval()(input_ids=ids, pixel_values=pixels)
            torch.testing.assert_close(members.logits_per_image[k], merged.logits_per_image, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(members.logits_per_text[k], merged.logits_per_text, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("images, texts", [(4, 2), (2, 4)])
def test_a_contrastive_models_towers_given_batches_of_different_sizes_are_refused_in_one_pass_and_run_per_member(
    images: int, texts: int
) -> None:
    """Zero-shot CLIP: N images against M prompts. One tiled pass took the batch from the first input alone, so the
    other tower ran one member's weights for all members (its embeddings 0.49 off the members' mean, the similarity
    matrix 3.5 off; with 2 images and 4 texts at projection width K x 4 the embeddings were reduced on their width).
    The mixture's pass is refused in one line naming ``bayesify.predict``, which runs each member once."""
    model = _tiny_clip()
    ids, pixels = torch.randint(0, 50, (texts, 6)), torch.randn(images, 3, 32, 32)
    with pytest.raises(ValueError, match=rf"batches of different sizes \(input_ids {texts}, pixel_values {images}\).*bayesify\.predict"):
        model(input_ids=ids, pixel_values=pixels)
    with pytest.raises(ValueError, match="batches of different sizes"):
        model(ids, pixels)  # (given by position)
    with torch.no_grad():
        members = bayesify.predict(model, pixel_values=pixels, input_ids=ids)
        assert isinstance(members, list) and len(members) == 2
        for k in range(2):
            merged = bayesify.merge(model, component=k).eval()(input_ids=ids, pixel_values=pixels)
            for name in ("logits_per_image", "image_embeds", "text_embeds"):
                assert getattr(members[k], name).shape == getattr(merged, name).shape
                torch.testing.assert_close(getattr(members[k], name), getattr(merged, name), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(members[0].text_embeds, members[1].text_embeds)  # (two members, not one twice)
        model(input_ids=ids[:1].expand(images, -1), pixel_values=pixels)  # batches of one size: the mixture's pass


def test_hugging_face_heads_beside_the_logits_are_each_the_mixture_of_their_own_distribution() -> None:
    """GPT-2's multiple-choice head (``mc_logits``) and BERT's pre-training heads (``prediction_logits``,
    ``seq_relationship_logits``) came back as the members' mean of raw logits, not the mixture of their softmax; and
    ELECTRA's discriminator logits ``[B, T]`` (one sigmoid per token) were reduced as a softmax over the sequence."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)

    def mixture(members: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(members.log_softmax(-1), 0) - math.log(members.shape[0])

    small = {"vocab_size": 50, "max_position_embeddings": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    spread = {"init": "normal", "init_mean_std": 0.3}
    gpt2 = transformers.GPT2DoubleHeadsModel(transformers.GPT2Config(n_embd=16, bos_token_id=0, eos_token_id=1, **small))
    bayesify.convert(gpt2, **spread).eval()
    ids, choice = torch.randint(0, 50, (2, 3, 6)), torch.full((2, 3), 5)
    bert = bayesify.convert(transformers.BertForPreTraining(transformers.BertConfig(hidden_size=16, intermediate_size=32, **small)), **spread).eval()
    electra_config = transformers.ElectraConfig(embedding_size=16, hidden_size=16, intermediate_size=32, **small)
    electra = bayesify.convert(transformers.ElectraForPreTraining(electra_config), **spread).eval()
    tokens = torch.randint(0, 50, (3, 6))
    with torch.no_grad():
        out, members = gpt2(input_ids=ids, mc_token_ids=choice), bayesify.predict(gpt2, input_ids=ids, mc_token_ids=choice)
        torch.testing.assert_close(out.mc_logits, mixture(members.mc_logits))
        torch.testing.assert_close(out.logits, mixture(members.logits))
        out, members = bert(input_ids=tokens), bayesify.predict(bert, input_ids=tokens)
        torch.testing.assert_close(out.seq_relationship_logits, mixture(members.seq_relationship_logits))
        torch.testing.assert_close(out.prediction_logits, mixture(members.prediction_logits))
        out, members = electra(input_ids=tokens), bayesify.predict(electra, input_ids=tokens)
        torch.testing.assert_close(out.logits, torch.logit(members.logits.sigmoid().mean(0)), rtol=1e-4, atol=1e-4)


# ---- class outputs that are probabilities already (a final softmax) -------------------------------


def _softmax_net(last: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3), last)
    return bayesify.convert(net, task="classification", components=K, init="normal").eval()


def test_a_classifier_ending_in_a_softmax_is_refused_not_softmaxed_again() -> None:
    # its softmax of probabilities is another distribution: the mixture, its NLL and its uncertainty silently wrong
    net = _softmax_net(nn.Softmax(-1))
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    for call in (
        lambda: net(x),
        lambda: net(x),  # (looked at again: the first refusal did not mark it looked at)
        lambda: bayesify.uncertainty(net, x, noise=False),
        lambda: bayesify.evaluation.evaluate(net, torch.utils.data.TensorDataset(x, y)),
    ):
        with pytest.raises(ValueError, match=r"probabilities .*torch.log\(probs\)"):
            call()


def test_log_probabilities_pass_and_the_forward_looks_once() -> None:
    net = _softmax_net(nn.LogSoftmax(-1))
    x = torch.randn(5, 6)
    members = bayesify.predict(net, x, noise=False)
    torch.testing.assert_close(net(x).exp(), members.exp().mean(0))  # the members' mixture of probabilities
    calls = []
    original = bayesify.predictive.outputs.refuse_probabilities
    bayesify.predictive.outputs.refuse_probabilities = lambda *a: calls.append(a) or original(*a)
    try:
        net(x), net(x)
    finally:
        bayesify.predictive.outputs.refuse_probabilities = original
    assert calls == []  # looked at in the first mixture pass above only: no sync in every evaluation pass
