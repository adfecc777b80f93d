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
from torch import Tensor, nn

from bayesify.config import Rank1Config
from bayesify.options import Perturbation
from bayesify.wrappers.base import Rank1Layer

__all__ = ["Rank1CondConv2d", "condconv_mapping"]


def condconv_mapping() -> dict[type[nn.Module], type[Rank1Layer]]:
    """``{timm CondConv2d: Rank1CondConv2d}`` if timm's layer is loaded, else ``{}`` (timm stays optional)."""
    import sys

    module = sys.modules.get("timm.layers.cond_conv2d")
    source = getattr(module, "CondConv2d", None)
    return {} if source is None else {source: Rank1CondConv2d}


class Rank1CondConv2d(Rank1Layer):
    """``y = conv(x o s, W(x)) o r + b(x) + delta_k`` for timm's ``CondConv2d(x, routing_weights)``.

    References:
        Dusenberry et al., ICML 2020.
    """

    def _rank1_setup(self, config: Rank1Config) -> None:
        self.rank1_s = self._rank1_new_factor(self.in_channels, config)
        self.rank1_r = self._rank1_new_factor(self.out_channels, config)
        bias = self._parameters.get("bias")
        if bias is not None:
            self.rank1_bias = nn.Parameter(torch.zeros(config.components, self.out_channels, dtype=bias.dtype, device=bias.device))
        else:
            self.register_parameter("rank1_bias", None)

    def _rank1_batch_axis(self, x: Tensor) -> int | None:
        return 0

    def forward(self, x: Tensor, routing_weights: Tensor) -> Tensor:
        rows, noise = self._rank1_rows(x.shape[0], x.device)
        additive = self.rank1_config.perturbation is Perturbation.ADDITIVE
        s = self.rank1_s.sample(rows, noise).to(x.dtype)[:, :, None, None]
        out = type(self).__rank1_base__.forward(self, x + s if additive else x * s, routing_weights)
        r = self.rank1_r.sample(rows, noise).to(out.dtype)[:, :, None, None]
        bias = self._parameters.get("bias")
        if additive:
            out = out + r
        elif bias is not None:  # out holds + b(x): only the convolution is scaled by r
            mixed = (routing_weights @ bias).to(out.dtype)[:, :, None, None]
            out = (out - mixed) * r + mixed
        else:
            out = out * r
        if self.rank1_bias is not None:
            out = out + self.rank1_bias[rows].to(out.dtype)[:, :, None, None]
        return out
