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

from torch import Tensor

from bayesify.config import Rank1Config
from bayesify.layers.base import Rank1Layer
from bayesify.layers.rank1_op import rank1_affine
from bayesify.options import Perturbation

__all__ = ["Rank1CondConv2d"]


class Rank1CondConv2d(Rank1Layer):
    """``y = conv(x o s, W(x)) o r + b(x) + delta_k`` for timm's ``CondConv2d(x, routing_weights)``.

    References:
        Dusenberry et al., ICML 2020.
    """

    def rank1_setup(self, config: Rank1Config) -> None:
        self.rank1_s = self.rank1_factor(self.in_channels)
        self.rank1_r = self.rank1_factor(self.out_channels)
        if self._parameters.get("bias") is not None:
            # an offset of the per-example mixed bias routing_weights @ bias: it stands alone (its own L2)
            self.rank1_bias_offset("rank1_bias", self.out_channels)
        else:
            self.register_parameter("rank1_bias", None)

    def rank1_batch_axis(self, x: Tensor) -> int | None:
        return 0

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
            None if self.rank1_bias is None else draw.gather(self.rank1_bias),
            additive=self.rank1_config.perturbation is Perturbation.ADDITIVE,
            batch_axis=0,
            channel_axis=1,
            core_bias=mixed,
        )
