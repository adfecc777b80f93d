"""Rank-1 ``nn.Linear`` (and every subclass: ``NonDynamicallyQuantizableLinear``, timm's ``Linear``, ...)."""

from __future__ import annotations

import sys
from typing import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from bayesify.layers.affine import Fold, Rank1Affine
from bayesify.layers.rank1_op import KnownMap

__all__ = ["Rank1Linear"]


class Rank1Linear(Rank1Affine):
    """``y = ((x o s) W^T) o r + b_k`` on the last axis; the batch is at ``batch_dim``.

    ``s`` has ``in_features`` entries and ``r`` has ``out_features``. The batch axis is the
    conversion's ``batch_dim`` (1 inside torch's time-major transformer layers, whatever the model's:
    ``LayerState.batch_axis``), capped at ``x.dim() - 2`` (a ``[B, F]`` head of a sequence-first
    model still has its batch first); a 1-d input is one unbatched example.

    References:
        Dusenberry et al., ICML 2020, Eq. 1; edward2 ``DenseRank1``.
    """

    @property
    def rank1_known_forwards(self) -> tuple:  # type: ignore[override]
        # nn.Linear's, and timm's Linear (MobileNetV3's, GhostNet's heads): F.linear(x, weight, bias), with a dtype
        # cast under torch.jit scripting only. bayesify imports no library: looked up where timm is loaded
        timm_linear = getattr(sys.modules.get("timm.layers.linear"), "Linear", None)
        return (nn.Linear.forward,) if timm_linear is None else (nn.Linear.forward, timm_linear.forward)

    def rank1_features(self) -> tuple[int, int]:
        return self.in_features, self.out_features

    def rank1_axes(self, x: Tensor) -> tuple[int | None, int]:
        if x.dim() < 2:
            return None, -1
        state = self.rank1_state
        axis = state.model.options.batch_dim if state.batch_axis is None else state.batch_axis
        return min(axis, x.dim() - 2), -1

    def rank1_core(self, x: Tensor) -> Tensor:
        return F.linear(x, self._parameters["weight"])

    def rank1_constant_response(self, weight: Tensor, s: Tensor) -> Tensor:
        return F.linear(s, weight)

    def rank1_fold(self) -> Fold:
        return Fold(self._parameters["weight"], F.linear, dense=True)

    def rank1_known_map(self, x: Tensor) -> KnownMap | None:
        return KnownMap(self._parameters["weight"], F.linear, _linear_backward) if x.dim() >= 2 else None

    def rank1_functional_handlers(self) -> dict[Callable, Callable]:
        return {F.linear: self._rank1_external(F.linear)}


def _linear_backward(grad: Tensor, x: Tensor, weight: Tensor, needs: tuple[bool, bool]) -> tuple[Tensor | None, Tensor | None]:
    """``F.linear(x, weight)``'s backward: ``grad @ W`` and ``grad^T x`` over every leading axis."""
    g = grad if grad.dim() == 2 else grad.reshape(-1, grad.shape[-1])
    d_x = d_weight = None
    if needs[0]:
        d_x = g.mm(weight)
        d_x = d_x if grad.dim() == 2 else d_x.view(*grad.shape[:-1], weight.shape[1])
    if needs[1]:
        d_weight = g.t().mm(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]))
    return d_x, d_weight
