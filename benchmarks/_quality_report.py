"""The report of ``benchmarks/quality.py``: mean +- std over seeds, ratios, markdown, JSON and plots."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

__all__ = ["aggregate", "write_report"]

CLASSIFICATION_COLUMNS = (
    ("nll", "NLL"), ("accuracy", "acc"), ("ece", "ECE"), ("brier", "Brier"),
    ("c_nll", "cNLL"), ("c_accuracy", "cA"), ("c_ece", "cECE"),
)  # fmt: skip
AURC_COLUMN = (("aurc", "AURC"),)  # selective prediction, shown where the runs have it
OOD_SCORES = (("max_probability", "max prob."), ("entropy", "entropy"), ("mutual_information", "MI"))
OOD_METRICS = (("auroc", "AUROC"), ("aupr_out", "AUPR"), ("fpr95", "FPR@95"))
BINARY_COLUMNS = (("auc_pr", "AUC-PR"), ("auc_roc", "AUC-ROC"))
REGRESSION_COLUMNS = (
    ("nll", "NLL"), ("rmse", "RMSE"), ("coverage", "90% cov."), ("width", "90% width"),
    ("c_nll", "cNLL"), ("c_rmse", "cRMSE"), ("c_coverage", "c 90% cov."),
)  # fmt: skip
RELATIVE = ("nll", "ece", "c_nll", "c_ece")  # shown with their change against the deterministic baseline
COST_COLUMNS = (("train_x", "train x"), ("eval_x", "eval x"), ("params_x", "params x"))
# fine-tuning: the rank-1 fine-tune against what a user would do instead (issue 29's comparisons)
SUBJECTS = ("ft-rank1", "ft-rank1-sampled")
ALTERNATIVES = ("ft-deterministic", "ft-temperature", "ft-laplace", "ft-laplace-all", "ft-ensemble")
COMPARED = (("nll", "NLL", -1), ("ece", "ECE", -1), ("c_nll", "cNLL", -1), ("accuracy", "acc", 1),
            ("ood_entropy_auroc", "OOD AUROC", 1))  # fmt: skip


def _baseline(result: dict[str, Any]) -> str:
    return "deterministic" if "deterministic" in result["methods"] else "ft-deterministic"


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aggregate(result: dict[str, Any]) -> dict[str, dict[str, tuple[float, float]]]:
    """``{method: {metric: (mean, std)}}`` over seeds, with cost ratios to the baseline of the same seed."""
    base_runs = {r["seed"]: r for r in result["methods"][_baseline(result)]["runs"]}
    table: dict[str, dict[str, tuple[float, float]]] = {}
    for key, method in result["methods"].items():
        runs = method["runs"]
        metrics = sorted({k for r in runs for k, v in r.items() if isinstance(v, (int, float)) and k != "seed"})
        row = {k: _mean_std([r.get(k) for r in runs]) for k in metrics}

        def ratio(field: str) -> list[float]:
            return [r[field] / base_runs[r["seed"]][field] for r in runs if base_runs[r["seed"]][field] > 0]

        row["train_x"] = _mean_std(ratio("train_s"))
        row["eval_x"] = _mean_std(ratio("eval_s"))
        row["params_x"] = _mean_std(ratio("params"))
        table[key] = row
    return table


def _number(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.3g}" if abs(value) >= 10 else f"{value:.4f}" if abs(value) < 1 else f"{value:.3f}"


def _cell(row: dict[str, tuple[float, float]], key: str, base: dict[str, tuple[float, float]] | None) -> str:
    mean, std = row.get(key, (math.nan, math.nan))
    text = f"{_number(mean)} +- {_number(std)}"
    if base is not None and key in RELATIVE and key in base and base[key][0] and not math.isnan(mean):
        text += f" ({100 * (mean / base[key][0] - 1):+.0f}%)"
    return text


def _columns(result: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    if result["kind"] == "regression":
        return REGRESSION_COLUMNS
    binary = any("auc_pr" in r for m in result["methods"].values() for r in m["runs"])
    aurc = all("aurc" in r for m in result["methods"].values() for r in m["runs"])
    return CLASSIFICATION_COLUMNS + (AURC_COLUMN if aurc else ()) + (BINARY_COLUMNS if binary else ())


def _has_ood(result: dict[str, Any]) -> bool:
    return any("ood_entropy_auroc" in r for m in result["methods"].values() for r in m["runs"])


def ood_markdown(result: dict[str, Any]) -> list[str]:
    """The out-of-distribution table: AUROC / AUPR (OOD positive) / FPR@95 of each score, mean +- std over seeds."""
    table = aggregate(result)
    header = [f"{metric} {score}" for _, score in OOD_SCORES for _, metric in OOD_METRICS]
    lines = [
        "",
        f"Out-of-distribution detection, {result.get('ood')} test ({result.get('num_ood')} images) against the "
        f"test set: AUROC, AUPR with OOD as positive (higher is better), FPR at 95% TPR (lower is better), "
        "for max probability, predictive entropy and mutual information (MI: 0.5 for one member). "
        "`*`: through `bayesify.evaluation.evaluate(..., ood=...)`; the others: its functions on the method's members.",
        "",
        "| method | " + " | ".join(header) + " |",
        "|---" * (1 + len(header)) + "|",
    ]
    for key, method in result["methods"].items():
        row = table[key]
        cells = [_cell(row, f"ood_{score}_{metric}", None) for score, _ in OOD_SCORES for metric, _ in OOD_METRICS]
        star = "*" if row.get("ood_via_evaluate", (0.0, 0.0))[0] == 1.0 else ""
        lines.append(f"| `{key}`{star} | " + " | ".join(cells) + " |")
    return lines


def comparison_markdown(result: dict[str, Any]) -> list[str]:
    """The rank-1 fine-tune against each alternative: the change of the seed means (accuracy, OOD AUROC: the
    difference), and in how many seeds rank-1 was better (paired by seed)."""
    methods = result["methods"]
    pairs = [(s, a) for s in SUBJECTS for a in ALTERNATIVES if s in methods and a in methods]
    if not pairs:
        return []
    lines = [
        "",
        "The rank-1 fine-tune against the alternatives: change of the mean over seeds (NLL, ECE, cNLL: relative, "
        "lower is better; accuracy in points and OOD AUROC by entropy: difference, higher is better), and the seeds in which "
        "rank-1 was better.",
        "",
        "| rank-1 | against | " + " | ".join(label for _, label, _ in COMPARED) + " |",
        "|---" * (2 + len(COMPARED)) + "|",
    ]
    for subject, other in pairs:
        mine = {r["seed"]: r for r in methods[subject]["runs"]}
        theirs = {r["seed"]: r for r in methods[other]["runs"]}
        seeds = sorted(set(mine) & set(theirs))
        cells = []
        for metric, _, sign in COMPARED:
            paired = [(mine[s][metric], theirs[s][metric]) for s in seeds if metric in mine[s] and metric in theirs[s]]
            if not paired:
                cells.append("-")
                continue
            a, b = statistics.fmean(p[0] for p in paired), statistics.fmean(p[1] for p in paired)
            if metric == "accuracy":
                change = f"{100 * (a - b):+.2f} pt"
            else:
                change = f"{a - b:+.4f}" if sign > 0 else (f"{100 * (a / b - 1):+.0f}%" if b else "-")
            better = sum(sign * (x - y) > 0 for x, y in paired)
            cells.append(f"{change} ({better}/{len(paired)})")
        lines.append(f"| `{subject}` | `{other}` | " + " | ".join(cells) + " |")
    return lines


def task_markdown(result: dict[str, Any]) -> str:
    """One task's section: what it is, the tuned configurations and the table."""
    table = aggregate(result)
    base_key = _baseline(result)
    columns = _columns(result)
    seeds = len(next(iter(result["methods"].values()))["runs"])
    lines = [
        f"## {result['task']}",
        "",
        f"{result['description']}. Train / val / test: {result['num_train']} / {result['num_val']} / "
        f"{result['num_test']}; {result['epochs']} epochs, batch {result['batch_size']}; "
        f"{result['shifted_sets']} shifted test sets"
        + (f" of {result['shift_examples']} images" if result.get("shift_examples", result["num_test"]) != result["num_test"] else "")
        + (f"; {result['loop']} loop" if result.get("loop") else "")
        + f"; {seeds} seeds, mean +- std; "
        f"percentages: change against `{base_key}`; costs: ratios to `{base_key}` of the same seed.",
        "",
        "| method | " + " | ".join(label for _, label in columns + COST_COLUMNS) + " |",
        "|---" * (1 + len(columns) + len(COST_COLUMNS)) + "|",
    ]
    for key, method in result["methods"].items():
        row = table[key]
        cells = [_cell(row, k, table[base_key] if key != base_key else None) for k, _ in columns]
        cells += [_number(row[k][0]) for k, _ in COST_COLUMNS]
        lines.append(f"| {method['label']} (`{key}`) | " + " | ".join(cells) + " |")
    lines += comparison_markdown(result)
    if _has_ood(result):
        lines += ood_markdown(result)
    plain = result.get("loop") == "plain"
    lines += ["", "Settings (plain loop: fixed, not tuned):" if plain else
              "Tuned on the validation split (learning rate, and the method's own knob):", ""]  # fmt: skip
    for key, method in result["methods"].items():
        config = method["config"]
        if config.get("lr") is None:
            lines.append(f"- `{key}`: no training")
            continue
        knob = f", knob {config['knob']}" if config.get("knob") is not None else ""
        scores = config.get("val_nll")
        tried = ""
        if scores and len(scores) > 1:
            tried = "; val NLL " + ", ".join(
                f"{c['lr']:g}{'/' + str(c['knob']) if c.get('knob') is not None else ''}: {s:.4f}"
                for c, s in zip(config["grid"], scores)
            )
        lines.append(f"- `{key}`: lr {config['lr']:g}{knob}{tried}")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": _device_name(),
    }


def _device_name() -> str:
    from benchmarks._quality_methods import device

    where = device()
    return torch.cuda.get_device_name(where) if where.type == "cuda" else "cpu"


def plot(result: dict[str, Any], path: Path) -> None:
    """NLL and ECE (regression: |90% coverage - 0.9|), and OOD AUROC (predictive entropy) where measured,
    against the training-time ratio, one point per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = aggregate(result)
    regression = result["kind"] == "regression"
    panels = [("nll", "test NLL"), ("coverage", "|90% coverage - 0.9|") if regression else ("ece", "test ECE")]
    if _has_ood(result):
        panels.append(("ood_entropy_auroc", f"OOD AUROC, entropy ({result.get('ood')}; higher: better)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2))
    for ax, (metric, label) in zip(axes, panels):
        for key, row in table.items():
            x, y = row["train_x"][0], row[metric][0]
            if regression and metric == "coverage":
                y = abs(y - 0.9)
            if math.isnan(x) or x <= 0:
                continue
            ax.errorbar(x, y, yerr=row[metric][1], fmt="o", capsize=3)
            ax.annotate(key, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel(f"training time / {_baseline(result)}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['task']}: quality against training cost (mean +- std over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    results: list[dict[str, Any]],
    out: Path,
    *,
    command: str,
    seconds: float,
    budget: int,
    info: dict[str, Any] | None = None,
    date: str | None = None,
) -> None:
    """``quality.md``, ``quality.json`` and ``quality_<task>.png`` in ``out`` (machine and date: this one's, now)."""
    out.mkdir(parents=True, exist_ok=True)
    info = info or machine()
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = [
        "# bayesify quality benchmark",
        "",
        f"Command: `{command}`  ",
        f"Machine: {info['platform']}, {info['cpu_count']} CPUs, Python {info['python']}, torch {info['torch']}, "
        f"{info['threads']} thread(s), models on {info.get('device', 'cpu')}; {date}; {seconds / 60:.1f} min in all.  ",
        f"Tuning budget: {budget} validation run(s) per method (see `benchmarks/quality.py`).",
        "",
    ]
    body = [task_markdown(r) + f"\n\n![{r['task']}](quality_{r['task']}.png)\n" for r in results]
    (out / "quality.md").write_text("\n".join(header) + "\n" + "\n".join(body))
    payload = {"command": command, "machine": info, "date": date, "seconds": seconds, "budget": budget,
               "tasks": results, "summary": {r["task"]: aggregate(r) for r in results}}  # fmt: skip
    (out / "quality.json").write_text(json.dumps(payload, indent=1, default=_jsonable))
    for r in results:
        plot(r, out / f"quality_{r['task']}.png")


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
