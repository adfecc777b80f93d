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
* **folded** (:func:`rank1_folded`): rows that run as blocks of one component and one sample
  each (:class:`bayesify.Sampling`) get that block's weight ``W o (r_b s_b^T)`` and the layer's own
  map runs once per block: weight-sized work instead of activation-sized, and no activation kept
  for the factors. Cheap when the weight is small next to the activations (conv nets).

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
from bayesify.layers._recompute import recomputing

__all__ = [
    "KnownMap", "broadcast_rows", "dense_blocks", "fold_weight", "fold_weights", "rank1_affine", "rank1_folded", "run_blocks",
    "with_bias",
]  # fmt: skip


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
    shape = [1] * ndim
    if batch_axis is None:
        v = v[0]
    else:
        shape[batch_axis] = v.shape[0]
    shape[channel_axis % ndim] = v.shape[-1]
    return v.reshape(shape)


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
    if known is not None and _one_node(x, s, r, offset, bias, known.weight):
        s_b = s.view(shape) if (shape := _row_shape(s, x.dim(), batch_axis, channel_axis)) is not None else s
        if kernels.plan(x, s_b, None, batch_axis, channel_axis) is None:  # (the fused kernels take the path below)
            return _rank1_known(x, s_b, r, offset, bias, known, batch_axis, channel_axis)
    offset = with_bias(offset, bias, channel_axis)
    scaled, s_b, product = _scale(x, s, _row_shape(s, x.dim(), batch_axis, channel_axis), batch_axis, channel_axis)
    with recomputing(scaled, product, x, s_b):  # the core's saved copy of x o s: made again in backward
        out = core(scaled)
    if r.dim() not in (2, out.dim()):  # values shaped for the input's layout, and the output has another
        r = r.reshape(r.shape[batch_axis], -1)
        offset = None if offset is None or offset.dim() == 2 else offset.reshape(offset.shape[batch_axis], -1)
    shape = _row_shape(r, out.dim(), batch_axis, channel_axis)
    offset_shape = None if offset is None else _row_shape(offset, out.dim(), batch_axis, channel_axis)
    offset = None if offset is None else offset.to(out.dtype)
    return _scale_shift(out, r.to(out.dtype), offset, shape, offset_shape, batch_axis, channel_axis)


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
    shape = [1] * ndim
    if batch_axis is not None:
        shape[batch_axis] = v.shape[0]
    shape[channel_axis % ndim] = v.shape[-1]
    if batch_axis is None:
        return tuple(shape)
    return None if tuple(shape) == tuple(v.shape) else tuple(shape)


def _grad_wanted(*tensors: Tensor | None) -> bool:
    # forward-mode AD takes the plain ops (the Functions define no jvp: torch.compile does not trace one)
    forward_ad = getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0
    return torch.is_grad_enabled() and not forward_ad and any(t is not None and t.requires_grad for t in tensors)


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
    if _grad_wanted(x, s):
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
    if _grad_wanted(out, r, offset):
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
    """Whether the per-row op runs as :class:`_Rank1Map`: gradients wanted, outside a traced graph (compile and
    export fuse the plain ops their own way) and outside functorch's transforms (the node has no vmap rule)."""
    return (
        _grad_wanted(x, s, r, offset, bias, weight)
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not torch._C._are_functorch_transforms_active()
    )


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


def fold_weight(weight: Tensor, r: Tensor, s: Tensor, *, groups: int = 1, transposed: bool = False) -> Tensor:
    """``W o (r s^T)``: ``r`` scales the output channels, ``s`` the input channels.

    Args:
        weight: ``[out, in / groups, *kernel]`` (torch's Linear / Conv layout), or with ``transposed``
            ``[in, out / groups, *kernel]`` (torch's ConvTranspose layout; Hugging Face ``Conv1D``'s
            ``[in, out]`` is its case without groups or kernel).
        r: ``[out]``; s: ``[in]`` (a grouped convolution's weight holds group ``g``'s inputs in the rows
            of group ``g``'s outputs, and a grouped transposed one the reverse).

    With a gradient to take, it is one autograd node that keeps only ``W``, ``r`` and ``s`` (not the
    weight-sized ``W o r``), and its backward takes the factors' gradients as one reduction each.
    """
    return fold_weights(weight, r.unsqueeze(0), s.unsqueeze(0), groups=groups, transposed=transposed)[0]


def fold_weights(weight: Tensor, r: Tensor, s: Tensor, *, groups: int = 1, transposed: bool = False) -> Tensor:
    """``W o (r_i s_i^T)`` for every row ``i`` of ``r`` (``[m, out]``) and ``s`` (``[m, in]``): ``[m, *W.shape]``.

    One autograd node for all ``m`` weights (see :func:`fold_weight`): a layer's K blocks fold in one
    op, and their factors' gradients come back as one ``[m, out]`` and one ``[m, in]``.
    """
    rows, columns = (s, r) if transposed else (r, s)  # transposed: the same maths, the two leading axes swapped
    if torch.is_grad_enabled() and (weight.requires_grad or rows.requires_grad or columns.requires_grad):
        return _FoldWeights.apply(weight, rows, columns, groups)
    return _fold(weight, rows, columns, groups)


def _factor_views(rows: Tensor, columns: Tensor, weight: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """``rows`` ``[m, out]`` and ``columns`` ``[m, in]`` shaped to broadcast against ``m`` weights ``[m, *W.shape]``
    (``columns[i, j]`` for input ``j`` within output ``o``'s group)."""
    m, n = rows.shape
    per_group, kernel = weight.shape[1], (1,) * (weight.dim() - 2)
    r = rows.view(m, n, 1, *kernel)
    if groups == 1:
        return r, columns.view(m, 1, per_group, *kernel)
    c = columns.view(m, groups, 1, per_group).expand(m, groups, n // groups, per_group).reshape(m, n, per_group, *kernel)
    return r, c


def _fold(weight: Tensor, rows: Tensor, columns: Tensor, groups: int) -> Tensor:
    """``weight[o, j, ...] * rows[i, o] * columns[i, j]`` for each ``i`` (``j`` within the row's group)."""
    r, c = _factor_views(rows, columns, weight, groups)
    return weight * (r * c)


class _FoldWeights(torch.autograd.Function):
    # the fewest ops: two views and two multiplies forward; backward takes each gradient as one multiply and one
    # sum, with forward's views of the factors and (where it is smaller than the weight: a kernel of K or more
    # taps) its outer product r s^T; a weight-sized one (a dense layer's) is made again instead of kept
    @staticmethod
    def forward(ctx: Any, weight: Tensor, rows: Tensor, columns: Tensor, groups: int) -> Tensor:  # type: ignore[override]
        ctx.groups, ctx.shapes = groups, (rows.shape, columns.shape)
        ctx.save_for_backward(weight, rows, columns)  # the inputs, so that a double backward reaches them
        r, c = _factor_views(rows, columns, weight, groups)
        outer = r * c
        ctx.views = (r, c, outer if outer.numel() <= weight.numel() else None)  # (first-order backward only)
        return weight * outer

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        weight, rows, columns = ctx.saved_tensors
        groups, (rows_shape, columns_shape) = ctx.groups, ctx.shapes
        r, c, outer = ctx.views  # (kept for another backward of a retained graph)
        if torch.is_grad_enabled():  # a double backward: made again from the inputs, so that the graph reaches them
            r, c = _factor_views(rows, columns, weight, groups)
            outer = None
        d_weight = d_rows = d_columns = None
        if ctx.needs_input_grad[0]:
            d_weight = (grad * (r * c if outer is None else outer)).sum(0).to(weight.dtype)  # each fold's share, summed
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            q = grad * weight  # d/d(outer), summed over the kernel below
            spatial = tuple(i for i in range(3, q.dim()) if q.shape[i] > 1)
            if spatial:  # (a 1x1 kernel has nothing to sum: no op)
                q = q.sum(spatial, keepdim=True)
            r_q, c_q = r.to(q.dtype), c.to(q.dtype)  # factors of another dtype than the weight
            kernel = tuple(range(3, q.dim()))
            if ctx.needs_input_grad[1]:
                d_rows = (q * c_q).sum((2, *kernel)).to(r.dtype)
            if ctx.needs_input_grad[2]:
                if groups == 1:
                    d_columns = (q * r_q).sum((1, *kernel))
                else:  # [m, out, per_group]: each group's outputs summed onto that group's inputs
                    m, n = rows_shape
                    d_columns = (q * r_q).view(m, groups, n // groups, weight.shape[1]).sum(2).reshape(columns_shape)
                d_columns = d_columns.to(c.dtype)
        return d_weight, d_rows, d_columns, None


def rank1_folded(
    x: Tensor,
    blocks: tuple[tuple[int, int], ...],
    weight: Tensor,
    apply: Callable[[Tensor, Tensor, Tensor | None], Tensor],
    s: Tensor,
    r: Tensor,
    offset: Tensor | None,
    *,
    batch_axis: int = 0,
    groups: int = 1,
    transposed: bool = False,
    dense: bool = False,
) -> Tensor:
    """The layer's own map once per block of rows, with that block's folded weight.

    Args:
        x: the input, batch at ``batch_axis``.
        blocks: ``(start, stop)`` runs covering the rows in order, one component each.
        weight: the layer's weight (see :func:`fold_weight`).
        apply: ``apply(x_block, weight, bias)``: the layer's map (``F.linear``, a convolution, ...).
        s, r: ``[len(blocks), in]`` and ``[len(blocks), out]``: one sample per block.
        offset: ``[len(blocks), out]`` bias per block (bias + the component's offset), or None.
        dense: ``apply`` is the plain dense map on the last axis (``x W^T + b``, or ``x W + b`` with
            ``transposed``): blocks of equal size along a leading batch axis then run as one batched
            matmul on views of ``x``, with no split of the input and no concatenation of the outputs.

    Multiplicative perturbation only: an additive one is not a weight (``(x + s) * W`` with padding
    is not ``x * W + const``), so it takes :func:`rank1_affine`.
    """
    # the folded weights are kept for the backward pass (the map saves them): folding them again there costs K
    # weight-sized passes per layer, measured at +6% of a ViT-tiny step on the CPU, to save K weights
    weights = fold_weights(weight, r, s, groups=groups, transposed=transposed)
    return run_blocks(x, blocks, weights, offset, apply, batch_axis=batch_axis, transposed=transposed, dense=dense)


def run_blocks(
    x: Tensor,
    blocks: tuple[tuple[int, int], ...],
    weights: Tensor | tuple[Tensor, ...],
    offsets: Tensor | None,
    apply: Callable[[Tensor, Tensor, Tensor | None], Tensor],
    *,
    batch_axis: int = 0,
    transposed: bool = False,
    dense: bool = False,
) -> Tensor:
    """Block ``i`` of the rows through ``apply(rows, weights[i], offsets[i])``, the outputs in the rows' order
    (see :func:`rank1_folded`): one batched matmul for a dense map on equal blocks along a leading batch
    axis, else the map once per block (``weights``: stacked, or already one by one)."""
    if dense and batch_axis == 0 and _equal_tiling(blocks, x.shape[0]) and isinstance(weights, Tensor):
        return dense_blocks(x, weights, offsets, transposed=transposed)
    each = weights.unbind(0) if isinstance(weights, Tensor) else weights
    outputs = []
    for part, w, b in zip(_block_views(x, blocks, batch_axis), each, _rows(offsets, len(blocks))):
        outputs.append(apply(part, w, b))
    if len(outputs) == 1:
        return outputs[0]
    traced = torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
    if torch.is_grad_enabled() and not traced and any(o.requires_grad for o in outputs):
        return _Concatenate.apply(batch_axis, *outputs)
    return torch.cat(outputs, batch_axis)


class _Concatenate(torch.autograd.Function):
    # torch.cat, whose gradient is one split (autograd's own cat takes a slice per input: K ops a folded layer)
    @staticmethod
    def forward(ctx: Any, axis: int, *parts: Tensor) -> Tensor:  # type: ignore[override]
        ctx.axis, ctx.sizes = axis, [p.shape[axis] for p in parts]
        return torch.cat(parts, axis)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (None, *grad.split(ctx.sizes, ctx.axis))


def dense_blocks(x: Tensor, weights: Tensor, offset: Tensor | None, *, transposed: bool = False) -> Tensor:
    """``x`` in ``m`` equal blocks of leading rows, block ``i`` through the dense map of ``weights[i]``
    (``[m, out, in]``, or ``[m, in, out]`` with ``transposed``) plus ``offset[i]``: one batched matmul."""
    m = weights.shape[0]
    blocked = x.reshape(m, -1, x.shape[-1])  # a view for a contiguous input: the batch leads
    w = weights if transposed else weights.transpose(1, 2)
    if offset is None:
        out = torch.bmm(blocked, w)
    else:
        out = torch.baddbmm(offset.unsqueeze(1), blocked, w)
    return out.view(*x.shape[:-1], out.shape[-1])


def _equal_tiling(blocks: tuple[tuple[int, int], ...], rows: int) -> bool:
    """Whether the blocks are equal runs that tile all ``rows`` in order."""
    size = blocks[0][1] - blocks[0][0]
    return size > 0 and len(blocks) * size == rows and all(start == i * size for i, (start, _) in enumerate(blocks))


def _rows(table: Tensor | None, m: int) -> tuple[Tensor | None, ...]:
    return (None,) * m if table is None else table.unbind(0)


def _block_views(x: Tensor, blocks: tuple[tuple[int, int], ...], axis: int) -> tuple[Tensor, ...]:
    """The rows of each block. One ``split`` when the blocks tile the axis (its backward is one
    ``cat``; ``narrow``'s is a zero-filled input-sized gradient per block, summed: K extra
    activation-sized passes per layer in the backward)."""
    sizes = [stop - start for start, stop in blocks]
    if blocks[0][0] == 0 and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:])) and blocks[-1][1] == x.shape[axis]:
        return x.split(sizes, axis)
    return tuple(x.narrow(axis, start, size) for (start, _), size in zip(blocks, sizes))
