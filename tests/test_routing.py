"""Routing: train/eval defaults, mode(), predict(), the mixture reduction, batch layouts."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

import bayesify


def _net(components: int = 3) -> nn.Module:
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))
    bayesify.convert(net, components=components, init_std=0.3, task="classification")
    return net


def test_default_shapes_train_and_eval() -> None:
    net = _net()
    x = torch.randn(6, 5)
    assert net.train()(x).shape == (6, 4)
    assert net.eval()(x).shape == (6, 4)
    with bayesify.mode(net, route="tile"):
        assert net(x).shape == (18, 4)
    with bayesify.mode(net, route="tile", samples=2):
        assert net(x).shape == (36, 4)


def test_eval_returns_log_mean_softmax_of_the_members() -> None:
    net = _net().eval()
    x = torch.randn(6, 5)
    torch.manual_seed(1)
    with bayesify.mode(net, route="tile", samples=2):
        members = net(x).view(6, 6, 4)  # [K*M, B, C]
    torch.manual_seed(1)
    with bayesify.mode(net, route="mixture", samples=2):
        mixture = net(x)
    expected = torch.logsumexp(members.log_softmax(-1), 0) - math.log(6)
    torch.testing.assert_close(mixture, expected)
    torch.testing.assert_close(mixture.exp().sum(-1), torch.ones(6))


def test_reductions_mean_and_binary_logits() -> None:
    net = nn.Sequential(nn.Linear(5, 1))
    bayesify.convert(net, components=2, init_std=0.5, task="binary")
    net.eval()
    x = torch.randn(4, 5)
    torch.manual_seed(3)
    with bayesify.mode(net, route="tile"):
        members = net(x).view(2, 4, 1)
    torch.manual_seed(3)
    out = net(x)
    torch.testing.assert_close(torch.sigmoid(out), torch.sigmoid(members).mean(0))
    torch.manual_seed(3)
    with bayesify.mode(net, route="mixture", task="regression"):
        torch.testing.assert_close(net(x), members.mean(0))


def test_single_output_with_logits_reduction_explains_the_fix() -> None:
    net = bayesify.convert(nn.Linear(3, 1), task="classification").eval()
    with pytest.raises(ValueError, match="task='binary'"):
        net(torch.randn(2, 3))


def test_mode_noise_false_is_deterministic_and_nested_modes_restore() -> None:
    net = _net().eval()
    x = torch.randn(4, 5)
    with bayesify.mode(net, noise=False):
        a, b = net(x), net(x)
        with bayesify.mode(net, route="tile"):
            assert net(x).shape == (12, 4)
        c = net(x)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
    torch.testing.assert_close(net(x), a)  # the default evaluation is the mixture of the K posterior means
    sampled = bayesify.revert(net)
    bayesify.convert(sampled, components=3, init_std=0.3, task="classification", eval_noise=True)
    assert not torch.allclose(sampled(x), sampled(x))  # eval_noise=True samples, like the reference


def test_mode_overrides_training_default() -> None:
    net = _net().train()
    with bayesify.mode(net, route="mixture"):
        out = net(torch.randn(4, 5))
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(4))


def test_component_route_matches_tile_member() -> None:
    net = _net().eval()
    with torch.no_grad():
        for _, layer in bayesify.rank1_layers(net):
            layer.rank1_s.loc.normal_(1.0, 0.5)
    x = torch.randn(4, 5)
    with bayesify.mode(net, route="tile", noise=False):
        members = net(x).view(3, 4, 4)
    for k in range(3):
        with bayesify.mode(net, component=k, noise=False):
            torch.testing.assert_close(net(x), members[k])


def test_predict_stacks_members() -> None:
    net = _net().eval()
    x = torch.randn(7, 5)
    members = bayesify.predict(net, x, samples=4)
    assert members.shape == (12, 7, 4)
    assert not members.requires_grad
    means = bayesify.predict(net, x, noise=False)
    with bayesify.mode(net, route="tile", noise=False):
        torch.testing.assert_close(means, net(x).view(3, 7, 4))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(route="sideways"), "route='sideways'"),
        (dict(samples=0), "samples=0"),
        (dict(component=3), r"component=3 must be an integer in \[0, 3\)"),
        (dict(route="tile", component=1), "only applies"),
    ],
)
def test_mode_rejects_bad_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        with bayesify.mode(_net(), **kwargs):
            pass


def test_the_reduction_option_of_release_0_1_is_an_unknown_option() -> None:
    with pytest.raises(TypeError, match=r"unknown conversion option\(s\) \['reduction'\]"):
        bayesify.convert(_net(), reduction="logits")
    with pytest.raises(TypeError, match="reduction"):
        with bayesify.mode(_net(), reduction="binary_logits"):
            pass


def test_mode_on_unconverted_model_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="bayesify.convert"):
        with bayesify.mode(nn.Linear(2, 2)):
            pass


def test_sequence_first_batch_dim() -> None:
    """batch_dim=1: inputs [T, B, F]; each example keeps one component across time steps."""
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))
    bayesify.convert(net, components=2, batch_dim=1, posterior="delta")
    with torch.no_grad():
        for _, layer in bayesify.rank1_layers(net):
            layer.rank1_r.loc.normal_(1.0, 0.5)
    x = torch.randn(5, 4, 3)  # [T, B, F]
    with bayesify.mode(net, route="tile"):
        members = net(x)
    assert members.shape == (5, 8, 2)  # tiled along the batch dimension
    net.train()
    out = net(x)
    m = members.view(5, 2, 4, 2)
    for b in range(4):
        matches = [torch.allclose(out[:, b], m[:, k, b]) for k in range(2)]
        assert sum(matches) == 1


def test_window_folded_batches_follow_their_example() -> None:
    """A layer that sees [B * windows, ...] routes each window through its example's component."""

    class Windowed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 4, 3] -> windows folded into batch
            b = x.shape[0]
            return self.proj(x.reshape(b * 4, 1, 3)).reshape(b, 4, 3)

    net = bayesify.convert(Windowed(), components=3, posterior="delta")
    with torch.no_grad():
        net.proj.rank1_r.loc.normal_(1.0, 0.5)
    x = torch.randn(6, 4, 3)
    with bayesify.mode(net, route="tile"):
        members = net(x).view(3, 6, 4, 3)
    net.train()
    out = net(x)
    for b in range(6):
        assert sum(torch.allclose(out[b], members[k, b]) for k in range(3)) == 1


def test_dict_and_kwarg_inputs_are_tiled() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 3), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, *, extra: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.a(x) + self.b(extra), "aux": extra.sum(-1)}

    net = bayesify.convert(TwoInputs(), components=2, task={"logits": "classification", "aux": "regression"}).eval()
    out = net(torch.randn(5, 2), extra=torch.randn(5, 4))
    assert out["logits"].shape == (5, 3) and out["aux"].shape == (5,)
    with bayesify.mode(net, route="tile"):
        assert net(torch.randn(5, 2), extra=torch.randn(5, 4))["logits"].shape == (10, 3)


def test_exception_in_forward_leaves_routing_clean() -> None:
    net = _net()
    with pytest.raises(RuntimeError):
        net(torch.randn(3, 7))  # wrong feature size: torch's own error
    context = net.rank1_model.router
    assert not context.active
    assert net.eval()(torch.randn(3, 5)).shape == (3, 4)


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "eva02_tiny_patch14_224"])
def test_activation_checkpointing_recomputes_the_same_members(name: str) -> None:
    """Checkpointed blocks are recomputed in backward: same components, same samples, same gradients."""
    import timm

    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = timm.create_model(name, img_size=32, patch_size=16, depth=2, num_classes=3)
        bayesify.convert(model, components=2, init_std=0.2)
        model.set_grad_checkpointing(checkpointing)
        model.train()
        torch.manual_seed(1)
        loss = model(torch.randn(4, 3, 32, 32)).square().mean()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], msg=f"gradient of {n} differs under checkpointing")


class _Checkpointed(nn.Module):
    """A conv block (folded: a draw per block) and an MLP block (a draw per row), each checkpointed."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.mlp = nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in (self.conv, self.mlp):
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def test_reentrant_and_non_reentrant_checkpointing_give_the_plain_gradients() -> None:
    # reentrant checkpointing backpropagates through the recomputation on its own: the layers make their values again
    # from their Parameters and the pass's random numbers (taking the pass's draws, in the outer graph, failed:
    # "Trying to backward through the graph a second time")
    grads = {}
    for reentrant in (None, False, True):
        torch.manual_seed(0)
        model = bayesify.convert(_Checkpointed(reentrant), components=4, init_std=0.2, task="classification")
        x = torch.randn(8, 3, 6, 6, requires_grad=True)
        torch.manual_seed(1)
        F.cross_entropy(model(x), torch.arange(8) % 3).backward()
        grads[reentrant] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        grads[reentrant]["input"] = x.grad.clone()
    assert {n for n in grads[None] if "rank1" in n} and grads[None].keys() == grads[True].keys() == grads[False].keys()
    for reentrant in (False, True):
        for n in grads[None]:
            torch.testing.assert_close(grads[reentrant][n], grads[None][n], msg=f"{n}, use_reentrant={reentrant}")


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_recomputes_its_own_pass_when_another_pass_ran_before_the_backward(reentrant: bool) -> None:
    # a training step, then a pass on another batch before its backward (a monitoring pass in evaluation, a training
    # pass under no_grad): the recomputation took the later pass's rows and draws (gradients 0.04 off, or torch's
    # CheckpointError after an evaluation); it takes its own pass's
    # (an input that takes a gradient: reentrant checkpointing gives a first block's parameters none otherwise)
    x, y, other = torch.randn(8, 3, 6, 6, requires_grad=True), torch.arange(8) % 3, torch.randn(5, 3, 6, 6)
    grads = {}
    for checkpointed, between in [(None, "eval"), (reentrant, "eval"), (None, "no_grad"), (reentrant, "no_grad")]:
        torch.manual_seed(0)
        model = bayesify.convert(_Checkpointed(checkpointed), components=4, init_std=0.2, task="classification")
        torch.manual_seed(1)
        loss = F.cross_entropy(model(x), y)
        with torch.no_grad():
            if between == "eval":
                model.eval()(other)
                model.train()
            else:
                model(other)
        loss.backward()
        grads[checkpointed is not None, between] = _grads(model)
    for between in ("eval", "no_grad"):
        assert grads[False, between].keys() == grads[True, between].keys()
        for n, g in grads[False, between].items():
            torch.testing.assert_close(grads[True, between][n], g, msg=f"{n}, between: {between}")


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_under_a_loss_of_two_passes_is_refused_and_one_backward_each_is_exact(reentrant: bool) -> None:
    # two views, one backward (R-Drop, SimCLR): the recomputation of each view's layers took the last view's rows (the
    # gradients 0.06 off, silently); which pass a recomputation belongs to cannot be told: refused in one line. A
    # backward after each pass is exact
    x1, x2 = torch.randn(8, 3, 6, 6, requires_grad=True), torch.randn(8, 3, 6, 6, requires_grad=True)
    y = torch.arange(8) % 3
    torch.manual_seed(0)
    model = bayesify.convert(_Checkpointed(reentrant), components=4, init_std=0.2, task="classification")
    torch.manual_seed(1)
    loss = F.cross_entropy(model(x1), y) + F.cross_entropy(model(x2), y)
    with pytest.raises(RuntimeError, match=r"recomputes activation-checkpointed layers .* of one of 2 forward passes"):
        loss.backward()
    grads = {}
    for checkpointed in (None, reentrant):
        torch.manual_seed(0)
        model = bayesify.convert(_Checkpointed(checkpointed), components=4, init_std=0.2, task="classification")
        torch.manual_seed(1)
        first = F.cross_entropy(model(x1), y)
        second = F.cross_entropy(model(x2), y)
        first.backward()
        second.backward()
        grads[checkpointed] = _grads(model)
    for n, g in grads[None].items():
        torch.testing.assert_close(grads[reentrant][n], g, msg=n)


class _CheckpointedStem(nn.Module):
    """A checkpointed first block whose first layer is a patch embedding (its input takes no gradient)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 4, stride=4), nn.ReLU(), nn.Flatten(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        z = self.stem(x) if self.reentrant is None else checkpoint(self.stem, x, use_reentrant=self.reentrant)
        return self.head(z)


def test_a_checkpointed_stem_takes_one_path_in_the_forward_and_the_recomputation() -> None:
    # a stem folds where gradients are taken (its per-row path would take the input's gradient): the non-reentrant
    # checkpoint's forward and recomputation both take them, so both fold and draw alike. (A reentrant checkpoint
    # of a block whose input takes no gradient gives its parameters none: torch's rule, so nothing recomputes.)
    grads = {}
    for reentrant in (None, False):
        torch.manual_seed(0)
        model = bayesify.convert(_CheckpointedStem(reentrant), components=4, init_std=0.2, task="classification")
        torch.manual_seed(1)
        F.cross_entropy(model(torch.randn(8, 3, 8, 8)), torch.arange(8) % 3).backward()
        grads[reentrant] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert "stem.0.rank1_s.loc" in grads[None] and grads[None].keys() == grads[False].keys()
    for n in grads[None]:
        torch.testing.assert_close(grads[False][n], grads[None][n], msg=n)


def test_hugging_face_gradient_checkpointing_with_reentrant_blocks() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = bayesify.convert(transformers.BertForSequenceClassification(config), init_std=0.2)
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": True})
        model.train()
        torch.manual_seed(1)
        ids = torch.randint(50, (4, 7))
        model(input_ids=ids, labels=torch.tensor([0, 1, 2, 0])).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], msg=n)


def test_predict_keeps_each_outputs_own_batch_axis() -> None:
    """A sequence-first LSTM as the model: output [T, B, H], states [layers, B, H]."""
    lstm = bayesify.convert(nn.LSTM(3, 5, num_layers=2), components=2).eval()
    x = torch.randn(7, 4, 3)
    out, (h, c) = bayesify.predict(lstm, x, samples=3)
    assert out.shape == (6, 7, 4, 5) and h.shape == c.shape == (6, 2, 4, 5)
    with bayesify.mode(lstm, route="tile", samples=3, noise=False):
        tiled, (h_tiled, _) = lstm(x)
    members, (h_members, _) = bayesify.predict(lstm, x, samples=3, noise=False)
    torch.testing.assert_close(members[4], tiled[:, 16:20])
    torch.testing.assert_close(h_members[4], h_tiled[:, 16:20])


class _TableNet(nn.Module):
    """A converted layer on a batch-independent input (a learned table) next to the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 6))
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.proj(self.table).mean(0))


class _PaddedAttention(nn.Module):
    """Self-attention with a key padding mask made from the batch (no padded key here)."""

    def __init__(self, need_weights: bool = True) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = torch.zeros(x.shape[:2], dtype=torch.bool)
        return self.attention(x, x, x, key_padding_mask=padding, need_weights=self.need_weights)[0]


def _hf_dense() -> nn.Module:
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D  # Hugging Face's [in, out] dense layer
    return nn.Sequential(conv1d(8, 6), nn.ReLU(), conv1d(3, 8))


# name: (the plain model, its inputs with an empty batch, its task)
EMPTY_BATCH_MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), [(0, 6)], "classification"),
    "cnn": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(8, 3),
        ),
        [(0, 3, 8, 8)],
        "classification",
    ),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 8, 3), nn.ConvTranspose1d(8, 4, 3)), [(0, 3, 8)], "regression"),
    "gaussian": (lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4)), [(0, 6)], "gaussian"),
    "multilabel": (lambda: nn.Linear(6, 2), [(0, 6)], "multilabel"),
    "lstm": (lambda: nn.LSTM(6, 5, num_layers=2, batch_first=True), [(0, 4, 6)], "regression"),
    "gru_sequence_first": (lambda: nn.GRU(6, 5, bidirectional=True), [(4, 0, 6)], "regression"),
    "transformer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), [(0, 4, 8)], "regression"),
    "padded_attention": (_PaddedAttention, [(0, 4, 8)], "regression"),
    "hf_conv1d": (_hf_dense, [(0, 4, 6)], "regression"),
    "bilinear": (lambda: nn.Bilinear(6, 6, 3), [(0, 6), (0, 6)], "classification"),
    "table": (_TableNet, [(0, 6)], "classification"),
}


@pytest.mark.filterwarnings("error")  # no warning either (a variance over no examples warns)
@pytest.mark.parametrize("sampling", ["auto", "example", "component"])
@pytest.mark.parametrize("name", list(EMPTY_BATCH_MODELS))
def test_an_empty_batch_gives_the_plain_models_empty_outputs(name: str, sampling: str) -> None:
    """The end of a sharded or filtered loader: a batch of size 0 in training, evaluation, predict, uncertainty."""
    make, shapes, task = EMPTY_BATCH_MODELS[name]
    net = make()
    xs = [torch.randn(shape) for shape in shapes]
    batch_dim = 1 if name == "gru_sequence_first" else 0
    expected = [t.shape for t in tree_leaves(net.eval()(*xs))]  # what the plain model returns
    bayesify.convert(net, components=3, task=task, sampling=sampling, batch_dim=batch_dim)

    out = net.train()(*xs)
    assert [t.shape for t in tree_leaves(out)] == expected
    (sum(t.sum() for t in tree_leaves(out)) + bayesify.kl_loss(net, 10)).backward()
    assert [t.shape for t in tree_leaves(net.eval()(*xs))] == expected
    with bayesify.mode(net, route="tile"):
        assert [t.shape for t in tree_leaves(net(*xs))] == expected
    members = bayesify.predict(net, *xs, samples=2)
    assert [t.shape for t in tree_leaves(members)] == [(6, *shape) for shape in expected]
    u = bayesify.uncertainty(net, *xs)
    fields = [getattr(u, f.name) for f in dataclasses.fields(u)]
    assert all(t.numel() == 0 for t in fields if isinstance(t, torch.Tensor)), f"{type(u).__name__} of no examples"


def test_an_empty_batch_has_empty_uncertainty_fields() -> None:
    net = bayesify.convert(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), task="classification")
    u = bayesify.uncertainty(net.eval(), torch.randn(0, 6))
    assert u.probs.shape == (0, 3)
    assert u.predictive_entropy.shape == u.expected_entropy.shape == u.mutual_information.shape == (0,)
    assert u.prediction.shape == (0,)


def test_an_empty_batch_through_padded_attention_without_weights() -> None:
    """The scaled-dot-product path with a key padding mask (torch's own module fails here on an empty batch)."""
    net = bayesify.convert(_PaddedAttention(need_weights=False), components=3, task="regression")
    x = torch.randn(0, 4, 8)
    assert net.train()(x).shape == net.eval()(x).shape == (0, 4, 8)
    torch.manual_seed(0)
    full = net(torch.randn(2, 4, 8))  # and the same path on a batch that is not empty
    assert full.shape == (2, 4, 8) and torch.isfinite(full).all()


class _TimeMajorInside(nn.Module):
    """A batch-first model whose middle layer sees the batch at dimension 1 (time-major inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, 6]
        h = self.embed(x).transpose(0, 1)
        return self.head(torch.relu(self.mix(h)).mean(0))


def test_a_layer_that_sees_the_batch_elsewhere_is_named_and_so_is_a_batch_independent_one() -> None:
    # mix's input [T=5, B, 16]: the pass's rows lie at dimension 1, not at batch_dim; it would run one member for
    # all rows (a batch-independent call), mixing the members: a warning names the layer and the fix
    model = bayesify.convert(_TimeMajorInside(), components=2, task="classification")
    for training in (True, False):
        with pytest.warns(UserWarning, match=r"Rank1Linear 'mix' got an input of shape \(5, (4|8), 16\).*batch_first=True"):
            model.train(training)(torch.randn(4, 5, 6))
    # a learned [5, 6] table through a layer, broadcast over the batch: every member's rows take one component's
    # draw there (member k's output is not its own), which cannot be done per member: named, with the fix
    for training in (True, False):
        table = bayesify.convert(_TableNet(), components=2, task="classification")
        with pytest.warns(UserWarning, match=r"Rank1Linear 'proj' ran on an input of shape \(5, 6\) that does not depend on the batch.*exclude="):
            table.train(training)(torch.randn(4, 6))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per model
            table(torch.randn(4, 6))
    assert "proj" in bayesify.summary(table, torch.randn(4, 6)).shared
    kept = bayesify.convert(_TableNet(), components=2, task="classification", exclude="proj")  # the fix it names
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept(torch.randn(4, 6))
        kept.eval()(torch.randn(4, 6))
    assert not bayesify.summary(kept, torch.randn(4, 6)).shared


class _LastStep(nn.Module):
    """A time-major RNN (``[T, B, C]`` in, torch's default layout) whose head takes the last step: ``[B, classes]``."""

    def __init__(self, rnn: nn.Module, classes: int) -> None:
        super().__init__()
        self.rnn, self.head = rnn, nn.Linear(rnn.hidden_size, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][-1])


def test_a_time_major_model_left_at_batch_dim_0_is_told_to_say_batch_dim_1() -> None:
    """nn.LSTM's default [T, B, C] input, converted with the default batch_dim=0: every example of a training step
    went through one component (the pass took T as the batch), and the one warning, and summary, named the head and
    convert(..., exclude=...), which fixes nothing. The LSTM, whose time steps are the pass's rows, refuses the call
    (in training, in evaluation and in summary's pass) naming batch_dim=1, from the input's shape."""

    x = torch.randn(10, 8, 3)  # T=10, B=8
    model = bayesify.convert(_LastStep(nn.LSTM(3, 16), 2), components=4, task="classification").train()
    said = r"time steps are the pass's rows .* The model's input \(shape \(10, 8, 3\)\) has 8 at dimension 1: .*batch_dim=1"
    for training in (True, False):
        with pytest.raises(ValueError, match=said):
            model.train(training)(x)
    with pytest.raises(ValueError, match=said):
        bayesify.summary(model, x)
    fixed = bayesify.convert(_LastStep(nn.LSTM(3, 16), 2), components=4, task="classification", batch_dim=1).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed(x)
    # a learned table through a layer (no other dimension of the input has its rows): no such hint
    table = bayesify.convert(_TableNet(), components=2, task="classification")
    assert "batch_dim" not in bayesify.summary(table, torch.randn(4, 6)).shared["proj"]


def test_an_images_channels_are_not_named_as_its_batch() -> None:
    """timm's maxvit at 64 px runs a relative-position MLP on 3 rows that do not depend on the batch; the warning named
    batch_dim=1 because the [B, 3, H, W] image has 3 channels, which crashed the model when followed."""

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp, self.table = nn.Linear(2, 4), nn.Parameter(torch.randn(3, 2))
            self.head = nn.Linear(3 * 4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bias = self.mlp(self.table)  # 3 rows, whatever the batch
            return self.head(x.mean((2, 3))[:, :, None].mul(bias[None]).flatten(1))

    model = bayesify.convert(Positions(), components=4, task="classification").train()
    with pytest.warns(UserWarning, match="does not depend on the batch") as said:
        model(torch.randn(8, 3, 6, 6))
    assert not any("batch_dim=1" in str(w.message) for w in said), [str(w.message) for w in said]


def test_an_output_with_its_batch_elsewhere_than_the_input_is_reduced_there() -> None:
    # a time-major RNN (batch_dim=1) whose head takes the last step: the output [B, C] has its batch at dimension 0
    torch.manual_seed(0)
    model = bayesify.convert(_LastStep(nn.GRU(5, 8), 3), components=4, task="classification", batch_dim=1, init="normal",
                             init_mean_std=0.3).eval()  # fmt: skip
    x = torch.randn(6, 3, 5)
    with torch.no_grad():
        mixture = model(x)
        members = []
        for k in range(4):
            with bayesify.mode(model, component=k, noise=False):
                members.append(model(x).log_softmax(-1))
    assert mixture.shape == (3, 3)
    torch.testing.assert_close(mixture, torch.logsumexp(torch.stack(members), 0) - math.log(4))
    class Pairs(nn.Module):  # [1, B, 2] -> [B, 1, B]: two candidate axes
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)[0]
            return (y @ y.T)[:, None, :]

    pairs = bayesify.convert(Pairs(), components=4, task="regression", batch_dim=1).eval()
    with pytest.raises(ValueError, match=r"cannot tell which dimension of an output of shape \(12, 1, 12\)"):
        pairs(torch.randn(1, 3, 2))


def test_one_task_of_logits_over_several_outputs_warns() -> None:
    class LogitsAndFeatures(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(self.body(x))
            return self.head(h), h

    model = bayesify.convert(LogitsAndFeatures(), components=2, task="classification").eval()
    with pytest.warns(UserWarning, match=r"reduced each of the 2 tensors of LogitsAndFeatures's output .* as logits"):
        model(torch.randn(3, 4))
    said = bayesify.convert(LogitsAndFeatures(), components=2, task={0: "classification", 1: "regression"}).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logits, features = said(torch.randn(3, 4))
    assert logits.shape == (3, 3) and features.shape == (3, 8)

    class TwoHeads(nn.Module):  # a dict output: the example names its keys (it named 0 and 1, which then failed)
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"species": self.a(x), "colour": self.b(x)}

    heads = bayesify.convert(TwoHeads(), components=2, task="classification").eval()
    with pytest.warns(UserWarning, match=r"\(shapes \(3, 3\), \(3, 5\)\) as logits.* task=\{'species': 'classification', "
                                         r"'colour': 'regression'\}\.$"):  # fmt: skip
        heads(torch.randn(3, 4))
    bayesify.convert(TwoHeads(), components=2, task={"species": "classification", "colour": "regression"}).eval()(torch.randn(3, 4))


def test_a_copy_or_a_save_made_inside_mode_is_the_model_outside_it(tmp_path) -> None:
    import copy

    net = _net().eval()
    x = torch.randn(5, 5)
    with bayesify.mode(net, route="tile"):
        copied = copy.deepcopy(net)
    with bayesify.mode(net, component=2, noise=False):
        torch.save(net, tmp_path / "net.pt")
    loaded = torch.load(tmp_path / "net.pt", weights_only=False)
    with torch.no_grad():
        for other in (copied, loaded):
            assert other(x).shape == (5, 4)  # the mixture, not the tiled K*B rows or member 2
            torch.testing.assert_close(other(x), net(x))


def test_mode_and_predict_refuse_a_module_holding_two_converted_models_side_by_side() -> None:
    class Two(nn.Module):  # mode() would reach the first only: its members and the other's would not line up
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = _net(), _net()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x), self.b(x)

    two = Two().eval()
    with pytest.raises(ValueError, match=r"Two holds 2 converted models \('a', 'b'\); bayesify.mode acts on one"):
        with bayesify.mode(two, route="tile"):
            pass
    with pytest.raises(ValueError, match=r"bayesify.predict acts on one: call it on each"):
        bayesify.predict(two, torch.randn(2, 5))
    with bayesify.mode(two.a, route="tile"):  # each on its own
        assert two.a(torch.randn(2, 5)).shape == (6, 4)


class _Views(nn.Module):
    """Takes its inputs as a list: ``[x_img [B, 6], x_meta [B, 3]]`` (parts of one batch, not one tensor per example)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(3, 8), nn.Linear(16, 4)

    def forward(self, views: list) -> torch.Tensor:
        return self.head(torch.cat([self.a(views[0]).relu(), self.b(views[1]).relu()], -1))


def test_a_list_of_batched_inputs_is_routed_as_a_batch_not_as_examples() -> None:
    # tensors sharing the batch's size are parts of one batch: training spreads its rows over the K components (it
    # sent the whole batch through one, as for a detector's list of images) and evaluation mixes the members (it
    # refused: "takes a list of examples"); a list of tensors of different sizes is still one of examples
    torch.manual_seed(0)
    model = bayesify.convert(_Views(), components=4, init_std=0.3, task="classification")
    views = [torch.randn(8, 6), torch.randn(8, 3)]
    model.train()
    model(views).sum().backward()
    assert bool((model.head.rank1_r.loc.grad.abs().sum(1) > 0).all()), "every component trains on its rows"
    model.eval()
    with torch.no_grad():
        mixture = model(views)
        members = torch.stack([_member(model, k, views) for k in range(4)])
    torch.testing.assert_close(mixture, members.softmax(-1).mean(0).log())
    assert not bayesify._router.is_example_list([torch.randn(8, 6), torch.randn(8, 3)])
    assert bayesify._router.is_example_list([torch.randn(3, 5, 7), torch.randn(3, 6, 7)], bayesify.predictive.Members())
    assert bayesify._router.is_example_list([torch.randn(5, 3), torch.randn(7, 3)])  # one of each example's size


def _member(model: nn.Module, k: int, *args: object) -> torch.Tensor:
    with bayesify.mode(model, component=k, noise=False):
        return model(*args)


def test_evaluation_warns_once_where_a_batch_norm_pools_the_members_statistics() -> None:
    # a batch norm without running statistics normalises the tiled evaluation batch, every member's rows together:
    # the members are not mode(component=k)'s and the predictive not their exact mixture, so it is said, once
    def model(track: bool) -> nn.Module:
        net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8, track_running_stats=track), nn.ReLU(), nn.Linear(8, 3))
        return bayesify.convert(net, components=3, init_std=0.3, task="classification").eval()

    x = torch.randn(6, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(True)(x)  # running statistics: each row alone, nothing said
    pooled = model(False)
    with pytest.warns(UserWarning, match=r"batch norm layers '1' of Sequential normalise by the statistics"):
        pooled(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pooled(x)  # (once per model)
        pooled.train()(x)  # training normalises its batch as the reference does


class _Prototypes(nn.Module):
    """A prototype classifier: the class prototypes [C, D] are an input that holds no batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
        return -torch.cdist(self.embed(x), self.embed(prototypes))


class _Causal(nn.Module):
    """Attention with a [T, T] mask passed in."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.attention(x, x, x, attn_mask=attn_mask)[0].mean(1))


@pytest.mark.filterwarnings("ignore:.*does not depend on the batch")  # the prototypes run one component's factors
def test_an_input_named_unbatched_is_never_tiled_whatever_its_size() -> None:
    """An input that holds no batch but whose size equals the batch's (prototypes with C == B, a [T, T] mask with
    T == B) was tiled for the members in evaluation: [B, K*C] "classes" (an NLL off by log K), silently, or a shape
    error in attention. ``unbatched_inputs`` names such inputs (by name or position): never tiled, so a batch of C
    gives the rows a larger batch gives."""
    torch.manual_seed(0)
    model = bayesify.convert(_Prototypes(), components=4, task="classification", unbatched_inputs=("prototypes",),
                             init="normal", init_mean_std=0.3)  # fmt: skip
    model.eval()
    x, prototypes = torch.randn(6, 4), torch.randn(5, 4)
    with torch.no_grad():
        six = model(x, prototypes)
        five = model(x[:5], prototypes=prototypes)  # C == B, given by keyword
    assert six.shape == (6, 5) and five.shape == (5, 5)
    torch.testing.assert_close(five, six[:5])
    by_position = bayesify.convert(_Prototypes(), components=4, task="classification", unbatched_inputs=(1,)).eval()
    by_position.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(by_position(x[:5], prototypes), six[:5])
    causal = bayesify.convert(_Causal(), components=4, task="classification", unbatched_inputs=["attn_mask"]).eval()
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    with torch.no_grad():
        assert causal(torch.randn(6, 6, 8), mask).shape == (6, 2)  # B == T
    with pytest.raises(ValueError, match=r"unbatched_inputs names 'protos', which is not an input of _Prototypes.forward\(x, prototypes\)"):
        bayesify.convert(_Prototypes(), task="classification", unbatched_inputs=("protos",))
    with pytest.raises(ValueError, match=r"unbatched_inputs=\[1.5\] must name the forward's inputs"):
        bayesify.convert(_Prototypes(), task="classification", unbatched_inputs=[1.5])


@pytest.mark.parametrize("kind", ["encoder", "encoder-layer", "decoder-layer", "transformer"])
def test_torchs_transformer_used_as_the_model_takes_the_batch_where_its_batch_first_says(kind: str) -> None:
    # a time-major TransformerEncoder at batch_dim=0: evaluation tiled the sequence (the mixture off by 0.76), a
    # padding mask failed inside torch; refused before any change, and exact at batch_dim=1
    def make(batch_first: bool) -> nn.Module:
        torch.manual_seed(0)
        layer = {"d_model": 8, "nhead": 2, "dim_feedforward": 16, "dropout": 0.0, "batch_first": batch_first}
        if kind == "encoder":
            return nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer), 2, enable_nested_tensor=False)
        if kind == "encoder-layer":
            return nn.TransformerEncoderLayer(**layer)
        if kind == "decoder-layer":
            return nn.TransformerDecoderLayer(**layer)
        return nn.Transformer(num_encoder_layers=1, num_decoder_layers=1, **layer)

    plain = make(False)
    with pytest.raises(ValueError, match=r"\(batch_first=False\) takes its batch at dimension 1 .* batch_dim=1\.$"):
        bayesify.convert(plain)
    assert not bayesify.is_converted(plain)  # nothing changed
    with pytest.raises(ValueError, match=r"\(batch_first=True\) takes its batch at dimension 0 .* batch_dim=0\.$"):
        bayesify.convert(make(True), batch_dim=1)
    model = bayesify.convert(make(False), batch_dim=1, task="regression", init="normal", init_mean_std=0.3).eval()
    src, mask = torch.randn(6, 3, 8), torch.zeros(3, 6, dtype=torch.bool)
    mask[0, 4:] = True
    tgt = torch.randn(5, 3, 8)
    args = {"encoder": (src,), "encoder-layer": (src,), "decoder-layer": (tgt, src), "transformer": (src, tgt)}[kind]
    keys = {"encoder": "src_key_padding_mask", "encoder-layer": "src_key_padding_mask",
            "decoder-layer": "memory_key_padding_mask", "transformer": "src_key_padding_mask"}  # fmt: skip
    with torch.no_grad():
        out = model(*args, **{keys[kind]: mask})
        members = []
        for k in range(4):
            with bayesify.mode(model, component=k, noise=False):
                members.append(model(*args, **{keys[kind]: mask}))
    torch.testing.assert_close(out, torch.stack(members).mean(0))


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", ["encoder", "transformer"])
def test_torchs_transformer_masks_are_tiled_as_torch_lays_them_out_when_the_sequence_is_as_long_as_the_batch(
    kind: str, batch_first: bool
) -> None:
    # S == B: the padding mask [B, S] was tiled at batch_dim=1 (a time-major model) and a causal mask [S, S] at
    # batch_dim, each an error inside torch; the padding mask holds the batch at 0 whatever batch_dim says, the
    # attention masks are the attention layers' to tile
    torch.manual_seed(0)
    layer = {"d_model": 8, "nhead": 2, "dim_feedforward": 16, "dropout": 0.0, "batch_first": batch_first}
    if kind == "encoder":
        model = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer), 2, enable_nested_tensor=False)
    else:
        model = nn.Transformer(num_encoder_layers=1, num_decoder_layers=1, **layer)
    bayesify.convert(model, batch_dim=0 if batch_first else 1, task="regression", init="normal", init_mean_std=0.3)
    model.eval()
    n = 4  # the sequence's length and the batch's
    src = torch.randn(n, n, 8)
    padding = torch.zeros(n, n, dtype=torch.bool)
    padding[0, -1] = padding[2, -2:] = True  # [B, S]: not symmetric, so the axis matters
    causal = nn.Transformer.generate_square_subsequent_mask(n)
    if kind == "encoder":
        args, kwargs = (src,), {"mask": causal, "src_key_padding_mask": padding}
    else:
        args, kwargs = (src, src.flip(0)), {"tgt_mask": causal, "src_key_padding_mask": padding,
                                           "memory_key_padding_mask": padding}  # fmt: skip
    with torch.no_grad():
        out = model(*args, **kwargs)
        members = []
        for k in range(4):
            with bayesify.mode(model, component=k, noise=False):
                members.append(model(*args, **kwargs))
    assert not torch.allclose(members[0], members[1])  # the members differ: the mean is a real check
    torch.testing.assert_close(out, torch.stack(members).mean(0))


def test_a_models_own_key_padding_mask_keeps_its_own_layout() -> None:
    # a time-major model of one's own whose key_padding_mask is [S, B] like its input (it transposes it for torch):
    # tiled at batch_dim as before, not at 0 (torch's layout holds for torch's transformer modules only)
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention, self.head = nn.MultiheadAttention(8, 2), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
            h = self.attention(x, x, x, key_padding_mask=key_padding_mask.T, need_weights=False)[0]
            return self.head(h).mean(0)

    torch.manual_seed(0)
    model = bayesify.convert(Encoder(), batch_dim=1, task="classification", init="normal", init_mean_std=0.3).eval()
    for length in (5, 3):  # (S == B too)
        x, mask = torch.randn(length, 3, 8), torch.zeros(length, 3, dtype=torch.bool)
        mask[-1, 0] = True
        with torch.no_grad():
            out = model(x, mask)
            members = []
            for k in range(4):
                with bayesify.mode(model, component=k, noise=False):
                    members.append(model(x, mask).log_softmax(-1))
        torch.testing.assert_close(out, torch.logsumexp(torch.stack(members), 0) - math.log(4))


def test_a_time_major_models_last_step_as_wide_as_the_members_rows_warns_which_axis_it_reduced() -> None:
    # a time-major GRU (batch_dim=1) whose last step [B, D] has D == K x B: both axes hold the pass's rows, and the
    # input's (1) is taken, which averages the features here (0.44 off), silently: it warns, naming both axes. Taking
    # the first axis instead would be wrong for the outputs whose first axis is not the batch (an RNN's state with as
    # many layers as rows, a decoder's steps), which are right as they are and stay so
    class LastStep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.head = nn.GRU(3, 6), nn.Linear(6, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0][-1])  # [B, 8]

    torch.manual_seed(0)
    model = bayesify.convert(LastStep(), batch_dim=1, task="regression", init="normal", init_mean_std=0.3).eval()
    with pytest.warns(UserWarning, match=r"member rows at dimensions 1 and 0; bayesify took dimension 1.*batch-first"):
        model(torch.randn(3, 2, 3))  # T=3 steps, B=2: K x B = 8 = D
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(3, 3, 3))  # (D != K x B: no warning)
    # a GRU's state [layers, B, H] with 4 layers at B=1: the input's axis, right
    gru = bayesify.convert(nn.GRU(3, 5, num_layers=4), batch_dim=1, task="regression", init="normal", init_mean_std=0.3)
    x = torch.randn(5, 1, 3)
    with torch.no_grad():
        state = gru.eval()(x)[1]
        members = []
        for k in range(4):
            with bayesify.mode(gru, component=k, noise=False):
                members.append(gru(x)[1])
    torch.testing.assert_close(state, torch.stack(members).mean(0))


def test_an_error_inside_a_tiled_pass_names_unbatched_inputs() -> None:
    # a [T, T] mask when the batch happens to be T: tiled with the batch, torch's error said nothing of the fix
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.layer(x, src_mask=mask)

    torch.manual_seed(0)
    x, mask = torch.randn(6, 6, 8), nn.Transformer.generate_square_subsequent_mask(6)  # B == T == 6
    model = bayesify.convert(Encoder(), task="regression").eval()
    with pytest.raises(RuntimeError) as error, torch.no_grad():
        model(x, mask)
    assert "unbatched_inputs=[...]" in "\n".join(getattr(error.value, "__notes__", []))
    fixed = bayesify.convert(Encoder(), task="regression", unbatched_inputs=["mask"]).eval()
    with torch.no_grad():
        assert fixed(x, mask).shape == (6, 6, 8)


def test_a_time_major_models_lengths_of_one_entry_per_example_are_tiled_at_their_one_dimension() -> None:
    # batch_dim=1 with lengths [B] for pack_padded_sequence: not tiled (no dimension 1), and evaluation was refused
    # naming "pass it as a tensor" (it was one)
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    class Tagger(nn.Module):  # [T, B, F] and lengths [B] -> [T, B, 5]
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.fc = nn.LSTM(8, 12), nn.Linear(12, 5)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            out, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
            return self.fc(pad_packed_sequence(out, total_length=x.shape[0])[0])

    torch.manual_seed(0)
    model = bayesify.convert(Tagger(), task="classification", class_axis=-1, batch_dim=1, init="normal",
                             init_mean_std=0.3).eval()  # fmt: skip
    x, lengths = torch.randn(6, 3, 8), torch.tensor([6, 2, 4])
    _assert_the_members_mixture(model, x, lengths)


def test_an_output_with_the_member_rows_at_two_axes_says_which_it_took() -> None:
    # a CTC-style [T, B, C] output of a batch-first model: where T == K x B its time steps were averaged as members,
    # silently (its batch is found by its size, and the input's axis wins a tie)
    class CTCNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.fc = nn.GRU(6, 16, batch_first=True), nn.Linear(16, 7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, F, T] -> [T, B, C]
            return self.fc(self.rnn(x.transpose(1, 2))[0]).log_softmax(-1).transpose(0, 1)

    model = bayesify.convert(CTCNet(), task="classification", class_axis=-1).eval()
    with torch.no_grad(), pytest.warns(UserWarning, match=r"member rows at dimensions 0 and 1; bayesify took dimension 0"):
        model(torch.randn(2, 6, 8))  # T = 8 = K x B
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model(torch.randn(2, 6, 10)).shape == (10, 2, 7)  # T != K x B: found at its size


def test_another_threads_pass_or_mode_is_refused_not_routed_through_this_ones() -> None:
    # the routing and mode() are the model's: a plain evaluation call on one thread while another thread was inside
    # mode(component=1) returned member 1 (300 of 300 calls), and concurrent passes failed with misleading errors
    import threading

    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), task="classification",
                             init="normal", init_mean_std=0.3).eval()  # fmt: skip
    x = torch.randn(5, 8)
    with torch.no_grad():
        mixture = model(x)
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with bayesify.mode(model, component=1, noise=False):
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert inside.wait(10)
        with pytest.raises(RuntimeError, match=r"another thread's forward pass or bayesify.mode\(\) uses the model: .*"
                                               r"copy.deepcopy\(model\)"), torch.no_grad():  # fmt: skip
            model(x)
        with pytest.raises(RuntimeError, match="another thread"), bayesify.mode(model, component=0):
            pass
        twin = __import__("copy").deepcopy(model)  # (a copy made meanwhile leaves the other thread's mode behind)
        with torch.no_grad():
            torch.testing.assert_close(twin(x), mixture)
    finally:
        leave.set()
        thread.join()
    with torch.no_grad():
        torch.testing.assert_close(model(x), mixture)  # the thread gone: the model is this thread's again

    # concurrent passes: each call gives the mixture, or is refused in that line; never another thread's routing
    from concurrent.futures import ThreadPoolExecutor

    inputs = [torch.randn(n, 8) for n in (3, 5, 7, 9)]
    with torch.no_grad():
        expected = [model(v) for v in inputs]

    def serve(i: int) -> torch.Tensor:
        with torch.no_grad():
            return model(inputs[i % 4])

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(serve, i) for i in range(200)]
    for i, future in enumerate(futures):
        error = future.exception()
        if error is None:
            torch.testing.assert_close(future.result(), expected[i % 4])
        else:
            assert isinstance(error, RuntimeError) and "another thread" in str(error), error


def test_a_one_dimensional_input_of_the_batchs_size_is_not_tiled_where_the_time_steps_have_that_size_too() -> None:
    # a [T] vector of the time steps with T == B (batch_dim=1) was tiled as if it held the examples: 0.35 off
    class TimeMajor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.fc = nn.GRU(6, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
            return self.fc(self.rnn(x[: int(valid.sum())])[0].mean(0))

    torch.manual_seed(0)
    model = bayesify.convert(TimeMajor(), task="classification", batch_dim=1, init="normal", init_mean_std=0.3).eval()
    x, valid = torch.randn(4, 4, 6), torch.tensor([True, True, False, False])
    x[2:] = 100.0
    _assert_the_members_mixture(model, x, valid)


def _assert_the_members_mixture(model: nn.Module, *args: torch.Tensor) -> None:
    """A classifier's evaluation output is the log of its K posterior-mean members' mean softmax."""
    with torch.no_grad():
        out = model.eval()(*args)
        members = []
        for k in range(bayesify.num_components(model)):
            with bayesify.mode(model, component=k, noise=False):
                members.append(model(*args).softmax(-1))
    torch.testing.assert_close(out, torch.stack(members).mean(0).log())
