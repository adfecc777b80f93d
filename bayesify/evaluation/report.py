"""The evaluation report: a markdown page, a reliability diagram and corruption curves (PNG).

Plots use matplotlib's Agg backend (no display needed) and are written next to the report.
When a baseline run (e.g. the deterministic network) is given, it is drawn beside the model
(reliability) or on the same axes (corruptions), so the two read at a glance.

References:
    Guo et al., "On Calibration of Modern Neural Networks", ICML 2017 (reliability diagrams, ECE).
    Dusenberry et al., ICML 2020, Sec. 5 (cNLL, cA and cECE on CIFAR-10-C / ImageNet-C).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from bayesify.evaluation.metrics import expected_calibration_error

__all__ = ["markdown_report", "reliability_diagram", "severity_plot", "write_json"]

# colour-blind-safe pairs (Okabe & Ito): the model, the baseline; over- and under-confidence
_MODEL, _BASELINE = "#0072B2", "#E69F00"
_OVER, _UNDER = "#D55E00", "#009E73"
_METRICS = ("nll", "accuracy", "ece")
_NAMES = {"nll": "NLL", "accuracy": "accuracy", "ece": "ECE"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | os.PathLike) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    return path


# ---- reliability diagram ----------------------------------------------------------------------


def _bins(probs: Tensor, labels: Tensor, bins: int) -> tuple[list[float], list[float], list[int]]:
    # per equal-width bin (lo, hi] of top-1 confidence: accuracy, mean confidence, count
    conf, pred = probs.double().max(-1)
    correct = (pred == labels).double()
    index = (torch.ceil(conf * bins).long() - 1).clamp(0, bins - 1)
    counts = torch.bincount(index, minlength=bins)
    hits = torch.bincount(index, weights=correct, minlength=bins)
    confidence = torch.bincount(index, weights=conf, minlength=bins)
    safe = counts.clamp(min=1)
    return (hits / safe).tolist(), (confidence / safe).tolist(), counts.tolist()


def reliability_diagram(
    probs: Tensor,
    labels: Tensor,
    path: str | os.PathLike,
    *,
    bins: int = 15,
    title: str = "",
    label: str = "",
    baseline: tuple[Tensor, Tensor] | None = None,
    baseline_label: str = "baseline",
) -> Path:
    """Accuracy against confidence in ``bins`` equal-width bins, ECE printed; saved as PNG.

    Each bin shows its accuracy (the bar, to its full height), its mean confidence (a black tick)
    and the gap between them, hatched: red above the bar where the model is overconfident
    (confidence above accuracy), green inside it where it is underconfident. Under it, how many
    test examples fall in each bin. The ECE, NLL and accuracy of the predictions are printed
    on the panel (ECE with the same 15-bin estimator as the report).

    Args:
        probs: ``[N, C]`` predictive probabilities (the mixture's, for a rank-1 model).
        labels: ``[N]`` integer labels.
        path: the PNG to write.
        bins: confidence bins (paper: 15).
        title: the figure's title.
        label: the model's name on its panel.
        baseline: ``(probs, labels)`` of a baseline model, drawn in a panel to the left.
        baseline_label: the baseline's name on its panel.

    Example:
        >>> reliability_diagram(probs, labels, "reliability.png", label="rank-1 K=4")

    References:
        Guo et al., ICML 2017, Sec. 2 (reliability diagrams and ECE).
    """
    plt = _pyplot()
    panels = [(baseline_label, *baseline)] if baseline is not None else []
    panels.append((label or "model", probs, labels))
    fig, axes = plt.subplots(
        2, len(panels), figsize=(4.6 * len(panels), 6.0), squeeze=False, sharex=True,
        gridspec_kw={"height_ratios": [3.2, 1], "hspace": 0.08, "wspace": 0.1},
    )  # fmt: skip
    for column, (name, p, y) in enumerate(panels):
        _reliability_panel(axes[0, column], axes[1, column], p, y, bins, name, show_ylabel=column == 0)
    fig.legend(handles=_reliability_legend(), loc="upper center", ncol=2, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.95))  # fmt: skip
    fig.suptitle(title or "reliability diagram", fontsize=11, y=0.995)
    fig.subplots_adjust(top=0.76)  # room for the three rows of the legend
    return _save(fig, path)


def _reliability_legend() -> list[Any]:
    # drawn from proxies, not from a panel: a panel without (say) underconfident bins has no such bar to show
    from matplotlib.colors import to_rgba
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    with _pyplot().rc_context({"hatch.linewidth": 1.6}):  # as the bars: green lines over the blue accuracy
        under = Patch(facecolor=to_rgba(_MODEL, 0.85), edgecolor=_UNDER, hatch="\\\\", linewidth=1.2,
                      label="gap: underconfident (confidence below accuracy)")  # fmt: skip
    return [
        Patch(facecolor=_MODEL, alpha=0.85, edgecolor="white", label="accuracy"),
        Patch(facecolor=_OVER, alpha=0.45, edgecolor=_OVER, hatch="///",
              label="gap: overconfident (confidence above accuracy)"),  # fmt: skip
        Line2D([], [], color="black", linewidth=1.4, label="mean confidence"),
        under,
        Line2D([], [], color="0.3", linestyle="--", linewidth=1, label="perfect calibration"),
    ]


def _reliability_panel(
    ax: Any, hist: Any, probs: Tensor, labels: Tensor, bins: int, name: str, *, show_ylabel: bool
) -> None:
    accs, confs, counts = _bins(probs, labels, bins)
    width = 1.0 / bins
    centers = [(b + 0.5) * width for b in range(bins)]
    filled = [b for b in range(bins) if counts[b]]

    # the blue bar is the bin's accuracy, always to its full height; the hatched part is the gap to the bin's
    # mean confidence (the black tick): above the bar (red) where the model claims more than it delivers,
    # inside it (green) where it delivers more than it claims
    ax.bar([centers[b] for b in filled], [accs[b] for b in filled], width=width, color=_MODEL, alpha=0.85,
           edgecolor="white", linewidth=0.6, label="accuracy", zorder=2)  # fmt: skip
    over = [b for b in filled if confs[b] > accs[b]]
    ax.bar([centers[b] for b in over], [confs[b] - accs[b] for b in over], bottom=[accs[b] for b in over],
           width=width, color=_OVER, alpha=0.45, edgecolor=_OVER, linewidth=1.0, hatch="///",
           label="gap: overconfident (confidence above accuracy)", zorder=3)  # fmt: skip
    under = [b for b in filled if confs[b] < accs[b]]  # hatched lines only: the blue bar shows through
    with _pyplot().rc_context({"hatch.linewidth": 1.6}):
        ax.bar([centers[b] for b in under], [accs[b] - confs[b] for b in under], bottom=[confs[b] for b in under],
               width=width, facecolor="none", edgecolor=_UNDER, linewidth=1.2, hatch="\\\\",
               label="gap: underconfident (confidence below accuracy)", zorder=3)  # fmt: skip
    ax.hlines([confs[b] for b in filled], [centers[b] - 0.4 * width for b in filled],
              [centers[b] + 0.4 * width for b in filled], color="black", linewidth=1.4, label="mean confidence",
              zorder=5)  # fmt: skip
    ax.plot([0, 1], [0, 1], linestyle="--", color="0.3", linewidth=1, label="perfect calibration", zorder=4)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.25, zorder=0)

    probs64 = probs.double()
    picked = probs64.gather(-1, labels.long().view(-1, 1)).squeeze(-1)
    ece = float(expected_calibration_error(probs.float(), labels.long(), bins))
    nll = float(-picked.log().mean())
    accuracy = float((probs64.argmax(-1) == labels).double().mean())
    ax.set_title(f"{name}\nECE {ece:.4f}   NLL {nll:.4f}   accuracy {accuracy:.4f}", fontsize=9.5)
    if show_ylabel:
        ax.set_ylabel("accuracy")
    else:
        ax.tick_params(labelleft=False)

    hist.bar(centers, counts, width=width, color="0.55", edgecolor="white", linewidth=0.6)
    top = max(counts) or 1
    for b in filled:
        hist.text(centers[b], counts[b] + 0.03 * top, str(counts[b]), ha="center", va="bottom", fontsize=6.5)
    # the counts stay in the lower 60% of the panel (the tallest bar at 1 / 1.9, its count just above):
    # the band above holds the panel's label, clear of every count
    hist.set_ylim(0, top * 1.9)
    hist.set_xlim(0, 1)
    hist.set_xlabel("confidence (top-1 probability)")
    hist.grid(axis="y", alpha=0.25)
    hist.text(0.02, 0.96, f"examples per bin ({len(labels)} in all)", transform=hist.transAxes, fontsize=7, va="top")
    if show_ylabel:
        hist.set_ylabel("examples")
    else:
        hist.tick_params(labelleft=False)


# ---- corruption severity curves ---------------------------------------------------------------


def severity_plot(
    by_severity: Mapping[Any, Mapping[str, float]],
    path: str | os.PathLike,
    *,
    title: str = "",
    clean: Mapping[str, float] | None = None,
    label: str = "",
    baseline: Mapping[Any, Mapping[str, float]] | None = None,
    baseline_clean: Mapping[str, float] | None = None,
    baseline_label: str = "baseline",
) -> Path:
    """Accuracy, NLL and ECE against corruption severity, one panel each; saved as PNG.

    Severity 0 is the clean test set when ``clean`` is given. A baseline is drawn on the same
    axes. The axes are fixed where the metric allows (accuracy 0 to 1; NLL and ECE from 0), so a
    small change looks small.

    Args:
        by_severity: ``{severity: {"nll", "accuracy", "ece"}}``, each the mean over corruption
            types (``evaluate_corruptions(...)["by_severity"]``; keys may be strings, from JSON).
        path: the PNG to write.
        title: the figure's title.
        clean: the metrics on the clean test set (plotted at severity 0).
        label: the model's name in the legend.
        baseline, baseline_clean, baseline_label: the same for a baseline model.

    Example:
        >>> severity_plot(rank1["by_severity"], "corruptions.png", clean=clean, label="rank-1 K=4",
        ...               baseline=det["by_severity"], baseline_clean=det_clean, baseline_label="deterministic")
    """
    plt = _pyplot()
    curves = []
    if baseline is not None:
        curves.append((baseline_label, _curve(baseline, baseline_clean), _BASELINE, "s", "--"))
    curves.append((label or "model", _curve(by_severity, clean), _MODEL, "o", "-"))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key in zip(axes, ("accuracy", "nll", "ece")):
        peak = 0.0
        for name, points, color, marker, style in curves:
            xs = sorted(points)
            ys = [points[s][key] for s in xs]
            peak = max(peak, *(y for y in ys if math.isfinite(y)), 0.0)
            ax.plot(xs, ys, marker=marker, linestyle=style, color=color, label=name, linewidth=1.8, markersize=5)
        severities = sorted({s for _, points, *_ in curves for s in points})
        ax.set_xticks(severities)
        ax.set_xticklabels(["clean" if s == 0 else str(s) for s in severities])
        ax.set_xlabel("corruption severity")
        ax.set_title(_NAMES[key] + (" (higher is better)" if key == "accuracy" else " (lower is better)"), fontsize=10)
        ax.set_ylim(0, 1.0 if key == "accuracy" else max(peak * 1.15, 1e-3))
        ax.grid(alpha=0.25)
    axes[0].legend(loc="lower left", fontsize=8)
    fig.suptitle(title or "corrupted test sets (mean over corruption types)", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def _curve(
    by_severity: Mapping[Any, Mapping[str, float]], clean: Mapping[str, Any] | None
) -> dict[int, Mapping[str, float]]:
    points: dict[int, Mapping[str, float]] = {int(s): m for s, m in by_severity.items()}
    if clean is not None:
        points[0] = {key: float(clean[key]) for key in _METRICS}
    return points


# ---- markdown ---------------------------------------------------------------------------------


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _option(value: object) -> str:
    # a configuration value as a reader would type it
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(_option(v) for v in value) if value else "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines + [""]


# a regression's headline (bayesify.evaluation.regression): the point error, the predictive's NLL and calibration
_REGRESSION = (("rmse", "RMSE"), ("mae", "MAE"), ("nll", "NLL"), ("calibration_error", "calibration error"),
               ("sharpness", "sharpness"))  # fmt: skip


def _is_regression(metrics: Mapping[str, Any]) -> bool:
    return "rmse" in metrics and "accuracy" not in metrics


def _headline(metrics: Mapping[str, Any], corrupted: Mapping[str, Any] | None, binary: bool) -> list[object]:
    if _is_regression(metrics):
        coverage = metrics.get("coverage") or {}
        return [metrics.get(key) if metrics.get(key) is not None else "-" for key, _ in _REGRESSION] + [
            coverage.get(0.9, coverage.get("0.9", "-"))
        ]
    row = [metrics["nll"], metrics["accuracy"], metrics["ece"], metrics["brier"]]
    if binary:
        row += [metrics.get("auc_pr", "-"), metrics.get("auc_roc", "-")]
    if corrupted is not None:
        row += [corrupted["mean"][key] for key in _METRICS]
    return row


def _mean_over_severities(per: Mapping[Any, Mapping[str, float]]) -> dict[str, float]:
    rows = list(per.values())
    return {key: sum(r[key] for r in rows) / len(rows) for key in _METRICS}


def markdown_report(
    clean: Mapping[str, Any],
    corrupted: Mapping[str, Any] | None = None,
    *,
    title: str = "",
    images: Mapping[str, str] | None = None,
    config: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
    label: str = "",
    baseline: Mapping[str, Any] | None = None,
) -> str:
    """The evaluation as markdown: headline table, members, corruptions, plots, configuration.

    Args:
        clean: :func:`~bayesify.evaluation.metrics.compute_metrics` on the clean test set
            (with ``components`` and ``samples``).
        corrupted: :func:`~bayesify.evaluation.evaluate_corruptions`'s result, or None.
        title: the page's title.
        images: ``{caption: file}`` of plots to show.
        config: the run's training configuration (the checkpoint's ``config``), as a table.
        settings: how the evaluation ran (samples, batch size, corruptions ...), as a table.
        label: the model's name in tables that compare it with the baseline.
        baseline: ``{"label", "clean", "corrupted", "config"?}`` of a baseline run, shown beside
            the model in every table.

    Example:
        >>> text = markdown_report(clean, corrupted, title="resnet18 on digits", config=config.to_dict())
    """
    label = label or "model"
    rows = [(label, clean, corrupted)]
    if baseline is not None:
        rows.insert(0, (baseline["label"], baseline["clean"], baseline.get("corrupted")))

    lines = [f"# {title or 'bayesify evaluation'}", ""]
    lines += _headline_section(rows, compared=baseline is not None)
    if clean.get("ood"):
        lines += _ood_section(rows, settings or {})
    if corrupted is not None:
        lines += _corruption_definitions(corrupted)
    if clean.get("members"):
        lines += _members_section(clean)
    if corrupted is not None:
        lines += _corruption_tables(rows if baseline is not None and baseline.get("corrupted") else rows[-1:])

    for caption, file in (images or {}).items():
        lines += [f"![{caption}]({file})", ""]

    if config is not None:
        lines += _configuration_section(config, label, baseline)
    if settings is not None:
        lines += ["## Evaluation settings", ""]
        lines += _table(["setting", "value"], [[k, _option(v)] for k, v in settings.items()])
    return "\n".join(lines)


def _headline_section(rows: Sequence[tuple[str, Mapping[str, Any], Any]], *, compared: bool) -> list[str]:
    """The members line, the headline table (a row per model when ``compared`` with a baseline) and its legend.

    ``rows``: ``(label, clean, corrupted)`` of each model, the one under evaluation last."""

    label, clean, corrupted = rows[-1]
    binary = any("auc_pr" in metrics for _, metrics, _ in rows)
    has_corruptions = corrupted is not None
    if _is_regression(clean):
        head = [name for _, name in _REGRESSION] + ["90% interval coverage"]
    else:
        head = ["NLL", "accuracy", "ECE", "Brier"] + (["AUC-PR", "AUC-ROC"] if binary else [])
    head += ["cNLL", "cA", "cECE"] if has_corruptions else []
    members = f"K = {clean.get('components', 1)} components x M = {clean.get('samples', 1)} samples per component"
    lines = [f"{label}: {members}" if compared else members, ""]
    if not compared:
        lines += _table(head, [_headline(clean, corrupted, binary)])
    else:
        lines += _table(["model", *head], [[name, *_headline(m, c, binary)] for name, m, c in rows])
    if _is_regression(clean):
        lines.append(
            "Lower is better for RMSE, MAE, NLL and the calibration error (|expected - observed| interval coverage, "
            "averaged over levels 5%..95%); sharpness is the mean predictive std; a calibrated 90% interval covers "
            "0.9. RMSE, MAE, NLL and sharpness are in the units of the targets the model was trained on: the built-in "
            "tabular sets standardise them (RMSE, MAE and sharpness times the data set's target_std are in the "
            "original units; NLL plus log(target_std))."
        )
    else:
        lines.append(
            "Lower is better for NLL, ECE, Brier" + (", cNLL and cECE" if has_corruptions else "")
            + "; higher for accuracy" + (" and cA" if has_corruptions else "") + "."
        )  # fmt: skip
    lines.append("")
    return lines


def _corruption_definitions(corrupted: Mapping[str, Any]) -> list[str]:
    """What cNLL, cA and cECE average over, with the numbers of corruption types and severities."""

    types, severities = len(corrupted["results"]), len(corrupted["by_severity"])
    sets = f"{types} corruption types x {severities} severities ({types * severities} corrupted test sets)"
    return [
        f"- **cNLL**: the NLL averaged over the {sets}.",
        f"- **cA**: the accuracy averaged over the same {types * severities} corrupted test sets.",
        f"- **cECE**: the ECE (15 bins) averaged over the same {types * severities} corrupted test sets.",
        "",
    ]


def _members_section(clean: Mapping[str, Any]) -> list[str]:
    """Each component's NLL and accuracy, and the members' diversity."""

    lines = ["## Members", ""]
    lines += _table(
        ["component", "NLL", "accuracy"], [[k, m["nll"], m["accuracy"]] for k, m in enumerate(clean["members"])]
    )
    d = clean["diversity"]
    lines += [
        (
            f"Diversity: disagreement {d['disagreement']:.4f}, normalised by (1 - accuracy) "
            f"{d['normalized_disagreement']:.4f}, mean pairwise KL {d['kl']:.4f}"
        ),
        "",
    ]
    return lines


def _configuration_section(config: Mapping[str, Any], label: str, baseline: Mapping[str, Any] | None) -> list[str]:
    """The training configuration as a table; beside the baseline's, option by option, when it has one."""

    lines = ["## Configuration", ""]
    if baseline is not None and baseline.get("config") is not None:
        other = baseline["config"]
        keys = list(config) + [k for k in other if k not in config]
        lines += _table(
            ["option", baseline["label"], label],
            [[k, _option(other.get(k)), _option(config.get(k))] for k in keys],
        )
    else:
        lines += _table(["option", "value"], [[k, _option(v)] for k, v in config.items()])
    return lines


def _ood_section(rows: Sequence[tuple[str, Mapping[str, Any], Any]], settings: Mapping[str, Any]) -> list[str]:
    # what the OOD set is, what each model's scores were computed from, and a note where a score says little
    lines = ["## Out-of-distribution detection", ""]
    if settings.get("ood_set"):
        lines += [f"OOD set `{settings.get('ood')}`: {settings['ood_set']}.", ""]
    lines += [
        "How well each uncertainty score tells the OOD set from the test set (higher score = more OOD): AUROC and "
        "AUPR (OOD as positive) higher is better, FPR@95 (false positives at 95% of OOD detected) lower. "
        "An AUROC of 0.5 is chance.",
        "",
    ]
    scored = [(name, metrics["ood_scoring"], metrics) for name, metrics, _ in rows if metrics.get("ood_scoring")]
    for name, scoring, metrics in scored:
        k, m = scoring["components"], scoring["samples"]
        if scoring["sampled"]:
            spread = metrics.get("diversity", {}).get("kl")
            means = f" (mean pairwise KL {spread:.4f})" if spread is not None and metrics.get("samples") == 1 else ""
            source = (
                f"K x M = {k} x {m} = {k * m} members drawn from the posterior, as bayesify.uncertainty draws them: "
                "the epistemic score (the members' disagreement) needs the posterior's spread"
            )
            if metrics.get("samples") == 1:
                source += f"; the {k} posterior-mean members of the tables above barely differ{means}"
        else:
            source = "its one network: with no members to disagree, its epistemic score is 0 everywhere"
        lines.append(f"- {name}: scores from {source}." if len(rows) > 1 else f"Scores from {source}.")
    lines += [""] if scored else []
    table = []
    for name, metrics, _ in rows:
        notes = (metrics.get("ood_scoring") or {}).get("notes", {})
        for score, values in (metrics.get("ood") or {}).items():
            table.append([name, score, values["auroc"], values["aupr_out"], values["fpr95"], notes.get(score, "")])
    return lines + _table(["model", "score", "AUROC", "AUPR", "FPR@95", "note"], table)


def _corruption_tables(rows: Sequence[tuple[str, Mapping[str, Any], Mapping[str, Any] | None]]) -> list[str]:
    # one column per (metric, model); severity 0 is the clean test set
    names = [name for name, _, _ in rows]
    compare = len(rows) > 1
    head = [f"{_NAMES[key]} {name}" if compare else _NAMES[key] for key in _METRICS for name in names]
    lines = ["## Corruptions", "", "Mean over corruption types, by severity (0: the clean test set):", ""]
    table = [[0, *[clean[key] for key in _METRICS for _, clean, _ in rows]]]
    first = rows[-1][2]
    assert first is not None
    for severity in sorted(first["by_severity"], key=int):
        table.append([severity, *[c["by_severity"][severity][key] for key in _METRICS for _, _, c in rows]])
    lines += _table(["severity", *head], table)
    lines += ["Mean over severities, by corruption:", ""]
    table = []
    for corruption in first["results"]:
        means = [_mean_over_severities(c["results"][corruption]) for _, _, c in rows]
        table.append([corruption, *[m[key] for key in _METRICS for m in means]])
    lines += _table(["corruption", *head], table)
    return lines


def write_json(data: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write ``data`` as indented JSON (int keys become strings)."""
    path = Path(path)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path
