"""Model-level helpers: find the rank-1 layers of a model and what they add."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor, nn

from bayesify.wrappers.base import Rank1Layer

__all__ = ["rank1_layers", "rank1_parameters", "kl_divergence", "is_converted", "num_components"]


def rank1_layers(model: nn.Module) -> Iterator[tuple[str, Rank1Layer]]:
    """``(qualified name, layer)`` for every rank-1 layer in ``model`` (found by ``isinstance``)."""
    for name, module in model.named_modules():
        if isinstance(module, Rank1Layer):
            yield name, module


def rank1_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters bayesify added (factor locations/scales and per-component biases)."""
    seen: set[int] = set()
    for _, layer in rank1_layers(model):
        for p in layer.rank1_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def is_converted(model: nn.Module) -> bool:
    """Whether ``model`` holds at least one rank-1 layer."""
    return next(rank1_layers(model), None) is not None


def num_components(model: nn.Module) -> int:
    """K, the number of mixture components of a converted model; 1 for a model with no rank-1 layers.

    Works on wrappers such as DDP and on any part of a converted model, so evaluation code can
    size its member axis (``[K * samples, ...]`` from :func:`bayesify.predict`) for any model.
    """
    first = next(rank1_layers(model), None)
    return 1 if first is None else first[1].rank1_config.components


def kl_divergence(model: nn.Module) -> Tensor:
    """KL(q || p) of every rank-1 posterior in ``model``, summed over components and layers.

    Divide by the number of training examples to get the per-example ELBO term:
    ``loss = nll + bayesify.kl_divergence(model) / len(train_set)``.

    References:
        Dusenberry et al., ICML 2020, Eq. 3 (the reference sums over the K components).
    """
    terms = [layer.kl_divergence() for _, layer in rank1_layers(model)]
    if not terms:
        raise ValueError(
            f"{type(model).__name__} has no rank-1 layers, so it has no KL term; call bayesify.convert(model) first."
        )
    device = terms[0].device
    return torch.stack([t.to(device) for t in terms]).sum()
