"""The one rank-1 op: every layer family computes its rank-1 maths here.

Per row e of the batch, routed through component k(e), with the factors sampled for that row:

    multiplicative:  y = core(x o s_e) o r_e + offset_e
    additive:        y = core(x + s_e) + r_e + offset_e

where ``core`` is the layer's own linear map without its bias (``F.linear``, a convolution, a
bilinear form, ...) and ``offset_e = b + delta_k`` is everything added after the scaling: the
original bias and the component's bias offset (the reference gives each component its own bias
``b_k``; ``b + delta_k`` is the same family with the pretrained bias kept as the live Parameter).
A core that adds the bias itself (a subclass's own forward) passes it as ``core_bias``: in the
multiplicative form it must not be scaled by ``r``, so ``r * core_bias`` is taken back off.

Two ways to compute it, the same function:

* **per row** (:func:`rank1_affine`): scale the activations, ``x o s`` before and ``o r + offset``
  after the layer's own map; a sample per example. Cheap when the activations are small next to
  the weight (large layers at small batches).
* **folded** (:func:`bayesify.layers.folded.rank1_folded`, its own file): rows that run as blocks of
  one component and one sample each (:class:`bayesify.Sampling`) get that block's weight
  ``W o (r_b s_b^T)`` and the layer's own map runs once per block: weight-sized work instead of
  activation-sized, and no activation kept for the factors. Cheap when the weight is small next to
  the activations (conv nets).

References:
    Dusenberry et al., ICML 2020, Eq. 1 and Sec. 3; edward2 ``DenseRank1`` / ``Conv2DRank1``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from bayesify import kernels
from bayesify._autograd import plain_ops
from bayesify.layers._recompute import recomputing
from bayesify.mixture import row_shape

__all__ = ["KnownMap", "broadcast_rows", "rank1_affine", "with_bias"]


@dataclass(frozen=True)
class KnownMap:
    """A layer's own linear map (no bias) with its backward written out, so that the per-row path runs as one
    autograd node (see :class:`_Rank1Map`): ``forward(x, weight)``, and ``backward(grad, x, weight, needs)`` ->
    ``(d_x, d_weight)`` (each None where ``needs`` says it is not wanted), all tensors of one dtype."""

    weight: Tensor
    forward: Callable[[Tensor, Tensor], Tensor]
    backward: Callable[[Tensor, Tensor, Tensor, tuple[bool, bool]], tuple[Tensor | None, Tensor | None]]


def broadcast_rows(v: Tensor, ndim: int, batch_axis: int | None, channel_axis: int) -> Tensor:
    """``[m, C]`` per-row values (``m`` rows, or 1 for all) as a tensor broadcastable against an
    ``ndim``-d activation with its batch at ``batch_axis`` (None: unbatched) and channels at ``channel_axis``."""
    if batch_axis is None:
        v = v[0]
    return v.reshape(row_shape(v.shape[0] if v.dim() > 1 else None, v.shape[-1], ndim, batch_axis, channel_axis))


def rank1_affine(
    x: Tensor,
    core: Callable[[Tensor], Tensor],
    s: Tensor,
    r: Tensor,
    offset: Tensor | None = None,
    *,
    additive: bool = False,
    batch_axis: int | None = 0,
    channel_axis: int = -1,
    core_bias: Tensor | None = None,
    known: KnownMap | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """``core(x o s) o r + offset`` (or the additive form) with per-row factors.

    Args:
        x: the layer's input, batch at ``batch_axis`` (None: one unbatched example), channels at
            ``channel_axis``; the output has its channels at the same axis.
        core: the layer's linear map without bias (unless ``core_bias`` says it adds one).
        s: ``[n, in]`` input factor per row (``n`` = rows of ``x``, or 1 for all rows).
        r: ``[n, out]`` output factor per row.
        offset: ``[n, out]`` or ``[1, out]`` added after the scaling (bias + per-component offset), or None.
        additive: the additive perturbation ``core(x + s) + r`` instead of the multiplicative one.
        core_bias: ``[out]`` or ``[n, out]``: a bias that ``core`` adds itself.
        known: ``core`` with its backward written out (a plain convolution or dense map): with gradients to
            take, the whole op is then one autograd node, which makes ``x o s`` again in its backward pass
            without saved-tensor hooks (whose unpacking costs two ops per layer and step).
        bias: ``[out]``, the layer's own bias, added after the scaling as ``offset`` is (kept apart from
            ``offset`` so that the one node takes its gradient in one sum).

    Returns:
        The layer's output for every row.
    """
    if additive or core_bias is not None:
        offset = with_bias(offset, bias, channel_axis)
        return _rank1_affine_broadcast(x, core, s, r, offset, additive, batch_axis, channel_axis, core_bias)
    s = s.to(x.dtype)
    shape = _row_shape(s, x.dim(), batch_axis, channel_axis)
    if torch.compiler.is_compiling():
        # a traced graph: the plain ops, which the compiler fuses and differentiates (no Function, kernel plan or
        # saved-tensors hook for Dynamo to trace in every layer call)
        out = core(x * (s if shape is None else s.view(shape)))
        r, offset, shape, offset_shape = _output_values(out, r, with_bias(offset, bias, channel_axis), batch_axis, channel_axis)
        r_b = r if shape is None else r.view(shape)
        offset_b = offset if offset is None or offset_shape is None else offset.view(offset_shape)
        return out * r_b if offset_b is None else torch.addcmul(offset_b, out, r_b)
    if known is not None and _one_node(x, s, r, offset, bias, known.weight):
        s_b = s if shape is None else s.view(shape)
        if kernels.plan(x, s_b, None, batch_axis, channel_axis) is None:  # (the fused kernels take the path below)
            return _rank1_known(x, s_b, r, offset, bias, known, batch_axis, channel_axis)
    offset = with_bias(offset, bias, channel_axis)
    scaled, s_b, product = _scale(x, s, shape, batch_axis, channel_axis)
    with recomputing(scaled, product, x, s_b):  # the core's saved copy of x o s: made again in backward
        out = core(scaled)
    r, offset, shape, offset_shape = _output_values(out, r, offset, batch_axis, channel_axis)
    return _scale_shift(out, r, offset, shape, offset_shape, batch_axis, channel_axis)


def _output_values(
    out: Tensor, r: Tensor, offset: Tensor | None, batch_axis: int | None, channel_axis: int
) -> tuple[Tensor, Tensor | None, tuple[int, ...] | None, tuple[int, ...] | None]:
    """``r`` and ``offset`` in ``out``'s dtype, with the shapes in which they broadcast against it."""
    if r.dim() not in (2, out.dim()):  # values shaped for the input's layout, and the output has another
        r = r.reshape(r.shape[batch_axis], -1)
        offset = None if offset is None or offset.dim() == 2 else offset.reshape(offset.shape[batch_axis], -1)
    shape = _row_shape(r, out.dim(), batch_axis, channel_axis)
    if offset is None:
        return r.to(out.dtype), None, shape, None
    return r.to(out.dtype), offset.to(out.dtype), shape, _row_shape(offset, out.dim(), batch_axis, channel_axis)


def _rank1_affine_broadcast(
    x: Tensor,
    core: Callable[[Tensor], Tensor],
    s: Tensor,
    r: Tensor,
    offset: Tensor | None,
    additive: bool,
    batch_axis: int | None,
    channel_axis: int,
    core_bias: Tensor | None,
) -> Tensor:
    """:func:`rank1_affine` in plain broadcast ops: the additive form, and a core that adds its own bias."""
    s = broadcast_rows(s.to(x.dtype), x.dim(), batch_axis, channel_axis)
    if additive:
        out = core(x + s)
    else:
        scaled = x * s
        with recomputing(scaled, torch.mul, x, s):
            out = core(scaled)
    nd = out.dim()
    r = broadcast_rows(r.to(out.dtype), nd, batch_axis, channel_axis)
    if offset is not None:
        offset = broadcast_rows(offset.to(out.dtype), nd, batch_axis, channel_axis)
    if core_bias is not None and not additive:
        # out already holds + b, which r would scale: take r * b back off
        b = broadcast_rows(core_bias.to(out.dtype).reshape(-1, core_bias.shape[-1]), nd, batch_axis, channel_axis)
        b = b - r * b
        offset = b if offset is None else offset + b
    if additive:
        out = out + r
        return out if offset is None else out + offset
    return out * r if offset is None else torch.addcmul(offset, out, r)


# The per-row path's two elementwise steps as autograd Functions with the fewest ops: the per-row values come in as
# they are drawn ([rows, channels]) and are broadcast inside, so their gradients come back in that shape from one
# multiply and one sum (autograd's own mul / addcmul take a scalar multiply per input of addcmul, and a sum and two
# views per broadcast factor). On a GPU, where the step is launch-bound, that count is the time. Without gradients
# (evaluation) or under forward-mode AD the plain ops run. On CUDA each scaling is one fused Triton launch forward and
# one backward where bayesify.kernels plans it (the torch ops here are the reference, and the CPU's path).


def _row_shape(v: Tensor, ndim: int, batch_axis: int | None, channel_axis: int) -> tuple[int, ...] | None:
    """The shape that broadcasts ``[m, C]`` per-row values against an ``ndim``-d activation (None: as they are,
    which they are when they come in that shape from the draw ahead)."""
    if v.dim() == ndim and ndim != 2:
        return None
    shape = row_shape(v.shape[0], v.shape[-1], ndim, batch_axis, channel_axis)
    if batch_axis is None:
        return shape
    return None if shape == tuple(v.shape) else shape


def _grad_wanted(*tensors: Tensor | None) -> bool:
    # forward-mode AD takes the plain ops (the Functions define no jvp: torch.compile does not trace one)
    if not torch.is_grad_enabled() or getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0:
        return False
    for t in tensors:  # (a loop, not any() of a generator: Dynamo traces this for every layer, and a loop faster)
        if t is not None and t.requires_grad:
            return True
    return False


def _function_wanted(*tensors: Tensor | None) -> bool:
    # the scalings as Functions of their own (fewer ops held and run eagerly); a traced graph takes the plain ops,
    # whose backward AOTAutograd derives as well, without tracing a Function's forward and backward for each layer
    return not torch.compiler.is_compiling() and _grad_wanted(*tensors)


def _to_rows(t: Tensor, rows: torch.Size, shape: tuple[int, ...] | None) -> Tensor:
    """``t`` (activation-shaped) summed to per-row values of shape ``rows`` (viewed as ``shape`` to broadcast
    against ``t``; None: they broadcast as they are)."""
    if shape is None:
        axes = [i for i, (a, b) in enumerate(zip(t.shape, rows)) if b == 1 and a != 1]
        return t.sum(axes, keepdim=True) if axes else t
    axes = [i for i, size in enumerate(shape) if size == 1 and t.shape[i] != 1]
    reduced = t.sum(axes) if axes else t
    return reduced if reduced.shape == rows else reduced.reshape(rows)


def _scale(
    x: Tensor, s: Tensor, shape: tuple[int, ...] | None, batch_axis: int | None, channel_axis: int
) -> tuple[Tensor, Tensor, Callable[[Tensor, Tensor], Tensor]]:
    """``(x o s, s as broadcast, how to make x o s again)`` for per-row ``s`` (``shape``: how it broadcasts
    against ``x``). The recipe is the op that made it (the fused kernel or ``torch.mul``): bitwise the same again."""
    s_b = s if shape is None else s.view(shape)
    fused = kernels.plan(x, s_b, None, batch_axis, channel_axis)
    product = torch.mul if fused is None else functools.partial(kernels.scale_shift, fused)
    if _function_wanted(x, s):
        return _Scale.apply(x, s_b, fused), s_b, product
    return product(x, s_b), s_b, product


def _scale_shift(
    out: Tensor,
    r: Tensor,
    offset: Tensor | None,
    shape: tuple[int, ...] | None,
    offset_shape: tuple[int, ...] | None,
    batch_axis: int | None,
    channel_axis: int,
) -> Tensor:
    """``out o r + offset`` for per-row ``r`` and ``offset`` (each broadcast against ``out`` as its shape says)."""
    r_b = r if shape is None else r.view(shape)
    offset_b = offset if offset is None or offset_shape is None else offset.view(offset_shape)
    fused = kernels.plan(out, r_b, offset_b, batch_axis, channel_axis)
    if _function_wanted(out, r, offset):
        return _ScaleShift.apply(out, r, offset, shape, offset_shape, fused)
    if fused is not None:
        return kernels.scale_shift(fused, out, r_b, offset_b)
    return out * r_b if offset_b is None else torch.addcmul(offset_b, out, r_b)


class _Scale(torch.autograd.Function):
    # takes s already broadcast (a view of the drawn values, or those values where the draw ahead shaped them) and
    # returns only x o s: a Function that returns an input (or a view made inside it) costs an alias op per call
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, s_b: Tensor, fused: kernels.Plan | None) -> Tensor:  # type: ignore[override]
        return x * s_b if fused is None else kernels.scale_shift(fused, x, s_b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x, s_b, fused = inputs
        ctx.fused = fused
        ctx.save_for_backward(x, s_b)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, s_b = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if ctx.fused is not None:  # one launch (None back: this gradient's layout, or a double backward)
            grads = kernels.scale_shift_backward(ctx.fused, grad, x, s_b, (needs[0], needs[1], False), s_b.shape, None)
            if grads is not None:
                return grads[0], grads[1], None
        d_x = grad * s_b if needs[0] else None
        d_s = _to_rows(grad * x, s_b.shape, None) if needs[1] else None
        return d_x, d_s, None


class _ScaleShift(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        out: Tensor, r: Tensor, offset: Tensor | None, shape: tuple | None, offset_shape: tuple | None, fused: kernels.Plan | None
    ) -> Tensor:
        r_b = r if shape is None else r.view(shape)
        offset_b = offset if offset is None or offset_shape is None else offset.view(offset_shape)
        if fused is not None:
            return kernels.scale_shift(fused, out, r_b, offset_b)
        return out * r_b if offset_b is None else torch.addcmul(offset_b, out, r_b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        out, r, offset, shape, offset_shape, fused = inputs
        ctx.shapes, ctx.fused = (shape, offset_shape), fused
        ctx.save_for_backward(out, r if shape is None else r.view(shape))  # r as broadcast: no view in backward
        ctx.rows = (r.shape, None if offset is None else offset.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        out, r_b = ctx.saved_tensors
        shape, offset_shape = ctx.shapes
        needs = ctx.needs_input_grad
        if ctx.fused is not None:  # one launch (None back: this gradient's layout, or a double backward)
            grads = kernels.scale_shift_backward(ctx.fused, grad, out, r_b, needs[:3], ctx.rows[0], ctx.rows[1])
            if grads is not None:
                return (*grads, None, None, None)
        d_out = grad * r_b if needs[0] else None
        d_r = _to_rows(grad * out, ctx.rows[0], shape) if needs[1] else None
        d_offset = _to_rows(grad, ctx.rows[1], offset_shape) if needs[2] else None
        return d_out, d_r, d_offset, None, None, None



def with_bias(offset: Tensor | None, bias: Tensor | None, channel_axis: int) -> Tensor | None:
    """The per-row ``offset`` (``[n, out]``, or shaped like the activations) plus the layer's ``[out]`` bias."""
    if bias is None:
        return offset
    if offset is None:
        return bias.unsqueeze(0)
    if offset.dim() > 2 and channel_axis % offset.dim() != offset.dim() - 1:
        return offset + bias.view(-1, *(1,) * (offset.dim() - 1 - channel_axis % offset.dim()))
    return offset + bias


def _one_node(x: Tensor, s: Tensor, r: Tensor, offset: Tensor | None, bias: Tensor | None, weight: Tensor) -> bool:
    """Whether the per-row op runs as :class:`_Rank1Map`: gradients wanted, and not where the plain ops run
    (:func:`~bayesify._autograd.plain_ops`; compile and export fuse them their own way) or in a jit trace."""
    return _grad_wanted(x, s, r, offset, bias, weight) and not plain_ops() and not torch.jit.is_tracing()


def _rank1_known(
    x: Tensor, s_b: Tensor, r: Tensor, offset: Tensor | None, bias: Tensor | None, known: KnownMap,
    batch_axis: int | None, channel_axis: int,
) -> Tensor:  # fmt: skip
    r_shape = _row_shape(r, x.dim(), batch_axis, channel_axis)  # the map keeps the layout: out has x's rank
    offset_shape = None if offset is None else _row_shape(offset, x.dim(), batch_axis, channel_axis)
    channel = channel_axis % x.dim()
    bias_shape = None if bias is None or channel == x.dim() - 1 else (-1, *(1,) * (x.dim() - 1 - channel))
    return _Rank1Map.apply(x, s_b, known.weight, r, offset, bias, (r_shape, offset_shape, bias_shape), known)


class _Rank1Map(torch.autograd.Function):
    # ``map(x o s) o r + offset + bias`` as one node: three ops forward (four with a bias); backward the scalings'
    # gradients (a multiply and a sum each), the map's own backward (one op for a convolution) on ``x o s`` made
    # again from ``x`` (kept anyway) and ``s``: the memory of the recomputing path (see _recompute.py) without its
    # hooks' two unpack ops per layer, and the bias's gradient in one sum. ``y = map(x o s)`` is kept for ``r``'s
    # gradient, as the two-node path keeps it.
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, s_b: Tensor, weight: Tensor, r: Tensor, offset: Tensor | None, bias: Tensor | None,
        shapes: tuple, known: KnownMap,
    ) -> Tensor:  # fmt: skip
        shape, offset_shape, bias_shape = shapes
        y = known.forward(x * s_b, weight)  # (under autocast the map runs in its dtype, and y has it)
        r_b = (r if shape is None else r.view(shape)).to(y.dtype)
        shift = None if offset is None else offset if offset_shape is None else offset.view(offset_shape)
        if bias is not None:  # added to the offset before the cast, as the two-node path does (the same bf16 values)
            bias_b = bias if bias_shape is None else bias.view(bias_shape)
            shift = bias_b.unsqueeze(0) if shift is None and bias_shape is None else bias_b if shift is None else shift + bias_b
        ctx.known, ctx.shapes = known, shapes
        ctx.dtypes = (r.dtype, None if offset is None else offset.dtype, None if bias is None else bias.dtype)
        ctx.rows = (r.shape, None if offset is None else offset.shape)
        ctx.save_for_backward(x, s_b, weight, r, r_b, y)
        return y * r_b if shift is None else torch.addcmul(shift.to(y.dtype), y, r_b)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, s_b, weight, r, r_b, y = ctx.saved_tensors
        shape, offset_shape, bias_shape = ctx.shapes
        r_dtype, offset_dtype, bias_dtype = ctx.dtypes
        r_rows, offset_rows = ctx.rows
        needs = ctx.needs_input_grad
        scaled = x * s_b  # made again: the map's backward needs its input
        if torch.is_grad_enabled():
            # a graph of this backward (double backward): what forward made, made again from the inputs, in the graph
            y = ctx.known.forward(scaled, weight)
            r_b = (r if shape is None else r.view(shape)).to(y.dtype)
        d_r = _to_rows(grad * y, r_rows, shape).to(r_dtype) if needs[3] else None
        # the offset's gradient summed to its rows in the output's dtype, then cast, and the bias's summed from it
        # over the rows (from the output's gradient where there is no offset): the two-node path's sums, in its order
        # (the same bf16 values under autocast, and no activation-sized cast)
        d_offset = None if offset_rows is None or not (needs[4] or needs[5]) else _to_rows(grad, offset_rows, offset_shape).to(offset_dtype)
        d_bias = None
        if needs[5]:  # every axis but the channels', in one sum
            source = grad if d_offset is None else d_offset
            channel = source.dim() - 1 if bias_shape is None or source.dim() == 2 else source.dim() - len(bias_shape)
            d_bias = source.sum([i for i in range(source.dim()) if i != channel]).to(bias_dtype)
        d_x = d_s = d_weight = None
        if needs[0] or needs[1] or needs[2]:
            dtype = grad.dtype  # the map's (autocast's) dtype
            d_scaled, d_weight = ctx.known.backward(
                grad * r_b, scaled.to(dtype), weight.to(dtype), (needs[0] or needs[1], needs[2])
            )
            if d_weight is not None:
                d_weight = d_weight.to(weight.dtype)
            if d_scaled is not None:
                d_scaled = d_scaled.to(x.dtype)
                d_x = d_scaled * s_b if needs[0] else None
                d_s = _to_rows(d_scaled * x, s_b.shape, None) if needs[1] else None
        return d_x, d_s, d_weight, d_r, d_offset if needs[4] else None, d_bias, None, None
