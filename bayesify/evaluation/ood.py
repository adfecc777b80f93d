"""Out-of-distribution detection: uncertainty scores and how well they separate two data sets.

Every score is oriented so that a **higher score means more likely OOD**, and the metrics
treat OOD examples as the positive class (as torchmetrics / scikit-learn would with
``target = 1`` for OOD):

* ``auroc``: area under the ROC curve (ties get half credit, as ``sklearn.metrics.roc_auc_score``);
* ``aupr_out``: average precision with OOD as positive (``sklearn.metrics.average_precision_score``);
* ``aupr_in``: average precision with in-distribution as positive, on the negated scores;
* ``fpr95``: the fraction of in-distribution examples flagged as OOD at the first threshold
  that flags 95% of the OOD examples (the smallest FPR on the ROC curve with TPR >= 0.95).

Example:
    >>> u_in = classification_uncertainty(bayesify.predict(model.eval(), x_test, samples=4))
    >>> u_out = classification_uncertainty(bayesify.predict(model.eval(), x_ood, samples=4))
    >>> ood_metrics_per_score(u_in, u_out)["mutual_information"]["auroc"]

References:
    Hendrycks and Gimpel, "A Baseline for Detecting Misclassified and Out-of-Distribution
    Examples in Neural Networks", ICLR 2017 (max probability, AUROC, AUPR-in/out);
    Liang et al., "Enhancing The Reliability of Out-of-distribution Image Detection in Neural
    Networks", ICLR 2018 (FPR at 95% TPR).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bayesify.predictive.decompositions import BinaryUncertainty, ClassificationUncertainty, RegressionUncertainty

__all__ = ["ood_metrics", "ood_metrics_per_score", "ood_scores", "score_notes"]

_TPR_LEVEL = 0.95


def ood_scores(uncertainty: ClassificationUncertainty | BinaryUncertainty | RegressionUncertainty) -> dict[str, Tensor]:
    """OOD scores (higher = more likely OOD) from the result of an ``*_uncertainty`` function.

    Classification and binary / multi-label:
        ``max_probability``: ``1 - max_c p(c)`` of the mixture (the maximum softmax probability
        baseline, negated so that higher is more OOD); ``entropy``: the predictive entropy;
        ``mutual_information``: the members' disagreement (epistemic).
    Regression:
        ``total_variance`` and ``epistemic_variance`` of the predictive.

    Scores keep the shape of the uncertainty fields: per example, per pixel for segmentation
    and per label for multi-label outputs; reduce them to one score per example (e.g. the mean
    over pixels) before :func:`ood_metrics` if the examples, not the pixels, are what is OOD.

    Example:
        >>> scores = ood_scores(classification_uncertainty(members))
        >>> scores["mutual_information"].shape
        torch.Size([B])
    """
    if isinstance(uncertainty, (ClassificationUncertainty, BinaryUncertainty)):
        return {
            "max_probability": 1.0 - uncertainty.confidence,
            "entropy": uncertainty.predictive_entropy,
            "mutual_information": uncertainty.mutual_information,
        }
    if isinstance(uncertainty, RegressionUncertainty):
        return {"total_variance": uncertainty.total_variance, "epistemic_variance": uncertainty.epistemic_variance}
    raise TypeError(
        f"ood_scores takes the result of classification_uncertainty, binary_uncertainty or regression_uncertainty "
        f"(bayesify.uncertainty), got {type(uncertainty).__name__}."
    )


def _scores(values: Tensor, name: str) -> Tensor:
    values = torch.as_tensor(values)
    if values.is_complex() or values.dtype == torch.bool:
        raise TypeError(f"{name} must hold real-valued scores, got dtype {values.dtype}.")
    values = values.detach().to("cpu", torch.float64).flatten()
    if values.numel() == 0:
        raise ValueError(f"{name} is empty; OOD metrics need at least one in-distribution and one OOD score.")
    if torch.isnan(values).any():
        raise ValueError(f"{name} contains NaN; a NaN score cannot be ranked (check the model's outputs).")
    return values


def _ranking_curve(scores: Tensor, positive: Tensor) -> tuple[Tensor, Tensor]:
    """True and false positive counts when flagging every score >= t, for each distinct threshold t, descending."""
    order = torch.argsort(scores, descending=True, stable=True)
    scores, positive = scores[order], positive[order]
    # tied scores are one threshold: keep the counts after the last example of each run of equal scores
    last_of_run = torch.cat([torch.nonzero(scores[1:] != scores[:-1]).flatten(), torch.tensor([scores.numel() - 1])])
    true_positives = positive.cumsum(0)[last_of_run]
    false_positives = (1.0 - positive).cumsum(0)[last_of_run]
    return true_positives, false_positives


def _average_precision(true_positives: Tensor, false_positives: Tensor) -> float:
    """``sum_i (R_i - R_{i-1}) P_i`` over descending thresholds: sklearn's step-wise AP, no interpolation."""
    recall = true_positives / true_positives[-1]
    precision = true_positives / (true_positives + false_positives)
    recall_steps = torch.diff(recall, prepend=recall.new_zeros(1))
    return float((recall_steps * precision).sum())


def ood_metrics(in_scores: Tensor, out_scores: Tensor) -> dict[str, float]:
    """AUROC, AUPR (OOD and in-distribution as the positive class) and FPR at 95% TPR.

    Args:
        in_scores: scores of in-distribution examples, any shape (flattened).
        out_scores: scores of OOD examples, any shape (flattened); higher = more OOD.

    Returns:
        ``{"auroc", "aupr_out", "aupr_in", "fpr95"}`` as Python floats, computed in float64;
        equal to ``roc_auc_score``, ``average_precision_score`` (on ``scores`` and on
        ``-scores`` with the labels flipped) and ``roc_curve`` of scikit-learn with OOD as
        label 1.

    Raises:
        ValueError: either set is empty or contains NaN.

    Example:
        >>> m = ood_metrics(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.25, 0.9]))
        >>> round(m["auroc"], 4), round(m["fpr95"], 4)      # 5 of 6 (in, out) pairs ranked right
        (0.8333, 0.3333)

    References:
        Hendrycks and Gimpel, ICLR 2017; Liang et al., ICLR 2018 (FPR at 95% TPR).
    """
    inside, outside = _scores(in_scores, "in_scores"), _scores(out_scores, "out_scores")
    scores = torch.cat([inside, outside])
    is_out = torch.cat([torch.zeros_like(inside), torch.ones_like(outside)])

    true_positives, false_positives = _ranking_curve(scores, is_out)
    tpr = torch.cat([scores.new_zeros(1), true_positives / outside.numel()])
    fpr = torch.cat([scores.new_zeros(1), false_positives / inside.numel()])
    auroc = float(torch.trapezoid(tpr, fpr))
    # fpr grows with tpr, so the first point reaching the level has the smallest FPR that does
    fpr95 = float(fpr[torch.nonzero(tpr >= _TPR_LEVEL)[0, 0]])

    in_true_positives, in_false_positives = _ranking_curve(-scores, 1.0 - is_out)
    return {
        "auroc": auroc,
        "aupr_out": _average_precision(true_positives, false_positives),
        "aupr_in": _average_precision(in_true_positives, in_false_positives),
        "fpr95": fpr95,
    }


def ood_metrics_per_score(
    in_uncertainty: ClassificationUncertainty | BinaryUncertainty | RegressionUncertainty,
    out_uncertainty: ClassificationUncertainty | BinaryUncertainty | RegressionUncertainty,
) -> dict[str, dict[str, float]]:
    """:func:`ood_metrics` for every score of :func:`ood_scores`, between an in-distribution and an OOD set (each
    an uncertainty, or its :func:`ood_scores` already taken: those of some positions only, say).

    Example:
        >>> table = ood_metrics_per_score(u_test, u_ood)
        >>> table["entropy"]["fpr95"], table["mutual_information"]["auroc"]
    """
    if type(in_uncertainty) is not type(out_uncertainty):
        raise TypeError(
            f"in_uncertainty is a {type(in_uncertainty).__name__} but out_uncertainty a "
            f"{type(out_uncertainty).__name__}; compute both with the same *_uncertainty function."
        )
    inside, outside = _score_table(in_uncertainty), _score_table(out_uncertainty)
    return {name: ood_metrics(inside[name], outside[name]) for name in inside}


def _score_table(uncertainty: object) -> dict[str, Tensor]:
    return uncertainty if isinstance(uncertainty, dict) else ood_scores(uncertainty)  # type: ignore[arg-type]


_EPISTEMIC = {"mutual_information": "entropy", "epistemic_variance": "total_variance"}  # score: its total
_NEGLIGIBLE = 1e-6  # an epistemic part below this share of the total is rounding, not disagreement


def score_notes(
    in_uncertainty: ClassificationUncertainty | BinaryUncertainty | RegressionUncertainty,
    out_uncertainty: ClassificationUncertainty | BinaryUncertainty | RegressionUncertainty,
    table: dict[str, dict[str, float]],
    members: int,
) -> dict[str, str]:
    """What a reader must know about a score of :func:`ood_metrics_per_score` before trusting its numbers.

    A score is *uninformative* when it takes one value on every example of both sets, so that its
    AUROC (0.5 by ties) tells nothing about them: an epistemic score (the members' disagreement) of a
    single member, or of members that all agree (below a millionth of the total uncertainty on
    every example: rounding, not disagreement), or any score that is constant. A score whose AUROC
    is below 0.5 is higher on the test set than on the OOD set: it ranks the OOD set as the more
    familiar one.

    Args:
        in_uncertainty, out_uncertainty: the uncertainty of the test set and of the OOD set (or their
            :func:`ood_scores`).
        table: their :func:`ood_metrics_per_score`.
        members: how many members the uncertainty was computed from.

    Returns:
        ``{score: note}`` for the scores that need one.
    """
    inside, outside = _score_table(in_uncertainty), _score_table(out_uncertainty)

    def both(name: str) -> Tensor:
        return torch.cat([inside[name].flatten(), outside[name].flatten()]).double()

    notes = {}
    for name, metrics in table.items():
        values = both(name)
        blind = ", so its AUROC tells nothing about them"
        if name in _EPISTEMIC and bool((values <= _NEGLIGIBLE * both(_EPISTEMIC[name])).all()):
            why = "one member, none to disagree" if members == 1 else "the members agree"
            notes[name] = f"uninformative: 0 on every example ({why}){blind}"
        elif bool((values == values[0]).all()):
            notes[name] = f"uninformative: {float(values[0]):.3g} on every example{blind}"
        elif metrics["auroc"] < 0.5:
            notes[name] = "below chance: higher on the test set than on the OOD set"
    return notes
