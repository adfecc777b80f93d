"""Every weight-bearing layer is converted, or summary() names it with the reason and the way to map it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesify


class Dense(nn.Module):  # a third-party linear layer that is not an nn.Linear
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.pos = nn.Parameter(torch.randn(4, 6))  # an additive position embedding: not a linear map
        self.proj = nn.Parameter(torch.randn(6, 6))  # used as x @ proj.t() in the block's own maths
        self.scale = nn.Parameter(torch.ones(6, 1))  # a per-channel scale
        self.norm = nn.LayerNorm([4, 6])  # 2-d affine parameters, deterministic by design
        self.bn = nn.BatchNorm1d(4)
        self.dense = Dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.bn(x + self.pos))
        x = self.fc(x) + x @ self.proj.t()
        return self.dense(x) * self.scale.squeeze(1)


def test_static_report_names_candidates_with_the_mapping() -> None:
    model = bayesify.convert(Block())
    skipped = bayesify.summary(model).skipped
    assert set(skipped) == {"", "dense"}  # the block (pos, proj) and Dense; never the norms or the scale
    assert "mapping={**bayesify.default_mapping(), Dense: <your Rank1Layer subclass>}" in skipped["dense"]


def test_example_forward_tells_linear_maps_from_tables() -> None:
    model = bayesify.convert(Block())
    report = bayesify.summary(model, torch.randn(2, 4, 6))
    assert set(report.skipped) == {"", "dense"}
    assert "Block.proj is a linear map (used by Tensor.matmul" in report.skipped[""]  # not pos: it is only added
    assert "Dense.weight is a linear map (used by F.linear" in report.skipped["dense"]
    assert not report.bypassed


def test_a_table_only_added_is_dropped_after_the_probe() -> None:
    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos_embed = nn.Parameter(torch.randn(1, 4, 6))
            self.table = nn.Parameter(torch.randn(9, 6))
            self.head = nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.pos_embed + self.table[torch.arange(4)]
            return self.head(x.mean(1))

    model = bayesify.convert(Tokens())
    assert "" in bayesify.summary(model).skipped  # statically it may be a linear map
    assert bayesify.summary(model, torch.randn(2, 4, 6)).skipped == {}


def test_the_printed_mapping_converts_the_layer() -> None:
    class Rank1Dense(bayesify.layers.Rank1Linear):
        def rank1_features(self) -> tuple[int, int]:
            return 6, 6

    model = nn.Sequential(Dense(), nn.Linear(6, 2))
    bayesify.convert(model, mapping={**bayesify.default_mapping(), Dense: Rank1Dense})
    report = bayesify.summary(model, torch.randn(3, 6))
    assert report.skipped == {} and len(report.converted) == 2


def test_weight_used_outside_its_module() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.fc.weight) + x @ self.fc.weight  # one call routed, one bypassing

    model = bayesify.convert(Tied())
    report = bayesify.summary(model, torch.randn(2, 6))
    assert "fc" in report.bypassed and "matmul" in report.bypassed["fc"]


def test_lazy_layers_need_a_forward_first() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="forward pass"):
        bayesify.convert(model)
    model(torch.randn(3, 5))  # materialised: now a plain Linear
    bayesify.convert(model)
    assert len(list(bayesify.rank1_layers(model))) == 2


@pytest.mark.parametrize(
    "layer,inputs",
    [
        (lambda: nn.LSTM(4, 6, batch_first=True), lambda: (torch.randn(2, 3, 4),)),
        (lambda: nn.GRUCell(4, 6), lambda: (torch.randn(2, 4),)),
        (lambda: nn.MultiheadAttention(6, 2, batch_first=True), lambda: (torch.randn(2, 3, 6),) * 3),
        (lambda: nn.Bilinear(4, 5, 3), lambda: (torch.randn(2, 4), torch.randn(2, 5))),
        (lambda: nn.TransformerDecoderLayer(6, 2, 8, batch_first=True), lambda: (torch.randn(2, 3, 6), torch.randn(2, 4, 6))),
    ],
    ids=["lstm", "gru-cell", "mha", "bilinear", "decoder-layer"],
)
def test_default_mapping_covers_weight_bearing_torch_layers(layer, inputs) -> None:
    model = bayesify.convert(layer())
    report = bayesify.summary(model, *inputs())
    assert report.skipped == {} and report.bypassed == {}, (report.skipped, report.bypassed)
