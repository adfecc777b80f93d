"""Speed of bayesify's rank-1 LSTM / GRU against torch's nn.LSTM / nn.GRU on the CPU, side by side.

    python benchmarks/recurrent.py                      # seq 100, batch 32, hidden 256, 1 thread
    python benchmarks/recurrent.py --threads 2 --repeats 9 --compile

One training step = forward + backward of ``out.square().mean()`` through one layer
(``batch_first=True``, input size = hidden size). Every variant of a layer is timed round-robin
in the same run (median of ``--repeats`` after a warm-up), so load on the machine hits all alike;
ratios are to torch's own module.

Rows per layer:

* ``torch``: ``nn.LSTM`` / ``nn.GRU`` (ATen's fused CPU kernel);
* ``rank-1, sample``: the converted layer in training mode (the default route: one component
  per example, cost ~1x);
* ``torch, batch x4``: torch's module on 4 copies of the batch, the yardstick for the next row;
* ``rank-1, tile K=4``: every example through all 4 members (``mode(route="tile")``), i.e. a
  4x larger batch: the cost of the paper's training layout and of evaluation;
* ``autograd loop``: the same rank-1 maths written the obvious way, autograd through a Python
  loop over time steps (what the hand-written scan backward replaces);
* ``autograd loop, compiled`` (``--compile``): the same step function under ``torch.compile``.

Inference rows: forward only under ``torch.no_grad()`` in eval mode, torch vs the rank-1 layer
routed through one component (``mode(component=0)``) and through the K=4 mixture (the
evaluation default).
"""

from __future__ import annotations

import argparse
import copy
from typing import Callable

import torch
from torch import Tensor, nn

import bayesify

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    from _timing import time_steps
else:
    from benchmarks._timing import time_steps


def train_step(module: nn.Module, x: Tensor, context: Callable | None = None) -> Callable[[], None]:
    def step() -> None:
        module.zero_grad(set_to_none=True)
        if context is None:
            out = module(x)[0]
        else:
            with context():
                out = module(x)[0]
        out.square().mean().backward()

    return step


def _lstm_cell(xi: Tensor, h: Tensor, c: Tensor, w_hh: Tensor, s: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    i, f, g, o = torch.addcmul(xi, (h * s) @ w_hh.t(), r).chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _gru_cell(xi: Tensor, h: Tensor, b_hh: Tensor, w_hh: Tensor, s: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    gh = torch.addcmul(b_hh, (h * s) @ w_hh.t(), r)
    hidden = h.shape[1]
    rz = torch.sigmoid(xi[:, : 2 * hidden] + gh[:, : 2 * hidden])
    n = torch.tanh(xi[:, 2 * hidden :] + rz[:, :hidden] * gh[:, 2 * hidden :])
    return n + rz[:, hidden:] * (h - n), b_hh


def autograd_loop(layer: nn.Module, compiled: bool = False) -> Callable[[Tensor], tuple[Tensor, None]]:
    """The rank-1 layer's maths with autograd through a Python loop over time (one layer, batch first)."""
    lstm = isinstance(layer, nn.LSTM)
    cell = _lstm_cell if lstm else _gru_cell
    if compiled:
        cell = torch.compile(cell, dynamic=False, fullgraph=True)

    def run(x: Tensor) -> tuple[Tensor, None]:
        batch, steps = x.shape[:2]
        draws = layer._rank1_draws(batch, x.device)
        s, r = draws["rank1_s_ih_l0"], draws["rank1_r_ih_l0"]
        bias = layer.bias_ih_l0 + (layer.bias_hh_l0 if lstm else 0) + draws["rank1_bias_ih_l0"]
        xi = torch.addcmul(bias.unsqueeze(1), (x * s.unsqueeze(1)) @ layer.weight_ih_l0.t(), r.unsqueeze(1))
        h = x.new_zeros(batch, layer.hidden_size)
        c = x.new_zeros(batch, layer.hidden_size) if lstm else layer.bias_hh_l0 + draws["rank1_bias_hh_l0"]
        s_h, r_h = draws["rank1_s_hh_l0"], draws["rank1_r_hh_l0"]
        outs = []
        for t in range(steps):
            h, c = cell(xi[:, t], h, c, layer.weight_hh_l0, s_h, r_h)
            outs.append(h)
        return torch.stack(outs, 1), None

    return run


class _Call(nn.Module):
    def __init__(self, layer: nn.Module, fn: Callable) -> None:
        super().__init__()
        self.layer, self.fn = layer, fn

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        return self.fn(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="also time the autograd loop under torch.compile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.hidden)

    print(
        f"seq {args.seq}, batch {args.batch}, input = hidden = {args.hidden}, float32, CPU, {args.threads} thread(s), "
        f"median of {args.repeats}, torch {torch.__version__}"
    )
    print(f"{'layer':<6}{'variant':<32}{'ms/step':>10}{'x torch':>10}")
    for cls in (nn.LSTM, nn.GRU):
        torch_layer = cls(args.hidden, args.hidden, batch_first=True)
        rank1 = bayesify.convert(copy.deepcopy(torch_layer), components=4)
        torch_layer.train(), rank1.train()
        x_tiled = torch.cat([x] * 4)
        variants: list[tuple[str, Callable[[], object]]] = [
            ("torch (train step)", train_step(torch_layer, x)),
            ("torch, batch x4 (train step)", train_step(torch_layer, x_tiled)),
            ("rank-1, sample (train step)", train_step(rank1, x)),
            ("rank-1, tile K=4 (train step)", train_step(rank1, x, lambda: bayesify.mode(rank1, route="tile"))),
            ("autograd loop (train step)", train_step(_Call(rank1, autograd_loop(rank1)), x)),
        ]
        if args.compile:
            variants.append(
                ("autograd loop, compiled", train_step(_Call(rank1, autograd_loop(rank1, compiled=True)), x))
            )
        times = time_steps([step for _, step in variants], args.repeats)
        for (name, _), seconds in zip(variants, times):
            print(f"{cls.__name__:<6}{name:<32}{seconds * 1e3:>10.1f}{seconds / times[0]:>10.2f}")

        torch_layer.eval(), rank1.eval()

        def infer(module: nn.Module, context: Callable | None = None) -> Callable[[], object]:
            def run() -> object:
                with torch.no_grad():
                    if context is None:
                        return module(x)
                    with context():
                        return module(x)

            return run

        inference = [
            ("torch (inference)", infer(torch_layer)),
            ("rank-1, 1 component (inference)", infer(rank1, lambda: bayesify.mode(rank1, component=0))),
            ("rank-1, K=4 mixture (inference)", infer(rank1)),
        ]
        times = time_steps([step for _, step in inference], args.repeats)
        for (name, _), seconds in zip(inference, times):
            print(f"{cls.__name__:<6}{name:<32}{seconds * 1e3:>10.1f}{seconds / times[0]:>10.2f}")


if __name__ == "__main__":
    main()
