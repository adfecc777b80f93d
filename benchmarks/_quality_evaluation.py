"""Metrics of one trained method on a task's test set and its shifted copies, from member predictions.

Classification: ``bayesify.evaluation.metrics.compute_metrics`` on the members' log-probabilities
(NLL of the mixture, accuracy, ECE with 15 bins, Brier; AUC-PR / AUC-ROC for two classes;
diversity of the components where a method has several), and cNLL / cA / cECE / cBrier: the
same metrics averaged over every (corruption, severity) set. Regression: the Gaussian-mixture
NLL, RMSE and 90% interval coverage of ``benchmarks/_regression_metrics.py``, and their
averages over the shifted sets (cNLL, cRMSE, cCoverage).
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

from torch import Tensor

from bayesify.evaluation.metrics import compute_metrics, member_log_probs_from_logits
from benchmarks._quality_tasks import REGRESSION, Task
from benchmarks._regression_metrics import gaussian_mixture_metrics

__all__ = ["evaluate_members"]

# metrics averaged over the shifted sets, by task kind: (clean name, shifted name)
SHIFTED = {
    "classification": (
        ("nll", "c_nll"), ("accuracy", "c_accuracy"), ("ece", "c_ece"), ("brier", "c_brier"),
        ("overconfidence", "c_overconfidence"),
    ),  # fmt: skip
    REGRESSION: (("nll", "c_nll"), ("rmse", "c_rmse"), ("coverage", "c_coverage")),
}


def _metrics(members: Tensor, y: Tensor, task: Task, components: int) -> dict[str, float]:
    if task.kind == REGRESSION:
        return gaussian_mixture_metrics(members, y, task.y_std)
    log_probs = member_log_probs_from_logits(members)
    with_members = components > 1 and log_probs.shape[0] % components == 0
    out = compute_metrics(log_probs, y, components=components if with_members else 1, members=with_members)
    flat = {k: float(v) for k, v in out.items() if isinstance(v, (int, float))}
    # signed miscalibration: mean top-1 confidence minus accuracy (> 0: overconfident)
    confidence = (log_probs.logsumexp(0) - math.log(len(log_probs))).exp().max(-1).values.mean()
    flat["overconfidence"] = float(confidence) - flat["accuracy"]
    if "diversity" in out:
        flat["disagreement"] = out["diversity"]["disagreement"]
    return flat


def evaluate_members(predict: Callable[[Tensor], Tensor], task: Task, components: int) -> dict[str, object]:
    """Clean metrics, shifted averages (``c_*``) and per-severity means (``by_severity``).

    Args:
        predict: inputs -> members ``[S, N, out]``.
        task: the task (its test set and cached shifted sets).
        components: groups of members for the diversity metric (1 for none).
    """
    result: dict[str, object] = dict(_metrics(predict(task.x_test), task.y_test, task, components))
    per_set: list[tuple[int, dict[str, float]]] = []
    for _, severity, x in task.shifts():
        per_set.append((severity, _metrics(predict(x), task.y_test, task, 1)))
    pairs = SHIFTED["classification" if task.kind != REGRESSION else REGRESSION]
    for clean, shifted in pairs:
        result[shifted] = statistics.fmean(m[clean] for _, m in per_set)
    severities = sorted({s for s, _ in per_set})
    result["by_severity"] = {
        str(s): {clean: statistics.fmean(m[clean] for sv, m in per_set if sv == s) for clean, _ in pairs}
        for s in severities
    }
    return result
