"""The rank-1 computation shared by Linear and Conv layers.

Per row e of the batch, routed through component k(e):

    multiplicative:  y = ((x o s_e) W^T) o r_e + b + delta_k
    additive:        y = ((x + s_e) W^T) + r_e + b + delta_k

with s_e, r_e drawn from component k(e)'s posterior (or its location without noise). The
reference gives each component its own bias b_k; here ``b_k = b + delta_k`` with the original
bias ``b`` shared and ``delta_k`` (``rank1_bias``, zero at init) per component: the same family
of functions, and the pretrained bias stays the live Parameter.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from bayesify.config import Rank1Config
from bayesify.options import Perturbation
from bayesify.wrappers._intercept import split_call
from bayesify.wrappers.base import Rank1Layer

__all__ = ["Rank1Affine"]


class Rank1Affine(Rank1Layer):
    """Base of layers computing ``W x + b`` with input channels and output channels."""

    _rank1_intercepted = ("weight",)
    # the base forwards whose maths we know, so the bias can be left out instead of subtracted
    _rank1_known_forwards: tuple[Callable, ...] = ()

    def _rank1_features(self) -> tuple[int, int]:
        """``(input channels, output channels)``."""
        raise NotImplementedError

    def _rank1_axes(self, x: Tensor) -> tuple[int | None, int]:
        """``(batch axis or None if unbatched, channel axis)`` of an input of this layer."""
        raise NotImplementedError

    def _rank1_batch_axis(self, x: Tensor) -> int | None:
        return self._rank1_axes(x)[0]

    def _rank1_core(self, x: Tensor) -> Tensor:
        """``W x`` without bias, for a base class whose forward is in ``_rank1_known_forwards``."""
        raise NotImplementedError

    def _rank1_setup(self, config: Rank1Config) -> None:
        fan_in, fan_out = self._rank1_features()
        self.rank1_s = self._rank1_new_factor(fan_in, config)
        self.rank1_r = self._rank1_new_factor(fan_out, config)
        bias = self._parameters.get("bias")
        if bias is not None:
            self.rank1_bias = nn.Parameter(torch.zeros(config.components, fan_out, device=bias.device, dtype=bias.dtype))
        else:
            self.register_parameter("rank1_bias", None)

    def forward(self, input: Tensor, *args: object, **kwargs: object) -> Tensor:
        base = type(self).__rank1_base__
        # fast path: a plain torch layer whose weight is a Parameter (not a parametrization / pruning mask)
        if base.forward in self._rank1_known_forwards and not args and not kwargs and "weight" in self._parameters:
            return self._rank1_apply(input, self._rank1_core, self._parameters.get("bias"), bias_in_core=False)

        # a subclass with its own forward (weight standardisation, same padding, ...): run it as is
        # on the perturbed input; it adds the original bias, which _rank1_apply accounts for
        def core(x: Tensor) -> Tensor:
            state = self.__dict__
            state["_rank1_busy"] = True
            try:
                return base.forward(self, x, *args, **kwargs)
            finally:
                state["_rank1_busy"] = False

        return self._rank1_apply(input, core, self._parameters.get("bias"), bias_in_core=True)

    def _rank1_apply(
        self, x: Tensor, core: Callable[[Tensor], Tensor], bias: Tensor | None, *, bias_in_core: bool
    ) -> Tensor:
        batch_axis, channel_axis = self._rank1_axes(x)
        if x.dim() == 0 or x.shape[channel_axis] != self.rank1_s.features:
            core(x)  # a wrong input shape: let the layer's own computation raise torch's usual error
            raise ValueError(
                f"{type(self).__name__} expects {self.rank1_s.features} input channels at dimension "
                f"{channel_axis}, got an input of shape {tuple(x.shape)}."
            )
        n = 1 if batch_axis is None else x.shape[batch_axis]
        rows, noise = self._rank1_rows(n, x.device)

        def shaped(v: Tensor, ndim: int) -> Tensor:
            # [m, C] (m = n rows, or 1 for all) -> broadcastable against an input/output of ndim dims
            shape = [1] * ndim
            if batch_axis is None:
                v = v[0]
            else:
                shape[batch_axis] = v.shape[0]
            shape[channel_axis % ndim] = v.shape[-1]
            return v.reshape(shape)

        additive = self.rank1_config.perturbation is Perturbation.ADDITIVE
        s = shaped(self.rank1_s.sample(rows, noise).to(x.dtype), x.dim())
        out = core(x + s if additive else x * s)
        r = shaped(self.rank1_r.sample(rows, noise).to(out.dtype), out.dim())
        # offset = everything added after the output scaling: b + delta_k, minus r*b if core added b
        offset = None if self.rank1_bias is None else shaped(self.rank1_bias[rows].to(out.dtype), out.dim())
        if bias is not None and not (bias_in_core and additive):
            b = shaped(bias.to(out.dtype).unsqueeze(0), out.dim())
            if bias_in_core:  # multiplicative: out already holds + b, which r would scale
                b = b - r * b
            offset = b if offset is None else offset + b
        if additive:
            out = out + r
            return out if offset is None else out + offset
        return out * r if offset is None else torch.addcmul(offset, out, r)

    def _rank1_external(self, func: Callable) -> Callable:
        """Handler for ``func(input, weight, bias, ...)`` called on this layer's intercepted weight."""

        def handle(args: tuple, kwargs: dict) -> Tensor:
            x, weight, bias, rest, rest_kwargs = split_call(args, kwargs)
            if getattr(weight, "_rank1_layer", None) is not self:
                return NotImplemented
            w = self._parameters["weight"]
            self.__dict__["_rank1_intercepted_by"] = getattr(func, "__name__", "function")
            with torch._C.DisableTorchFunctionSubclass():
                return self._rank1_apply(
                    x, lambda v: func(v, w, None, *rest, **rest_kwargs), bias, bias_in_core=False
                )

        return handle
