"""Saved tensors kept as their recipe: what the rank-1 op does not hold between forward and backward.

The per-row path makes the scaled input ``x o s``, which the layer's own map then saves for its
backward pass: one more activation-sized tensor per layer than the original network holds. (A map
whose backward bayesify knows, a convolution or a dense layer, runs as one autograd node that makes
it again itself, ``rank1_op._Rank1Map``; this module serves every other map.) It is
cheap to make again from what is kept anyway: ``x``, which the scaling keeps for ``s``'s gradient
(and which is usually the previous layer's saved output), and the small per-row ``s``. Under
:func:`recomputing`, a saved tensor that is such a product (or a view of one, as ``F.linear`` saves
a reshaped input) is packed as its recipe and made again when the backward pass unpacks it:
bitwise the same values, one elementwise pass in the backward instead of one activation held per
layer (ResNet-18 at 32 px: 1.95x -> 1.64x the original's held bytes, time within the noise). A
product changed in place after it was made is saved as it is; an input of the recipe changed in
place before the backward pass is an error, not a wrong gradient.

It stands aside (plain saving) where something else owns how tensors are saved: an outer
``saved_tensors_hooks`` (activation checkpointing, CPU offloading), ``torch.compile`` / ``torch.jit``
tracing, or no autograd graph being built.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch import Tensor

from bayesify._autograd import plain_ops

__all__ = ["recomputing"]


class _Packed:
    """A saved product as its recipe, and the view of it that was saved."""

    __slots__ = ("fn", "inputs", "versions", "size", "stride", "offset")

    def __init__(self, fn: Callable[..., Tensor], inputs: tuple[Tensor, ...], view: Tensor) -> None:
        self.fn, self.inputs, self.versions = fn, inputs, tuple(t._version for t in inputs)
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def __call__(self) -> Tensor:
        if any(t._version != v for t, v in zip(self.inputs, self.versions)):
            raise RuntimeError(
                "a tensor a rank-1 layer used was modified in place before the backward pass, which needs it "
                "(bayesify recomputes the layer's scaled input from it to save memory); use an out-of-place op "
                "on it instead"
            )
        full = self.fn(*self.inputs)
        if (self.size, self.stride, self.offset) == (full.size(), full.stride(), full.storage_offset()):
            return full
        return full.as_strided(self.size, self.stride, self.offset)  # a view was saved (F.linear's reshape)


# devices whose tensors have a storage to compare (an XLA tensor has none: it stands aside there)
_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})


def _plain(t: object) -> bool:
    return type(t) is Tensor and t.layout is torch.strided and t.device.type in _DEVICES  # type: ignore[union-attr]


class _Recompute(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, product: Tensor, fn: Callable[..., Tensor], inputs: tuple[Tensor, ...]) -> None:
        # plain values only: a closure holding the product would keep it alive through the hooks
        key, version = (product.untyped_storage().data_ptr(), product.dtype, product.device), product._version

        def pack(t: Tensor) -> object:
            if not _plain(t) or (t.untyped_storage().data_ptr(), t.dtype, t.device) != key:
                return t
            if t._version != version:  # changed in place since it was made: not the recipe's value
                return t
            return _Packed(fn, inputs, t)

        def unpack(packed: object) -> Tensor:
            return packed() if isinstance(packed, _Packed) else packed  # type: ignore[return-value]

        super().__init__(pack, unpack)


def recomputing(product: Tensor, fn: Callable[..., Tensor], *inputs: Tensor) -> ContextManager[object]:
    """Within the block, the backward pass recomputes ``product = fn(*inputs)`` (or the view of it that is
    saved) instead of keeping it (see the module doc); a no-op where that does not apply."""
    if (
        not torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or plain_ops()  # (torch.func: a batched tensor has no storage to key on; forward AD: a dual tensor)
        or not _plain(product)
        or not torch._C._autograd._saved_tensors_hooks_is_enabled()
        or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    ):
        return contextlib.nullcontext()
    return _Recompute(product, fn, inputs)
