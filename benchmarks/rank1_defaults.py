"""Which conversion defaults make a rank-1 net deliver, in a plain loop? Measured on validation splits only.

    python benchmarks/rank1_defaults.py --variants deterministic mc-dropout rank1 --tasks digits mnist1d-conv --seeds 3
    python benchmarks/rank1_defaults.py --define wide '{"convert": {"init": "normal", "init_mean_std": 0.5}}' --variants wide
    python benchmarks/rank1_defaults.py --summary          # tables of everything logged so far

Every run uses ``benchmarks/quality.py``'s training loop, tasks and methods, at one fixed learning
rate (``--lr``, default 2e-3, the middle of the tasks' grid) and the task's epochs, and is
evaluated on the task's validation split and its shifted copies (the test set is never
touched). Each (variant, task, seed) appends one JSON line to ``--log``; runs already there are
skipped, so an interrupted study resumes where it stopped. Besides the metrics, each line
holds diagnostics of the trained rank-1 net: the KL / N term at initialisation and at the end,
the mean posterior scale of the factors, the spread of the factor means across components,
and the disagreement of the components.

A variant is a ``quality.py`` method, or a rank-1 recipe: ``convert`` (keyword arguments of
``bayesify.convert``), ``route`` ("sample" or "tile"), ``kl_mean_over_components`` (divide the
KL by K as well), ``kl_scale`` (a constant factor on the KL term), ``factor_lr`` (learning-rate
multiplier of the rank-1 parameters), ``samples`` (M at evaluation), ``eval_noise`` (True: evaluate K x M
samples instead of the library's default, the K posterior means), ``kl_warmup`` (the KL warm-up's length, a
fraction of the steps; the loop's: 2/3), ``lr`` (overrides ``--lr``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bayesify  # noqa: E402
from benchmarks._quality_evaluation import evaluate_members  # noqa: E402
from benchmarks._quality_methods import FINETUNE_METHODS, METHODS, Method, Rank1, set_device  # noqa: E402
from benchmarks._quality_tasks import Scale, Task, build_task, validation_view  # noqa: E402
from benchmarks.quality import DEFAULT_CACHE, DEFAULT_DATA, fit, on_device, pretrain  # noqa: E402

# the named recipes of the study (results: benchmarks/results/rank1_defaults.md)
RECIPES: dict[str, dict[str, Any]] = {
    # experiment 1: the library as it is
    # (release 0.1's defaults, spelled out: the library's own defaults are now the study's outcome)
    "r1-default": {"convert": {"prior_std": 0.1, "init_dropout": 1e-3}, "samples": 4},
    "r1-tile": {"convert": {"prior_std": 0.1, "init_dropout": 1e-3}, "samples": 4, "route": "tile"},
    # experiment 2: one change at a time from the defaults (sample route)
    "r1-kl0": {"convert": {"init_std": 0.1}},  # posterior scale starts at the prior's: KL = 0 at init
    "r1-klmean": {"kl_mean_over_components": True},  # KL / (K N): the bound on the mixture's KL
    "r1-nokl": {"kl_scale": 0.0},  # diagnostic: no KL at all (scales stay where they start)
    "r1-normal0.3": {"convert": {"init": "normal", "init_mean_std": 0.3}},  # diversity at init
    "r1-sign0.5": {"convert": {"init": "random_sign", "init_sign_p": 0.5}},  # the paper's from-scratch init
    "r1-prior0.2-kl0": {"convert": {"prior_std": 0.2, "init_std": 0.2}},  # wider prior, KL = 0 at init
    # experiment 3: around the winner of experiment 2 (KL = 0 at init, wider prior)
    "r1-p0.15-kl0": {"convert": {"prior_std": 0.15, "init_std": 0.15}},
    "r1-p0.3-kl0": {"convert": {"prior_std": 0.3, "init_std": 0.3}},
    "r1-p0.2-kl0-tile": {"convert": {"prior_std": 0.2, "init_std": 0.2}, "route": "tile"},
    "r1-p0.2-kl0-mix": {"convert": {"prior_std": 0.2, "init_std": 0.2}, "route": "tile", "likelihood": "mixture"},
    "r1-p0.2-kl0-n0.3": {"convert": {"prior_std": 0.2, "init_std": 0.2, "init": "normal", "init_mean_std": 0.3}},
    # experiment 4: r1-prior0.2-kl0 again under a new name (exp. 2 ran before the [means] rows were logged),
    # and the depth check on digits-resnet
    "r1-p0.2-kl0": {"convert": {"prior_std": 0.2, "init_std": 0.2}},
    "r1-p0.1-kl0": {"convert": {"prior_std": 0.1, "init_std": 0.1}},  # = r1-kl0, logged again with [means]
    # experiment 5: fine-tuning a pre-trained net (digits-finetune; identity at init in the means)
    "ft-r1-default": {"from_pretrained": True},
    "ft-r1-kl0": {"from_pretrained": True, "convert": {"init_std": 0.1}},
    "ft-r1-p0.2-kl0": {"from_pretrained": True, "convert": {"prior_std": 0.2, "init_std": 0.2}},
    "ft-r1f-default": {"from_pretrained": True, "factors_only": True},
    "ft-r1f-p0.2-kl0": {"from_pretrained": True, "factors_only": True, "convert": {"prior_std": 0.2, "init_std": 0.2}},
}


def rank1_from_recipe(name: str, recipe: dict[str, Any]) -> Rank1:
    known = {"convert", "route", "likelihood", "kl_mean_over_components", "kl_scale", "factor_lr", "samples", "lr",
             "from_pretrained", "factors_only", "eval_noise", "kl_warmup"}  # fmt: skip
    unknown = set(recipe) - known
    if unknown:
        raise ValueError(f"recipe {name!r} has unknown keys {sorted(unknown)}; known: {sorted(known)}.")
    return Rank1(
        key=name, label=name, convert_kwargs=dict(recipe.get("convert", {})), route=recipe.get("route", "sample"),
        likelihood=recipe.get("likelihood", "average"),
        kl_mean_over_components=recipe.get("kl_mean_over_components", False), kl_scale=recipe.get("kl_scale", 1.0),
        factor_lr=recipe.get("factor_lr", 1.0), samples=recipe.get("samples", 4),
        from_pretrained=recipe.get("from_pretrained", False), factors_only=recipe.get("factors_only", False),
        eval_noise=recipe.get("eval_noise"), kl_warmup=recipe.get("kl_warmup"),
    )  # fmt: skip


def diagnostics(model: torch.nn.Module, num_train: int) -> dict[str, float]:
    """KL / N, mean posterior scale, and spread of the factor means across components."""
    scales, spreads = [], []
    for _, layer in bayesify.rank1_layers(model):
        for _, factor in layer.rank1_factors():
            if factor.scale is not None:
                scales.append(factor.scale.detach().flatten())
            spreads.append(factor.loc.detach().std(0).flatten())  # across the K components
    out = {"loc_spread": float(torch.cat(spreads).mean())}
    if scales:
        out["scale_mean"] = float(torch.cat(scales).mean())
        with torch.no_grad():
            out["kl_per_example"] = float(bayesify.kl_divergence(model)) / num_train
    return out


def run_one(method: Method, recipe: dict[str, Any], task: Task, seed: int, lr: float) -> dict:
    config = {"lr": recipe.get("lr", lr), "knob": recipe.get("knob", method.knob_values[0] if method.knob else None)}
    record: dict[str, Any] = {"task": task.name, "seed": seed, "config": config}
    trained: dict[str, Any] = {}
    if task.finetune and seed not in task.pretrained:
        task.pretrained[seed] = pretrain(task, seed, task.pretrain_lr)
    if isinstance(method, Rank1):
        torch.manual_seed(seed)
        record["init"] = diagnostics(method.build(task, None, seed), task.num_train)
    if method.builds_on:
        base = next(m for m in METHODS + FINETUNE_METHODS if m.key == method.builds_on)
        trained[base.key] = fit(base, task, config, seed, {}, task.x_train, task.y_train)
    model, seconds = fit(method, task, config, seed, trained, task.x_train, task.y_train)
    record["train_s"] = seconds
    record.update(evaluate_members(lambda v: method.members(model, v, task), task, method.components(model)))
    if isinstance(method, Rank1):
        record["end"] = diagnostics(model, task.num_train)
        # the same trained net evaluated with its K posterior means only (no sampling)
        means = dataclasses.replace(method, eval_noise=False)
        scores = evaluate_members(lambda v: means.members(model, v, task), task, 1)
        record["eval_means"] = {k: v for k, v in scores.items() if k != "by_severity"}
    return record


def ece_floor(task: Task, seeds: int, lr: float, draws: int = 200) -> str:
    """The deterministic net's validation ECE next to the ECE a perfectly calibrated model would show.

    Labels drawn from the net's own probabilities make it calibrated by construction; the mean
    ECE over ``draws`` such label sets is the estimator's floor for those confidences and N.
    """
    from bayesify.evaluation.metrics import expected_calibration_error

    lines = []
    det = Method()
    for seed in range(seeds):
        model, _ = fit(det, task, {"lr": lr}, seed, {}, task.x_train, task.y_train)
        probs = det.members(model, task.x_val, task)[0].softmax(-1)
        generator = torch.Generator().manual_seed(0)
        floor = statistics.fmean(
            float(expected_calibration_error(probs, torch.multinomial(probs, 1, generator=generator).squeeze(1)))
            for _ in range(draws)
        )
        observed = float(expected_calibration_error(probs, task.y_val))
        lines.append(f"| {task.name} | {seed} | {observed:.4f} | {floor:.4f} |")
    return "\n".join(lines)


def summarize(log: Path, tasks: list[str] | None, variants: list[str] | None, means_rows: bool = True) -> str:
    """Markdown tables, one per task: mean +- std over seeds of the validation metrics, per variant; percentages
    against deterministic's mean over the same seeds."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for line in log.read_text().splitlines():
        r = json.loads(line)
        if (tasks is None or r["task"] in tasks) and (variants is None or r["variant"] in variants):
            rows.setdefault((r["task"], r["variant"]), []).append(r)
            if means_rows and "eval_means" in r:  # the same nets evaluated with their K posterior means
                rows.setdefault((r["task"], r["variant"] + " [means]"), []).append(
                    {**r["eval_means"], "seed": r["seed"], "train_s": r["train_s"], "end": r["end"], "init": r["init"]}
                )
    out = []
    for task in dict.fromkeys(t for t, _ in rows):
        base = rows.get((task, "deterministic")) or []
        out += [f"### {task} (validation split)", "",
                "| variant | seeds | NLL | acc | ECE | cNLL | cA | cECE | conf-acc | disagree | KL/N init->end | scale end "
                "| train s |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for (t, variant), runs in rows.items():
            if t != task:
                continue
            base_variant = variant.removesuffix(" [means]")
            # percentages against deterministic on the same seeds (a variant run on fewer seeds is compared paired)
            paired = [r for r in base if r.get("seed") in {run.get("seed") for run in runs}]
            ref = {k: statistics.fmean(r[k] for r in paired) for k in ("nll", "ece", "c_nll")} if paired else {}

            def cell(key: str, digits: int = 4) -> str:
                values = [r[key] for r in runs if key in r]
                if not values:
                    return "-"
                mean = statistics.fmean(values)
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                rel = f" ({100 * (mean / ref[key] - 1):+.0f}%)" if key in ref and base_variant != "deterministic" else ""
                return f"{mean:.{digits}f} +- {std:.{digits}f}{rel}"

            def diag(stage: str, key: str) -> float:
                values = [r[stage][key] for r in runs if stage in r and key in r[stage]]
                return statistics.fmean(values) if values else math.nan

            kl = f"{diag('init', 'kl_per_example'):.2f} -> {diag('end', 'kl_per_example'):.2f}"
            out.append(
                f"| {variant} | {len(runs)} | {cell('nll')} | {cell('accuracy', 3)} | {cell('ece')} | {cell('c_nll', 3)} | "
                f"{cell('c_accuracy', 3)} | {cell('c_ece')} | {cell('overconfidence')} | {cell('disagreement', 3)} | {kl} | "
                f"{diag('end', 'scale_mean'):.3f} | {statistics.fmean(r['train_s'] for r in runs):.1f} |"
            )
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=[])
    parser.add_argument("--define", nargs=2, action="append", default=[], metavar=("NAME", "JSON"))
    parser.add_argument("--tasks", nargs="+", default=["digits", "mnist1d-conv"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--log", type=Path, default=Path(__file__).resolve().parent / "results" / "rank1_defaults.jsonl")
    parser.add_argument("--summary", action="store_true", help="print the tables of the log and exit")
    parser.add_argument("--ece-floor", action="store_true", help="deterministic val ECE vs a calibrated model's")
    parser.add_argument("--no-means", action="store_true", help="summary without the [means] rows")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (as benchmarks/quality.py)")
    # the Fashion-MNIST tasks' size (as benchmarks/quality.py; the validation split is the same 5000 images)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--max-train", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--corruptions", help="comma-separated ImageNet-C corruptions (default: all 15)")
    parser.add_argument("--shift-examples", type=int, help="shifted sets of the first N validation images")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    set_device(args.device)
    if args.summary:
        print(summarize(args.log, args.tasks, args.variants or None, means_rows=not args.no_means))
        return
    if args.ece_floor:
        print("| task | seed | deterministic val ECE | ECE if perfectly calibrated (mean of 200 label draws) |")
        print("|---|---|---|---|")
        for name in args.tasks:
            print(ece_floor(validation_view(build_task(name, Scale())), args.seeds, args.lr))
        return
    recipes = {**RECIPES, **{name: json.loads(spec) for name, spec in args.define}}
    methods = {m.key: m for m in METHODS + FINETUNE_METHODS}
    done = set()
    if args.log.exists():
        done = {(r["variant"], r["task"], r["seed"]) for r in map(json.loads, args.log.read_text().splitlines())}
    corruptions = None if args.corruptions is None else tuple(c for c in args.corruptions.split(",") if c)
    scale = Scale(
        cache_dir=DEFAULT_CACHE, data_dir=args.data_dir, max_train=args.max_train, fixed_epochs=args.epochs,
        image_corruptions=corruptions, shift_examples=args.shift_examples,
    )  # fmt: skip
    tasks: dict[str, Task] = {}
    for variant in args.variants:
        method = methods.get(variant) or rank1_from_recipe(variant, recipes[variant])
        recipe = recipes.get(variant, {})
        for task_name in args.tasks:
            for seed in range(args.seeds):
                if (variant, task_name, seed) in done:
                    continue
                start = time.perf_counter()
                if task_name not in tasks:
                    tasks[task_name] = on_device(validation_view(build_task(task_name, scale)))
                record = run_one(method, recipe, tasks[task_name], seed, args.lr)
                record = {"variant": variant, "recipe": recipe, **record}
                with args.log.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                print(f"{variant:<24} {task_name:<14} seed {seed} NLL {record['nll']:.4f} ECE {record['ece']:.4f} "
                      f"cNLL {record['c_nll']:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
