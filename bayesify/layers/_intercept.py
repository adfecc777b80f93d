"""Keeping rank-1 layers in the compute path when a model uses their weight directly.

Some models never call a layer's ``forward``; they read its weight and do the maths
themselves, e.g. timm's BEiT / EVA / SwinV2 attention: ``F.linear(x, weight=self.qkv.weight,
bias=qkv_bias)``. While a converted model's forward pass runs, reading ``layer.weight`` from
outside the layer's own forward returns an :class:`InterceptedWeight`: a view of the very same
Parameter (gradients reach it) whose ``__torch_function__`` turns ``F.linear`` / ``F.convNd``
calls on it into the layer's rank-1 computation. Any other compute on it (slicing, matmul)
runs on the plain weight and is recorded on the layer, so that :func:`bayesify.summary` can
name the layer as bypassed instead of staying silent.

Outside a forward pass (initialisation code, optimizers, checkpoints) ``layer.weight`` is the
plain Parameter, so nothing else sees the view.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

__all__ = ["InterceptedWeight", "intercept"]


class InterceptedWeight(Tensor):
    """A view of a rank-1 layer's weight that routes functional calls through the layer."""

    _rank1_layer: Any

    @classmethod
    def __torch_function__(cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        layer = next((t._rank1_layer for t in leaves if isinstance(t, InterceptedWeight)), None)
        if layer is not None:
            handler = layer.rank1_functional_handlers().get(func)
            if handler is not None:
                result = handler(args, kwargs)
                if result is not NotImplemented:
                    return result
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if layer is not None and any(isinstance(t, Tensor) for t in tree_flatten(result)[0]):
            # a compute use the layer cannot take over: remembered for summary(), and said once
            name = getattr(func, "__name__", repr(func))
            if name == "__get__":  # an attribute (weight.T): its name
                name = getattr(getattr(func, "__self__", None), "__name__", name)
            if not (name.endswith("_like") or name.startswith("new_") or name == "data"):  # (shape, not values)
                _bypassed(layer, name)
        return result


def _bypassed(layer: Any, func: str) -> None:
    """Record that ``func`` computed with ``layer``'s plain weight, and warn the first time for the model."""
    state = layer.rank1_state
    state.bypassed_by.add(func)
    model = state.model
    key = f"bypassed {id(layer)} {func}"
    if key in model.warned or torch.compiler.is_compiling():  # (said by the eager pass, not in a graph)
        return
    model.warned.add(key)
    root = model.root
    name = next((n for n, m in root.named_modules() if m is layer), type(layer).__name__) if root is not None else "?"
    warnings.warn(
        f"{name}'s weight was used by {func} outside the layer (bayesify takes over only F.linear and convolution "
        f"calls on it): that use reads the plain weight, so {name}'s rank-1 factors do not act there and its K "
        f"members share it. Call the layer (or F.linear on its weight), or convert(..., exclude=[{name!r}]) to keep "
        "it deterministic and say so.",
        stacklevel=3,
    )


def intercept(weight: Tensor, layer: Any) -> InterceptedWeight:
    """A differentiable view of ``weight`` that knows its ``layer``."""
    view = weight.as_subclass(InterceptedWeight)
    view._rank1_layer = layer
    return view


def split_call(args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, Tensor | None, tuple, dict]:
    """``(input, weight, bias, *rest)`` of an ``F.linear`` / ``F.convNd`` style call."""
    names = ("input", "weight", "bias")
    values = list(args[:3]) + [kwargs.get(n) for n in names[len(args[:3]) :]]
    rest_kwargs = {k: v for k, v in kwargs.items() if k not in names}
    return values[0], values[1], values[2], tuple(args[3:]), rest_kwargs
