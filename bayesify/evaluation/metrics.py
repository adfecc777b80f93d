"""The paper's evaluation metrics, on the members' log-probabilities.

Everything takes ``member_log_probs`` of shape ``[S, N, C]``: S = K components x M samples
(component-major: member ``k * M + m``, as :func:`bayesify.predict` returns them), N examples,
C classes, and integer ``labels`` of shape ``[N]``. A deterministic model is the case S = 1.

* NLL of the mixture predictive, in logsumexp form:
  ``mean_n[ -logsumexp_s log p_s(y_n) + log S ]``.
* accuracy, ECE (15 equal-width bins of top-1 confidence, checked against :func:`ece_reference` in the tests) and
  Brier score on the mean probabilities (summed over the classes: 0 to 2; a binary task's is twice the one-column
  Brier of sklearn's ``brier_score_loss``).
* per component: NLL and accuracy of ``mean_m p_{k,m}`` (the reference's per-member metrics).
* diversity: mean pairwise disagreement of the components' argmax, and that divided by the
  mixture's error rate ``1 - accuracy`` (the reference's ``average_pairwise_diversity(probs, K,
  error=1 - accuracy)``); plus the mean pairwise KL between components.
* binary tasks: AUC-PR (average precision) and AUC-ROC of the positive class (torchmetrics).
* selective prediction: the risk-coverage (accuracy-rejection) curve when the least confident
  examples are rejected first, and its area AURC (Geifman and El-Yaniv, NeurIPS 2017; lower is better).

References:
    Dusenberry et al., ICML 2020, Sec. 5 and the reference ``baselines/cifar/rank1_bnn.py``.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from bayesify.evaluation.regression import regression_metrics
from bayesify.mixture import logmeanexp
from bayesify.predictive.tasks import refuse_probabilities, resolve_task

__all__ = [
    "accuracy",
    "binary_auc",
    "brier_score",
    "compute_metrics",
    "diversity",
    "ece_reference",
    "expected_calibration_error",
    "member_log_probs_from_logits",
    "member_metrics",
    "mixture_log_probs",
    "negative_log_likelihood",
    "risk_coverage",
    "task_metrics",
]


def member_log_probs_from_logits(logits: Tensor) -> Tensor:
    """Log-probabilities ``[S, N, C]`` from member logits ``[S, N, C]``.

    A one-logit binary classifier (``C == 1``, sigmoid) becomes two classes
    ``[log(1 - p), log p]``, so every metric below treats it like any other classifier.
    """
    logits = logits.float()
    if logits.shape[-1] == 1:
        return torch.cat([F.logsigmoid(-logits), F.logsigmoid(logits)], dim=-1)
    refuse_probabilities(logits, -1)
    return logits.log_softmax(-1)


def _check(member_log_probs: Tensor, labels: Tensor) -> None:
    if member_log_probs.dim() != 3:
        raise ValueError(
            f"member_log_probs must have shape [members, examples, classes], got {tuple(member_log_probs.shape)}; "
            "add a leading axis of 1 for a single model."
        )
    if member_log_probs.shape[-1] == 1:  # (one class: NLL 0 and accuracy 1 whatever the labels)
        raise ValueError(
            f"member_log_probs {tuple(member_log_probs.shape)} hold one class; a one-logit binary classifier's logits "
            "go through member_log_probs_from_logits (or task='binary'), which makes its two classes."
        )
    if labels.shape != member_log_probs.shape[1:2]:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match {member_log_probs.shape[1]} examples "
            f"of member_log_probs {tuple(member_log_probs.shape)}."
        )


def as_class_labels(labels: Tensor, classes: int) -> Tensor:
    """``labels`` as class indices in ``[0, classes)``, or a one-line error for a value that is not one: a fractional
    label (truncating it would score another class) or one out of range (an ignore index such as -100 or 255)."""
    if labels.is_floating_point():
        fractional = labels[labels != labels.round()]
        if fractional.numel():
            raise ValueError(
                f"classification labels are class indices; got the fractional label {fractional[0].item():g} ("
                + ("soft binary targets: round them to 0 / 1 to score; " if classes == 2 else "")
                + "a regression target? say task='regression')."
            )
    labels = labels.long()
    if labels.numel():
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= classes:
            label = low if low < 0 else high
            signs = classes == 2 and low == -1 and high <= 1  # (binary labels as -1 / +1)
            raise ValueError(
                f"label {label} is not a class of the {classes}-class output (labels lie in [0, {classes})); "
                + ("binary labels are 0 and 1: for -1 / +1 labels pass (y + 1) // 2; " if signs else "")
                + "if it marks targets to leave out (an ignore index, as 255 in segmentation masks or -100 in Hugging "
                f"Face labels), pass evaluate(..., ignore_index={label})."
            )
    return labels


def mixture_log_probs(member_log_probs: Tensor) -> Tensor:
    """``log mean_s p_s``: the uniform mixture's log-probabilities ``[N, C]``."""
    return logmeanexp(member_log_probs, 0)


def negative_log_likelihood(member_log_probs: Tensor, labels: Tensor) -> Tensor:
    """``mean_n[-logsumexp_s log p_s(y_n) + log S]``, the mixture predictive's NLL."""
    _check(member_log_probs, labels)
    s = member_log_probs.shape[0]
    index = labels.view(1, -1, 1).expand(s, -1, 1)
    log_lik = member_log_probs.gather(-1, index).squeeze(-1)  # [S, N]
    return -logmeanexp(log_lik, 0).mean()


def accuracy(probs: Tensor, labels: Tensor) -> Tensor:
    """Top-1 accuracy of probabilities ``[N, C]``."""
    return (probs.argmax(-1) == labels).float().mean()


def ece_reference(probs: Tensor, labels: Tensor, bins: int = 15) -> Tensor:
    """Expected calibration error by its definition, for checking the library implementation.

    ``sum_b |B_b| / N * |acc(B_b) - conf(B_b)|`` over ``bins`` equal-width bins of top-1
    confidence, bin ``b`` holding confidences in ``(b / bins, (b + 1) / bins]``.
    """
    conf, pred = probs.max(-1)
    correct = (pred == labels).float()
    edges = torch.linspace(0, 1, bins + 1, dtype=conf.dtype)
    total = conf.new_zeros(())
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (conf > lo) & (conf <= hi)
        if inside.any():
            total = total + inside.float().mean() * (conf[inside].mean() - correct[inside].mean()).abs()
    return total


def expected_calibration_error(probs: Tensor, labels: Tensor, bins: int = 15) -> Tensor:
    """ECE with ``bins`` equal-width bins of top-1 confidence, bin ``b`` holding ``(b / bins, (b + 1) / bins]``
    (:func:`ece_reference`'s definition, in one pass). torchmetrics' ``calibration_error``, used before, put a
    confidence of exactly 1.0 (a saturated float32 softmax) in a bin of its own."""
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(
            f"bins={bins!r} must be an integer >= 1 (the number of equal-width confidence bins; paper: 15)."
        )
    conf, pred = probs.float().max(-1)
    correct = (pred == labels).float()
    inner = torch.linspace(0, 1, bins + 1, dtype=conf.dtype, device=conf.device)[1:-1]
    index = torch.bucketize(conf, inner)  # b: inner[b - 1] < conf <= inner[b], as the bins' (lo, hi]
    gap = torch.zeros(bins, dtype=conf.dtype, device=conf.device).index_add_(0, index, conf - correct)
    return gap.abs().sum() / max(len(labels), 1)


def brier_score(probs: Tensor, labels: Tensor) -> Tensor:
    """``mean_n sum_c (p_nc - 1[y_n = c])^2`` (0 is perfect, 2 is the worst)."""
    one_hot = F.one_hot(labels, probs.shape[-1]).to(probs.dtype)
    return ((probs - one_hot) ** 2).sum(-1).mean()


def member_metrics(member_log_probs: Tensor, labels: Tensor, components: int) -> list[dict[str, float]]:
    """NLL and accuracy of each component's predictive ``mean_m p_{k,m}`` (members component-major)."""
    _check(member_log_probs, labels)
    s = member_log_probs.shape[0]
    if s % components:
        raise ValueError(f"{s} members cannot be split into {components} components of equal sample counts.")
    per_component = member_log_probs.reshape(components, s // components, *member_log_probs.shape[1:])
    results = []
    for k in range(components):
        log_probs = per_component[k]
        results.append(
            {
                "nll": float(negative_log_likelihood(log_probs, labels)),
                "accuracy": float(accuracy(mixture_log_probs(log_probs).exp(), labels)),
            }
        )
    return results


def diversity(member_log_probs: Tensor, labels: Tensor, components: int) -> dict[str, float]:
    """Pairwise diversity of the K components (each averaged over its M samples).

    Returns:
        ``disagreement``: mean over pairs of the fraction of examples whose argmax differs;
        ``normalized_disagreement``: that divided by the mixture's error rate ``1 - accuracy``;
        ``kl``: mean over ordered pairs (i != j) of ``mean_n KL(p_i || p_j)``.
    """
    _check(member_log_probs, labels)
    s = member_log_probs.shape[0]
    per_component = member_log_probs.reshape(components, s // components, *member_log_probs.shape[1:])
    log_probs = torch.stack([mixture_log_probs(per_component[k]) for k in range(components)])  # [K, N, C]
    if components < 2:
        return {"disagreement": 0.0, "normalized_disagreement": 0.0, "kl": 0.0}
    preds = log_probs.argmax(-1)
    pairs = list(itertools.combinations(range(components), 2))
    disagreement = torch.stack([(preds[i] != preds[j]).float().mean() for i, j in pairs]).mean()
    # (KL is not symmetric: over ordered pairs, so that the members' order does not change it)
    ordered = pairs + [(j, i) for i, j in pairs]
    kl = torch.stack([(log_probs[i].exp() * (log_probs[i] - log_probs[j])).sum(-1).mean() for i, j in ordered]).mean()
    error = 1.0 - float(accuracy(mixture_log_probs(member_log_probs).exp(), labels))
    return {
        "disagreement": float(disagreement),
        "normalized_disagreement": float(disagreement) / (error + 1e-7),
        "kl": float(kl),
    }


def binary_auc(probs: Tensor, labels: Tensor) -> dict[str, float]:
    """AUC-PR (average precision) and AUC-ROC of the positive class (column 1) via torchmetrics; NaN where the labels
    hold one class (as sklearn's ``roc_auc_score`` refuses)."""
    from torchmetrics.functional.classification import binary_auroc, binary_average_precision

    positive = probs[:, 1].float()
    if labels.numel() == 0 or bool((labels == labels[0]).all()):  # one class only: neither curve is defined
        return {"auc_pr": float("nan"), "auc_roc": float("nan")}  # (torchmetrics gave 0.0: a perfectly inverted model)
    return {
        "auc_pr": float(binary_average_precision(positive, labels)),
        "auc_roc": float(binary_auroc(positive, labels)),
    }


def risk_coverage(probs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """The risk-coverage curve of selective prediction by top-1 confidence.

    The examples are kept in order of decreasing confidence; at coverage ``i / N`` the risk is the error rate of the
    ``i`` kept examples, examples of equal confidence taken in a random order (the expected risk: within a tie, each
    one kept adds the tie's mean error), so the curve depends on the predictions alone, not on the test set's order.
    ``risk.mean()`` is the AURC (area under the risk-coverage curve); ``1 - risk`` is the accuracy-rejection
    curve.

    Returns:
        ``(coverage, risk)``, each ``[N]`` in float64.

    Example:
        >>> coverage, risk = risk_coverage(torch.tensor([[0.9, 0.1], [0.4, 0.6], [0.3, 0.7]]), torch.tensor([0, 0, 1]))
        >>> risk.tolist()   # kept by confidence: 0.9 right, 0.7 right, 0.6 wrong
        [0.0, 0.0, 0.3333333333333333]
    """
    confidence, predicted = probs.max(-1)
    order = torch.argsort(confidence.double(), descending=True, stable=True)
    wrong = (predicted[order] != labels[order]).double()
    _, tie, sizes = torch.unique_consecutive(confidence[order], return_inverse=True, return_counts=True)
    tie_errors = torch.zeros(len(sizes), dtype=torch.float64, device=wrong.device).index_add_(0, tie, wrong)
    before = torch.cumsum(tie_errors, 0) - tie_errors  # errors of the ties kept before each tie
    starts = torch.cumsum(sizes, 0) - sizes
    kept = torch.arange(1, len(labels) + 1, dtype=torch.float64, device=wrong.device)
    errors = before[tie] + (kept - starts[tie]) * tie_errors[tie] / sizes[tie]
    return kept / len(labels), errors / kept


def compute_metrics(
    member_log_probs: Tensor, labels: Tensor, *, components: int = 1, bins: int = 15, members: bool = True
) -> dict[str, object]:
    """All metrics of one evaluation, as plain Python numbers.

    Args:
        member_log_probs: ``[K * M, N, C]`` member log-probabilities, component-major.
        labels: ``[N]`` integer labels.
        components: K (1 for a deterministic model); M is ``S / K``.
        bins: ECE bins (paper: 15).
        members: include per-component metrics and diversity.

    Returns:
        ``nll, accuracy, ece, brier, aurc`` (+ ``auc_pr, auc_roc`` for two classes), and with
        ``members`` and K > 1: ``members`` (a list of per-component dicts) and ``diversity``.
    """
    _check(member_log_probs, labels)
    member_log_probs = member_log_probs.float()
    labels = as_class_labels(labels, member_log_probs.shape[-1])
    probs = mixture_log_probs(member_log_probs).exp()
    out: dict[str, object] = {
        "nll": float(negative_log_likelihood(member_log_probs, labels)),
        "accuracy": float(accuracy(probs, labels)),
        "ece": float(expected_calibration_error(probs, labels, bins)),
        "brier": float(brier_score(probs, labels)),
        "aurc": float(risk_coverage(probs, labels)[1].mean()),
    }
    if probs.shape[-1] == 2:
        out.update(binary_auc(probs, labels))
    if members and components > 1:
        out["members"] = member_metrics(member_log_probs, labels, components)
        out["diversity"] = diversity(member_log_probs, labels, components)
    if bool(probs.isnan().any()):  # (a NaN input or weight: its argmax and confidence read as numbers, NaN's scores)
        out = _all_nan(out)
    return out


def _all_nan(value: object) -> object:
    """Every number of a metrics structure NaN: where an example's probabilities are, accuracy 0 and AURC 1 say
    nothing true (the NLL is NaN by itself)."""
    if isinstance(value, dict):
        return {k: _all_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_all_nan(v) for v in value]
    return math.nan if isinstance(value, float) else value



def _real_targets(targets: Tensor, shape: torch.Size, task: object) -> Tensor:
    """Real-valued ``targets`` in the predictions' ``shape``: as they are, or with trailing axes of size 1 put in
    or taken out (``[N]`` for ``[N, 1]``); any other shape is refused (reshaped, a ``[D, N]`` batch of ``[N, D]``
    predictions read its values in the wrong order, silently)."""
    if targets.shape == shape:
        return targets

    def core(size: tuple[int, ...]) -> tuple[int, ...]:
        while size and size[-1] == 1:
            size = size[:-1]
        return size

    if core(tuple(targets.shape)) == core(tuple(shape)):
        return targets.reshape(shape)
    raise ValueError(
        f"targets of shape {tuple(targets.shape)} do not fit task {task}'s predictions of shape {tuple(shape)}: give "
        "one target per prediction, in the predictions' shape (examples first)."
    )


def task_metrics(
    task: object,
    outputs: Tensor,
    targets: Tensor,
    *,
    components: int = 1,
    bins: int = 15,
    members: bool = True,
    ignore_index: int | None = None,
) -> dict[str, object]:
    """The metrics of ``[S, N, ...]`` member outputs against ``targets``, chosen by what the output means.

    * classification: :func:`compute_metrics` on the members' log-softmax over the task's class axis
      (a dense output's pixels or tokens count as examples: segmentation logits ``[S, N, C, H, W]``
      against labels ``[N, H, W]``);
    * binary / multi-label: every (example, label) a binary problem: NLL, accuracy, ECE, Brier, AUCs;
    * regression / Gaussian heads: :func:`bayesify.evaluation.regression.regression_metrics`.

    Args:
        ignore_index: a label marking targets to leave out of every metric (categorical tasks); the
            result then says how many were left out (``ignored``).

    Raises:
        ValueError: a task without metrics (``members``, a custom reduction), targets that are not one per
            prediction, or ``ignore_index`` for real-valued targets.
    """
    task = resolve_task(task, needed_by="task_metrics")
    log_probs = task.member_log_probs(outputs)
    if log_probs is not None:  # categorical: every pixel / token / label a row
        labels = targets.reshape(-1)
        if labels.numel() != log_probs.shape[1]:
            raise ValueError(
                f"targets of shape {tuple(targets.shape)} do not fit task {task}'s {log_probs.shape[1]} predictions "
                f"(outputs {tuple(outputs.shape[1:])}, members first): give one label per example, pixel or token "
                "(e.g. [B, H, W] for segmentation logits [B, C, H, W])."
            )
        ignored = None
        if ignore_index is not None:
            keep = labels != ignore_index
            ignored = int(labels.numel() - keep.sum())
            if ignored == labels.numel():
                raise ValueError(f"every target is ignore_index={ignore_index}: nothing is left to score.")
            log_probs, labels = log_probs[:, keep], labels[keep]
        results = compute_metrics(log_probs, labels, components=components, bins=bins, members=members)
        return results if ignored is None else {**results, "ignored": ignored}
    if ignore_index is not None:
        raise ValueError(
            f"ignore_index={ignore_index} marks class labels to leave out, but task {task} is scored against "
            "real-valued targets; leave those examples out of the data instead."
        )
    moments = task.member_moments(outputs)
    if moments is not None:
        means, variances = moments
        return regression_metrics(means, _real_targets(targets, means.shape[1:], task), variances)
    raise ValueError(
        f"evaluate() has no metrics for task {task}; pass task='classification', 'binary', 'multilabel', 'regression' "
        "or 'gaussian', or compute your own from bayesify.predict's members."
    )
