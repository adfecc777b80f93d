"""The predictive wing: what a model's output means, and what its members say about it.

Below the engine: it imports only options-level code (``options``, ``mixture``) and runs no model.

* :mod:`~bayesify.predictive.tasks`: the task algebra (:class:`Task` and its kinds) and
  :func:`resolve_task`, the one place a task is decided;
* :mod:`~bayesify.predictive.libraries`: what timm / torchvision / Hugging Face outputs mean
  (:func:`infer_task`) and a Hugging Face loss recomputed from the mixture;
* :mod:`~bayesify.predictive.outputs`: a model's output structure reduced leaf by leaf by its task;
* :mod:`~bayesify.predictive.decompositions`: uncertainty decompositions, pure functions of the members;
* :mod:`~bayesify.predictive.heads`: head formats (:func:`gaussian_head`).
"""

from bayesify.predictive.decompositions import (
    BinaryUncertainty,
    ClassificationUncertainty,
    RegressionUncertainty,
    binary_uncertainty,
    classification_uncertainty,
    mixture_cdf,
    mixture_quantile,
    regression_uncertainty,
)
from bayesify.predictive.heads import VarianceParameter, gaussian_head
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
    "Auto",
    "Binary",
    "BinaryUncertainty",
    "Classification",
    "ClassificationUncertainty",
    "CustomTask",
    "Gaussian",
    "HuggingFaceTask",
    "Members",
    "MultiLabel",
    "Regression",
    "RegressionUncertainty",
    "Task",
    "TaskMap",
    "TaskName",
    "VarianceParameter",
    "binary_uncertainty",
    "classification_uncertainty",
    "gaussian_head",
    "infer_task",
    "mixture_cdf",
    "mixture_quantile",
    "parse_task",
    "regression_uncertainty",
    "resolve_task",
]
