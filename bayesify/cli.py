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

__all__ = ["main"]


class UserError(Exception):
    """A mistake in the command line: reported in one line, exit status 2."""


_HEADLINE = ("nll", "accuracy", "ece", "rmse", "calibration_error")
# train flags that are not TrainConfig fields
_NOT_CONFIG = {"command", "preset", "download", "nprocs"}
# what a flag's help says beyond its field's one line (bayesify.zoo.models.create_model calls a factory so)
_MORE_HELP = {
    "model": "; a factory is called with those of these keyword arguments its signature names (a **kwargs gets the "
    "first two): num_classes (the head's width: the classes, 1 for --task binary on two classes, 2 per target for "
    "--task gaussian), in_channels (the data's channels, a table's features; also as in_chans) and input_shape (one "
    "example's shape, e.g. (1, 8, 8) for digits)",
}


def _parser() -> argparse.ArgumentParser:
    from bayesify.training.recipes import PRESETS

    parser = argparse.ArgumentParser(
        prog="bayesify", description="Train and evaluate rank-1 Bayesian neural nets (Dusenberry et al., ICML 2020)."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    # one flag per TrainConfig field (the conversion options included), generated from the fields; every
    # flag defaults to None: unset options come from the preset, then the config's defaults
    t = sub.add_parser("train", help="convert a model to a rank-1 BNN and train it", argument_default=None)
    _add_config_flags(t)
    t.add_argument("--preset", choices=sorted(PRESETS), help="the paper's hyperparameters for this benchmark")
    t.add_argument("--download", action="store_true", default=False, help="let torchvision download CIFAR / (Fashion-)MNIST")
    t.add_argument("--nprocs", type=int, help="with --device xla: one process per XLA device")

    e = sub.add_parser("evaluate", help="evaluate the checkpoint in --out; write report.md and plots")
    e.add_argument("--out", required=True, help="the run directory of `bayesify train`")
    e.add_argument("--corruptions", nargs="?", const="all", default=None,
                   help="also evaluate on corrupted test sets (all 15 ImageNet-C corruptions, or a comma list)")  # fmt: skip
    e.add_argument("--severities", type=_ints, default=(1, 2, 3, 4, 5), help="comma-separated, default 1,2,3,4,5")
    e.add_argument("--samples", type=int, help="posterior samples per component (default: the run's eval samples)")
    e.add_argument("--batch-size", type=int, default=256)
    e.add_argument(
        "--max-examples", type=int, help="evaluate the first N test examples only (and the first N of an --ood set)"
    )
    e.add_argument("--min-size", type=int, default=32, help="corrupt smaller images at an upsampled size")
    e.add_argument("--device", default="auto")
    e.add_argument("--data-dir", help="override the run's data directory")
    e.add_argument("--baseline", metavar="DIR",
                   help="another run on the same data (e.g. --deterministic), evaluated alike and plotted beside it")  # fmt: skip
    e.add_argument("--ood", metavar="SET",
                   help="out-of-distribution detection against SET: a data set of the same input shape, "
                        "CORRUPTION[:SEVERITY] (the test set corrupted), or noise")  # fmt: skip
    e.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    return parser


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``--name`` for each field of TrainConfig: choices from option enums, ``--x / --no-x`` for booleans,
    ``none`` for optional numbers, comma lists for tuples."""
    import typing

    from bayesify.options import StrOption
    from bayesify.training import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if not f.metadata.get("cli", True):
            continue
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        help_text = f.metadata.get("help", "") + _MORE_HELP.get(f.name, "")
        args = typing.get_args(kind)
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), kind) if optional else kind
        # a union with a string option (task: a name or a Task object): the names are the flag's choices
        base = next((a for a in args if isinstance(a, type) and issubclass(a, StrOption)), base)
        if f.name == "out":
            parser.add_argument(flag, required=True, help=help_text)
        elif base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        elif isinstance(base, type) and issubclass(base, StrOption):
            parser.add_argument(flag, choices=[m.value for m in base], help=help_text)
        elif typing.get_origin(base) is tuple:
            parser.add_argument(flag, type=_floats, help=help_text)
        elif base in (int, float):
            parser.add_argument(flag, type=_optional(base) if optional else base, help=help_text)
        else:
            parser.add_argument(flag, help=help_text)


def _optional(kind: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


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


def _train_config(args: argparse.Namespace) -> Any:
    from bayesify.training.run import new_run_config, resume_run_config

    explicit = {k: v for k, v in vars(args).items() if v is not None and k not in _NOT_CONFIG}
    if explicit.get("components") == 0:
        raise UserError("--components 0 is not a number of mixture components; to train the network as it is, "
                        "pass --deterministic.")  # fmt: skip
    if explicit.pop("resume", False):
        return resume_run_config(explicit)
    return new_run_config(explicit, args.preset)


def _train(args: argparse.Namespace) -> int:
    from bayesify.training.trainer import train

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
    results = train(config, download=args.download)
    if results and "components" in results:
        shown = "  ".join(f"{k} {results[k]:.4f}" for k in _HEADLINE if isinstance(results.get(k), float))
        print(f"test: {shown}  (K={results['components']}, M={results['samples']}); checkpoint and metrics.jsonl "
              f"in {config.out}")  # fmt: skip
    return 0


def _xla_worker(index: int, config: dict[str, Any], download: bool) -> None:
    from bayesify.training import TrainConfig
    from bayesify.training.trainer import train

    train(TrainConfig.from_dict(config), download=download)


# ---- evaluate ---------------------------------------------------------------------------------


def _evaluate(args: argparse.Namespace) -> int:
    from bayesify.training.evaluate_run import evaluate_run

    results = evaluate_run(
        args.out, corruptions=args.corruptions, severities=args.severities, samples=args.samples,
        batch_size=args.batch_size, max_examples=args.max_examples, min_size=args.min_size, device=args.device,
        data_dir=args.data_dir, progress=args.progress, baseline=args.baseline, ood=args.ood,
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
