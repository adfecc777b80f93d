"""The members of a mixture: tiling a batch for them, splitting their outputs, reducing them to the predictive.

A converted model's K components (x M posterior samples each) are its *members*. bayesify
lays them out **member-major**: a tiled batch of B examples has ``S * B`` rows, row
``s * B + b`` being example ``b`` through member ``s`` (member ``k * M + m`` is sample ``m`` of
component ``k``). This module is the one place that knows the layout; the router (tiling inputs,
reducing outputs), the metrics and the training objective all use it.

How the members reduce to one output is the output's task (:mod:`bayesify.predictive.tasks`).

References:
    Dusenberry et al., ICML 2020, Eq. 2 (the mixture predictive) and Sec. 3 (the tiled batch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["block_rows", "component_rows", "logmeanexp", "row_shape", "split_members", "tile"]


def logmeanexp(x: Tensor, dim: int = 0) -> Tensor:
    """``log mean exp`` along ``dim``, computed stably (logsumexp - log n)."""
    return torch.logsumexp(x, dim) - math.log(x.shape[dim])


def tile(t: Tensor, members: int, axis: int = 0) -> Tensor:
    """``members`` member-major copies of a batch along ``axis``: ``[B, ...] -> [members * B, ...]``."""
    return torch.cat([t] * members, dim=axis) if members > 1 else t


def split_members(t: Tensor, members: int, axis: int = 0) -> Tensor:
    """``[..., members * B, ...]`` (batch at ``axis``) -> ``[members, ..., B, ...]``: the member axis in front."""
    axis = axis % t.dim()
    if axis == 0:  # the usual batch-first output: one view (movedim dispatches a permute even when it moves nothing)
        return t.reshape(members, t.shape[0] // members, *t.shape[1:])
    t = t.movedim(axis, 0)
    return t.reshape(members, t.shape[0] // members, *t.shape[1:]).movedim(1, axis + 1)


def row_shape(rows: int | None, features: int, ndim: int, batch_axis: int | None, channel_axis: int) -> tuple[int, ...]:
    """The shape in which ``[rows, features]`` per-row values (a factor's draw, a bias offset) broadcast against an
    ``ndim``-d activation with its batch at ``batch_axis`` (None, or ``rows`` None: one value for all rows) and its
    channels at ``channel_axis``: ``[rows, features, 1, 1]`` for a 2-d convolution's input, ``[rows, 1, features]``
    for a sequence's. The one statement of that rule (the layers, the per-row op and the draws use it)."""
    shape = [1] * ndim
    if batch_axis is not None and rows is not None:
        shape[batch_axis] = rows
    shape[channel_axis % ndim] = features
    return tuple(shape)


def component_rows(components: Tensor, table: Tensor) -> Tensor:
    """Each row's component's entry of a ``[K, F]`` table: ``[len(components), F]``.

    Eager, ``F.embedding`` (one gather; its backward is much faster than advanced indexing's on the CPU). In a
    compiled graph, a one-hot matmul: inductor lowers the gather's backward to a serial scatter-add (on the GPU,
    atomics onto K rows), where ``one_hot @ table`` is one K-deep GEMM each way (a 32 x 4096 draw's gather and backward on a CPU: 1.6 ms
    -> 0.7 ms).
    """
    if torch.compiler.is_compiling():
        # (outside autocast: a gather copies the table's values exactly, and so must this product and its backward)
        with torch.autocast(table.device.type, enabled=False):
            return F.one_hot(components, table.shape[0]).to(table.dtype) @ table
    return F.embedding(components, table)


def block_rows(per_block: Tensor, blocks: tuple[tuple[int, int], ...]) -> Tensor:
    """``[len(blocks), F]`` -> ``[rows, F]``: each block's value on each of its rows (``blocks``: contiguous
    ``(start, stop)`` runs covering the rows, in order).

    In a compiled graph this is how a row's component entry is best taken where the rows run in blocks (the router's
    sample and tiled routes): an expanded view that fuses into its consumer (the noise draw, a scaling), whose
    backward is a sum over each block fused into its producer, where :func:`component_rows` per row is a GEMM
    each way and a ``[rows, F]`` tensor written out (a ViT-tiny's draw on a CPU: ~8 ms of a 160 ms step).
    """
    sizes = [b - a for a, b in blocks]
    features = per_block.shape[-1]
    if all(size == sizes[0] for size in sizes[1:]):  # (not a set: hashing a symbolic size would fix it to its value)
        return per_block[:, None].expand(len(blocks), sizes[0], features).reshape(-1, features)
    return torch.cat([v.expand(n, -1) for v, n in zip(per_block[:, None], sizes)])
