"""Rank-1 LSTM / GRU / RNN and their cells against torch's own modules, per member.

The reference's test idea: the converted layer on a tiled batch equals, for every member k, a
plain torch module whose kernels are ``W o (r_k s_k^T)`` (and biases ``b + delta_k``).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import bayesify
from bayesify.layers._scan import RecurrentScan, reference_scan

K = 3
B, T, F_IN, H = 3, 4, 3, 4
LENGTHS = torch.tensor([2, 4, 3])  # unsorted on purpose: sorted_indices is not the identity
DT = torch.float64

MODULES = [
    pytest.param(nn.LSTM, {}, id="lstm"),
    pytest.param(nn.LSTM, {"proj_size": 2}, id="lstm-proj"),
    pytest.param(nn.GRU, {}, id="gru"),
    pytest.param(nn.RNN, {}, id="rnn-tanh"),
    pytest.param(nn.RNN, {"nonlinearity": "relu"}, id="rnn-relu"),
]
STACKS = [pytest.param(1, False, id="1layer"), pytest.param(2, True, id="2layers-bidir")]


# ---- helpers --------------------------------------------------------------------------------


def _make(cls: type, kwargs: dict, layers: int, bidir: bool, batch_first: bool, bias: bool) -> nn.Module:
    return cls(F_IN, H, num_layers=layers, bidirectional=bidir, batch_first=batch_first, bias=bias, **kwargs).to(DT)


def _input(kind: str, batch_first: bool) -> Tensor | PackedSequence:
    x = torch.randn(B, T, F_IN, dtype=DT) if batch_first else torch.randn(T, B, F_IN, dtype=DT)
    if kind == "unbatched":
        return x[0] if batch_first else x[:, 0]
    if kind == "packed":
        return pack_padded_sequence(x, LENGTHS, batch_first=batch_first, enforce_sorted=False)
    return x


def _state(module: nn.Module, kind: str) -> Any:
    count = module.num_layers * (2 if module.bidirectional else 1)
    width = module.proj_size if getattr(module, "proj_size", 0) else module.hidden_size
    shape = (count, width) if kind == "unbatched" else (count, B, width)
    h = torch.randn(*shape, dtype=DT)
    if isinstance(module, nn.LSTM):
        return h, torch.randn(*shape[:-1], module.hidden_size, dtype=DT)
    return h


def _randomise(model: nn.Module) -> None:
    """Factor locations and bias offsets away from the identity, so the K members differ."""
    with torch.no_grad():
        for _, layer in bayesify.rank1_layers(model):
            for name, p in layer.named_parameters(recurse=False):
                if name.startswith("rank1_bias"):
                    p.normal_(0.0, 0.3)
            for _, factor in layer.rank1_factors():
                factor.loc.normal_(1.0, 0.3)


def _member_module(layer: nn.Module, k: int) -> nn.Module:
    """A plain torch module equal to member k of a converted recurrent module or cell."""
    base = type(layer).__rank1_base__
    plain = copy.deepcopy(layer)
    bayesify.revert(plain)
    assert type(plain) is base
    gru = isinstance(layer, (nn.GRU, nn.GRUCell))
    with torch.no_grad():
        for name, param in plain.named_parameters():
            kind, rest = name.split("_", 1)  # weight / bias, "ih_l0_reverse"
            kernel, tag = rest[:2], rest[2:]
            if kind == "weight":
                r = getattr(layer, f"rank1_r_{kernel}{tag}").loc[k]
                s = getattr(layer, f"rank1_s_{kernel}{tag}").loc[k]
                param.mul_(r[:, None] * s[None, :])
            elif kernel == "ih":
                param.add_(getattr(layer, f"rank1_bias_ih{tag}")[k])
            elif gru:
                param.add_(getattr(layer, f"rank1_bias_hh{tag}")[k])
    return plain


def _member_axis(module: nn.Module, kind: str) -> tuple[int, int]:
    """(axis of the members in the output, in the states) of a root recurrent module in route='tile'."""
    if kind == "packed":
        return -1, 1
    if kind == "unbatched":
        return (0 if module.batch_first else 1), 1
    return (0 if module.batch_first else 1), 1


def _split(t: Tensor, axis: int, k: int, per: int, squeeze: bool = False) -> Tensor:
    part = t.narrow(axis, k * per, per)
    return part.squeeze(axis) if squeeze else part


def _outputs(result: Any) -> tuple[Tensor, list[Tensor]]:
    out, hidden = result
    if isinstance(out, PackedSequence):
        out = pad_packed_sequence(out, batch_first=False)[0]  # [T, batch, ...] in the original order
    states = list(hidden) if isinstance(hidden, tuple) else [hidden]
    return out, states


# ---- recurrent modules ----------------------------------------------------------------------


@pytest.mark.parametrize("cls,kwargs", MODULES)
@pytest.mark.parametrize("layers,bidir", STACKS)
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
@pytest.mark.parametrize("kind", ["batched", "unbatched", "packed"])
@pytest.mark.parametrize("with_state", [False, True], ids=["no-hx", "hx"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_module_members_match_torch(
    cls: type, kwargs: dict, layers: int, bidir: bool, batch_first: bool, kind: str, with_state: bool, bias: bool
) -> None:
    reference = _make(cls, kwargs, layers, bidir, batch_first, bias)
    layer = bayesify.convert(copy.deepcopy(reference), components=K, posterior="delta")
    x = _input(kind, batch_first)
    hx = _state(reference, kind) if with_state else None
    expected = reference(x, hx)
    per = 1 if kind == "unbatched" else B
    out_axis, state_axis = _member_axis(reference, kind)
    if kind == "packed":
        out_axis = 1  # padded back to [T, K*B, ...]

    # shapes are torch's in training (sampled components) and evaluation (the mixture)
    for train in (True, False):
        layer.train(train)
        got = layer(x, hx)
        assert _shapes(got) == _shapes(expected)
    layer.eval()

    # identity at init: every member reproduces the original module, output and states
    with bayesify.mode(layer, route="tile", noise=False):
        tiled = layer(x, hx)
    out, states = _outputs(tiled)
    ref_out, ref_states = _outputs(expected)
    for k in range(K):
        torch.testing.assert_close(_split(out, out_axis, k, per, kind == "unbatched"), ref_out, atol=1e-10, rtol=0)
        for s, r in zip(states, ref_states):
            torch.testing.assert_close(_split(s, state_axis, k, per, kind == "unbatched"), r, atol=1e-10, rtol=0)

    # randomised factors: member k equals torch's module with kernels W o (r_k s_k^T)
    _randomise(layer)
    with bayesify.mode(layer, route="tile", noise=False):
        out, states = _outputs(layer(x, hx))
    for k in range(K):
        member_out, member_states = _outputs(_member_module(layer, k)(x, hx))
        torch.testing.assert_close(_split(out, out_axis, k, per, kind == "unbatched"), member_out, atol=1e-10, rtol=0)
        for s, r in zip(states, member_states):
            torch.testing.assert_close(_split(s, state_axis, k, per, kind == "unbatched"), r, atol=1e-10, rtol=0)


def _shapes(result: Any) -> list:
    out, hidden = result
    states = list(hidden) if isinstance(hidden, tuple) else [hidden]
    first = (tuple(out.data.shape), out.batch_sizes.tolist()) if isinstance(out, PackedSequence) else tuple(out.shape)
    return [first] + [tuple(s.shape) for s in states]


@pytest.mark.parametrize("cls,kwargs", MODULES)
@pytest.mark.parametrize("kind", ["batched", "packed"])
def test_module_gradients(cls: type, kwargs: dict, kind: str) -> None:
    """Gradients reach every new parameter; at init they are K x torch's for the shared weights."""
    reference = _make(cls, kwargs, 2, True, True, True)
    layer = bayesify.convert(copy.deepcopy(reference), components=K)
    x = _input(kind, True)
    hx = _state(reference, kind)
    hx_ref = tuple(h.clone().requires_grad_() for h in hx) if isinstance(hx, tuple) else hx.clone().requires_grad_()
    hx_new = tuple(h.clone().requires_grad_() for h in hx) if isinstance(hx, tuple) else hx.clone().requires_grad_()

    def loss(result: Any) -> Tensor:
        out, states = _outputs(result)
        total = (out * torch.linspace(-1, 1, out.shape[-1], dtype=DT)).sum()
        return total + sum((s * 0.5).sum() for s in states)

    loss(reference(x, hx_ref)).backward()
    with bayesify.mode(layer, route="tile", noise=False):
        loss(layer(x, hx_new)).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(dict(layer.named_parameters())[name].grad, K * p.grad, atol=1e-9, rtol=1e-9)
    for a, b in zip(hx_ref if isinstance(hx_ref, tuple) else [hx_ref], hx_new if isinstance(hx_new, tuple) else [hx_new]):
        torch.testing.assert_close(b.grad, K * a.grad, atol=1e-9, rtol=1e-9)

    layer.zero_grad()
    layer.train()
    with bayesify.mode(layer, route="tile"):  # noise on: the scales get gradients too
        loss(layer(x, hx)).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"No gradient for {name}"
        if name.startswith("rank1_"):
            assert p.grad.abs().sum() > 0, f"Zero gradient for {name}"


@pytest.mark.parametrize("mode,proj", [("LSTM", False), ("LSTM", True), ("GRU", False), ("RNN_TANH", False), ("RNN_RELU", False)])
@pytest.mark.parametrize("packed,reverse", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("additive", [False, True])
def test_scan_gradcheck(mode: str, proj: bool, packed: bool, reverse: bool, additive: bool) -> None:
    """The hand-written backward pass of the time loop against finite differences."""
    gates = {"LSTM": 4, "GRU": 3}.get(mode, 1) * 2
    hidden, width, batch = 2, (1 if proj else 2), 2
    sizes = [2, 2, 1] if packed else [2, 2, 2]
    rand = lambda *s: torch.randn(*s, dtype=DT, requires_grad=True)  # noqa: E731
    xi = rand(sum(sizes), gates) if mode != "RNN_RELU" else (torch.rand(sum(sizes), gates, dtype=DT) + 0.5).requires_grad_()
    h0, s_h = rand(batch, width), rand(batch, width)
    w_hh = rand(gates, width) if mode != "RNN_RELU" else (0.1 * torch.randn(gates, width, dtype=DT)).requires_grad_()
    c0 = rand(batch, hidden) if mode == "LSTM" else None
    r_h = None if additive else rand(batch, gates)
    b_h = rand(batch, gates) if mode == "GRU" else None
    w_hr, s_hr, r_hr = (rand(width, hidden), rand(batch, hidden), rand(batch, width)) if proj else (None, None, None)

    def run(*tensors: Tensor) -> tuple[Tensor, ...]:
        it = iter(tensors)
        args = [None if a is None else next(it) for a in (xi, h0, c0, w_hh, s_h, r_h, b_h, w_hr, s_hr, r_hr)]
        return RecurrentScan.apply(*args, mode, sizes, reverse, additive)

    inputs = [a for a in (xi, h0, c0, w_hh, s_h, r_h, b_h, w_hr, s_hr, r_hr) if a is not None]
    assert torch.autograd.gradcheck(run, inputs, atol=1e-6)
    # the same recurrence in autograd's ops (what torch.func runs): the same outputs and gradients
    args = (xi, h0, c0, w_hh, s_h, r_h, b_h, w_hr, s_hr, r_hr, mode, sizes, reverse, additive)
    fast, reference = RecurrentScan.apply(*args), reference_scan(*args)
    for a, b in zip(fast, reference):
        torch.testing.assert_close(a, b)
    weights = [torch.randn_like(t) for t in fast]
    grads = [torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, out)), inputs) for out in (fast, reference)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cls,kwargs", MODULES)
def test_torch_func_and_second_derivatives(cls: type, kwargs: dict) -> None:
    """torch.func's transforms run the recurrence in autograd's ops (the hand-written Function has no functorch
    rules: they failed); a second derivative through the Function is refused in one line (its gradients that pass
    the layer came back None, silently)."""
    torch.manual_seed(0)
    layer = bayesify.convert(_make(cls, kwargs, 2, True, True, True), components=K, task="regression")
    _randomise(layer)
    x = torch.randn(B, T, F_IN, dtype=DT, requires_grad=True)
    with bayesify.mode(layer, component=1, noise=False):
        expected = torch.autograd.grad(layer(x)[0].pow(2).sum(), x)[0]
        torch.testing.assert_close(torch.func.grad(lambda v: layer(v)[0].pow(2).sum())(x.detach()), expected)
        hessian = torch.func.hessian(lambda v: layer(v)[0].pow(2).sum())(x.detach()[:1, :2])  # grad of grad
        assert hessian.shape == (1, 2, F_IN, 1, 2, F_IN) and torch.isfinite(hessian).all()
        with pytest.raises(RuntimeError, match="cannot be differentiated again .*torch.func"):
            torch.autograd.grad(layer(x)[0].pow(2).sum(), x, create_graph=True)


def test_dropout_between_layers_only_in_training() -> None:
    reference = nn.LSTM(F_IN, H, num_layers=3, dropout=0.5, batch_first=True).to(DT)
    layer = bayesify.convert(copy.deepcopy(reference), components=K)
    x = torch.randn(B, T, F_IN, dtype=DT)
    with bayesify.mode(layer, route="component", component=0, noise=False):
        layer.train()
        a, b = layer(x)[0], layer(x)[0]
        layer.eval()
        c = layer(x)[0]
    assert not torch.allclose(a, b)  # a fresh dropout mask each call
    torch.testing.assert_close(c, reference.eval()(x)[0])


def test_samples_held_across_calls_within_one_forward() -> None:
    """One sample per example per forward pass: calling the layer twice gives the same weights."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(F_IN, H, batch_first=True)
            self.cell = nn.LSTMCell(F_IN, H)

        def forward(self, x: Tensor) -> Tensor:
            first, second = self.gru(x)[0], self.gru(x)[0]
            h1, _ = self.cell(x[:, 0])
            h2, _ = self.cell(x[:, 0])
            return torch.stack([first - second, (h1 - h2).unsqueeze(1).expand_as(first)])

    model = bayesify.convert(Twice().to(DT), components=K, init_std=0.3)
    model.train()
    x = torch.randn(B, T, F_IN, dtype=DT)
    assert model(x).abs().max() == 0
    # while separate forward passes draw afresh
    assert not torch.allclose(model.gru(x)[0], model.gru(x)[0])


def test_packed_samples_follow_sorted_indices() -> None:
    """Route 'sample': example e runs through the member of its own component, whatever the sort order."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(F_IN, H, batch_first=True, bidirectional=True)

        def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            out, _ = self.lstm(packed)
            return pad_packed_sequence(out, batch_first=True)[0]

    model = bayesify.convert(Model().to(DT), components=K, posterior="delta")
    _randomise(model)
    seen: dict[str, Tensor] = {}
    hook = model.lstm.register_forward_pre_hook(lambda m, a: seen.update(rows=m.rank1_state.model.router.rows.clone()))
    x = torch.randn(6, T, F_IN, dtype=DT)
    lengths = torch.tensor([2, 4, 1, 3, 4, 2])
    model.train()
    out = model(x, lengths)
    hook.remove()
    for e in range(6):
        member = _member_module(model.lstm, int(seen["rows"][e]))
        expected, _ = member(x[e : e + 1, : lengths[e]])
        torch.testing.assert_close(out[e, : lengths[e]], expected[0])


def test_mixture_of_packed_output_is_per_sequence() -> None:
    reference = nn.GRU(F_IN, H).to(DT)
    layer = bayesify.convert(copy.deepcopy(reference), components=K, posterior="delta")
    _randomise(layer)
    x = _input("packed", False)
    with bayesify.mode(layer, route="mixture", task="regression", noise=False):
        out, h = layer(x)
    expected = torch.stack([_member_module(layer, k)(x)[0].data for k in range(K)]).mean(0)
    torch.testing.assert_close(out.data, expected)
    assert out.sorted_indices.tolist() == x.sorted_indices.tolist()
    assert h.shape == (1, B, H)


@pytest.mark.parametrize("perturbation", ["additive"])
@pytest.mark.parametrize("cls,kwargs", MODULES)
def test_additive_matches_reference_formula(cls: type, kwargs: dict, perturbation: str) -> None:
    """Additive factors: (x + s) W^T + r, the same as the plain module with shifted biases / a manual loop."""
    reference = _make(cls, kwargs, 1, False, False, True)
    layer = bayesify.convert(copy.deepcopy(reference), components=K, posterior="delta", perturbation=perturbation)
    with torch.no_grad():
        for _, factor in layer.rank1_factors():
            factor.loc.normal_(0.0, 0.3)
    x = _input("batched", False)
    with bayesify.mode(layer, route="tile", noise=False):
        out = layer(x)[0]
    p = {n: v.detach() for n, v in layer.named_parameters()}
    lstm, gru = isinstance(reference, nn.LSTM), isinstance(reference, nn.GRU)
    for k in range(K):
        get = lambda n: getattr(layer, f"rank1_{n}_l0").loc[k]  # noqa: E731
        w_ih, w_hh = p["weight_ih_l0"], p["weight_hh_l0"]
        h = torch.zeros(B, w_hh.shape[1], dtype=DT)
        c = torch.zeros(B, H, dtype=DT)
        outs = []
        for t in range(T):
            gi = (x[t] + get("s_ih")) @ w_ih.t() + get("r_ih") + p["bias_ih_l0"] + layer.rank1_bias_ih_l0[k]
            gh = (h + get("s_hh")) @ w_hh.t() + get("r_hh") + p["bias_hh_l0"]
            if gru:
                gh = gh + layer.rank1_bias_hh_l0[k]
                r, z = torch.sigmoid(gi[:, :H] + gh[:, :H]), torch.sigmoid(gi[:, H : 2 * H] + gh[:, H : 2 * H])
                n = torch.tanh(gi[:, 2 * H :] + r * gh[:, 2 * H :])
                h = (1 - z) * n + z * h
            elif lstm:
                i, f, g, o = (gi + gh).chunk(4, 1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                if "weight_hr_l0" in p:
                    h = (h + get("s_hr")) @ p["weight_hr_l0"].t() + get("r_hr")
            else:
                h = torch.tanh(gi + gh) if reference.nonlinearity == "tanh" else torch.relu(gi + gh)
            outs.append(h)
        torch.testing.assert_close(out[:, k * B : (k + 1) * B], torch.stack(outs))


def test_wrong_inputs_raise_torchs_errors() -> None:
    layer = bayesify.convert(nn.LSTM(F_IN, H), components=K)
    with pytest.raises(ValueError, match="Expected input to be 2D or 3D"):
        layer(torch.randn(2, 3, 4, F_IN))
    with pytest.raises(RuntimeError, match="input_size"):
        layer(torch.randn(T, B, F_IN + 1))
    with pytest.raises(RuntimeError, match="Expected hidden"):
        layer(torch.randn(T, B, F_IN), (torch.zeros(2, B, H), torch.zeros(2, B, H)))


# ---- cells ----------------------------------------------------------------------------------

CELLS = [
    pytest.param(nn.LSTMCell, {}, id="lstm-cell"),
    pytest.param(nn.GRUCell, {}, id="gru-cell"),
    pytest.param(nn.RNNCell, {}, id="rnn-cell"),
    pytest.param(nn.RNNCell, {"nonlinearity": "relu"}, id="rnn-relu-cell"),
]


@pytest.mark.parametrize("cls,kwargs", CELLS)
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("with_state", [False, True], ids=["no-hx", "hx"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_cell_members_match_torch(cls: type, kwargs: dict, batched: bool, with_state: bool, bias: bool) -> None:
    reference = cls(F_IN, H, bias=bias, **kwargs).to(DT)
    cell = bayesify.convert(copy.deepcopy(reference), components=K, posterior="delta")
    x = torch.randn(B, F_IN, dtype=DT) if batched else torch.randn(F_IN, dtype=DT)
    shape = (B, H) if batched else (H,)
    hx = None
    if with_state:
        hx = (torch.randn(shape, dtype=DT), torch.randn(shape, dtype=DT)) if cls is nn.LSTMCell else torch.randn(shape, dtype=DT)
    expected = reference(x, hx)
    as_list = lambda r: list(r) if isinstance(r, tuple) else [r]  # noqa: E731
    per = B if batched else 1
    for train in (True, False):
        cell.train(train)
        assert [t.shape for t in as_list(cell(x, hx))] == [t.shape for t in as_list(expected)]

    with bayesify.mode(cell, route="tile", noise=False):
        got = as_list(cell(x, hx))
    for k in range(K):
        for g, e in zip(got, as_list(expected)):
            torch.testing.assert_close(g.narrow(0, k * per, per).reshape(e.shape), e, atol=1e-10, rtol=0)

    _randomise(cell)
    with bayesify.mode(cell, route="tile", noise=False):
        got = as_list(cell(x, hx))
    for k in range(K):
        member = as_list(_member_module(cell, k)(x, hx))
        for g, e in zip(got, member):
            torch.testing.assert_close(g.narrow(0, k * per, per).reshape(e.shape), e, atol=1e-10, rtol=0)

    cell.train()
    with bayesify.mode(cell, route="tile"):
        sum(t.sum() for t in as_list(cell(x, hx))).backward()
    for name, p in cell.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"No gradient for {name}"


def test_cell_loop_in_a_model_matches_the_module() -> None:
    """A model stepping a converted LSTMCell over time equals the converted nn.LSTM with the same factors."""

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.LSTMCell(F_IN, H)

        def forward(self, x: Tensor) -> Tensor:
            h = c = torch.zeros(x.shape[0], H, dtype=x.dtype)
            outs = []
            for t in range(x.shape[1]):
                h, c = self.cell(x[:, t], (h, c))
                outs.append(h)
            return torch.stack(outs, 1)

    loop = bayesify.convert(Loop().to(DT), components=K, posterior="delta")
    _randomise(loop)
    lstm = nn.LSTM(F_IN, H, batch_first=True).to(DT)
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(lstm, f"{name}_l0").copy_(getattr(loop.cell, name))
    bayesify.convert(lstm, components=K, posterior="delta")
    with torch.no_grad():
        for n in ("s_ih", "r_ih", "s_hh", "r_hh"):
            getattr(lstm, f"rank1_{n}_l0").loc.copy_(getattr(loop.cell, f"rank1_{n}").loc)
        lstm.rank1_bias_ih_l0.copy_(loop.cell.rank1_bias_ih)
    x = torch.randn(B, T, F_IN, dtype=DT)
    with bayesify.mode(loop, route="tile", noise=False), bayesify.mode(lstm, route="tile", noise=False):
        torch.testing.assert_close(loop(x), lstm(x)[0])


def test_summary_names_recurrent_layers() -> None:
    model = nn.Sequential(nn.GRU(F_IN, H, batch_first=True))
    bayesify.convert(model, components=K)
    text = str(bayesify.summary(model, torch.randn(B, T, F_IN)))
    assert "GRU" in text and "every converted layer ran" in text


def test_parameter_names_and_revert() -> None:
    layer = nn.LSTM(F_IN, H, num_layers=2, bidirectional=True, proj_size=2)
    before = set(layer.state_dict())
    bayesify.convert(layer, components=K)
    names = set(layer.state_dict())
    assert before < names
    assert {"rank1_s_ih_l1_reverse.loc", "rank1_s_ih_l1_reverse.rho", "rank1_bias_ih_l0_reverse"} <= names  # its own
    assert {"rank1_s_ih_l1_reverse", "rank1_r_hr_l0"} <= {n for n, _ in layer.rank1_factors()}
    assert "rank1_bias_ih_l0_reverse" in layer.rank1_state.packed
    bayesify.revert(layer)
    assert set(layer.state_dict()) == before and type(layer) is nn.LSTM


@pytest.mark.parametrize("layers,bidir", list(itertools.product([1, 2], [False, True])))
def test_copy_and_pickle(layers: int, bidir: bool) -> None:
    layer = bayesify.convert(nn.GRU(F_IN, H, num_layers=layers, bidirectional=bidir), components=K)
    layer.train()
    x = torch.randn(T, B, F_IN)
    layer(x)  # leaves draws of the last forward pass behind: they must not be copied
    clone = copy.deepcopy(layer)
    with bayesify.mode(layer, route="tile", noise=False), bayesify.mode(clone, route="tile", noise=False):
        torch.testing.assert_close(layer(x)[0], clone(x)[0])


def test_recurrent_samples_are_not_clipped() -> None:
    """As the reference LSTMCellRank1 (its dense / conv layers clip to [-10, 10], its LSTM does not)."""
    model = bayesify.convert(nn.Sequential(nn.LSTM(F_IN, H), nn.Linear(H, 2)), components=K, clip=10.0)
    assert all(f.options.clip is None for _, f in model[0].rank1_factors())
    assert model[1].rank1_s.options.clip == 10.0


class _TimeMajorTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.fc = nn.LSTM(F_IN, H), nn.Linear(H, 5)

    def forward(self, x: Tensor) -> Tensor:  # [T, B, F] -> [T, B, 5]
        return self.fc(self.rnn(x)[0])


def test_a_time_major_model_left_at_batch_dim_0_is_refused_at_its_recurrent_layer() -> None:
    # the pass took the time steps as the batch: evaluation ran one sequence K x T long (each member from the last
    # one's state) and reduced it as members, training mixed the members; both silently
    model = bayesify.convert(_TimeMajorTagger().to(DT), components=K, task="classification", class_axis=-1)
    x = torch.randn(6, B, F_IN, dtype=DT)
    for training in (True, False):
        model.train(training)
        with pytest.raises(ValueError, match=r"^Rank1LSTM 'rnn' \(batch_first=False\) got an input of shape \(\d+, 3, 3\) "
                           r"whose \d+ time steps are the pass's rows .*batch_dim=1"):
            model(x)
    said = bayesify.convert(_TimeMajorTagger().to(DT), components=K, task="classification", class_axis=-1, batch_dim=1)
    assert said.eval()(x).shape == (6, B, 5)

    # m x B rows whose length is the pass's rows by chance route as documented (a word RNN over each sentence)
    class Hierarchical(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word, self.sent = nn.GRU(F_IN, H, batch_first=True), nn.GRU(H, H, batch_first=True)
            self.fc = nn.Linear(H, 3)

        def forward(self, x: Tensor) -> Tensor:  # [B, S, W, F]
            b, s, w, f = x.shape
            words = self.word(x.reshape(b * s, w, f))[1][-1].reshape(b, s, -1)
            return self.fc(self.sent(words)[1][-1])

    han = bayesify.convert(Hierarchical().to(DT), components=K, task="classification")
    han.train()(torch.randn(8, 4, 8, F_IN, dtype=DT))  # W == B
    assert han.eval()(torch.randn(2, 4, 8, F_IN, dtype=DT)).shape == (2, 3)  # W == K x B


def test_an_initial_state_given_with_as_many_layers_as_examples_is_each_examples() -> None:
    # h0 [layers, B, H] of a batch-first model: where the layers number the batch, evaluation tiled h0 at its layers
    # (torch: "Expected hidden size (2, 8, 4), got [8, 2, 4]"); it is tiled at its batch, as an LSTM used as the model's
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.fc = nn.GRU(F_IN, H, num_layers=2, batch_first=True), nn.Linear(H, 3)

        def forward(self, x: Tensor, h0: Tensor) -> Tensor:
            return self.fc(self.rnn(x, h0)[0][:, -1])

    torch.manual_seed(0)
    model = bayesify.convert(Encoder().to(DT), components=K, task="classification", init="normal", init_mean_std=0.5)
    x, h0 = torch.randn(2, T, F_IN, dtype=DT), torch.randn(2, 2, H, dtype=DT)
    model.eval()
    with torch.no_grad():
        members = []
        for k in range(K):
            with bayesify.mode(model, component=k, noise=False):
                members.append(model(x, h0).softmax(-1))
        torch.testing.assert_close(model(x, h0), torch.stack(members).mean(0).log())


def test_a_state_carried_from_a_tiled_pass_goes_on_per_member_where_the_layers_number_the_batch() -> None:
    # the README's recipe for a carried state (mode(route="tile")): h [L, K x B, H] fed back was tiled again at its
    # layers where L == B (torch: "Expected hidden size (1, 3, 4), got [3, 3, 4]")
    class Stream(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.fc = nn.GRU(F_IN, H, batch_first=True), nn.Linear(H, 5)

        def forward(self, x: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
            out, state = self.rnn(x, state)
            return self.fc(out), state

    torch.manual_seed(0)
    model = bayesify.convert(Stream().to(DT), components=K, task={0: "classification", 1: "members"}, class_axis=-1,
                             init="normal", init_mean_std=0.3).eval()  # fmt: skip
    first, second = torch.randn(1, 5, F_IN, dtype=DT), torch.randn(1, 6, F_IN, dtype=DT)  # one stream: L == B == 1
    with torch.no_grad():
        with bayesify.mode(model, route="tile", noise=False):
            _, state = model(first)
            out, _ = model(second, state)
        for k in range(K):
            with bayesify.mode(model, component=k, noise=False):
                _, own = model(first)
                torch.testing.assert_close(out[k : k + 1], model(second, own)[0])
