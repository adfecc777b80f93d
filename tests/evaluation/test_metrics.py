"""Metrics on fixed inputs against hand-computed values, and torchmetrics against the formulas."""

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from bayesify.evaluation.metrics import (
    binary_auc,
    compute_metrics,
    diversity,
    ece_reference,
    expected_calibration_error,
    member_log_probs_from_logits,
    member_metrics,
    mixture_log_probs,
    negative_log_likelihood,
    risk_coverage,
)

# 2 components x 1 sample, 3 examples, 2 classes: probabilities written out so every number can be checked by hand
P = torch.tensor(
    [
        [[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]],  # member 0
        [[0.7, 0.3], [0.2, 0.8], [0.4, 0.6]],  # member 1
    ],
    dtype=torch.float64,
)
Y = torch.tensor([0, 1, 1])


def test_nll_is_the_log_of_the_mean_member_probability():
    # mean p(y): 0.8, 0.6, 0.7 -> NLL = -(ln 0.8 + ln 0.6 + ln 0.7) / 3
    expected = -(math.log(0.8) + math.log(0.6) + math.log(0.7)) / 3
    assert float(negative_log_likelihood(P.log(), Y)) == pytest.approx(expected, rel=1e-12)


def test_logsumexp_form_equals_the_definition_on_random_members():
    torch.manual_seed(0)
    lp = torch.randn(6, 40, 5, dtype=torch.float64).log_softmax(-1)
    y = torch.randint(5, (40,))
    by_definition = -lp.exp().mean(0).gather(1, y[:, None]).log().mean()
    assert torch.allclose(negative_log_likelihood(lp, y), by_definition)
    assert torch.allclose(mixture_log_probs(lp).exp(), lp.exp().mean(0))


def test_accuracy_ece_and_brier_by_hand():
    m = compute_metrics(P.log(), Y, components=2)
    # mean probabilities [.8 .2], [.4 .6], [.3 .7]: all three argmax right
    assert m["accuracy"] == 1.0
    # confidences .8, .6, .7 fall in 3 different bins, all correct: ECE = mean(1 - conf) = 0.3
    assert m["ece"] == pytest.approx(0.3, abs=1e-6)
    # Brier: sum_c (p - onehot)^2 = 2 (1 - p_y)^2 -> 2 * (.04 + .16 + .09) / 3
    assert m["brier"] == pytest.approx(2 * (0.04 + 0.16 + 0.09) / 3)
    assert m["auc_pr"] == pytest.approx(1.0) and m["auc_roc"] == pytest.approx(1.0)


def test_per_member_metrics_and_diversity_by_hand():
    members = member_metrics(P.log(), Y, components=2)
    assert members[0]["nll"] == pytest.approx(-(math.log(0.9) + math.log(0.4) + math.log(0.8)) / 3)
    assert members[0]["accuracy"] == pytest.approx(2 / 3)  # member 0 gets example 1 wrong
    assert members[1]["accuracy"] == pytest.approx(1.0)
    d = diversity(P.log(), Y, components=2)
    assert d["disagreement"] == pytest.approx(1 / 3)  # they disagree on example 1 only
    # mixture accuracy is 1, so the error is 0: the normalised value is disagreement / (0 + eps)
    assert d["normalized_disagreement"] == pytest.approx((1 / 3) / 1e-7)
    # over both orders: KL is not symmetric, and the members' order must not change the figure
    kl = sum(float((P[i, n] * (P[i, n] / P[1 - i, n]).log()).sum()) for i in (0, 1) for n in range(3)) / 6
    assert d["kl"] == pytest.approx(kl)
    assert diversity(P.flip(0).log(), Y, components=2)["kl"] == pytest.approx(kl)


def test_a_single_class_column_is_refused_not_scored_perfect():
    # log-probabilities of one class are 0 whatever the labels: NLL 0, accuracy 1, ECE 0 on labels all 0, silently
    with pytest.raises(ValueError, match="hold one class; a one-logit binary classifier"):
        compute_metrics(torch.zeros(2, 3, 1), torch.zeros(3, dtype=torch.long), components=2)


def test_binary_labels_given_as_signs_or_soft_targets_are_told_how_to_score():
    logits = torch.randn(1, 4, 1)
    with pytest.raises(ValueError, match=r"binary labels are 0 and 1: for -1 / \+1 labels pass \(y \+ 1\) // 2"):
        compute_metrics(member_log_probs_from_logits(logits), torch.tensor([-1, 1, 1, -1]))
    with pytest.raises(ValueError, match="soft binary targets: round them"):
        compute_metrics(member_log_probs_from_logits(logits), torch.tensor([0.3, 0.7, 0.7, 0.3]))


def test_samples_are_averaged_within_each_component():
    # K=2 components x M=2 samples, component-major
    lp = torch.randn(4, 10, 3, dtype=torch.float64).log_softmax(-1)
    y = torch.randint(3, (10,))
    members = member_metrics(lp, y, components=2)
    comp0 = lp[:2].exp().mean(0)
    assert members[0]["nll"] == pytest.approx(float(-comp0.gather(1, y[:, None]).log().mean()))


def test_ece_matches_the_bin_formula_at_every_bin_count():
    torch.manual_seed(1)
    for bins in (1, 2, 5, 15, 100):
        probs = (torch.randn(300, 10) * 3).softmax(-1)
        y = torch.randint(10, (300,))
        assert float(expected_calibration_error(probs, y, bins)) == pytest.approx(float(ece_reference(probs, y, bins)), abs=1e-6)
    with pytest.raises(ValueError, match=r"bins=0 must be an integer >= 1"):
        expected_calibration_error(probs, y, 0)


def test_a_confidence_of_exactly_one_is_in_the_last_bin():
    """A saturated float32 softmax gives confidences of exactly 1.0; torchmetrics' binning (used before) put them in
    a bin of their own: 0.275 where the definition gives 0.225 (all four rows in (14/15, 1]: accuracy 0.75,
    confidence 0.975)."""
    probs, y = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.95, 0.05], [0.95, 0.05]]), torch.tensor([0, 1, 0, 0])
    assert float(expected_calibration_error(probs, y)) == pytest.approx(0.225, abs=1e-6)
    assert compute_metrics(probs.log()[None], y)["ece"] == pytest.approx(float(ece_reference(probs, y)), abs=1e-6)


def test_binary_auc_of_one_class_is_undefined_not_zero():
    """A test set (or a slice of one) whose labels hold one class: sklearn refuses the ROC AUC; torchmetrics gave 0.0,
    which reads as a perfectly inverted classifier."""
    p = torch.rand(20)
    for y in (torch.ones(20, dtype=torch.long), torch.zeros(20, dtype=torch.long)):
        aucs = binary_auc(torch.stack([1 - p, p], 1), y)
        assert math.isnan(aucs["auc_roc"]) and math.isnan(aucs["auc_pr"])


def test_aurc_of_tied_confidences_does_not_depend_on_the_test_sets_order():
    """Ties in confidence (common at a float32 confidence of 1.0) were kept in the test set's order, so shuffling
    it changed the AURC (0.271 against 0.0625 here); each tie now adds its mean error per example kept."""
    probs, y = torch.tensor([[0.7, 0.3], [0.7, 0.3], [0.7, 0.3], [0.9, 0.1]]), torch.tensor([1, 0, 0, 0])
    forward, backward = risk_coverage(probs, y)[1], risk_coverage(probs.flip(0), y.flip(0))[1]
    torch.testing.assert_close(forward, backward)
    # kept by confidence: 0.9 right; then the three tied, one of them wrong: a third of an error each
    torch.testing.assert_close(forward, torch.tensor([0.0, 1 / 6, 2 / 9, 1 / 4], dtype=torch.float64))


def test_binary_auc_matches_sklearn():
    torch.manual_seed(2)
    p = torch.rand(200)
    y = (torch.rand(200) < p).long()
    aucs = binary_auc(torch.stack([1 - p, p], 1), y)
    assert aucs["auc_roc"] == pytest.approx(roc_auc_score(y.numpy(), p.numpy()), abs=1e-6)
    assert aucs["auc_pr"] == pytest.approx(average_precision_score(y.numpy(), p.numpy()), abs=1e-6)


def test_one_logit_binary_members_become_two_classes():
    z = torch.tensor([[[0.0], [2.0]]])
    lp = member_log_probs_from_logits(z)
    assert torch.allclose(lp.exp(), torch.tensor([[[0.5, 0.5], [1 / (1 + np.exp(2)), 1 / (1 + np.exp(-2))]]]).float())


def test_shape_errors_name_the_expected_layout():
    with pytest.raises(ValueError, match=r"\[members, examples, classes\]"):
        negative_log_likelihood(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="do not match"):
        negative_log_likelihood(torch.zeros(1, 3, 2), torch.zeros(4, dtype=torch.long))


def test_risk_coverage_and_aurc_by_hand():
    # confidences 0.9 (right), 0.8 (wrong), 0.6 (right), 0.5 (wrong): risks 0, 1/2, 1/3, 2/4
    probs = torch.tensor([[0.6, 0.4], [0.1, 0.9], [0.2, 0.8], [0.5, 0.5]])
    labels = torch.tensor([0, 1, 0, 1])
    coverage, risk = risk_coverage(probs, labels)
    assert coverage.tolist() == [0.25, 0.5, 0.75, 1.0]
    assert risk.tolist() == pytest.approx([0.0, 0.5, 1 / 3, 0.5])
    members = probs.log().unsqueeze(0)
    assert compute_metrics(members, labels)["aurc"] == pytest.approx((0 + 0.5 + 1 / 3 + 0.5) / 4)


def test_aurc_rewards_confidence_that_ranks_errors_last():
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (200,), generator=generator)
    wrong = torch.rand(200, generator=generator) < 0.3
    predicted = torch.where(wrong, (labels + 1) % 3, labels)
    # the same predictions, once confident where right and unsure where wrong, once the other way round
    good = torch.where(wrong, 0.4, 0.9)
    bad = torch.where(wrong, 0.9, 0.4)

    def probs(confidence):
        out = ((1 - confidence) / 2).unsqueeze(1).repeat(1, 3)
        return out.scatter(1, predicted.unsqueeze(1), confidence.unsqueeze(1))

    aurc_good = float(risk_coverage(probs(good), labels)[1].mean())
    aurc_bad = float(risk_coverage(probs(bad), labels)[1].mean())
    error = float(wrong.double().mean())
    assert aurc_good < error < aurc_bad


def test_evaluate_checks_class_labels_and_leaves_the_model_as_it_was() -> None:
    from torch.utils.data import TensorDataset

    import bayesify

    torch.manual_seed(0)
    net = bayesify.convert(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)),
                           task="classification")  # fmt: skip
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    net.train()
    net[1].eval()  # a norm layer the user froze
    expected = bayesify.evaluation.evaluate(net, TensorDataset(x, y))["nll"]
    assert net.training and net[0].training and not net[1].training  # as it was, module by module
    assert bayesify.evaluation.evaluate(net, TensorDataset(x, y.float()))["nll"] == expected  # integral floats: fine
    with pytest.raises(ValueError, match=r"got the fractional label \d.5 \(a regression target\? say task='regression'\)"):
        bayesify.evaluation.evaluate(net, TensorDataset(x, y.float() + 0.5))  # (truncated, it scored another class)
    for ignored in (-100, 255, 3):
        labels = torch.where(torch.arange(10) < 2, ignored, y)
        with pytest.raises(ValueError, match=rf"label {ignored} is not a class of the 3-class output .* ignore_index={ignored}\)"):
            bayesify.evaluation.evaluate(net, TensorDataset(x, labels))
        if ignored != 3:  # what it marks left out when told (3 is no ignore index, but the option would take it)
            kept = bayesify.evaluation.evaluate(net, TensorDataset(x, labels), ignore_index=ignored, members=False)
            assert kept["ignored"] == 2 and kept["nll"] == pytest.approx(bayesify.evaluation.evaluate(
                net, TensorDataset(x[2:], y[2:]), members=False)["nll"], rel=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match=r"bins=0 must be the number of equal-width confidence bins"):
        bayesify.evaluation.evaluate(net, TensorDataset(x, y), bins=0)


def test_an_example_with_nan_probabilities_makes_every_metric_nan() -> None:
    # the NLL was NaN, but accuracy 0.0 and AURC 1.0 read as numbers (a NaN's argmax and confidence)
    log_probs = torch.randn(4, 6, 3).log_softmax(-1)
    log_probs[:, 2] = float("nan")
    metrics = compute_metrics(log_probs, torch.tensor([0, 1, 2, 0, 1, 2]), components=2)
    numbers = [metrics[k] for k in ("nll", "accuracy", "ece", "brier", "aurc")]
    numbers += [v for member in metrics["members"] for v in member.values()] + list(metrics["diversity"].values())
    assert all(math.isnan(v) for v in numbers)
    clean = compute_metrics(log_probs[:, [0, 1, 3]], torch.tensor([0, 1, 0]), components=2)
    assert not math.isnan(clean["accuracy"]) and not math.isnan(clean["nll"])
