"""Rank-1 ``nn.Bilinear``: ``y = r o ((x1 o s1)^T W (x2 o s2)) + b + delta_k``.

The weight ``W [out, in1, in2]`` is a 3-way tensor; its rank-1 perturbation
``W' = W o (r (x) s1 (x) s2)`` scales each of its three axes, the direct analogue of
``W o (r s^T)`` for a matrix, and it is exact per example by scaling both inputs and the
output. Additive variant: ``((x1 + s1)^T W (x2 + s2)) + r + b``.

References:
    Dusenberry et al., ICML 2020, Eq. 1 (rank-1 factors on every weight).
"""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_flatten

from bayesify.config import LayerOptions
from bayesify.layers.base import Rank1Layer, layer_bias
from bayesify.layers.rank1_op import broadcast_rows, rank1_affine
from bayesify.options import Perturbation

__all__ = ["Rank1Bilinear"]


class Rank1Bilinear(Rank1Layer):
    """Rank-1 ``nn.Bilinear``: factors ``rank1_s1`` (in1), ``rank1_s2`` (in2), ``rank1_r`` (out).

    The batch axis is the conversion's ``batch_dim`` capped at ``x1.dim() - 2``, as for Linear;
    1-d inputs are one unbatched example.

    References:
        Dusenberry et al., ICML 2020.
    """

    rank1_intercepted = ("weight",)

    def rank1_setup(self, options: LayerOptions) -> None:
        self.rank1_s1 = self.rank1_factor(self.in1_features)
        self.rank1_s2 = self.rank1_factor(self.in2_features)
        self.rank1_r = self.rank1_factor(self.out_features)
        self.rank1_bias_offset("rank1_bias", self.out_features, "bias")

    def rank1_batch_axis(self, x1: Tensor) -> int | None:
        return None if x1.dim() < 2 else min(self.rank1_state.model.options.batch_dim, x1.dim() - 2)

    def rank1_input_axes(self, args: tuple, kwargs: dict) -> list[int | None]:
        # used as the model: both inputs carry the batch (an unbatched pair gets its members at axis 0)
        x1 = args[0] if args else kwargs["input1"]
        axis = self.rank1_batch_axis(x1)
        return [0 if axis is None else axis] * len(tree_flatten((args, kwargs))[0])

    def rank1_merge(self, component: int) -> dict[str, Tensor]:
        """``W' = W o (r_k (x) s1_k (x) s2_k)``, ``b' = b + delta_k``; the additive form is refused."""
        if self.rank1_options.perturbation is Perturbation.ADDITIVE:
            raise ValueError(
                "the additive perturbation (x1 + s1)^T W (x2 + s2) adds terms linear in x1 and in x2, which "
                "nn.Bilinear's weight and bias cannot hold"
            )
        at = partial(self.rank1_location, component=component)
        r, s1, s2 = at("rank1_r"), at("rank1_s1"), at("rank1_s2")
        merged = {"weight": self._parameters["weight"] * r[:, None, None] * s1[None, :, None] * s2[None, None, :]}
        bias = self._parameters.get("bias")
        if bias is not None:
            merged["bias"] = bias + at("rank1_bias")
        return merged

    def forward(self, input1: Tensor, input2: Tensor) -> Tensor:
        axis = self.rank1_batch_axis(input1)
        draw = self.rank1_draw(1 if axis is None else input1.shape[axis], input1.device)
        additive = self.rank1_options.perturbation is Perturbation.ADDITIVE
        s2 = broadcast_rows(draw.sample(self.rank1_s2).to(input2.dtype), input2.dim(), axis, -1)
        x2 = input2 + s2 if additive else input2 * s2
        bias = layer_bias(self)
        offset = None if bias is None else bias + draw.gather("rank1_bias")
        weight = self._parameters["weight"]
        return rank1_affine(
            input1,
            lambda x1: F.bilinear(x1, x2, weight),
            draw.sample(self.rank1_s1),
            draw.sample(self.rank1_r),
            offset,
            additive=additive,
            batch_axis=axis,
            channel_axis=-1,
        )
