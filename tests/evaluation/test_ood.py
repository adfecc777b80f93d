"""OOD scores from uncertainty results, and the OOD metrics against scikit-learn and by hand."""

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

from bayesify.evaluation.ood import ood_metrics, ood_metrics_per_score, ood_scores
from bayesify.predictive import binary_uncertainty, classification_uncertainty, regression_uncertainty


def _sklearn(in_scores: torch.Tensor, out_scores: torch.Tensor) -> dict[str, float]:
    scores = np.concatenate([in_scores.numpy().ravel(), out_scores.numpy().ravel()])
    is_out = np.concatenate([np.zeros(in_scores.numel()), np.ones(out_scores.numel())])
    fpr, tpr, _ = roc_curve(is_out, scores)
    return {
        "auroc": roc_auc_score(is_out, scores),
        "aupr_out": average_precision_score(is_out, scores),
        "aupr_in": average_precision_score(1 - is_out, -scores),
        "fpr95": float(fpr[tpr >= 0.95].min()),
    }


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("sizes", [(200, 150), (37, 400), (1, 20)])
def test_metrics_equal_sklearn(sizes, ties):
    generator = torch.Generator().manual_seed(sum(sizes))
    inside = torch.randn(sizes[0], generator=generator, dtype=torch.float64)
    outside = torch.randn(sizes[1], generator=generator, dtype=torch.float64) + 1.0
    if ties:  # coarse scores, many equal across and within the sets
        inside, outside = inside.round(decimals=1), outside.round(decimals=1)
    ours, reference = ood_metrics(inside, outside), _sklearn(inside, outside)
    assert ours.keys() == reference.keys()
    for name in ours:
        assert ours[name] == pytest.approx(reference[name], abs=1e-12), name


def test_metrics_by_hand():
    inside, outside = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.25, 0.9])
    m = ood_metrics(inside, outside)
    # out-in pairs ranked right: 0.25 beats 0.1 and 0.2, 0.9 beats all three -> 5 of 6
    assert m["auroc"] == pytest.approx(5 / 6)
    # descending: 0.9 (out), 0.3 (in), 0.25 (out): precision 1 at recall 1/2, 2/3 at recall 1
    assert m["aupr_out"] == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)
    # both OOD examples flagged only at threshold 0.25, which also flags the in-distribution 0.3
    assert m["fpr95"] == pytest.approx(1 / 3)
    perfect = ood_metrics(torch.zeros(5), torch.ones(5))
    assert perfect == {"auroc": 1.0, "aupr_out": 1.0, "aupr_in": 1.0, "fpr95": 0.0}
    assert ood_metrics(torch.ones(5), torch.zeros(5))["auroc"] == 0.0
    assert ood_metrics(torch.ones(5), torch.ones(3))["auroc"] == 0.5  # all tied: chance


def test_scores_of_each_uncertainty_kind():
    logits = torch.randn(4, 6, 3, dtype=torch.float64)
    u = classification_uncertainty(logits)
    scores = ood_scores(u)
    assert set(scores) == {"max_probability", "entropy", "mutual_information"}
    assert torch.equal(scores["max_probability"], 1 - u.probs.amax(-1))
    assert torch.equal(scores["mutual_information"], u.mutual_information)
    binary = binary_uncertainty(logits)
    assert torch.equal(ood_scores(binary)["max_probability"], 1 - torch.maximum(binary.probs, 1 - binary.probs))
    regression = regression_uncertainty(logits, logits.square())
    assert set(ood_scores(regression)) == {"total_variance", "epistemic_variance"}
    with pytest.raises(TypeError, match="ood_scores takes"):
        ood_scores(logits)


def test_members_that_disagree_on_ood_inputs_are_detected_by_mutual_information():
    generator = torch.Generator().manual_seed(3)
    # in-distribution: every member confident in the same class; OOD: each member confident in its own class
    confident = torch.tensor([6.0, 0.0, 0.0], dtype=torch.float64)
    inside = confident.expand(8, 50, 3) + 0.5 * torch.randn(8, 50, 3, generator=generator, dtype=torch.float64)
    outside = torch.stack([confident.roll(s % 3) for s in range(8)])[:, None].expand(8, 40, 3)
    outside = outside + 0.5 * torch.randn(8, 40, 3, generator=generator, dtype=torch.float64)
    table = ood_metrics_per_score(classification_uncertainty(inside), classification_uncertainty(outside))
    assert set(table) == {"max_probability", "entropy", "mutual_information"}
    assert table["mutual_information"]["auroc"] == 1.0 and table["mutual_information"]["fpr95"] == 0.0


def test_segmentation_scores_are_per_pixel_and_flatten():
    u_in = classification_uncertainty(torch.randn(4, 2, 3, 5, 5), class_axis=1)
    u_out = classification_uncertainty(3 * torch.randn(4, 1, 3, 5, 5), class_axis=1)
    assert ood_scores(u_in)["entropy"].shape == (2, 5, 5)
    table = ood_metrics_per_score(u_in, u_out)
    scores_in, scores_out = ood_scores(u_in)["entropy"].double(), ood_scores(u_out)["entropy"].double()
    assert table["entropy"]["auroc"] == pytest.approx(_sklearn(scores_in, scores_out)["auroc"])


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="in_scores is empty"):
        ood_metrics(torch.zeros(0), torch.ones(3))
    with pytest.raises(ValueError, match="NaN"):
        ood_metrics(torch.tensor([0.1, float("nan")]), torch.ones(3))
    with pytest.raises(TypeError, match="real-valued"):
        ood_metrics(torch.tensor([True]), torch.ones(3))
    classification = classification_uncertainty(torch.randn(2, 3, 4))
    regression = regression_uncertainty(torch.randn(2, 3))
    with pytest.raises(TypeError, match="same \\*_uncertainty function"):
        ood_metrics_per_score(classification, regression)


def test_an_ood_set_of_inputs_alone_is_evaluated_as_one_with_dummy_labels():
    """The docstring says the OOD set's targets are ignored, yet a set of inputs alone (noise, another domain:
    ``TensorDataset(inputs)``, a loader of bare tensors) was refused ("a batch must be an (inputs, target) pair")."""
    import bayesify
    from torch.utils.data import DataLoader, TensorDataset

    from bayesify.evaluation import evaluate

    torch.manual_seed(0)
    net = bayesify.convert(torch.nn.Sequential(torch.nn.Linear(8, 3)), task="classification", init="normal").eval()
    x, y, far = torch.randn(30, 8), torch.randint(3, (30,)), torch.randn(20, 8) * 4
    paired_set = TensorDataset(far, torch.zeros(20, dtype=torch.long))
    for alone in (TensorDataset(far), DataLoader(far, batch_size=len(far))):
        result = evaluate(net, TensorDataset(x, y), ood=alone, batch_size=len(far))
        assert result["ood"] == evaluate(net, TensorDataset(x, y), ood=paired_set, batch_size=len(far))["ood"]
    with pytest.raises(ValueError, match=r"an OOD batch must be inputs, \(inputs,\), an \(inputs, target\) pair"):
        evaluate(net, TensorDataset(x, y), ood=[(far, far, far)])
