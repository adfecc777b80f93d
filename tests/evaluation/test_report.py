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


def _panel(probs: torch.Tensor, labels: torch.Tensor, bins: int = 15):
    """One reliability panel drawn on a figure of its own: ``(figure, diagram axes, histogram axes)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bayesify.evaluation.report import _reliability_panel

    fig, (ax, hist) = plt.subplots(2, 1, figsize=(4.6, 6.0), sharex=True, gridspec_kw={"height_ratios": [3.2, 1]})
    _reliability_panel(ax, hist, probs, labels, bins, "model", show_ylabel=True)
    fig.canvas.draw()
    return fig, ax, hist


def _underconfident(n: int = 400, classes: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A hedging classifier: confidence 0.1-0.4 (many examples at low confidence), right far more often."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (n,), generator=generator)
    logits = 0.4 * torch.randn(n, classes, generator=generator, dtype=torch.float64)
    logits[torch.arange(n), labels] += 0.8  # the true class on top for most examples, at a low probability
    return logits.softmax(-1), labels


def test_the_accuracy_bar_reaches_the_accuracy_in_every_bin():
    probs, labels = _underconfident()
    accs, confs, counts = _bins(probs, labels, 15)
    assert any(counts[b] and accs[b] > confs[b] + 0.1 for b in range(15)), "underconfident bins"
    fig, ax, _ = _panel(probs, labels)
    (bars,) = [c for c in ax.containers if c.get_label() == "accuracy"]
    assert [bar.get_height() for bar in bars] == pytest.approx([accs[b] for b in range(15) if counts[b]])
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.mark.parametrize("make", [_underconfident, _probs], ids=["low-confidence", "spread"])
def test_the_examples_per_bin_label_clears_every_count(make):
    probs, labels = make()
    fig, _, hist = _panel(probs, labels)
    renderer = fig.canvas.get_renderer()
    (label,) = [t for t in hist.texts if t.get_text().startswith("examples per bin")]
    counts = [t for t in hist.texts if t is not label]
    assert counts and all(not label.get_window_extent(renderer).overlaps(t.get_window_extent(renderer)) for t in counts)
    for bar in hist.patches:  # nor any bar
        assert not label.get_window_extent(renderer).overlaps(bar.get_window_extent(renderer))
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_report_says_what_the_ood_set_is_and_how_each_model_was_scored():
    table = {"max_probability": {"auroc": 0.9, "aupr_out": 0.8, "fpr95": 0.3}}
    table["mutual_information"] = {"auroc": 0.5, "aupr_out": 0.5, "fpr95": 1.0}
    uninformative = "uninformative: 0 on every example (one member, none to disagree)"
    model = {"nll": 0.25, "accuracy": 0.9, "ece": 0.03, "brier": 0.15, "components": 4, "samples": 1,
             "diversity": {"kl": 0.0003}, "ood": table,
             "ood_scoring": {"components": 4, "samples": 4, "sampled": True, "notes": {}}}  # fmt: skip
    det = {"nll": 0.5, "accuracy": 0.8, "ece": 0.06, "brier": 0.3, "components": 1, "samples": 1, "ood": table,
           "ood_scoring": {"components": 1, "samples": 1, "sampled": False,
                           "notes": {"mutual_information": uninformative}}}  # fmt: skip
    settings = {"ood": "noise", "ood_set": "20 inputs of uniform noise"}
    text = markdown_report(model, label="rank-1", settings=settings, baseline={"label": "det", "clean": det})
    assert "OOD set `noise`: 20 inputs of uniform noise." in text
    assert (
        "- rank-1: scores from K x M = 4 x 4 = 16 members drawn from the posterior, as bayesify.uncertainty draws "
        "them: the epistemic score (the members' disagreement) needs the posterior's spread; the 4 posterior-mean "
        "members of the tables above barely differ (mean pairwise KL 0.0003)."
    ) in text
    assert "- det: scores from its one network: with no members to disagree, its epistemic score is 0" in text
    assert f"| det | mutual_information | 0.5000 | 0.5000 | 1.0000 | {uninformative} |" in text
    assert "| rank-1 | mutual_information | 0.5000 | 0.5000 | 1.0000 |  |" in text
