"""``torch.compile`` of every other layer family: no graph breaks in the converted layers' forward.

Recurrent cells stepped in a loop and ``nn.LSTM`` (with ``torch._dynamo.config.allow_rnn``: dynamo
refuses every ``nn.LSTM`` / ``GRU`` / ``RNN`` without it, a converted one as a plain one), Gaussian
embeddings sampling their table, ``nn.Bilinear``, a ``TransformerEncoderLayer`` (rank-1
``MultiheadAttention``) and a transposed convolution. ``aot_eager`` also traces the recurrent
scan's hand-written backward pass, checked against eager. See ``tests/test_compile.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bayesify
from tests.test_compile import compiled_breaks, perturbed


class _CellLoop(nn.Module):
    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.cell, self.head = cell, nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = None
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        return self.head(state[0] if isinstance(state, tuple) else state)


class _Recurrent(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn, self.head = rnn, nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 6, padding_idx=0), nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bilinear(x, x.flip(-1))


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.head = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


FAMILIES = {
    "lstm-cell": (lambda: _CellLoop(nn.LSTMCell(4, 6)), lambda: torch.randn(5, 3, 4), {}),
    "gru-cell": (lambda: _CellLoop(nn.GRUCell(4, 6)), lambda: torch.randn(5, 3, 4), {}),
    "lstm": (lambda: _Recurrent(nn.LSTM(4, 6, bidirectional=True, batch_first=True)), lambda: torch.randn(5, 3, 4), {}),
    "gaussian-embedding": (_Tokens, lambda: torch.randint(20, (5, 7)), {"embeddings": True}),
    "bilinear": (_Pair, lambda: torch.randn(5, 4), {}),
    "transformer-encoder": (_Encoder, lambda: torch.randn(5, 7, 8), {}),
    "conv-transpose": (lambda: nn.Sequential(nn.ConvTranspose2d(3, 4, 3, stride=2), nn.Flatten(), nn.Linear(324, 3)),
                       lambda: torch.randn(5, 3, 4, 4), {}),  # fmt: skip
}


@pytest.mark.parametrize("name", list(FAMILIES))
@torch._dynamo.config.patch(allow_rnn=True)  # dynamo refuses every nn.LSTM / GRU / RNN (a converted one too) without it
def test_no_graph_breaks(name: str) -> None:
    make, inputs, options = FAMILIES[name]
    model = perturbed(make(), **options).train()  # noise on: Gaussian embeddings sample their table
    breaks, _ = compiled_breaks(model, inputs())
    assert breaks == {}, f"graph breaks: {breaks}"


@torch._dynamo.config.patch(allow_rnn=True)
def test_compiled_recurrent_scan_equals_eager_with_gradients() -> None:
    # aot_eager traces the scan's hand-written backward pass too
    torch.manual_seed(0)
    model = perturbed(_Recurrent(nn.LSTM(4, 12, batch_first=True)).double())
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    results = []
    torch._dynamo.reset()
    for run in (model, torch.compile(model, backend="aot_eager")):
        with bayesify.mode(model, route="tile", noise=False):
            out = run(x)
        grads = torch.autograd.grad(out.square().sum(), list(model.parameters()), allow_unused=True)
        results.append((out, grads))
    torch.testing.assert_close(results[1][0], results[0][0])
    for compiled, eager in zip(results[1][1], results[0][1]):
        if eager is not None:
            torch.testing.assert_close(compiled, eager)


def test_compiled_gaussian_embedding_samples_one_vector_per_token() -> None:
    # under torch.compile the whole table is sampled (torch.unique's size would break the graph)
    model = bayesify.convert(nn.Sequential(nn.Embedding(20, 6, padding_idx=0)), embeddings=True, task="members")
    with torch.no_grad():
        model[0].rank1_rho.fill_(0.0)  # std softplus(0) = 0.69: the noise is plain to see
    torch._dynamo.reset()
    vectors = torch.compile(model.train(), backend="eager")(torch.tensor([[0, 3, 3, 5]]))[0]
    weight = model[0].weight
    torch.testing.assert_close(vectors[0], weight[0])  # the padding row: its mean, no noise
    torch.testing.assert_close(vectors[1], vectors[2])  # one sample per token and pass
    assert (vectors[1] - weight[3]).abs().min() > 1e-4 and (vectors[3] - weight[5]).abs().min() > 1e-4
