"""Deprecated alias (release 0.3): the tasks moved to :mod:`bayesify.predictive` (removed in 0.4)."""

import warnings

from bayesify.predictive.libraries import HuggingFaceTask, infer_task
from bayesify.predictive.tasks import (
    Auto,
    Binary,
    Classification,
    CustomTask,
    Gaussian,
    Members,
    MultiLabel,
    Regression,
    Task,
    TaskMap,
    TaskName,
    parse_task,
    resolve_task,
)

__all__ = [
    "Auto", "Binary", "Classification", "CustomTask", "Gaussian", "HuggingFaceTask", "Members", "MultiLabel",
    "Regression", "Task", "TaskMap", "TaskName", "infer_task", "parse_task", "resolve_task",
]

warnings.warn(
    "bayesify.tasks moved to bayesify.predictive in release 0.3 (e.g. from bayesify.predictive import Classification); "
    "this alias goes in 0.4.",
    DeprecationWarning,
    stacklevel=2,
)
