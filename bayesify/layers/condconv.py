"""Rank-1 timm ``CondConv2d`` (conditionally parameterised convolution, EfficientNet-CondConv).

``CondConv2d`` mixes ``num_experts`` kernels per example, ``W(x) = sum_e a_e(x) W_e`` (and
biases alike), then convolves. The rank-1 factors act on the mixed kernel,
``W(x) o (r s^T)``: ``s`` scales input channels and ``r`` output channels, exactly as for a
plain convolution, with per-component bias offsets. timm's own forward (grouped-conv batching,
dynamic "same" padding) runs unchanged on the scaled input.

References:
    Dusenberry et al., ICML 2020; Yang et al., "CondConv", NeurIPS 2019 (timm ``CondConv2d``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bayesify.config import LayerOptions
from bayesify.layers.base import Rank1Layer
from bayesify.layers.folded import fold_weight
from bayesify.layers.rank1_op import rank1_affine
from bayesify.options import Perturbation

__all__ = ["Rank1CondConv2d"]


class Rank1CondConv2d(Rank1Layer):
    """``y = conv(x o s, W(x)) o r + b(x) + delta_k`` for timm's ``CondConv2d(x, routing_weights)``.

    References:
        Dusenberry et al., ICML 2020.
    """

    def rank1_setup(self, options: LayerOptions) -> None:
        self.rank1_s = self.rank1_factor(self.in_channels)
        self.rank1_r = self.rank1_factor(self.out_channels)
        if self._parameters.get("bias") is not None:
            # an offset of the per-example mixed bias routing_weights @ bias: it stands alone (its own L2)
            self.rank1_bias_offset("rank1_bias", self.out_channels)
        else:
            self.register_parameter("rank1_bias", None)

    def rank1_batch_axis(self, x: Tensor) -> int | None:
        return 0

    def rank1_merge(self, component: int) -> dict[str, Tensor]:
        """Every expert kernel ``W_e' = W_e o (r_k s_k^T)``: the mixed kernel is linear in them, so
        ``W(x)' = W(x) o (r_k s_k^T)`` for every example. A bias offset ``delta_k`` is added once, while
        the biases are mixed by routing weights that need not sum to one: it merges only when zero."""
        name = type(self).__rank1_base__.__name__
        if self.rank1_options.perturbation is Perturbation.ADDITIVE:
            raise ValueError(
                f"the additive perturbation of {name} shifts its output by conv(s, W(x)) + r, which depends on each "
                "example's routing weights and is no parameter of the layer"
            )
        delta = self.rank1_location("rank1_bias", component)
        if delta is not None and bool(delta.any()):
            raise ValueError(
                f"component {component}'s bias offset is added once, but {name} mixes its expert biases with routing "
                "weights that need not sum to one, so no expert bias can hold it"
            )
        s, r = self.rank1_location("rank1_s", component), self.rank1_location("rank1_r", component)
        weight = self._parameters["weight"]  # [experts, out * in / groups * kernel], one flattened kernel per expert
        experts = weight.view(weight.shape[0], *self.weight_shape)
        folded = torch.stack([fold_weight(w, r, s, groups=self.groups) for w in experts])
        return {"weight": folded.view_as(weight)}

    def forward(self, x: Tensor, routing_weights: Tensor) -> Tensor:
        draw = self.rank1_draw(x.shape[0], x.device)
        bias = self._parameters.get("bias")
        # timm's forward adds the per-example mixed bias b(x) = routing_weights @ bias itself
        mixed = None if bias is None else routing_weights @ bias
        return rank1_affine(
            x,
            lambda v: type(self).__rank1_base__.forward(self, v, routing_weights),
            draw.sample(self.rank1_s),
            draw.sample(self.rank1_r),
            draw.gather("rank1_bias"),
            additive=self.rank1_options.perturbation is Perturbation.ADDITIVE,
            batch_axis=0,
            channel_axis=1,
            core_bias=mixed,
        )
