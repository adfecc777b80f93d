"""The ``bayesify`` command line: train and evaluate rank-1 BNNs.

    bayesify train --model resnet18 --data digits --epochs 2 --out runs/a
    bayesify evaluate --out runs/a --corruptions
    bayesify evaluate --out runs/a --corruptions --baseline runs/det   # det and rank-1 on the same plots
    bayesify train --out runs/a --resume --epochs 4            # continue (settings come from the checkpoint)
    bayesify train --model wide_resnet50_2 --data cifar10 --data-dir ~/data --preset cifar10 --out runs/c10
    torchrun --standalone --nproc-per-node 2 -m bayesify train --model cnn --data digits --out runs/ddp
    python -m bayesify ...                                     # the same as `bayesify ...`

User errors (unknown names, a missing or corrupt checkpoint, a batch size that does not fit)
print one line naming the value and the fix, and exit with status 2; nothing already saved
is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["PRESETS", "main"]

# The paper's recipes (METHOD.md; reference baselines/{cifar,imagenet}/rank1_bnn.py, MIMIC-III).
# Epoch-relative entries ("*_fraction") are scaled to --epochs; "base_lr" is for "lr_batch" examples
# per step and is scaled linearly to --batch-size.
PRESETS: dict[str, dict[str, Any]] = {
    "cifar10": dict(
        components=4, route="tile", optimizer="sgd", momentum=0.9, nesterov=True, base_lr=0.1, lr_batch=128,
        batch_size=128, epochs=250, warmup_epochs=1.0, decay_fractions=(80 / 200, 160 / 200, 180 / 200),
        decay_ratio=0.2, l2=1e-4, l2_norm_layers=True, prior_std=0.1, init="random_sign", init_sign_p=0.5,
        init_dropout=1e-3, init_jitter=0.1, kl_annealing_fraction=200 / 250,
    ),
    "cifar100": dict(
        components=4, route="tile", optimizer="sgd", momentum=0.9, nesterov=True, base_lr=0.1, lr_batch=128,
        batch_size=128, epochs=250, warmup_epochs=1.0, decay_fractions=(80 / 200, 160 / 200, 180 / 200),
        decay_ratio=0.2, l2=3e-4, l2_norm_layers=True, prior_std=0.1, init="random_sign", init_sign_p=0.5,
        init_dropout=1e-3, init_jitter=0.1, kl_annealing_fraction=200 / 250,
    ),
    "imagenet": dict(
        components=4, route="tile", optimizer="sgd", momentum=0.9, nesterov=True, base_lr=0.1, lr_batch=256,
        batch_size=256, epochs=135, warmup_epochs=5.0, decay_fractions=(45 / 135, 90 / 135, 120 / 135),
        decay_ratio=0.1, l2=1e-4, l2_norm_layers=False, prior_std=0.05, init="random_sign", init_sign_p=0.75,
        init_dropout=1e-3, init_jitter=0.1, kl_annealing_fraction=90 / 135,
    ),
    "mimic": dict(
        components=4, route="tile", optimizer="adam", lr=3e-4, batch_size=128, max_steps=25_000, epochs=10_000,
    ),
}  # fmt: skip


class UserError(Exception):
    """A mistake in the command line: reported in one line, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bayesify", description="Train and evaluate rank-1 Bayesian neural nets (Dusenberry et al., ICML 2020)."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    # every train option defaults to None: unset options come from the preset, then TrainConfig
    t = sub.add_parser("train", help="convert a model to a rank-1 BNN and train it", argument_default=None)
    t.add_argument("--model", help="built-in (cnn, cnn1d, mlp), timm or torchvision name, or module:factory")
    t.add_argument("--data", help="digits, mnist1d, breast-cancer, cifar10, cifar100, or folder:PATH")
    t.add_argument("--out", required=True, help="run directory: metrics.jsonl, checkpoint.pt, reports")
    t.add_argument("--data-dir", help="where torchvision data sets are (CIFAR)")
    t.add_argument("--download", action="store_true", default=False, help="let torchvision download CIFAR")
    t.add_argument("--preset", choices=sorted(PRESETS), help="the paper's hyperparameters for this benchmark")
    t.add_argument("--resume", action="store_true", default=False, help="continue the run in --out")
    t.add_argument("--epochs", type=int)
    t.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    t.add_argument("--batch-size", type=int, help="unique examples per step, all processes together")
    t.add_argument("--components", type=int, help="K mixture components (paper: 4)")
    t.add_argument("--deterministic", action="store_true", default=False, help="train without converting (baseline)")
    t.add_argument("--route", choices=["sample", "tile"], help="sample: one component per example; tile: all K")
    t.add_argument("--likelihood", choices=["average", "mixture"])
    t.add_argument("--prior", choices=["normal", "cauchy"])
    t.add_argument("--prior-std", type=float)
    t.add_argument("--posterior", choices=["normal", "cauchy", "delta"])
    t.add_argument("--init", choices=["preserve", "random_sign", "normal"])
    t.add_argument("--init-mean-std", type=float, help="spread of the means for --init normal")
    t.add_argument("--init-sign-p", type=float)
    t.add_argument("--init-dropout", type=float)
    t.add_argument("--init-jitter", type=float)
    t.add_argument("--l2", type=float, help="L2 prior coefficient on the point-estimated weights")
    t.add_argument("--no-l2-norm-layers", dest="l2_norm_layers", action="store_false", default=None)
    t.add_argument("--kl-annealing-epochs", type=float)
    t.add_argument("--optimizer", choices=["sgd", "adam", "adamw"])
    t.add_argument("--lr", type=float)
    t.add_argument("--momentum", type=float)
    t.add_argument("--no-nesterov", dest="nesterov", action="store_false", default=None)
    t.add_argument("--warmup-epochs", type=float)
    t.add_argument("--decay-epochs", type=_floats, help="comma-separated epochs, e.g. 80,160,180")
    t.add_argument("--decay-ratio", type=float)
    t.add_argument("--fast-weight-lr-multiplier", type=float)
    t.add_argument("--grad-clip", type=float)
    t.add_argument("--eval-samples", type=int)
    t.add_argument("--device", help="auto, cpu, cuda, cuda:N, xla")
    t.add_argument("--nprocs", type=int, help="with --device xla: one process per XLA device")
    t.add_argument("--precision", choices=["32", "bf16", "fp16"])
    t.add_argument("--compile", action="store_true", default=None)
    t.add_argument("--num-workers", type=int)
    t.add_argument("--seed", type=int)
    t.add_argument("--log-every", type=int)
    t.add_argument("--checkpoint-every", type=int)
    t.add_argument("--pretrained", action="store_true", default=None)
    t.add_argument("--no-progress", dest="progress", action="store_false", default=None)

    e = sub.add_parser("evaluate", help="evaluate the checkpoint in --out; write report.md and plots")
    e.add_argument("--out", required=True, help="the run directory of `bayesify train`")
    e.add_argument("--corruptions", nargs="?", const="all", default=None,
                   help="also evaluate on corrupted test sets (all 15 ImageNet-C corruptions, or a comma list)")  # fmt: skip
    e.add_argument("--severities", type=_ints, default=(1, 2, 3, 4, 5), help="comma-separated, default 1,2,3,4,5")
    e.add_argument("--samples", type=int, help="posterior samples per component (default: the run's eval samples)")
    e.add_argument("--batch-size", type=int, default=256)
    e.add_argument("--max-examples", type=int, help="evaluate the first N test examples only")
    e.add_argument("--min-size", type=int, default=32, help="corrupt smaller images at an upsampled size")
    e.add_argument("--device", default="auto")
    e.add_argument("--data-dir", help="override the run's data directory")
    e.add_argument("--baseline", metavar="DIR",
                   help="another run on the same data (e.g. --deterministic), evaluated alike and plotted beside it")  # fmt: skip
    e.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    return parser


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers (e.g. 80,160,180)"
        ) from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 1,3,5)") from None


# ---- train ------------------------------------------------------------------------------------

_NOT_CONFIG = {"command", "preset", "download", "deterministic", "nprocs"}


def _train_config(args: argparse.Namespace) -> Any:
    from bayesify.training import TrainConfig
    from bayesify.training.checkpoint import load_checkpoint

    explicit = {k: v for k, v in vars(args).items() if v is not None and k not in _NOT_CONFIG}
    explicit.pop("resume", None)
    if args.deterministic:
        explicit["components"] = 0
    out = Path(args.out)
    checkpoint = out / "checkpoint.pt"

    if args.resume:
        if not checkpoint.exists():
            raise UserError(
                f"--resume: there is no checkpoint at {checkpoint}; drop --resume to start a new run there."
            )
        saved = load_checkpoint(checkpoint)["config"]
        for key in ("model", "data"):
            if key in explicit and explicit[key] != saved[key]:
                raise UserError(
                    f"--{key} {explicit[key]} differs from the run in {out}, which trained --{key} {saved[key]}; "
                    f"resume without --{key}, or train a new run in another --out."
                )
        return TrainConfig.from_dict({**saved, **explicit, "resume": True})

    if checkpoint.exists():
        raise UserError(
            f"{out} already holds a checkpoint; pass --resume to continue that run, or choose another --out "
            "(nothing was overwritten)."
        )
    missing = [f"--{k}" for k in ("model", "data") if k not in explicit]
    if missing:
        raise UserError(
            f"train needs {' and '.join(missing)} (e.g. --model cnn --data digits) unless it --resume's a run."
        )

    values: dict[str, Any] = {}
    if args.preset:
        preset = dict(PRESETS[args.preset])
        epochs = explicit.get("epochs", preset["epochs"])
        batch = explicit.get("batch_size", preset["batch_size"])
        if "decay_fractions" in preset:
            values["decay_epochs"] = tuple(round(f * epochs, 4) for f in preset.pop("decay_fractions"))
        if "kl_annealing_fraction" in preset:
            values["kl_annealing_epochs"] = round(preset.pop("kl_annealing_fraction") * epochs, 4)
        if "base_lr" in preset:
            values["lr"] = preset.pop("base_lr") * batch / preset.pop("lr_batch")
        values.update(preset)
    values.update(explicit)
    if values.get("pretrained") and "init" not in explicit:
        values["init"] = "preserve"  # keep the pretrained network's function at the start
    return TrainConfig(**values)


def _train(args: argparse.Namespace) -> int:
    config = _train_config(args)
    config.validate()
    if args.nprocs and args.nprocs > 1:
        if not str(config.device).startswith("xla"):
            raise UserError(
                f"--nprocs {args.nprocs} starts XLA processes; for CPU / GPU data parallelism use "
                "torchrun --nproc-per-node N -m bayesify train ..."
            )
        from bayesify.training.distributed import launch_xla

        launch_xla(_xla_worker, args=(config.to_dict(), args.download), nprocs=args.nprocs)
        return 0
    results = _run_training(config, args.download)
    if results and "nll" in results:
        print(
            f"test: NLL {results['nll']:.4f}  accuracy {results['accuracy']:.4f}  ECE {results['ece']:.4f}  "
            f"(K={results['components']}, M={results['samples']}); checkpoint and metrics.jsonl in {config.out}"
        )
    return 0


def _run_training(config: Any, download: bool) -> dict[str, Any]:
    from bayesify.data import load_data
    from bayesify.training import Trainer, build_model

    bundle = load_data(config.data, config.data_dir, download=download, seed=0)
    # a resumed run loads its weights from the checkpoint: no pretrained download
    model = build_model(dataclasses.replace(config, pretrained=False) if config.resume else config, bundle)
    try:
        return Trainer(config, model, bundle).run()
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _xla_worker(index: int, config: dict[str, Any], download: bool) -> None:
    from bayesify.training import TrainConfig

    _run_training(TrainConfig.from_dict(config), download)


# ---- evaluate ---------------------------------------------------------------------------------


def _evaluate(args: argparse.Namespace) -> int:
    from bayesify.evaluation.run import evaluate_run

    results = evaluate_run(
        args.out, corruptions=args.corruptions, severities=args.severities, samples=args.samples,
        batch_size=args.batch_size, max_examples=args.max_examples, min_size=args.min_size, device=args.device,
        data_dir=args.data_dir, progress=args.progress, baseline=args.baseline,
    )  # fmt: skip
    files = results["files"]
    print(Path(files["report"]).read_text())
    print("wrote " + ", ".join(files.values()))
    return 0


# ---- entry point ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``bayesify`` command; returns the exit status (also used by ``python -m bayesify``)."""
    args = _parser().parse_args(argv)
    from bayesify.training.checkpoint import CheckpointError

    try:
        if args.command == "train":
            return _train(args)
        return _evaluate(args)
    except (UserError, CheckpointError, ValueError) as error:
        # user errors: one line naming the value and the fix, no traceback (BAYESIFY_DEBUG=1 shows it)
        if os.environ.get("BAYESIFY_DEBUG"):
            raise
        print(f"bayesify {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"bayesify {args.command}: interrupted; the last checkpoint in {args.out} is intact "
            "(continue with --resume).",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
