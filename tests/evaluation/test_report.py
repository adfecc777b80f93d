"""The report: reliability bins, plots with and without a baseline, the markdown page."""

import pytest
import torch

from bayesify.evaluation.report import _bins, markdown_report, reliability_diagram, severity_plot

PNG = b"\x89PNG\r\n\x1a\n"


def _probs(n: int = 200, classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    probs = (3 * torch.randn(n, classes, generator=generator, dtype=torch.float64)).softmax(-1)
    return probs, torch.randint(classes, (n,), generator=generator)


def test_reliability_bins_by_hand():
    probs, labels = _probs()
    accs, confs, counts = _bins(probs, labels, 10)
    conf, pred = probs.max(-1)
    for b in range(10):
        inside = (conf > b / 10) & (conf <= (b + 1) / 10)
        assert counts[b] == int(inside.sum())
        if counts[b]:
            assert accs[b] == pytest.approx(float((pred[inside] == labels[inside]).double().mean()))
            assert confs[b] == pytest.approx(float(conf[inside].mean()))
    assert sum(counts) == len(labels)


def test_plots_with_and_without_a_baseline(tmp_path):
    probs, labels = _probs()
    base_probs, _ = _probs(seed=1)
    alone = reliability_diagram(probs, labels, tmp_path / "r1.png", title="t", label="rank-1")
    beside = reliability_diagram(
        probs, labels, tmp_path / "r2.png", label="rank-1", baseline=(base_probs, labels), baseline_label="det"
    )
    by_severity = {str(s): {"nll": 0.2 * s, "accuracy": 0.9 - 0.1 * s, "ece": 0.02 * s} for s in (1, 2, 3)}
    clean = {"nll": 0.1, "accuracy": 0.95, "ece": 0.01, "brier": 0.1}
    curves = severity_plot(by_severity, tmp_path / "c1.png", clean=clean, label="rank-1")
    both = severity_plot(by_severity, tmp_path / "c2.png", clean=clean, baseline=by_severity, baseline_clean=clean)
    for path in (alone, beside, curves, both):
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def _corrupted(scale: float) -> dict:
    per = {s: {"nll": scale * s, "accuracy": 1 - 0.1 * s, "ece": 0.01 * s} for s in (1, 2)}
    return {"results": {"fog": per, "frost": per}, "by_severity": per, "mean": per[2]}


def test_the_report_records_the_configuration_and_explains_the_corruption_metrics():
    clean = {"nll": 0.25, "accuracy": 0.9, "ece": 0.03, "brier": 0.15, "components": 4, "samples": 2}
    config = {"model": "resnet18", "data": "digits", "components": 4, "prior": "normal", "decay_epochs": [80, 160]}
    text = markdown_report(
        clean, _corrupted(1.0), title="resnet18 on digits", config=config, settings={"samples": 2}, label="rank-1"
    )
    assert text.startswith("# resnet18 on digits")
    assert "| NLL | accuracy | ECE | Brier | cNLL | cA | cECE |" in text
    for line in (
        "- **cNLL**: the NLL averaged over the 2 corruption types x 2 severities (4 corrupted test sets).",
        "- **cA**: the accuracy averaged over the same 4 corrupted test sets.",
        "- **cECE**: the ECE (15 bins) averaged over the same 4 corrupted test sets.",
    ):
        assert line in text
    assert "## Configuration" in text and "| model | resnet18 |" in text and "| decay_epochs | 80, 160 |" in text
    assert "## Evaluation settings" in text and "| 0 | 0.2500 | 0.9000 | 0.0300 |" in text  # severity 0: clean


def test_the_report_puts_the_baseline_beside_the_model():
    clean = {"nll": 0.25, "accuracy": 0.9, "ece": 0.03, "brier": 0.15}
    base = {"nll": 0.5, "accuracy": 0.8, "ece": 0.06, "brier": 0.3}
    baseline = {"label": "det", "clean": base, "corrupted": _corrupted(2.0), "config": {"components": 0}}
    text = markdown_report(clean, _corrupted(1.0), label="rank-1", config={"components": 4}, baseline=baseline)
    assert "| det | 0.5000 | 0.8000 | 0.0600 | 0.3000 | 4.0000 | 0.8000 | 0.0200 |" in text
    assert "| rank-1 | 0.2500 | 0.9000 | 0.0300 | 0.1500 | 2.0000 | 0.8000 | 0.0200 |" in text
    assert "| severity | NLL det | NLL rank-1 | accuracy det | accuracy rank-1 | ECE det | ECE rank-1 |" in text
    assert "| 1 | 2.0000 | 1.0000 | 0.9000 | 0.9000 | 0.0100 | 0.0100 |" in text
    assert "| option | det | rank-1 |" in text and "| components | 0 | 4 |" in text
