"""Evaluation of rank-1 BNNs as in the paper: mixture predictive metrics, corruptions, reports.

from bayesify.evaluation import evaluate, evaluate_corruptions
clean = evaluate(model, bundle.test, samples=4, transform=bundle.normalize)
robust = evaluate_corruptions(model, bundle.test, samples=4, transform=bundle.normalize)

A run directory of ``bayesify train`` is evaluated by :func:`bayesify.training.evaluate_run` (the training
side imports this package, never the other way round).
"""

from bayesify.evaluation.corruptions import CORRUPTIONS, SEVERITIES, corrupt_images
from bayesify.evaluation.evaluator import (
    collect_members,
    compare_corruptions,
    evaluate,
    evaluate_corruptions,
    model_task,
    ood_detection,
    predict_members,
)
from bayesify.evaluation.metrics import compute_metrics, task_metrics
from bayesify.evaluation.ood import ood_metrics, ood_scores
from bayesify.evaluation.regression import regression_metrics
from bayesify.evaluation.report import markdown_report, reliability_diagram, severity_plot

__all__ = [
    "CORRUPTIONS",
    "SEVERITIES",
    "collect_members",
    "compare_corruptions",
    "compute_metrics",
    "corrupt_images",
    "evaluate",
    "evaluate_corruptions",
    "markdown_report",
    "model_task",
    "ood_detection",
    "ood_metrics",
    "ood_scores",
    "predict_members",
    "regression_metrics",
    "reliability_diagram",
    "severity_plot",
    "task_metrics",
]
