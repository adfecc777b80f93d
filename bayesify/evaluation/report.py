"""The evaluation report: a markdown table, a reliability diagram and corruption curves (PNG).

Plots use matplotlib's Agg backend (no display needed) and are written next to the report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

__all__ = ["markdown_report", "reliability_diagram", "severity_plot", "write_json"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def reliability_diagram(
    probs: Tensor, labels: Tensor, path: str | os.PathLike, *, bins: int = 15, title: str = ""
) -> Path:
    """Accuracy vs confidence in ``bins`` equal-width bins, with the gap to the diagonal; saved as PNG."""
    plt = _pyplot()
    conf, pred = probs.float().max(-1)
    correct = (pred == labels).float()
    edges = torch.linspace(0, 1, bins + 1)
    centers = (edges[:-1] + edges[1:]) / 2
    accs, confs, counts = [], [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (conf > lo) & (conf <= hi)
        counts.append(int(inside.sum()))
        accs.append(float(correct[inside].mean()) if inside.any() else 0.0)
        confs.append(float(conf[inside].mean()) if inside.any() else 0.0)
    width = 1.0 / bins
    fig, (ax, hist) = plt.subplots(2, 1, figsize=(4.5, 5.5), gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    ax.bar(centers, accs, width=width, edgecolor="black", color="tab:blue", label="accuracy")
    gaps = [c - a if n else 0.0 for a, c, n in zip(accs, confs, counts)]
    ax.bar(centers, gaps, bottom=accs, width=width, edgecolor="tab:red", color="tab:red", alpha=0.3, label="gap")
    ax.plot([0, 1], [0, 1], "k--", linewidth=1)
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(title or "reliability diagram")
    ax.legend(loc="upper left")
    hist.bar(centers, counts, width=width, edgecolor="black", color="gray")
    hist.set_xlabel("confidence")
    hist.set_ylabel("count")
    hist.set_xlim(0, 1)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def severity_plot(by_severity: Mapping[int, Mapping[str, float]], path: str | os.PathLike, *, title: str = "") -> Path:
    """NLL, accuracy and ECE averaged over corruption types, against severity; saved as PNG."""
    plt = _pyplot()
    severities = sorted(int(s) for s in by_severity)
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    for ax, key in zip(axes, ("nll", "accuracy", "ece")):
        ax.plot(severities, [by_severity[s][key] for s in severities], "o-")
        ax.set_xlabel("severity")
        ax.set_title(key)
        ax.set_xticks(severities)
    fig.suptitle(title or "corrupted test sets (mean over corruption types)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def markdown_report(
    clean: Mapping[str, Any],
    corrupted: Mapping[str, Any] | None = None,
    *,
    title: str = "",
    images: Mapping[str, str] | None = None,
) -> str:
    """The evaluation as markdown: headline table, per-member table, corruption tables."""
    lines = [f"# {title or 'bayesify evaluation'}", ""]
    head = ["NLL", "accuracy", "ECE", "Brier"]
    row = [clean["nll"], clean["accuracy"], clean["ece"], clean["brier"]]
    if "auc_pr" in clean:
        head += ["AUC-PR", "AUC-ROC"]
        row += [clean["auc_pr"], clean["auc_roc"]]
    if corrupted is not None:
        head += ["cNLL", "cA", "cECE"]
        mean = corrupted["mean"]
        row += [mean["nll"], mean["accuracy"], mean["ece"]]
    lines += [
        f"K = {clean.get('components', 1)} components x M = {clean.get('samples', 1)} samples per component",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        "| " + " | ".join(_fmt(v) for v in row) + " |",
        "",
    ]
    members = clean.get("members")
    if members:
        lines += ["## Members", "", "| component | NLL | accuracy |", "|---|---|---|"]
        lines += [f"| {k} | {m['nll']:.4f} | {m['accuracy']:.4f} |" for k, m in enumerate(members)]
        d = clean["diversity"]
        lines += [
            "",
            f"Diversity: disagreement {d['disagreement']:.4f}, normalised by (1 - accuracy) "
            f"{d['normalized_disagreement']:.4f}, mean pairwise KL {d['kl']:.4f}",
            "",
        ]
    if corrupted is not None:
        lines += ["## Corruptions", "", "Mean over corruption types, by severity:", ""]
        lines += ["| severity | NLL | accuracy | ECE |", "|---|---|---|---|"]
        for s, m in sorted(corrupted["by_severity"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {s} | {m['nll']:.4f} | {m['accuracy']:.4f} | {m['ece']:.4f} |")
        lines += [
            "",
            "Mean over severities, by corruption:",
            "",
            "| corruption | NLL | accuracy | ECE |",
            "|---|---|---|---|",
        ]
        for name, per in corrupted["results"].items():
            rows = list(per.values())
            avg = {k: sum(r[k] for r in rows) / len(rows) for k in ("nll", "accuracy", "ece")}
            lines.append(f"| {name} | {avg['nll']:.4f} | {avg['accuracy']:.4f} | {avg['ece']:.4f} |")
        lines.append("")
    for caption, file in (images or {}).items():
        lines += [f"![{caption}]({file})", ""]
    return "\n".join(lines)


def write_json(data: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write ``data`` as indented JSON (int keys become strings)."""
    path = Path(path)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path
