"""Evaluation of rank-1 BNNs as in the paper: mixture predictive metrics, corruptions, reports.

from bayesify.evaluation import evaluate, evaluate_corruptions
clean = evaluate(model, bundle.test, samples=4, transform=bundle.normalize)
robust = evaluate_corruptions(model, bundle.test, samples=4, transform=bundle.normalize)
"""

from bayesify.evaluation.corruptions import CORRUPTIONS, SEVERITIES, corrupt_images
from bayesify.evaluation.evaluator import compare_corruptions, evaluate, evaluate_corruptions, predict_members
from bayesify.evaluation.metrics import compute_metrics
from bayesify.evaluation.report import markdown_report, reliability_diagram, severity_plot

__all__ = [
    "CORRUPTIONS",
    "SEVERITIES",
    "compare_corruptions",
    "compute_metrics",
    "corrupt_images",
    "evaluate",
    "evaluate_corruptions",
    "markdown_report",
    "predict_members",
    "reliability_diagram",
    "severity_plot",
]
