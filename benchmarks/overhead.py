"""What a rank-1 model costs next to its deterministic original: ratios measured side by side in one run.

    make bench            # = python benchmarks/overhead.py: the CPU table of the README
    python benchmarks/overhead.py --models resnet18:32 --repeats 25 --threads 2
    python benchmarks/overhead.py --device cuda --models resnet50:224 --batch 128 --amp bf16 [--compile]
    python benchmarks/overhead.py --device cuda --models gpt2:256 --batch 16 --amp bf16   # GPT-2 small, 256 tokens
    python benchmarks/overhead.py --peers                 # + BatchEnsemble and bayesian-torch's mean-field
    python benchmarks/overhead.py --models resnet18:32 --profile   # + where the extra time goes (torch.profiler)

For each model (``name:image size`` of timm, or ``gpt2:tokens`` / ``gpt2-tiny:tokens``: a Hugging Face GPT-2 small
/ a 2-layer one, randomly initialised, trained as a language model on random tokens), K components, batch B, in
one process, every row
timed round-robin with its yardstick (median of ``--repeats`` after a warm-up, so load on the
machine hits all rows alike):

* **training step, default route** (one SGD step, ``route="sample"``, KL term included) vs the
  deterministic step at batch B;
* **training step, tiled route** (the paper's layout: every example through all K components) vs
  the deterministic step at batch K*B (the same rows);
* **evaluation, mixture of K** (``model.eval()`` forward, no gradients) vs the deterministic
  forward at batch K*B;
* **memory** of each training step: the bytes it holds from the forward pass for the backward
  (every storage made in the forward and still alive when ``backward()`` starts, each counted once,
  parameters and optimizer state excluded; device-independent), and on CUDA the step's peak
  allocation above the model and optimizer state;
* **recurrent** (``--recurrent``, on by default on the CPU): a converted LSTM / GRU training step
  (default route) vs torch's fused ``nn.LSTM`` / ``nn.GRU`` (seq 50, batch B, hidden 128).

It prints a markdown table with the machine and the command; ratios, not absolute times, are
what carry over between machines.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import platform
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import bayesify
from bayesify.cost import HeldBytes, OpCount, held_activation_bytes, op_calls  # noqa: F401 (the instruments this prints)

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    from _timing import time_steps
else:
    from benchmarks._timing import time_steps


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


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)  # time the work, not its launch


def make_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    route: str | None = None,
    kl: Callable | None = None,
    amp: torch.dtype | None = None,
    compile: bool = False,
    foreach: bool | None = None,
) -> Callable[[], None]:
    """One SGD step of ``model`` on ``(x, y)`` (the labels tiled for ``route="tile"``). ``foreach``: torch's
    multi-tensor optimizer kernels (its default on a GPU; None: torch's default for the device)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=foreach)
    model.train()
    forward = torch.compile(model) if compile else model

    def step(record: HeldBytes | None = None) -> None:
        optimizer.zero_grad(set_to_none=True)
        with record or contextlib.nullcontext(), torch.autocast(x.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            if route == "tile":
                with bayesify.mode(model, route="tile"):
                    logits = forward(x)
                targets = y.repeat(logits.shape[0] // y.shape[0], *(1,) * (y.dim() - 1))
            else:
                logits, targets = forward(x), y
            # classes on the last axis: [B, C], or a language model's [B, T, V] against [B, T]
            loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
            if kl is not None:
                loss = loss + kl(model) / 50_000
        if record is not None:
            record.bytes_held = record.held()
        loss.backward()
        optimizer.step()
        _sync(x)

    return step


def make_eval(model: nn.Module, x: torch.Tensor, *, amp: torch.dtype | None = None, compile: bool = False) -> Callable[[], None]:
    """One evaluation forward (the mixture of K for a converted model)."""
    model.eval()
    forward = torch.compile(model) if compile else model

    def run() -> None:
        with torch.no_grad(), torch.autocast(x.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            forward(x)
        _sync(x)

    return run


class _LanguageModel(nn.Module):
    """A Hugging Face causal LM as ``tokens [B, T] -> logits [B, T, V]`` (the benchmark's steps take plain tensors)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits


def _model(spec: str, device: torch.device) -> tuple[nn.Module, int]:
    name, _, size = spec.partition(":")
    if name in ("gpt2", "gpt2-tiny"):
        from transformers import GPT2Config, GPT2LMHeadModel

        tokens = int(size or 256)
        small = {} if name == "gpt2" else {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 0}
        config = GPT2Config(n_positions=max(1024, tokens), attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, **small)
        return _LanguageModel(GPT2LMHeadModel(config)).to(device), tokens
    import timm

    size = int(size or 224)
    kwargs = {"img_size": size} if "vit" in name or "deit" in name or "eva" in name else {}
    return timm.create_model(name, num_classes=10, **kwargs).to(device), size


def _task(base: nn.Module) -> dict:
    """What the model's output means (a language model's logits: classes on the last axis of [B, T, V])."""
    return {"task": "classification", "class_axis": -1} if isinstance(base, _LanguageModel) else {"task": "classification"}


def _inputs(base: nn.Module, size: int, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch and its targets: images and labels, or a language model's tokens and next tokens."""
    if isinstance(base, _LanguageModel):
        vocab = base.model.config.vocab_size
        tokens = torch.randint(vocab, (batch, size + 1), device=device)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(batch, 3, size, size, device=device), torch.randint(10, (batch,), device=device)


def _rows(args: argparse.Namespace) -> list[str]:
    """The rank-1 rows ``--rows`` names (``--default-route-only``: the default-route step alone)."""
    rows = getattr(args, "rows", "sample,tile,mixture")
    chosen = ["sample"] if getattr(args, "default_route_only", False) else [r.strip() for r in rows.split(",") if r.strip()]
    unknown = sorted(set(chosen) - {"sample", "tile", "mixture"})
    if unknown or not chosen:
        raise SystemExit(f"--rows {rows!r}: choose from sample, tile, mixture (comma-separated), e.g. --rows sample,mixture")
    return chosen


def model_rows(
    spec: str, args: argparse.Namespace, device: torch.device, amp: torch.dtype | None, profiles: list[str] | None = None
) -> list[list[str]]:
    """The table rows of one model: each measured against its own yardstick, in one round-robin run. ``profiles``, if
    given, receives the op profile of its training steps (the original's and the default route's) after the timing."""
    base, size = _model(spec, device)
    k, batch = args.components, args.batch
    x, y = _inputs(base, size, batch, device)
    x_tiled, y_tiled = torch.cat([x] * k), torch.cat([y] * k)
    rank1 = bayesify.convert(copy.deepcopy(base), components=k, sampling=args.sampling, **_task(base))
    options = dict(amp=amp, compile=args.compile)
    train_options = dict(options, foreach=True if getattr(args, "foreach", False) else None)
    makers = {  # each made only where its row was chosen (a copy of the model each)
        "det@B": lambda: make_step(copy.deepcopy(base), x, y, **train_options),
        "det@KB": lambda: make_step(copy.deepcopy(base), x_tiled, y_tiled, **train_options),
        "det eval@KB": lambda: make_eval(copy.deepcopy(base), x_tiled, **options),
        "sample": lambda: make_step(copy.deepcopy(rank1), x, y, kl=bayesify.kl_divergence, **train_options),
        "tile": lambda: make_step(copy.deepcopy(rank1), x, y, route="tile", kl=bayesify.kl_divergence, **train_options),
        "mixture": lambda: make_eval(copy.deepcopy(rank1), x, **options),
    }
    # each row chosen with its yardstick (a compiled run compiles every step once: choose what to pay for)
    chosen = _rows(args)
    yardsticks = {"sample": "det@B", "tile": "det@KB", "mixture": "det eval@KB"}
    keep = set(chosen) | {yardsticks[c] for c in chosen} | ({"det@B"} if args.peers else set())  # peers: against det at B
    steps = {name: make() for name, make in makers.items() if name in keep}
    if args.peers:
        be = bayesify.convert(copy.deepcopy(base), components=k, posterior="delta", sampling=args.sampling, **_task(base))
        steps["delta"] = make_step(be, x, y, **train_options)
        try:
            from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn, get_kl_loss
        except ImportError:
            print("(bayesian-torch not installed: its row is skipped; pip install -e '.[bench]')", file=sys.stderr)
        else:
            peer = copy.deepcopy(base)
            try:
                dnn_to_bnn(peer, {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0, "posterior_rho_init": -3.0,
                                  "type": "Reparameterization", "moped_enable": False})  # fmt: skip
            except (AttributeError, TypeError, ValueError) as error:  # e.g. Hugging Face's Conv1D: no such layer there
                print(f"(bayesian-torch cannot convert {spec}: {error}; its row is skipped)", file=sys.stderr)
                peer = None
            if peer is not None:
                peer.to(device)  # dnn_to_bnn makes its new layers on the CPU
                steps["peer"] = make_step(peer, x, y, kl=get_kl_loss, **train_options)
    if args.compile:
        # compile times: each rank-1 step compiles first, so its yardstick reuses any kernel it made (an upper bound
        # on the ratio), and nothing comes from an earlier run's cache on disk
        from torch._inductor import config as inductor_config

        inductor_config.force_disable_caches = True
        steps = dict(sorted(steps.items(), key=lambda item: item[0].startswith("det")))
    first: list[float] = []
    seconds = dict(zip(steps, time_steps(list(steps.values()), args.repeats, first)))
    first_call = dict(zip(steps, first))  # compiled: the compilation (and one step)
    trained = [n for n in ("det@B", "det@KB", "sample", "tile") if n in steps]
    memory = {} if args.compile else {n: held_activation_bytes(steps[n]) for n in trained}
    # ops dispatched per step, after the timing's warm-up (a compiled step's ops run inside its graph: not counted)
    ops = {} if args.compile else {n: op_calls(steps[n]) for n in ("det@B", "det@KB", "det eval@KB", "sample", "tile", "mixture") if n in steps}
    peaks = {n: peak_step_bytes(steps[n], device) for n in trained}
    if profiles is not None:
        profiles.append(profile({"deterministic": steps["det@B"], "rank-1": steps["sample"]}, device) if "sample" in steps else "")

    def ratio(a: str, b: str) -> str:
        return f"{seconds[a] / seconds[b]:.2f}"

    def count(a: str, b: str) -> str:
        return f"{ops[a] / ops[b]:.2f} ({ops[b]} / {ops[a]})" if ops else "-"

    def mem(a: str, b: str) -> str:
        saved = f"{memory[a] / memory[b]:.2f}" if memory else "-"
        peak = f" (peak {peaks[a] / peaks[b]:.2f})" if peaks[a] is not None else ""
        return saved + peak

    title = f"{spec} B={batch}"
    rows = []
    if "sample" in steps:
        rows.append([title, "training step, default route", "det at B", ratio("sample", "det@B"), count("sample", "det@B"),
                     mem("sample", "det@B"), f"{seconds['det@B'] * 1e3:.0f} / {seconds['sample'] * 1e3:.0f}"])  # fmt: skip
    if "tile" in steps:  # (only the rows --rows chose)
        rows.append([title, "training step, tiled route", "det at K*B", ratio("tile", "det@KB"), count("tile", "det@KB"),
                     mem("tile", "det@KB"), f"{seconds['det@KB'] * 1e3:.0f} / {seconds['tile'] * 1e3:.0f}"])  # fmt: skip
    if "mixture" in steps:
        rows.append([title, f"evaluation, mixture of {k}", "det at K*B", ratio("mixture", "det eval@KB"), count("mixture", "det eval@KB"),
                     "-", f"{seconds['det eval@KB'] * 1e3:.0f} / {seconds['mixture'] * 1e3:.0f}"])  # fmt: skip
    if args.compile:  # what compiling costs, against compiling the original (the first call of each; an upper bound)
        # (the tiled step against the original's step at B: its step at K*B, compiled next, may reuse that graph with
        # a symbolic batch and take no time at all)
        pairs = [("sample", "det@B", "training step, default route"), ("tile", "det@B", "training step, tiled route"),
                 ("mixture", "det eval@KB", f"evaluation, mixture of {k}")]  # fmt: skip
        for a, b, figure in pairs:
            if a in steps and b in steps:
                rows.append([title, f"compile time, {figure}", b.replace("@", " at ").replace("KB", "K*B"),
                             f"{first_call[a] / first_call[b]:.2f}", "-", "-", f"{first_call[b]:.0f} / {first_call[a]:.0f} s"])  # fmt: skip
    if "delta" in steps:
        rows.append([title, "BatchEnsemble training step", "det at B", ratio("delta", "det@B"), "-", "-", f"{seconds['delta'] * 1e3:.0f}"])
    if "peer" in steps:
        rows.append([title, "bayesian-torch mean-field step", "det at B", ratio("peer", "det@B"), "-", "-", f"{seconds['peer'] * 1e3:.0f}"])
    return rows


def recurrent_rows(args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    """A converted LSTM / GRU training step (default route) vs torch's fused module."""
    rows = []
    for cls in (nn.LSTM, nn.GRU):
        torch.manual_seed(0)
        layer = cls(128, 128, batch_first=True).to(device)
        rank1 = bayesify.convert(copy.deepcopy(layer), components=args.components, task="regression")
        x = torch.randn(args.batch, 50, 128, device=device)

        def step(module: nn.Module) -> Callable[[], None]:
            def run(record: HeldBytes | None = None) -> None:
                module.zero_grad(set_to_none=True)
                with record or contextlib.nullcontext():
                    loss = module(x)[0].square().mean()
                    if bayesify.is_converted(module):
                        loss = loss + bayesify.kl_divergence(module) / 50_000
                if record is not None:
                    record.bytes_held = record.held()
                loss.backward()
                _sync(x)

            return run

        torch_s, rank1_s = time_steps([step(layer.train()), step(rank1.train())], args.repeats)
        memory = held_activation_bytes(step(rank1)) / held_activation_bytes(step(layer))
        rows.append([f"{cls.__name__} 128, seq 50, B={args.batch}", "training step, default route", "torch's fused",
                     f"{rank1_s / torch_s:.2f}", "-", f"{memory:.2f}", f"{torch_s * 1e3:.0f} / {rank1_s * 1e3:.0f}"])  # fmt: skip
    return rows


def profile(steps: dict[str, Callable[[], None]], device: torch.device) -> str:
    """Where a training step's extra time goes: torch.profiler's op table (on CUDA its kernels'), of each step as the
    timing ran it (compiled ones too: then the table holds the graph's generated kernels)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out = []
    for name, step in steps.items():
        step()
        with torch_profile(activities=activities) as prof:
            for _ in range(5):
                step()
        events = prof.key_averages()
        calls = sum(e.count for e in events) / 5
        total = sum(e.self_cpu_time_total for e in events) / 5 / 1e3
        gpu = ""
        if device.type == "cuda":
            kernel_ms = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events) / 5 / 1e3
            gpu = f", {kernel_ms:.1f} ms of GPU time per step"
        out.append(f"### {name}: {calls:.0f} op calls per step, {total:.1f} ms of self CPU time per step{gpu}\n")
        out.append("```\n" + events.table(sort_by=sort, row_limit=15, max_name_column_width=60) + "```\n")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18:32,vit_tiny_patch16_224:64", help="timm name:image size, comma-separated")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--components", type=int, default=4)
    parser.add_argument("--sampling", default="auto", help="the conversion's sampling option (auto, example, component)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--amp", choices=["bf16", "fp16"], help="autocast the forward to this dtype")
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument("--peers", action="store_true", help="add BatchEnsemble and bayesian-torch rows")
    parser.add_argument("--rows", default="sample,tile,mixture", help="the rank-1 rows, each timed with its yardstick: "
                        "sample (training step, default route), tile (tiled route), mixture (evaluation)")
    parser.add_argument("--default-route-only", action="store_true", help="= --rows sample (compiled runs)")
    parser.add_argument("--no-recurrent", dest="recurrent", action="store_false", help="skip the LSTM / GRU rows")
    parser.add_argument("--profile", action="store_true", help="also print the op profile of the first model's training steps")
    parser.add_argument("--foreach", action="store_true", help="the optimizer's foreach kernels (torch's GPU default) on every device")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.amp]

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()} CPU, {args.threads} threads"
    # on CUDA the per-row scalings run as Triton kernels with BAYESIFY_KERNELS=1 (off by default; bayesify/kernels): say which
    from bayesify import kernels as fused

    switch = os.environ.get(fused.SWITCH, "1")
    kernels = device.type == "cuda" and f"fused kernels {'on' if fused.enabled() else 'off'} (BAYESIFY_KERNELS={switch})"
    extras = "".join(f", {e}" for e in (args.amp and f"autocast {args.amp}", args.compile and "torch.compile", kernels) if e)
    print(f"bayesify {bayesify.__version__}, torch {torch.__version__}, {where}{extras}, K={args.components}, "
          f"sampling={args.sampling}, median of {args.repeats}")  # fmt: skip
    print(f"command: python {' '.join(sys.argv)}\n")
    print("| model | figure | against | time x | ops x (yardstick / rank-1 per step) | memory x (held for backward) | ms (yardstick / rank-1) |")
    print("|---|---|---|---|---|---|---|", flush=True)
    # each model's rows as soon as they are measured (a run cut short by a time limit keeps what it measured)
    profiles: list[str] = []
    for i, spec in enumerate(args.models.split(",")):
        for row in model_rows(spec, args, device, amp, profiles if args.profile and i == 0 else None):
            print("| " + " | ".join(row) + " |", flush=True)
    if args.recurrent and not args.compile:
        for row in recurrent_rows(args, device):
            print("| " + " | ".join(row) + " |", flush=True)
    if profiles:
        print(f"\n## Profile: {args.models.split(',')[0]}, B={args.batch}, one training step (mean of 5)\n")
        print(profiles[0])


if __name__ == "__main__":
    main()
