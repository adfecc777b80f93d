"""The KL term of a converted model's training objective.

``kl_divergence(model)`` is the sum over every converted layer of KL(q || p), each layer stating
its pieces (:meth:`~bayesify.layers.ConvertedLayer.rank1_kl_terms`), taken in one concatenated
pass per prior (:func:`bayesify.variational.kl.total_kl`). Divide it by the number of training
examples for the per-example ELBO term.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bayesify.inspection import rank1_layers
from bayesify.variational.kl import total_kl

__all__ = ["kl_divergence"]


def kl_divergence(model: nn.Module) -> Tensor:
    """KL(q || p) of every variational posterior in ``model``, summed over components and layers.

    Divide by the number of training examples to get the per-example ELBO term:
    ``loss = nll + bayesify.kl_divergence(model) / len(train_set)``.

    Raises:
        ValueError: ``model`` has no converted layer.

    References:
        Dusenberry et al., ICML 2020, Eq. 3 (the reference sums over the K components).
    """
    layers = [layer for _, layer in rank1_layers(model)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no rank-1 layers, so it has no KL term; call bayesify.convert(model) first."
        )
    total = total_kl(term for layer in layers for term in layer.rank1_kl_terms())
    if total is None:  # only delta posteriors (BatchEnsemble)
        first = next((p for layer in layers for p in layer.rank1_parameters()), None)
        return torch.zeros(()) if first is None else first.new_zeros(())
    return total
