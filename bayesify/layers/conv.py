"""Rank-1 convolutions: ``nn.Conv1d/2d/3d``, ``nn.ConvTranspose1d/2d/3d`` and their subclasses.

``s`` scales input channels and ``r`` output channels, broadcast over space:
``W'[o, i, ...] = W[o, i, ...] * r[o] * s[i]``, which is exact for grouped and transposed
convolutions too. Subclasses that override ``forward`` (timm's ``StdConv2d`` weight
standardisation, ``Conv2dSame`` padding, ...) keep running their own forward.

References:
    Dusenberry et al., ICML 2020, Sec. 3; edward2 ``Conv2DRank1``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayesify.layers.affine import Fold, Rank1Affine
from bayesify.layers.folded import fold_weight
from bayesify.layers.rank1_op import KnownMap

__all__ = ["Rank1Conv", "Rank1ConvTranspose"]

_CONV_FUNCTIONS = (F.conv1d, F.conv2d, F.conv3d)
_CONV_TRANSPOSE_FUNCTIONS = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)


class _Rank1ConvBase(Rank1Affine):
    _functions: tuple[Callable, ...] = ()
    rank1_stem_folds = True

    def rank1_features(self) -> tuple[int, int]:
        return self.in_channels, self.out_channels

    def rank1_axes(self, x: Tensor) -> tuple[int | None, int]:
        spatial = len(self.kernel_size)
        if x.dim() == spatial + 1:  # unbatched [C, *spatial]
            return None, 0
        return 0, 1

    def rank1_output_numel(self, x: Tensor) -> int:
        # the output's positions from the input's (a stride-16 patch embedding has 256x fewer than its input)
        spatial = len(self.kernel_size)
        positions = 1
        for axis, size in enumerate(x.shape[x.dim() - spatial :]):
            positions = positions * self._rank1_output_length(size, axis)
        batch = x.numel() // max(math.prod(x.shape[x.dim() - spatial - 1 :]), 1)
        return batch * self.out_channels * positions

    def _rank1_output_length(self, size: int, axis: int) -> int:
        kernel, stride, dilation = self.kernel_size[axis], self.stride[axis], self.dilation[axis]
        padding = self.padding if isinstance(self.padding, str) else self.padding[axis]
        if padding == "same":
            return size
        padding = 0 if padding == "valid" else padding
        return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1

    def rank1_functional_handlers(self) -> dict[Callable, Callable]:
        return {f: self._rank1_external(f) for f in self._functions}

    def _rank1_zero_padded(self) -> bool:
        """Whether the convolution pads with zeros (a constant input is then not constant at the border)."""
        return self.padding_mode == "zeros" and any(self._reversed_padding_repeated_twice)


class Rank1Conv(_Rank1ConvBase):
    """Rank-1 ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d`` (``padding_mode`` respected)."""

    rank1_known_forwards = (nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward)
    _functions = _CONV_FUNCTIONS

    def rank1_core(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self._parameters["weight"], None)

    def rank1_fold(self) -> Fold:
        return Fold(self._parameters["weight"], self._conv_forward, self.groups)

    def rank1_known_map(self, x: Tensor) -> KnownMap | None:
        # zero padding given as numbers, batched input: torch's one convolution op and its one backward op
        if self.padding_mode != "zeros" or isinstance(self.padding, str) or x.dim() != len(self.kernel_size) + 2:
            return None
        spatial = len(self.kernel_size)
        conv, stride, padding, dilation, groups = _CONV_FUNCTIONS[spatial - 1], self.stride, self.padding, self.dilation, self.groups

        def forward(v: Tensor, weight: Tensor) -> Tensor:
            return conv(v, weight, None, stride, padding, dilation, groups)

        def backward(grad: Tensor, v: Tensor, weight: Tensor, needs: tuple[bool, bool]) -> tuple[Tensor | None, Tensor | None]:
            d_v, d_weight, _ = torch.ops.aten.convolution_backward(
                grad, v, weight, None, stride, padding, dilation, False, (0,) * spatial, groups, (*needs, False)
            )
            return d_v, d_weight

        return KnownMap(self._parameters["weight"], forward, backward)

    def rank1_constant_response(self, weight: Tensor, s: Tensor) -> Tensor:
        # padding by reflection, replication or wrapping keeps a constant input constant; zeros do not
        if self._rank1_zero_padded():
            raise ValueError(
                f"{type(self).__rank1_base__.__name__} pads with zeros, so an additive perturbation of its input "
                "is not a constant shift of its output at the border (only unpadded or non-zero padding_mode "
                "convolutions merge)"
            )
        return fold_weight(weight, weight.new_ones(weight.shape[0]), s, groups=self.groups).flatten(1).sum(1)


class Rank1ConvTranspose(_Rank1ConvBase):
    """Rank-1 ``nn.ConvTranspose1d`` / ``2d`` / ``3d`` (``output_size`` passes through)."""

    _functions = _CONV_TRANSPOSE_FUNCTIONS
    # its forward computes output_padding from output_size: always run it, bias accounted for
    rank1_merge_forwards = (nn.ConvTranspose1d.forward, nn.ConvTranspose2d.forward, nn.ConvTranspose3d.forward)

    def rank1_merged_weight(self, weight: Tensor, r: Tensor, s: Tensor) -> Tensor:
        return fold_weight(weight, r, s, groups=self.groups, transposed=True)  # weight [in, out / groups, ...]

    def _rank1_output_length(self, size: int, axis: int) -> int:
        kernel, stride, dilation = self.kernel_size[axis], self.stride[axis], self.dilation[axis]
        extra = self.output_padding[axis] - 2 * self.padding[axis]
        return (size - 1) * stride + dilation * (kernel - 1) + extra + 1

    def rank1_constant_response(self, weight: Tensor, s: Tensor) -> Tensor:
        raise ValueError(
            f"{type(self).__rank1_base__.__name__} is a transposed convolution: a constant input reaches the output "
            "border positions through fewer taps, so an additive perturbation is not a constant shift of its output"
        )


