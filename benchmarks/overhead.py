"""Cost of a rank-1 model vs its deterministic original, and vs a mean-field peer, side by side.

    make bench            # or: python benchmarks/overhead.py [--model resnet18] [--batch 32] [--size 32]

Measures, in one run on the same machine, for one SGD training step (forward + backward +
step) of a torchvision / timm model at CIFAR size:

* time (median of ``--repeats`` after warm-up), as a ratio to the deterministic model;
* parameters, as a ratio;
* activation memory saved for backward (bytes of the tensors autograd keeps, counted with
  ``torch.autograd.graph.saved_tensors_hooks``: device-independent), as a ratio.

Rows: deterministic; bayesify K=4 "sample" route (the training default, one component per
example); bayesify K=4 "tile" route (the paper's layout: every example through all K, so a
4x larger effective batch); BatchEnsemble (bayesify ``posterior="delta"``); and, when installed,
bayesian-torch's mean-field ``dnn_to_bnn`` (Reparameterization) as a peer.
"""

from __future__ import annotations

import argparse
import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import bayesify

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    from _timing import time_steps
else:
    from benchmarks._timing import time_steps


def saved_activation_bytes(step: Callable[[], None]) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return total


def make_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, route: str | None = None, kl: Callable | None = None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if route == "tile":
            with bayesify.mode(model, route="tile"):
                logits = model(x)
            loss = F.cross_entropy(logits, y.repeat(logits.shape[0] // y.shape[0]))
        else:
            loss = F.cross_entropy(model(x), y)
        if kl is not None:
            loss = loss + kl(model) / 50_000
        loss.backward()
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="timm or torchvision model name")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--components", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    import timm

    base = timm.create_model(args.model, num_classes=10)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(10, (args.batch,))
    k = args.components

    rows: list[tuple[str, nn.Module, Callable[[], None]]] = []
    rows.append(("deterministic", base, make_step(base, x, y)))
    sample = bayesify.convert(copy.deepcopy(base), components=k)
    rows.append((f"bayesify K={k} sample route", sample, make_step(sample, x, y, kl=bayesify.kl_divergence)))
    tile = bayesify.convert(copy.deepcopy(base), components=k)
    rows.append((f"bayesify K={k} tile route", tile, make_step(tile, x, y, route="tile", kl=bayesify.kl_divergence)))
    be = bayesify.convert(copy.deepcopy(base), components=k, posterior="delta")
    rows.append((f"BatchEnsemble K={k} (delta)", be, make_step(be, x, y)))
    try:
        from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn, get_kl_loss

        peer = copy.deepcopy(base)
        dnn_to_bnn(peer, {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0, "posterior_rho_init": -3.0,
                          "type": "Reparameterization", "moped_enable": False})  # fmt: skip
        rows.append(("bayesian-torch mean-field", peer, make_step(peer, x, y, kl=get_kl_loss)))
    except ImportError:
        print("(bayesian-torch not installed: peer row skipped; pip install bayesian-torch)")

    params0 = sum(p.numel() for p in base.parameters())
    results = []
    seconds_all = time_steps([step for _, _, step in rows], args.repeats)
    for (name, model, step), seconds in zip(rows, seconds_all):
        memory = saved_activation_bytes(step)
        params = sum(p.numel() for p in model.parameters())
        results.append((name, seconds, params, memory))
    t0, m0 = results[0][1], results[0][3]
    print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, CPU threads {args.threads}, one SGD step")
    print(f"{'':34}{'step s':>9}{'time x':>8}{'params':>13}{'params x':>10}{'act MB':>9}{'mem x':>7}")
    for name, seconds, params, memory in results:
        print(f"{name:34}{seconds:9.3f}{seconds / t0:8.2f}{params:13,}{params / params0:10.3f}{memory / 2**20:9.1f}{memory / m0:7.2f}")


if __name__ == "__main__":
    main()
