"""Cost of a rank-1 model vs its deterministic original, and vs a mean-field peer, side by side.

    make bench            # or: python benchmarks/overhead.py [--model resnet18] [--batch 32] [--size 32]
    python benchmarks/overhead.py --device cuda --model resnet50 --batch 128 --size 224 [--amp bf16] [--compile]
    python benchmarks/overhead.py --rows sample,delta      # only these rows besides the deterministic one

Measures, in one run on the same machine, for one SGD training step (forward + backward +
step) of a torchvision / timm model (CIFAR size by default):

* time (median of ``--repeats`` after warm-up), as a ratio to the deterministic model;
* parameters, as a ratio;
* activation memory saved for backward (bytes of the tensors autograd keeps, counted with
  ``torch.autograd.graph.saved_tensors_hooks``: device-independent), as a ratio; on CUDA also
  the step's peak allocated memory above what the model and optimizer hold before it.

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


def peak_step_bytes(step: Callable[[], None], device: torch.device) -> int | None:
    """CUDA only: peak memory allocated during ``step`` above what was allocated before it."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def make_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    route: str | None = None,
    kl: Callable | None = None,
    amp: torch.dtype | None = None,
    compile: bool = False,
):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    forward = torch.compile(model) if compile else model

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            if route == "tile":
                with bayesify.mode(model, route="tile"):
                    logits = forward(x)
                loss = F.cross_entropy(logits.float(), y.repeat(logits.shape[0] // y.shape[0]))
            else:
                loss = F.cross_entropy(forward(x).float(), y)
            if kl is not None:
                loss = loss + kl(model) / 50_000
        loss.backward()
        optimizer.step()
        if x.is_cuda:
            torch.cuda.synchronize(x.device)  # time the work, not its launch

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="timm or torchvision model name")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--components", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--amp", choices=["bf16", "fp16"], help="autocast the forward to this dtype")
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument(
        "--rows",
        default="sample,tile,delta,peer",
        help="comma list of rows besides the deterministic one (compiling each takes a while)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.amp]

    import timm

    base = timm.create_model(args.model, num_classes=10).to(device)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    y = torch.randint(10, (args.batch,), device=device)
    k = args.components
    options = dict(amp=amp, compile=args.compile)

    wanted = set(args.rows.split(","))
    rows: list[tuple[str, nn.Module, Callable[[], None]]] = []
    rows.append(("deterministic", base, make_step(base, x, y, **options)))
    if "sample" in wanted:
        sample = bayesify.convert(copy.deepcopy(base), components=k)
        rows.append((f"bayesify K={k} sample route", sample, make_step(sample, x, y, kl=bayesify.kl_divergence, **options)))
    if "tile" in wanted:
        tile = bayesify.convert(copy.deepcopy(base), components=k)
        step = make_step(tile, x, y, route="tile", kl=bayesify.kl_divergence, **options)
        rows.append((f"bayesify K={k} tile route", tile, step))
    if "delta" in wanted:
        be = bayesify.convert(copy.deepcopy(base), components=k, posterior="delta")
        rows.append((f"BatchEnsemble K={k} (delta)", be, make_step(be, x, y, **options)))
    if "peer" in wanted:
        try:
            from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn, get_kl_loss
        except ImportError:
            print("(bayesian-torch not installed: peer row skipped; pip install -e '.[bench]')")
        else:
            peer = copy.deepcopy(base)
            dnn_to_bnn(peer, {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0, "posterior_rho_init": -3.0,
                              "type": "Reparameterization", "moped_enable": False})  # fmt: skip
            rows.append(("bayesian-torch mean-field", peer, make_step(peer, x, y, kl=get_kl_loss, **options)))

    params0 = sum(p.numel() for p in base.parameters())
    results = []
    seconds_all = time_steps([step for _, _, step in rows], args.repeats)
    for (name, model, step), seconds in zip(rows, seconds_all):
        peak = peak_step_bytes(step, device)
        memory = saved_activation_bytes(step) if not args.compile else None  # compiled graphs save inside
        params = sum(p.numel() for p in model.parameters())
        results.append((name, seconds, params, memory, peak))
    t0, m0, p0 = results[0][1], results[0][3], results[0][4]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU threads {args.threads}"
    extras = "".join(f", {e}" for e in (args.amp and f"autocast {args.amp}", args.compile and "torch.compile") if e)
    print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, {where}{extras}, one SGD step")
    header = f"{'':34}{'step s':>9}{'time x':>8}{'params':>13}{'params x':>10}{'act MB':>9}{'mem x':>7}"
    print(header + (f"{'peak MB':>9}{'peak x':>8}" if p0 is not None else ""))
    for name, seconds, params, memory, peak in results:
        line = f"{name:34}{seconds:9.4f}{seconds / t0:8.2f}{params:13,}{params / params0:10.3f}"
        line += f"{memory / 2**20:9.1f}{memory / m0:7.2f}" if memory is not None else f"{'-':>9}{'-':>7}"
        line += f"{peak / 2**20:9.1f}{peak / p0:8.2f}" if peak is not None else ""
        print(line)


if __name__ == "__main__":
    main()
