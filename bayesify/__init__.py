"""bayesify: turn any PyTorch model into a rank-1 Bayesian neural net with one call.

    model = bayesify.convert(model, components=4)
    loss = F.cross_entropy(model(x), y) + bayesify.kl_divergence(model) / len(train_set)

References:
    Dusenberry et al., "Efficient and Scalable Bayesian Neural Nets with Rank-1 Factors", ICML 2020.
"""

from bayesify.adapter import freeze_base
from bayesify.config import LayerOptions, ModelOptions, Rank1Config
from bayesify.convert import convert, default_mapping, revert
from bayesify.inspection import is_converted, num_components, rank1_layers, rank1_parameters
from bayesify.kl import kl_divergence, kl_loss
from bayesify.layers import ConvertedLayer, Rank1Layer
from bayesify.merge import merge
from bayesify.mode import mode, predict
from bayesify.model_state import ModelState
from bayesify.options import Init, Perturbation, Posterior, Prior, Route
from bayesify.summary import Summary, summary
from bayesify.predictive.tasks import Task
from bayesify.uncertainty import uncertainty
from bayesify.variational import Rank1Factor

__version__ = "0.4.0.dev0"

__all__ = [
    "ConvertedLayer",
    "Init",
    "LayerOptions",
    "ModelOptions",
    "ModelState",
    "Perturbation",
    "Posterior",
    "Prior",
    "Rank1Config",
    "Rank1Factor",
    "Rank1Layer",
    "Route",
    "Summary",
    "Task",
    "convert",
    "default_mapping",
    "freeze_base",
    "is_converted",
    "kl_divergence",
    "kl_loss",
    "merge",
    "mode",
    "num_components",
    "predict",
    "rank1_layers",
    "rank1_parameters",
    "revert",
    "summary",
    "uncertainty",
]


# sub-packages loaded on first use (bayesify.detection, bayesify.training, ...)
_LAZY = ("detection", "evaluation", "hf", "predictive", "training", "zoo")


def __getattr__(name: str) -> object:
    import importlib

    if name in _LAZY:
        return importlib.import_module(f"bayesify.{name}")
    raise AttributeError(f"module 'bayesify' has no attribute {name!r}")
