"""Evaluate a rank-1 net at its K posterior means or sampled? The same trained nets both ways, on validation splits.

    python benchmarks/eval_default.py --data-dir data --out benchmarks/results/eval_default   # runs, then the table
    python benchmarks/eval_default.py --table benchmarks/results/eval_default/*/quality.json  # the table of runs made

Issue 29, item 3. ``benchmarks/quality.py`` trains each rank-1 net once and evaluates it two ways, as
two methods of its report: at the K posterior means, the library's default (``model.eval()``;
``bayesify.predict(model.eval(), x)``, K members: ``rank1``, ``ft-rank1``, ``ft-rank1-factors``) and
sampled, K x M = 4 x 4 draws (``bayesify.predict(model.eval(), x, samples=4)``: the ``*-sampled``
method that ``builds_on`` it, ``post_hoc``, so the very same weights). This script runs
``quality.py --split val`` (the validation split in the place of the test set; the test set is not
touched; ``--budget 1``: no tuning on that split, the tuned loop at its grid's 3rd learning rate, the plain
loop at 1e-3) on every task of ``quality.py``, in three runs, and writes one table of the pairs:

* the small tasks: digits, MNIST-1D (Conv1d, GRU), breast cancer, diabetes, digits fine-tuning;
* Fashion-MNIST, the CNN and the ResNet-8, tuned and plain loops, at a small CPU budget;
* the image fine-tuning tasks (``finetune-all``), full fine-tune and adapter.

For each pair: mean +- std over seeds of NLL, ECE, cNLL (and OOD AUROC by entropy where the task has
an OOD set), and in how many seeds sampling was better. The library's defaults are not changed here;
the table reports which evaluation wins where.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import quality  # noqa: E402

# (at the means, sampled): the same nets, see the module doc
PAIRS = (("rank1", "rank1-sampled"), ("ft-rank1", "ft-rank1-sampled"), ("ft-rank1-factors", "ft-rank1-factors-sampled"))
METRICS = (("nll", "NLL", -1), ("ece", "ECE", -1), ("c_nll", "cNLL", -1), ("ood_entropy_auroc", "OOD AUROC", 1))
CORRUPTIONS = "gaussian_noise,defocus_blur,fog,contrast,jpeg_compression"
SMALL_TASKS = ("digits", "mnist1d-conv", "mnist1d-gru", "breast-cancer", "diabetes", "digits-finetune")


def runs(data_dir: Path, seeds: int, quick: bool) -> dict[str, list[str]]:
    """The ``quality.py`` arguments of the three runs (``--out`` added by :func:`main`)."""
    methods = ["--methods", *(key for pair in PAIRS for key in pair)]
    common = ["--split", "val", *methods, "--threads", "1"]
    common += ["--quick"] if quick else ["--budget", "1", "--seeds", str(seeds)]
    images = ["--data-dir", str(data_dir)]
    if not quick:
        images += ["--corruptions", CORRUPTIONS, "--shift-examples", "200", "--max-ood", "500"]
    return {
        "small": [*common, "--tasks", *SMALL_TASKS],
        "fashion": [*common, *images, "--tasks", "fashion-mnist-all",
                    *([] if quick else ["--max-train", "5000", "--epochs", "5"])],
        "finetune": [*common, *images, "--tasks", "finetune-all",
                     *([] if quick else ["--max-pretrain", "10000", "--pretrain-epochs", "5"])],
    }  # fmt: skip


def _values(method: dict[str, Any], metric: str) -> dict[int, float]:
    return {r["seed"]: r[metric] for r in method["runs"] if r.get(metric) is not None}


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.4f} +- {std:.4f}"


def pair_row(task: dict[str, Any], means_key: str, sampled_key: str) -> tuple[str, dict[str, int]] | None:
    """One markdown row (means vs sampled for each metric, and the seeds where sampling was better) and the wins."""
    methods = task["methods"]
    if means_key not in methods or sampled_key not in methods:
        return None
    cells, wins = [], {}
    for metric, _, sign in METRICS:
        means, sampled = _values(methods[means_key], metric), _values(methods[sampled_key], metric)
        seeds = sorted(set(means) & set(sampled))
        if not seeds:
            cells.append("- | - | -")
            continue
        better = sum(sign * (sampled[s] - means[s]) > 0 for s in seeds)
        wins[metric] = better
        a, b = statistics.fmean(means[s] for s in seeds), statistics.fmean(sampled[s] for s in seeds)
        change = f" ({100 * (b / a - 1):+.0f}%)" if a else ""
        cells.append(f"{_cell([means[s] for s in seeds])} | {_cell([sampled[s] for s in seeds])}{change} | "
                     f"{better}/{len(seeds)}")  # fmt: skip
    seeds = len(methods[means_key]["runs"])
    return f"| {task['task']} | {task.get('loop', 'tuned')} | `{means_key}` | {seeds} | " + " | ".join(cells) + " |", wins


def table(reports: list[dict[str, Any]]) -> str:
    """The markdown table of every pair in the reports, and a count of the tasks each way wins."""
    header = " | ".join(f"{label} means | {label} sampled | sampled better" for _, label, _ in METRICS)
    lines = [
        f"| task | loop | nets | seeds | {header} |",
        "|---" * (4 + 3 * len(METRICS)) + "|",
    ]
    tally: dict[str, list[int]] = {metric: [0, 0, 0] for metric, _, _ in METRICS}  # sampled wins, means win, tie
    for report in reports:
        for task in report["tasks"]:
            for means_key, sampled_key in PAIRS:
                row = pair_row(task, means_key, sampled_key)
                if row is None:
                    continue
                lines.append(row[0])
                seeds = len(task["methods"][means_key]["runs"])
                for metric, better in row[1].items():
                    tally[metric][0 if 2 * better > seeds else 1 if 2 * better < seeds else 2] += 1
    lines += ["", "Majority of seeds, over the rows above (a row: one task and one kind of net):", ""]
    for metric, label, _ in METRICS:
        sampled, means, tie = tally[metric]
        if sampled + means + tie:
            lines.append(f"- {label}: sampled better in {sampled} rows, the means in {means}" + (f", tied in {tie}" if tie else ""))
    return "\n".join(lines)


def write(reports: list[dict[str, Any]], out: Path, command: str) -> None:
    """``out`` (markdown): the commands, the machine, the table."""
    machine = reports[0]["machine"]
    lines = [
        "# Evaluation at the K means or sampled: validation splits of every task",
        "",
        f"Command: `{command}`; the runs (each wrote its own report, in the folder of this file's name):",
        "",
        *(f"- `{report['command']}` ({report['seconds'] / 60:.1f} min)" for report in reports),
        "",
        f"Machine: {machine['platform']}, {machine['cpu_count']} CPUs, torch {machine['torch']}, "
        f"{machine['threads']} thread(s), models on {machine.get('device', 'cpu')}; {reports[0]['date']}.",
        "",
        "The same trained nets evaluated at their K = 4 posterior means (`model.eval()`, the library's default) and "
        "with K x M = 4 x 4 posterior samples (`bayesify.predict(model.eval(), x, samples=4)`), on each task's "
        "validation split (and its shifted copies; OOD: MNIST test images). `rank1`: converted from scratch; "
        "`ft-rank1`: a pre-trained net converted and fully fine-tuned; `ft-rank1-factors`: the adapter "
        "(`freeze_base`). Loops: `tuned` is the benchmark's loop (cosine decay) at its grid's 3rd learning rate, not "
        "tuned (`--budget 1`: nothing is chosen on the split it is scored on); `plain` is Adam at 1e-3, constant, with "
        "the README's `convert` + `kl_loss` recipe. NLL, ECE, cNLL: lower is better; OOD AUROC: higher. "
        "\"sampled better\": the seeds in which the sampled evaluation was better. Percentages: sampled against the means.",
        "",
        table(reports),
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=quality.DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "eval_default")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=("small", "fashion", "finetune"), help="some of the three runs")
    parser.add_argument("--quick", action="store_true", help="quality.py --quick runs (a smoke test)")
    parser.add_argument("--table", nargs="+", type=Path, metavar="JSON", help="only the table, of these quality.json")
    args = parser.parse_args(argv)
    command = ("python benchmarks/eval_default.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    if args.table:
        reports = [json.loads(path.read_text()) for path in args.table]
        write(reports, args.out.with_suffix(".md"), command)
        print(f"wrote {args.out.with_suffix('.md')}")
        return
    paths = []
    for name, arguments in runs(args.data_dir, args.seeds, args.quick).items():
        if args.only and name not in args.only:
            continue
        quality.main([*arguments, "--out", str(args.out / name)])
        paths.append(args.out / name / "quality.json")
    write([json.loads(path.read_text()) for path in paths], args.out.with_suffix(".md"), command)
    print(f"wrote {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
