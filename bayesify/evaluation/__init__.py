"""Evaluation of rank-1 BNNs as in the paper: mixture predictive metrics, corruptions, reports.

from bayesify.evaluation import evaluate, evaluate_corruptions, evaluate_run
clean = evaluate(model, bundle.test, samples=4, transform=bundle.normalize)
robust = evaluate_corruptions(model, bundle.test, samples=4, transform=bundle.normalize)
results = evaluate_run("runs/rank1", corruptions="all", baseline="runs/det", ood="noise")  # report.md + plots
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
from bayesify.evaluation.run import LoadedRun, evaluate_run, open_run

__all__ = [
    "CORRUPTIONS",
    "SEVERITIES",
    "LoadedRun",
    "collect_members",
    "compare_corruptions",
    "compute_metrics",
    "corrupt_images",
    "evaluate",
    "evaluate_corruptions",
    "evaluate_run",
    "markdown_report",
    "model_task",
    "ood_detection",
    "ood_metrics",
    "ood_scores",
    "open_run",
    "predict_members",
    "regression_metrics",
    "reliability_diagram",
    "severity_plot",
    "task_metrics",
]
