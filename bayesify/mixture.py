"""The members of a mixture: tiling a batch for them, splitting their outputs, reducing them to the predictive.

A converted model's K components (x M posterior samples each) are its *members*. bayesify
lays them out **member-major**: a tiled batch of B examples has ``S * B`` rows, row
``s * B + b`` being example ``b`` through member ``s`` (member ``k * M + m`` is sample ``m`` of
component ``k``). This module is the one place that knows the layout; the router (tiling inputs,
reducing outputs), the metrics and the training objective all use it.

Reductions of ``[S, ...]`` member outputs to one output:

* ``logits``: ``log mean_s softmax(z_s)`` over the class axis: the mixture's log-probabilities.
* ``binary_logits``: ``logit(mean_s sigmoid(z_s))`` elementwise (binary / multi-label heads).
* ``mean``: ``mean_s z_s`` (regression, features).

References:
    Dusenberry et al., ICML 2020, Eq. 2 (the mixture predictive) and Sec. 3 (the tiled batch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from bayesify.options import Reduction

__all__ = ["logmeanexp", "reduce_members", "split_members", "tile"]


def logmeanexp(x: Tensor, dim: int = 0) -> Tensor:
    """``log mean exp`` along ``dim``, computed stably (logsumexp - log n)."""
    return torch.logsumexp(x, dim) - math.log(x.shape[dim])


def tile(t: Tensor, members: int, axis: int = 0) -> Tensor:
    """``members`` member-major copies of a batch along ``axis``: ``[B, ...] -> [members * B, ...]``."""
    return torch.cat([t] * members, dim=axis) if members > 1 else t


def split_members(t: Tensor, members: int, axis: int = 0) -> Tensor:
    """``[..., members * B, ...]`` (batch at ``axis``) -> ``[members, ..., B, ...]``: the member axis in front."""
    axis = axis % t.dim()
    t = t.movedim(axis, 0)
    return t.reshape(members, t.shape[0] // members, *t.shape[1:]).movedim(1, axis + 1)


def reduce_members(members: Tensor, reduction: Reduction | str, class_axis: int = -1) -> Tensor:
    """Reduce ``[S, ...]`` member outputs to the mixture predictive ``[...]``.

    Args:
        members: the member outputs stacked on a leading axis.
        reduction: ``"logits"``, ``"binary_logits"`` or ``"mean"`` (see the module doc).
        class_axis: for ``logits``, the class axis of one member's output.
    """
    reduction = Reduction.parse(reduction, "reduction")
    if reduction is Reduction.MEAN:
        return members.mean(0)
    if reduction is Reduction.BINARY_LOGITS:
        # logit(mean sigmoid) = log(mean p) - log(mean (1 - p)), both in log space
        return logmeanexp(F.logsigmoid(members), 0) - logmeanexp(F.logsigmoid(-members), 0)
    axis = class_axis % (members.dim() - 1) + 1
    if members.shape[axis] == 1:
        raise ValueError(
            "reduction='logits' (log of the mean softmax) needs one output per class, but the model's output "
            "has a single column; use reduction='binary_logits' for a one-logit binary classifier or "
            "reduction='mean' for regression (convert(..., reduction=...) or bayesify.mode(..., reduction=...))."
        )
    return logmeanexp(torch.log_softmax(members.float(), axis), 0).to(members.dtype)
