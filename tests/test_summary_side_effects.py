"""summary(model, x) inspects: its example pass leaves the model's buffers, flags, gradients and the global RNG as
they were (a BatchNorm in training mode updated its running statistics from the example batch, and a pretrained
model's evaluation shifted)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import bayesify


class TrainOnlyHead(nn.Module):
    """Batch norm and dropout in training mode, a buffer the forward replaces, and a head that runs only in
    training (as an Inception's auxiliary classifier): the probe must still see it in the compute path."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))
        self.aux = nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1  # a new tensor in the buffer's place
        y = self.body(x)
        return y + self.aux(self.body[0](x)) if self.training else y


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.clone() for name, b in model.named_buffers()}


@pytest.mark.parametrize("training", [True, False])
def test_summary_example_pass_leaves_the_model_and_the_rng_as_they_were(training: bool) -> None:
    model = bayesify.convert(TrainOnlyHead(), task="classification").train(training)
    with torch.no_grad():
        for _ in range(3):
            model.train()(torch.randn(16, 6))  # running statistics away from their initial values
    model.train(training)
    x, example = torch.randn(8, 6), torch.randn(4, 6)
    buffers, calls = _buffers(model), model.calls
    flags = {name: m.training for name, m in model.named_modules()}
    reference = copy.deepcopy(model).eval()(x)
    rng = torch.get_rng_state()

    report = bayesify.summary(model, example)

    assert report.probed and set(report.bypassed) == (set() if training else {"aux"}), str(report)  # its own route
    assert torch.equal(torch.get_rng_state(), rng), "the example pass drew from the global generator"
    after = _buffers(model)
    assert after.keys() == buffers.keys()
    for name, value in buffers.items():
        assert torch.equal(after[name], value), f"buffer {name} changed: {value} -> {after[name]}"
    assert model.calls is calls, "the buffer the forward replaced was not put back"
    assert {name: m.training for name, m in model.named_modules()} == flags
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model.eval()(x), reference)


def test_summary_runs_the_train_only_layers_of_a_model_in_training() -> None:
    """The probe keeps the model's mode (the same route as before the fix): a layer that runs only in training is
    in the compute path of a model in training, and named as bypassed of one in evaluation."""
    model = bayesify.convert(TrainOnlyHead(), task="classification")
    assert "aux" not in bayesify.summary(model.train(), torch.randn(4, 6)).bypassed
    assert "aux" in bayesify.summary(model.eval(), torch.randn(4, 6)).bypassed


def test_summary_leaves_a_timm_resnet_in_training_as_it_was() -> None:
    """The report's case: timm.create_model returns a model in training mode; summary's example pass updated every
    batch norm's statistics (num_batches_tracked 20 -> 21) and the evaluation moved by 0.2."""
    timm = pytest.importorskip("timm")
    net = timm.create_model("resnet18", num_classes=10, zero_init_last=False)
    with torch.no_grad():
        for _ in range(2):
            net(torch.rand(16, 3, 32, 32))
    model = bayesify.convert(net)
    x = torch.rand(4, 3, 32, 32)
    reference = copy.deepcopy(model).eval()(x)
    buffers = _buffers(model)
    bayesify.summary(model, torch.randn(2, 3, 32, 32))
    assert model.training
    assert model.bn1.num_batches_tracked.item() == 2
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())
    assert torch.equal(model.eval()(x), reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_summary_leaves_the_cuda_generator_as_it_was() -> None:
    model = bayesify.convert(TrainOnlyHead(), task="classification").cuda().train()
    example = torch.randn(4, 6, device="cuda")
    rng = torch.cuda.get_rng_state()
    bayesify.summary(model, example)
    assert torch.equal(torch.cuda.get_rng_state(), rng)


def test_summary_finds_a_layer_whose_rows_are_not_each_examples_in_a_run() -> None:
    # a torch.cat of two batches through a shared encoder: its 2 x B rows are two blocks of B, not each example's two
    # rows in a run, which is how bayesify routes them (the members mixed, silently); a batch-first flatten is fine
    class Siamese(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.head = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            za, zb = self.enc(torch.cat([a, b])).chunk(2)
            return self.head((za - zb).abs())

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.reshape(-1, 4)).view(x.shape[0], -1, 3).mean(1)

    siamese = bayesify.convert(Siamese(), task="classification")
    before = {k: v.clone() for k, v in siamese.state_dict().items()}
    report = bayesify.summary(siamese, torch.randn(3, 4), torch.randn(3, 4))
    assert set(report.misordered) == {"enc"} and "example 0's at rows [0, 3], not rows 0-1" in report.misordered["enc"]
    assert "members mixed" in str(report) and siamese.training
    assert all(torch.equal(v, siamese.state_dict()[k]) for k, v in before.items())
    assert bayesify.summary(bayesify.convert(Tokens(), task="classification"), torch.randn(3, 5, 4)).misordered == {}


def test_summary_finds_a_time_major_layer_whose_length_equals_the_batch() -> None:
    # a batch-first model with a time-major layer of its own inside: with T == B its Linear's rows look like the
    # batch's. torch's time-major encoder layer is known (its Linears and attention take the batch at axis 1) and is
    # not named
    class Clf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False)
            self.mix = nn.Linear(8, 8)  # called on [T, B, 8]
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, 8]
            return self.head(self.mix(self.enc(x.transpose(0, 1))).mean(0))

    model = bayesify.convert(Clf(), task="classification")
    report = bayesify.summary(model, torch.randn(5, 5, 8))
    assert set(report.misordered) == {"mix"}, report.misordered
    assert "batch lies on another axis" in report.misordered["mix"]
    # with another length (T = 6, B = 4) each pass warns, and summary lists it too (it said nothing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = bayesify.summary(model, torch.randn(4, 6, 8))
    assert set(report.misordered) == {"mix"}, report.misordered
    assert "another axis of size 4: its batch lies there" in report.misordered["mix"]


def test_summary_moves_token_ids_to_find_a_time_major_layer() -> None:
    # a text model takes integer tokens [B, T]: the row check moved float inputs only, and with none it said nothing
    # ("every converted layer ran"); example 0's tokens are moved to the next id in the batch's range
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mix, self.head = nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T]
            return self.head(self.mix(self.emb(tokens).transpose(0, 1)).mean(0))  # a time-major Linear inside

    torch.manual_seed(0)
    model = bayesify.convert(Tagger(), task="classification")
    report = bayesify.summary(model, torch.randint(0, 20, (5, 5)))
    assert set(report.misordered) == {"mix"}, report.misordered
    assert "batch lies on another axis" in report.misordered["mix"]
