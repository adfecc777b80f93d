"""Questions about a model: which of its layers are converted, what bayesify added, K, what its output means.

These find converted layers by ``isinstance``, so a user's own layer families join for free,
and work through wrappers such as DDP or ``torch.compile``'s ``OptimizedModule``.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from torch import nn

from bayesify.layers.base import ConvertedLayer
from bayesify.model_state import hands_on_root_output, model_state
from bayesify.predictive.libraries import infer_task
from bayesify.predictive.tasks import Task, resolve_task

__all__ = [
    "NORM_LAYERS", "inside", "is_converted", "model_task", "num_components", "rank1_layers", "rank1_parameters",
]

NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
"""Normalisation layers: deterministic by design (as in the paper), covered by the optional L2 on norm layers."""


def rank1_layers(model: nn.Module) -> Iterator[tuple[str, ConvertedLayer]]:
    """``(qualified name, layer)`` for every converted layer in ``model`` (rank-1 layers and Gaussian embeddings)."""
    for name, module in model.named_modules():
        if isinstance(module, ConvertedLayer):
            yield name, module


def rank1_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters bayesify added (factor locations/scales, per-component bias offsets, embedding scales)."""
    seen: set[int] = set()
    for _, layer in rank1_layers(model):
        for p in layer.rank1_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def is_converted(model: nn.Module) -> bool:
    """Whether ``model`` holds at least one converted layer."""
    return next(rank1_layers(model), None) is not None


def num_components(model: nn.Module) -> int:
    """K, the number of mixture components of a converted model; 1 for a model with no rank-1 layers.

    Works on wrappers such as DDP and on any part of a converted model, so evaluation code can
    size its member axis (``[K * samples, ...]`` from :func:`bayesify.predict`) for any model.
    """
    first = next(rank1_layers(model), None)
    return 1 if first is None else first[1].rank1_state.model.components


def model_task(model: nn.Module, task: object = None, *, needed_by: str | None = None) -> Task:
    """What ``model``'s output means: ``task`` if given, else what the converted model was told (or found) at
    conversion, else what a plain model states (timm / torchvision / Hugging Face; see
    :func:`~bayesify.predictive.tasks.resolve_task`, which decides, and raises naming ``needed_by``'s ``task=``).
    A module holding a converted part that it is not a known wrapper of (its own forward around the part) states the
    part's, which holds where the module returns the part's output as it is: :func:`check_handed_on` says."""
    stated = model_state(model).current_task() if is_converted(model) else infer_task(model)
    return resolve_task(task, stated=stated, needed_by=needed_by)


def check_handed_on(model: nn.Module, task: object, needed_by: str) -> None:
    """After ``predict(model, ...)`` without a task said: refuse where ``model`` holds a converted part and returned
    something else than that part's output (a head of its own on a backbone converted with ``task="regression"``),
    whose task the part's says nothing of (its class logits were decomposed as a regression, silently)."""
    if task is not None or not is_converted(model) or hands_on_root_output(model) or model_state(model).handed_on:
        return
    raise ValueError(
        f"{needed_by} does not know what the output of {type(model).__name__} means: the task of the converted part it "
        f"holds ({model_state(model).current_task()}) is that part's output's, and {type(model).__name__} returns "
        "another; pass task= to it ('classification', 'binary', 'multilabel', 'regression' or 'gaussian')."
    )


def inside(name: str, prefixes: Iterable[str]) -> bool:
    """Whether module ``name`` lies strictly below one of the modules ``prefixes`` ("" is the root)."""
    return any(p == "" and name != "" or name.startswith(p + ".") for p in prefixes if p != name)
