"""``uncertainty(model, x)``: the predictive uncertainty of one batch, from one batched pass of the members.

The decompositions themselves are pure functions of the members
(:mod:`bayesify.predictive.decompositions`, importable from here as well); this module runs the model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bayesify.inspection import check_handed_on, model_task
from bayesify.mode import predict
from bayesify.model_state import model_state
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
from bayesify.predictive.libraries import named_outputs
from bayesify.predictive.outputs import check_leaf, leaf_task, selected_output
from bayesify.predictive.tasks import Binary, refuse_sigmoid_outputs, resolve_task

__all__ = [
    "BinaryUncertainty",
    "ClassificationUncertainty",
    "RegressionUncertainty",
    "VarianceParameter",
    "binary_uncertainty",
    "classification_uncertainty",
    "gaussian_head",
    "members_uncertainty",
    "mixture_cdf",
    "mixture_quantile",
    "regression_uncertainty",
    "uncertainty",
]


def members_uncertainty(
    task: object, members: Tensor
) -> ClassificationUncertainty | BinaryUncertainty | RegressionUncertainty:
    """The decomposition that fits ``task`` (a :class:`~bayesify.predictive.tasks.Task` or its name) for ``[S, ...]``
    members."""
    return resolve_task(task, needed_by="members_uncertainty").uncertainty(members)


def uncertainty(
    model: torch.nn.Module,
    *inputs: object,
    samples: int = 4,
    task: object = None,
    noise: bool | None = None,
    output: object = None,
    **kwargs: object,
) -> ClassificationUncertainty | BinaryUncertainty | RegressionUncertainty:
    """Predictive uncertainty of one batch: one batched pass of K x ``samples`` members, decomposed.

    Classification gives ``probs``, ``predictive_entropy`` (total), ``expected_entropy``
    (aleatoric), ``mutual_information`` (epistemic) and ``variation_ratio`` (Gal's: 1 - the share
    of members voting for the most-voted class, not for the mixture's ``prediction``), per example
    (per pixel for segmentation); binary / multi-label the same per label; regression and Gaussian
    heads ``mean``, ``total_variance``, ``aleatoric_variance`` and ``epistemic_variance``, with
    predictive intervals (``interval(level)``).

    Args:
        model: a converted model (in eval mode for evaluation).
        *inputs: the batch, as the model takes it (``**kwargs`` too).
        samples: posterior samples per component (M); with ``noise=False`` one pass per component
            (the posterior means are the same in every sample).
        task: what the output means; default: the model's (see :mod:`bayesify.predictive.tasks`).
        noise: sample the factors (default) or use the posterior means (``False``: the K members
            that ``model.eval()`` averages, so the decomposition describes the eval output).
        output: the part of a structured output to decompose: a dict key, a tuple index or an attribute name;
            default: the tensor itself, a Hugging Face ``logits``, a segmentation ``out``, a tuple's first element.

    Example:
        >>> u = bayesify.uncertainty(model.eval(), x, samples=4)
        >>> u.mutual_information           # [B]: epistemic uncertainty, nats
        >>> low, high = bayesify.uncertainty(regressor.eval(), x).interval(0.9)

    References:
        Depeweg et al., ICML 2018 (the decompositions).
    """
    resolved = model_task(model, task, needed_by="bayesify.uncertainty")
    kwargs = named_outputs(model_state(model).root or model, kwargs)[0]  # (read by name: a tuple's positions do not say which is which)
    members = predict(model, *inputs, samples=1 if noise is False else samples, noise=noise, **kwargs)
    check_handed_on(model, task, "bayesify.uncertainty")
    leaf, key = selected_output(members, output, type(model_state(model).root or model).__name__, "bayesify.uncertainty")
    found = leaf_task(resolved, key, model)
    state = model_state(model).router.state  # where the pass took the batch, and its size (a member's output may
    axis = state.axis  # put it elsewhere: a time-major model's last step); None: unbatched
    check_leaf(found, key, model, leaf.shape[1:], axis, state.batch)
    if isinstance(found, Binary):
        refuse_sigmoid_outputs(leaf, model_state(model).root or model)
    return found.uncertainty(leaf)
