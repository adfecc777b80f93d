"""Metrics of one trained method on a task's test set and its shifted copies, from member predictions.

Classification: ``bayesify.evaluation.metrics.compute_metrics`` on the members' log-probabilities
(NLL of the mixture, accuracy, ECE with 15 bins, Brier; AUC-PR / AUC-ROC for two classes;
diversity of the components where a method has several), and cNLL / cA / cECE / cBrier: the
same metrics averaged over every (corruption, severity) set. Regression: the Gaussian-mixture
NLL, RMSE and 90% interval coverage of ``bayesify.evaluation.regression.regression_metrics``
(:func:`gaussian_head_metrics`), and their averages over the shifted sets (cNLL, cRMSE, cCoverage).

Out-of-distribution detection (the Fashion-MNIST tasks: MNIST test images against the test set):
:func:`ood_evaluation` runs ``bayesify.evaluation.evaluate(model, test, ood=...)``, the library's own
evaluator, for every method whose members it produces (a plain network, temperature scaling as a
network that divides its logits, the converted ones); for MC dropout, the deep ensemble and
bayesian-torch (several stochastic passes or networks) it applies the functions ``evaluate`` uses
(the task's ``uncertainty`` + ``ood_metrics_per_score``) to their members. ``ood_via_evaluate`` says which.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable

import torch
from torch import Tensor, nn

import bayesify.predictive
from bayesify.evaluation.metrics import compute_metrics, member_log_probs_from_logits
from bayesify.evaluation.regression import regression_metrics
from benchmarks._quality_tasks import REGRESSION, Task

__all__ = ["evaluate_members", "gaussian_head_metrics", "ood_evaluation"]

LOG_VAR_RANGE = (-12.0, 8.0)  # keeps exp(log variance) finite for a badly trained head


def gaussian_head_metrics(members: Tensor, y: Tensor, y_std: float = 1.0, level: float = 0.9) -> dict[str, float]:
    """NLL, RMSE, coverage and mean width of the central ``level`` interval of the members' mixture, in data units.

    Args:
        members: ``[S, N, 2]`` (mean, log variance) in standardised units.
        y: ``[N]`` standardised targets.
        y_std: the target's training standard deviation (reports in data units).
    """
    if members.dim() != 3 or members.shape[-1] != 2:
        raise ValueError(f"members must be [S, N, 2] (mean, log variance), got {tuple(members.shape)}.")
    means, log_var = members.double().unbind(-1)
    variances = log_var.clamp(*LOG_VAR_RANGE).exp()
    out = regression_metrics(means, y.double(), variances, levels=(level,))
    lower, upper = bayesify.predictive.regression_uncertainty(means, variances).interval(level)
    return {
        "nll": out["nll"] + math.log(y_std),
        "rmse": out["rmse"] * y_std,
        "coverage": out["coverage"][level],
        "width": float((upper - lower).mean()) * y_std,
    }

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
        return gaussian_head_metrics(members, y, task.y_std)
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
        per_set.append((severity, _metrics(predict(x), task.y_shift, task, 1)))
    pairs = SHIFTED["classification" if task.kind != REGRESSION else REGRESSION]
    for clean, shifted in pairs:
        result[shifted] = statistics.fmean(m[clean] for _, m in per_set)
    severities = sorted({s for s, _ in per_set})
    result["by_severity"] = {
        str(s): {clean: statistics.fmean(m[clean] for sv, m in per_set if sv == s) for clean, _ in pairs}
        for s in severities
    }
    return result


def ood_evaluation(
    method: Any, model: nn.Module, task: Task, clean: dict[str, object], predict: Callable[[Tensor], Tensor]
) -> dict[str, float]:
    """AUROC / AUPR / FPR@95 of every uncertainty score, ``task.x_ood`` against the test set (see the module doc).

    ``predict``: inputs -> the method's members (as for :func:`evaluate_members`). ``clean`` is the method's clean test metrics: where ``evaluate`` sees the same members (no
    posterior noise), its NLL must match them, or this raises rather than report another model's numbers.
    """
    from bayesify.evaluation import evaluate
    from bayesify.evaluation.ood import ood_metrics_per_score
    from bayesify.zoo.data import InMemoryDataset
    from benchmarks._quality_methods import device

    via = method.evaluator_model(model)
    if via is not None:
        module, samples = via
        test = InMemoryDataset(task.x_test, task.y_test)
        ood = InMemoryDataset(task.x_ood, torch.zeros(len(task.x_ood), dtype=torch.long))
        result = evaluate(
            module, test, samples=samples, ood=ood, task="classification", batch_size=500, members=False, device=device()
        )
        if samples == 1 and not math.isclose(float(result["nll"]), float(clean["nll"]), rel_tol=1e-4, abs_tol=1e-6):
            raise RuntimeError(
                f"{method.key}: evaluate() gives test NLL {result['nll']:.6f}, the benchmark's members "
                f"{clean['nll']:.6f}: the evaluator does not see the method's predictive"
            )
        table = result["ood"]
    else:
        inside = bayesify.predictive.Classification().uncertainty(predict(task.x_test))
        outside = bayesify.predictive.Classification().uncertainty(predict(task.x_ood))
        table = ood_metrics_per_score(inside, outside)
    flat = {f"ood_{score}_{metric}": float(value) for score, row in table.items() for metric, value in row.items()}
    flat["ood_via_evaluate"] = 1.0 if via is not None else 0.0
    return flat
