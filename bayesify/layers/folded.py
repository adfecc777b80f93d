"""The folded path of the rank-1 op: rows in blocks of one component each run with that block's weight.

Rows that run as blocks of one component and one sample each (:class:`bayesify.Sampling`) get that block's
weight ``W o (r_b s_b^T)`` (:func:`fold_weight`; all K at once, one autograd node: :func:`fold_weights`) and the
layer's own map runs once per block (:func:`rank1_folded`, :func:`run_blocks`): weight-sized work instead of
activation-sized, and no activation kept for the factors. A dense layer (``nn.Linear``, Hugging Face ``Conv1D``)
on equal blocks runs them as one batched matmul over views of the input (:func:`dense_blocks`). The same function
as the per-row path of :mod:`bayesify.layers.rank1_op`; cheap when the weight is small next to the activations
(conv nets).

References:
    Dusenberry et al., ICML 2020, Sec. 3 (the folded weight of a member); edward2 ``Conv2DRank1``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from bayesify._autograd import plain_ops
from bayesify.mixture import row_shape

__all__ = ["dense_blocks", "fold_weight", "fold_weights", "rank1_folded", "run_blocks"]


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
    op, and their factors' gradients come back as one ``[m, out]`` and one ``[m, in]``. The weights have ``W``'s
    dtype whatever the factors' (fp32 factors of a bf16 layer), as the per-row path computes in the activations'.
    """
    rows, columns = (s, r) if transposed else (r, s)  # transposed: the same maths, the two leading axes swapped
    if (
        torch.is_grad_enabled()
        and (weight.requires_grad or rows.requires_grad or columns.requires_grad)
        and not plain_ops()
    ):
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
    return _in_dtype_of(weight * (r * c), weight)


def _in_dtype_of(folded: Tensor, weight: Tensor) -> Tensor:
    """``folded`` in ``weight``'s dtype: factors of a wider dtype than the weight (fp32 factors of a bf16 layer)
    promote the product, which the layer's map (``F.linear``, a convolution, ``bmm``) refuses next to its input.
    Folded in the wider dtype and rounded once; no op where the dtypes agree."""
    return folded if folded.dtype == weight.dtype else folded.to(weight.dtype)


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
        return _in_dtype_of(weight * outer, weight)

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
    channel_axis: int | None = None,
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
        channel_axis: the output's channel axis, where :func:`run_blocks` adds the blocks' biases after the map in a
            compiled graph (None: always given to ``apply``).
        dense: ``apply`` is the plain dense map on the last axis (``x W^T + b``, or ``x W + b`` with
            ``transposed``): blocks of equal size along a leading batch axis then run as one batched
            matmul on views of ``x``, with no split of the input and no concatenation of the outputs.

    Multiplicative perturbation only: an additive one is not a weight (``(x + s) * W`` with padding
    is not ``x * W + const``), so it takes :func:`rank1_affine`.
    """
    # the folded weights are kept for the backward pass (the map saves them): folding them again there costs K
    # weight-sized passes per layer, measured at +6% of a ViT-tiny step on the CPU, to save K weights
    weights = fold_weights(weight, r, s, groups=groups, transposed=transposed)
    return run_blocks(
        x, blocks, weights, offset, apply, batch_axis=batch_axis, channel_axis=channel_axis, transposed=transposed, dense=dense
    )


def run_blocks(
    x: Tensor,
    blocks: tuple[tuple[int, int], ...],
    weights: Tensor | tuple[Tensor, ...],
    offsets: Tensor | None,
    apply: Callable[[Tensor, Tensor, Tensor | None], Tensor],
    *,
    batch_axis: int = 0,
    channel_axis: int | None = None,
    transposed: bool = False,
    dense: bool = False,
) -> Tensor:
    """Block ``i`` of the rows through ``apply(rows, weights[i], offsets[i])``, the outputs in the rows' order
    (see :func:`rank1_folded`): one batched matmul for a dense map on equal blocks along a leading batch
    axis, else the map once per block (``weights``: stacked, or already one by one)."""
    # bias offsets of another dtype than the weights (fp32 offsets of a bf16 layer) in the weights', as the per-row
    # path adds them in its output's: the map refuses a bias of another dtype (no op where the dtypes agree)
    dtype = weights.dtype if isinstance(weights, Tensor) else weights[0].dtype
    if offsets is not None and offsets.dtype != dtype:
        offsets = offsets.to(dtype)
    if dense and batch_axis == 0 and _equal_tiling(blocks, x.shape[0]) and isinstance(weights, Tensor):
        return dense_blocks(x, weights, offsets, transposed=transposed)
    each = weights.unbind(0) if isinstance(weights, Tensor) else weights
    # in a graph, each block's bias is added after the map, where inductor fuses it: torch 2.9's cannot lower a
    # convolution whose bias is a view of another op's output (NotImplementedError: View)
    after = channel_axis is not None and offsets is not None and torch.compiler.is_compiling()
    outputs = []
    for part, w, b in zip(_block_views(x, blocks, batch_axis), each, _rows(offsets, len(blocks))):
        if after:
            y = apply(part, w, None)
            outputs.append(y + b.view(row_shape(None, b.shape[-1], y.dim(), batch_axis, channel_axis)).to(y.dtype))
        else:
            outputs.append(apply(part, w, b))
    if len(outputs) == 1:
        return outputs[0]
    if torch.is_grad_enabled() and not plain_ops() and any(o.requires_grad for o in outputs):
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
