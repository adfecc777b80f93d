"""What compiling a rank-1 training step costs next to compiling the original's: cold and warm, in fresh processes.

    python benchmarks/compile_time.py                               # resnet18:32 and vit_tiny_patch16_224:32, B=8
    python benchmarks/compile_time.py --models resnet50:224 --batch 32 --device cuda --amp bf16

``torch.compile`` compiles in two ways a user meets: **cold**, the first run on a machine (every kernel generated and
built: a fresh inductor cache directory), and **warm**, every later run of the same script (inductor's and
AOTAutograd's caches on disk hand back the graphs compiled before, and what is left is Dynamo tracing the Python
code). Each figure is the first training step (one SGD step of ``benchmarks/overhead.py``'s, the KL term included),
compilation and all, of a process of its own, so that nothing one compilation made is reused by the other; the
variants run interleaved, ``--repeats`` times, and the medians are compared. It prints a markdown table with the
machine and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("det", "rank1")


def child(spec: str, variant: str, batch: int, device_name: str, amp_name: str | None) -> None:
    """One process: build the step of ``variant``, compile it, time its first call; print the seconds as JSON."""
    import torch

    import bayesify

    if __package__ in (None, ""):
        from overhead import _inputs, _model, _task, make_step
    else:
        from benchmarks.overhead import _inputs, _model, _task, make_step

    torch.manual_seed(0)
    device = torch.device(device_name)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[amp_name]
    base, size = _model(spec, device)
    x, y = _inputs(base, size, batch, device)
    if variant == "rank1":
        model = bayesify.convert(base, components=4, **_task(base))
        step = make_step(model, x, y, kl=bayesify.kl_divergence, amp=amp, compile=True)
    else:
        step = make_step(base, x, y, amp=amp, compile=True)
    start = time.perf_counter()
    step()
    print(json.dumps({"seconds": time.perf_counter() - start}))


def _run(spec: str, variant: str, args: argparse.Namespace, cache: str) -> float:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    command = [sys.executable, os.path.abspath(__file__), "--child", spec, variant, str(args.batch), args.device, args.amp or ""]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{spec} {variant} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18:32,vit_tiny_patch16_224:32", help="timm name:image size, comma-separated")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="cold and warm compilations of each variant")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--amp", choices=["bf16", "fp16"])
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec, variant, batch, device, amp = args.child
        child(spec, variant, int(batch), device, amp or None)
        return
    import torch

    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{platform.processor() or platform.machine()} CPU"
    print(f"torch {torch.__version__}, {where}, K=4, B={args.batch}{f', autocast {args.amp}' if args.amp else ''}, "
          f"median of {args.repeats}; each figure a fresh process's first training step, compilation included")  # fmt: skip
    print(f"command: python {' '.join(sys.argv)}\n")
    print("| model | compile | original s | rank-1 s | rank-1 x |")
    print("|---|---|---|---|---|", flush=True)
    for spec in args.models.split(","):
        seconds: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):
            for variant in VARIANTS:  # interleaved: load on the machine hits both alike
                with tempfile.TemporaryDirectory(prefix="bayesify-compile-") as cache:
                    seconds.setdefault(("cold", variant), []).append(_run(spec, variant, args, cache))
                    seconds.setdefault(("warm", variant), []).append(_run(spec, variant, args, cache))
        for kind in ("cold", "warm"):
            det, rank1 = (statistics.median(seconds[(kind, v)]) for v in VARIANTS)
            print(f"| {spec} | {kind} | {det:.1f} | {rank1:.1f} | {rank1 / det:.2f} |", flush=True)


if __name__ == "__main__":
    main()
