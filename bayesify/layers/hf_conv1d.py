"""Rank-1 Hugging Face ``Conv1D`` (``transformers.pytorch_utils``): GPT-2, OpenAI GPT, ImageGPT, ...

Despite its name, ``Conv1D`` is a dense layer with its weight stored ``[in, out]`` (the transpose
of ``nn.Linear``'s): ``y = x @ W + b``. Its rank-1 form is the Linear one,
``y = ((x o s) @ W) o r + b + delta_k``, with ``s`` over the ``nx`` inputs and ``r`` over the ``nf``
outputs. transformers stays optional: the default mapping holds this class once
``transformers.pytorch_utils`` is imported.

References:
    Dusenberry et al., ICML 2020, Eq. 1; transformers ``pytorch_utils.Conv1D``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bayesify.layers.affine import Fold, Rank1Affine
from bayesify.layers.folded import fold_weight
from bayesify.layers.rank1_op import KnownMap

__all__ = ["Rank1HFConv1D"]


class Rank1HFConv1D(Rank1Affine):
    """``y = ((x o s) @ W) o r + b_k`` on the last axis; the batch at ``batch_dim`` (capped as for Linear)."""

    @property
    def rank1_known_forwards(self) -> tuple:  # type: ignore[override]
        return (type(self).__rank1_base__.forward,) if type(self).__rank1_base__.__name__ == "Conv1D" else ()

    def rank1_features(self) -> tuple[int, int]:
        return self.nx, self.nf

    def rank1_axes(self, x: Tensor) -> tuple[int | None, int]:
        if x.dim() < 2:
            return None, -1
        return min(self.rank1_state.model.options.batch_dim, x.dim() - 2), -1

    def rank1_core(self, x: Tensor) -> Tensor:
        return x @ self._parameters["weight"]

    def rank1_merged_weight(self, weight: Tensor, r: Tensor, s: Tensor) -> Tensor:
        return fold_weight(weight, r, s, transposed=True)

    def rank1_constant_response(self, weight: Tensor, s: Tensor) -> Tensor:
        return s @ weight

    def rank1_fold(self) -> Fold:
        return Fold(self._parameters["weight"], _dense, transposed=True, dense=True)

    def rank1_known_map(self, x: Tensor) -> KnownMap | None:
        return KnownMap(self._parameters["weight"], torch.matmul, _matmul_backward) if x.dim() >= 2 else None


def _dense(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x @ weight if bias is None else torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)


def _matmul_backward(grad: Tensor, x: Tensor, weight: Tensor, needs: tuple[bool, bool]) -> tuple[Tensor | None, Tensor | None]:
    """``x @ weight``'s backward (``weight`` ``[in, out]``): ``grad W^T`` and ``x^T grad`` over every leading axis."""
    g = grad if grad.dim() == 2 else grad.reshape(-1, grad.shape[-1])
    d_x = d_weight = None
    if needs[0]:
        d_x = g.mm(weight.t())
        d_x = d_x if grad.dim() == 2 else d_x.view(*grad.shape[:-1], weight.shape[0])
    if needs[1]:
        d_weight = (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).t().mm(g)
    return d_x, d_weight
