"""Rank-1 layers computing ``W x + b`` with input and output channels: the base of Linear and Conv.

Per row e, routed through component k(e): ``y = ((x o s_e) W^T) o r_e + b + delta_k`` (see
:func:`~bayesify.layers.rank1_op.rank1_affine`). A subclass whose class overrides ``forward``
(timm's ``StdConv2d`` weight standardisation, ``Conv2dSame`` padding, ...) keeps running its own
forward on the perturbed input; the bias it adds is accounted for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from bayesify.config import Rank1Config
from bayesify.layers._intercept import split_call
from bayesify.layers.base import Draw, Rank1Layer
from bayesify.layers.rank1_op import rank1_affine, rank1_folded
from bayesify.options import Perturbation, Sampling

__all__ = ["Fold", "Rank1Affine"]


@dataclass(frozen=True)
class Fold:
    """How a layer runs with a given weight: ``apply(x, weight, bias)``, its groups and weight layout."""

    weight: Tensor
    apply: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    groups: int = 1
    transposed: bool = False  # weight stored [in, out] (Hugging Face Conv1D)


class Rank1Affine(Rank1Layer):
    """Base of layers computing ``W x + b`` with input channels and output channels.

    A family implements :meth:`rank1_features`, :meth:`rank1_axes` and :meth:`rank1_core`.
    """

    rank1_intercepted = ("weight",)
    # the base forwards whose maths we know, so the bias can be left out instead of subtracted
    rank1_known_forwards: tuple[Callable, ...] = ()

    def rank1_features(self) -> tuple[int, int]:
        """``(input channels, output channels)``."""
        raise NotImplementedError

    def rank1_axes(self, x: Tensor) -> tuple[int | None, int]:
        """``(batch axis or None if unbatched, channel axis)`` of an input of this layer."""
        raise NotImplementedError

    def rank1_core(self, x: Tensor) -> Tensor:
        """``W x`` without bias, for a base class whose forward is in :attr:`rank1_known_forwards`."""
        raise NotImplementedError

    def rank1_batch_axis(self, x: Tensor) -> int | None:
        return self.rank1_axes(x)[0]

    def rank1_fold(self) -> Fold | None:
        """How this layer runs with a given weight (for :func:`~bayesify.layers.rank1_op.rank1_folded`),
        or None when it cannot (a subclass's own forward, e.g. weight standardisation)."""
        return None

    def rank1_setup(self, config: Rank1Config) -> None:
        fan_in, fan_out = self.rank1_features()
        self.rank1_s = self.rank1_factor(fan_in)
        self.rank1_r = self.rank1_factor(fan_out)
        self.rank1_bias_offset("rank1_bias", fan_out, "bias")

    def forward(self, input: Tensor, *args: object, **kwargs: object) -> Tensor:
        base = type(self).__rank1_base__
        # a plain torch layer whose weight is a Parameter (not a parametrization / pruning mask)
        if base.forward in self.rank1_known_forwards and not args and not kwargs and "weight" in self._parameters:
            return self._rank1_apply(
                input, self.rank1_core, self._parameters.get("bias"), core_adds_bias=False, fold=self.rank1_fold()
            )

        # a subclass with its own forward (weight standardisation, same padding, ...): run it as is
        # on the perturbed input; it adds the original bias, which the op accounts for
        state = self.rank1_state

        def core(x: Tensor) -> Tensor:
            state.busy = True
            try:
                return base.forward(self, x, *args, **kwargs)
            finally:
                state.busy = False

        return self._rank1_apply(input, core, self._parameters.get("bias"), core_adds_bias=True)

    def _rank1_apply(
        self,
        x: Tensor,
        core: Callable[[Tensor], Tensor],
        bias: Tensor | None,
        *,
        core_adds_bias: bool,
        fold: Fold | None = None,
    ) -> Tensor:
        batch_axis, channel_axis = self.rank1_axes(x)
        if x.dim() == 0 or x.shape[channel_axis] != self.rank1_s.features:
            core(x)  # a wrong input shape: let the layer's own computation raise torch's usual error
            raise ValueError(
                f"{type(self).__name__} expects {self.rank1_s.features} input channels at dimension "
                f"{channel_axis}, got an input of shape {tuple(x.shape)}."
            )
        draw = self.rank1_draw(1 if batch_axis is None else x.shape[batch_axis], x.device)
        additive = self.rank1_config.perturbation is Perturbation.ADDITIVE
        if fold is not None and not additive and batch_axis is not None and self._rank1_folds(draw, x, fold.weight):
            offset = None if self.rank1_bias is None else draw.gather_blocks(self.rank1_bias)
            if bias is not None:  # one row per block (a bias given by the caller, e.g. SwinV2's q/k/v biases)
                offset = bias.expand(len(draw.blocks), -1) if offset is None else offset + bias
            s, r = draw.sample_blocks(self.rank1_s, self.rank1_r)
            return rank1_folded(
                x, draw.blocks, fold.weight, fold.apply, s, r, offset, batch_axis=batch_axis, groups=fold.groups,
                transposed=fold.transposed,
            )  # fmt: skip
        offset = None if self.rank1_bias is None else draw.gather(self.rank1_bias)
        if bias is not None and not core_adds_bias:
            offset = bias.unsqueeze(0) if offset is None else offset + bias
        s, r = draw.sample(self.rank1_s, self.rank1_r)
        return rank1_affine(
            x,
            core,
            s,
            r,
            offset,
            additive=additive,
            batch_axis=batch_axis,
            channel_axis=channel_axis,
            core_bias=bias if core_adds_bias else None,
        )

    def _rank1_folds(self, draw: Draw, x: Tensor, weight: Tensor) -> bool:
        """Whether this call runs folded: blocked rows, and (``sampling='auto'``) the folded path moves
        fewer bytes than the per-row one.

        The per-row path makes ~3 activation-sized passes on each side of the layer (scale, and in the
        backward the scaled gradient and the factor's reduction); the folded one ~8 weight-sized passes
        per block (fold, and in the backward the chain rule to W, r and s). Memory follows the same
        count: the per-row path keeps the scaled input and the unscaled output for the backward pass.
        """
        sampling = self.rank1_config.sampling
        if draw.blocks is None or sampling is Sampling.EXAMPLE:
            return False
        if sampling is Sampling.COMPONENT:
            return True
        fan_in, fan_out = self.rank1_features()
        activations = x.numel() + x.numel() // max(fan_in, 1) * fan_out
        return 8 * len(draw.blocks) * weight.numel() < 3 * activations

    def _rank1_groups(self) -> int:
        return getattr(self, "groups", 1)

    def _rank1_external(self, func: Callable) -> Callable:
        """Handler for ``func(input, weight, bias, ...)`` called on this layer's intercepted weight."""
        import torch

        def handle(args: tuple, kwargs: dict) -> Tensor:
            x, weight, bias, rest, rest_kwargs = split_call(args, kwargs)
            if getattr(weight, "_rank1_layer", None) is not self:
                return NotImplemented
            w = self._parameters["weight"]
            self.rank1_state.intercepted_by = getattr(func, "__name__", "function")
            fold = Fold(w, lambda v, weight, b: func(v, weight, b, *rest, **rest_kwargs), self._rank1_groups())
            with torch._C.DisableTorchFunctionSubclass():
                return self._rank1_apply(
                    x, lambda v: func(v, w, None, *rest, **rest_kwargs), bias, core_adds_bias=False, fold=fold
                )

        return handle
