"""Triton kernels for the per-row path's activation-sized work (see :mod:`bayesify.kernels`).

An activation is read as ``[rows, channels, inner]`` through three strides (``inner``: every axis but the batch and
the channels, collapsed; :func:`bayesify.kernels.plan` says whether they collapse), and a per-row value as
``[rows or 1, channels]`` through two. Two kernels:

* ``_scale_shift_fwd``: ``y = a o v (+ o)``, one launch: the input scaling ``x o s`` and the output one
  ``y o r + offset`` of :func:`bayesify.layers.rank1_affine` alike.
* ``_scale_shift_bwd``: from the incoming gradient ``g``, in one launch, ``g o v`` (the activation's gradient),
  ``sum g o a`` (the factor's gradient: ``a`` is the input of the scaling) and ``sum g`` (the offset's), the sums
  over each row's ``inner`` axis accumulated in float32 (float64 for float64). A row's ``inner`` axis is cut into
  ``splits`` chunks where rows x channel blocks alone would leave the GPU idle; then ``_sum_partials``, a second
  launch, adds the chunks' partial sums (and, for values shared by all rows, the rows') in a fixed order and casts
  them: the result does not depend on scheduling.

Importing this module imports Triton; :mod:`bayesify.kernels` imports it only when a kernel runs. With
``TRITON_INTERPRET=1`` set before that import, the kernels run on CPU tensors in Triton's interpreter (the tests).
They call Triton's builtins and this module's own jit functions only (``tl.reduce`` with ``_add``, not ``tl.sum``,
``tl.full``, not ``tl.zeros``): Triton's library functions are jit functions made when Triton was first imported,
which the interpreter cannot run if that import came before the variable was set (as in a test session).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["Rows", "Values", "scale_shift", "scale_shift_backward"]


class Rows(NamedTuple):
    """An activation as ``[rows, channels, inner]``: its sizes and strides."""

    rows: int
    channels: int
    inner: int
    stride_row: int
    stride_channel: int
    stride_inner: int


class Values(NamedTuple):
    """Per-row values as ``[rows, channels]`` (``rows`` 1: shared by all; a stride 0 broadcasts)."""

    rows: int
    stride_row: int
    stride_channel: int


@triton.jit
def _scale_shift_fwd(
    a_ptr, v_ptr, o_ptr, y_ptr,
    C, M, n_c, n_m,
    a_r, a_c, a_m, v_r, v_c, o_r, o_c, y_r, y_c, y_m,
    HAS_OFFSET: tl.constexpr, ACC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pm = pid % n_m
    pc = (pid // n_m) % n_c
    row = (pid // (n_m * n_c)).to(tl.int64)
    c = (pc * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    m = (pm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    c_ok = c < C
    mask = c_ok[:, None] & (m < M)[None, :]
    a = tl.load(a_ptr + row * a_r + c[:, None] * a_c + m[None, :] * a_m, mask=mask, other=0.0).to(ACC)
    v = tl.load(v_ptr + row * v_r + c * v_c, mask=c_ok, other=0.0).to(ACC)
    y = a * v[:, None]
    if HAS_OFFSET:
        o = tl.load(o_ptr + row * o_r + c * o_c, mask=c_ok, other=0.0).to(ACC)
        y = y + o[:, None]
    tl.store(y_ptr + row * y_r + c[:, None] * y_c + m[None, :] * y_m, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _scale_shift_bwd(
    g_ptr, a_ptr, v_ptr, da_ptr, dv_ptr, do_ptr,
    R, C, M, n_c, n_s, chunk,
    g_r, g_c, g_m, a_r, a_c, a_m, v_r, v_c, da_r, da_c, da_m,
    NEED_DA: tl.constexpr, NEED_DV: tl.constexpr, NEED_DO: tl.constexpr,
    ACC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = pid % n_s
    pc = (pid // n_s) % n_c
    row = (pid // (n_s * n_c)).to(tl.int64)
    c = (pc * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    c_ok = c < C
    if NEED_DA:
        v = tl.load(v_ptr + row * v_r + c * v_c, mask=c_ok, other=0.0).to(ACC)
    acc_v = tl.full([BLOCK_C, BLOCK_M], 0.0, dtype=ACC)
    acc_o = tl.full([BLOCK_C, BLOCK_M], 0.0, dtype=ACC)
    start = split * chunk
    stop = tl.minimum(start + chunk, M)
    for m0 in range(start, stop, BLOCK_M):
        m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = c_ok[:, None] & (m < stop)[None, :]
        g = tl.load(g_ptr + row * g_r + c[:, None] * g_c + m[None, :] * g_m, mask=mask, other=0.0).to(ACC)
        if NEED_DA:
            da = g * v[:, None]
            tl.store(da_ptr + row * da_r + c[:, None] * da_c + m[None, :] * da_m, da.to(da_ptr.dtype.element_ty), mask=mask)
        if NEED_DV:
            a = tl.load(a_ptr + row * a_r + c[:, None] * a_c + m[None, :] * a_m, mask=mask, other=0.0).to(ACC)
            acc_v += g * a
        if NEED_DO:
            acc_o += g
    out = (split * R + row) * C + c  # [splits, rows, channels], contiguous
    if NEED_DV:
        tl.store(dv_ptr + out, tl.reduce(acc_v, 1, _add).to(dv_ptr.dtype.element_ty), mask=c_ok)
    if NEED_DO:
        tl.store(do_ptr + out, tl.reduce(acc_o, 1, _add).to(do_ptr.dtype.element_ty), mask=c_ok)


@triton.jit
def _sum_rows(p_ptr, out_ptr, lo, hi, out_row, c, c_ok, S, R, C, ACC: tl.constexpr, BLOCK_C: tl.constexpr):
    acc = tl.full([BLOCK_C], 0.0, dtype=ACC)
    for s in range(0, S):
        for r in range(lo, hi):
            acc += tl.load(p_ptr + (s * R + r) * C + c, mask=c_ok, other=0.0)
    tl.store(out_ptr + out_row * C + c, acc.to(out_ptr.dtype.element_ty), mask=c_ok)


@triton.jit
def _sum_partials_one(p_ptr, out_ptr, row, c, c_ok, S, R, C, ALL_ROWS: tl.constexpr, ACC: tl.constexpr, BLOCK_C: tl.constexpr):
    if ALL_ROWS:  # one row wanted: program row 0 adds every row
        if row == 0:
            _sum_rows(p_ptr, out_ptr, 0, R, 0, c, c_ok, S, R, C, ACC, BLOCK_C)
    else:
        _sum_rows(p_ptr, out_ptr, row, row + 1, row, c, c_ok, S, R, C, ACC, BLOCK_C)


@triton.jit
def _sum_partials(
    p_ptr, q_ptr, p_out, q_out, S, R, C, n_c,
    HAS_P: tl.constexpr, HAS_Q: tl.constexpr, ALL_ROWS_P: tl.constexpr, ALL_ROWS_Q: tl.constexpr,
    ACC: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # the backward's partial sums [splits, rows, C] added up in a fixed order and cast, both outputs in one launch
    pid = tl.program_id(0)
    row = (pid // n_c).to(tl.int64)
    c = ((pid % n_c) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    c_ok = c < C
    if HAS_P:
        _sum_partials_one(p_ptr, p_out, row, c, c_ok, S, R, C, ALL_ROWS_P, ACC, BLOCK_C)
    if HAS_Q:
        _sum_partials_one(q_ptr, q_out, row, c, c_ok, S, R, C, ALL_ROWS_Q, ACC, BLOCK_C)


def _pow2(n: int, cap: int) -> int:
    return max(2, min(triton.next_power_of_2(max(n, 1)), cap))  # at least 2: no size-1 block axis


def _blocks(lay: Rows, budget: int) -> tuple[int, int]:
    """A ``[channels, inner]`` tile of about ``budget`` elements, long along the contiguous axis."""
    if lay.stride_channel == 1 or lay.inner == 1:  # tokens [B, T, C], channels-last images: channels contiguous
        block_c = _pow2(lay.channels, 128)
        return block_c, _pow2(lay.inner, max(2, budget // block_c))
    block_m = _pow2(lay.inner, 1024)  # NCHW: each channel's plane contiguous
    return _pow2(lay.channels, max(2, budget // block_m)), block_m


def _acc(dtype: torch.dtype) -> tl.dtype:
    return tl.float64 if dtype == torch.float64 else tl.float32


_SM_COUNT: dict[torch.device, int] = {}


def _programs_wanted(device: torch.device) -> int:
    """Enough programs to fill the device a few times over (the interpreter: a few, each one is slow)."""
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return 4 * _SM_COUNT[device]


def scale_shift(
    a: Tensor, lay: Rows, v: Tensor, v_lay: Values, o: Tensor | None, o_lay: Values | None, y: Tensor, y_lay: Rows
) -> Tensor:
    """``y = a o v (+ o)`` into ``y`` (allocated by the caller with its layout ``y_lay``), one launch."""
    block_c, block_m = _blocks(lay, 4096)
    n_c, n_m = triton.cdiv(lay.channels, block_c), triton.cdiv(lay.inner, block_m)
    o_arg, o_lay = (v, v_lay) if o is None else (o, o_lay)
    _scale_shift_fwd[(lay.rows * n_c * n_m,)](
        a, v, o_arg, y,
        lay.channels, lay.inner, n_c, n_m,
        lay.stride_row, lay.stride_channel, lay.stride_inner, v_lay.stride_row, v_lay.stride_channel,
        o_lay.stride_row, o_lay.stride_channel, y_lay.stride_row, y_lay.stride_channel, y_lay.stride_inner,
        HAS_OFFSET=o is not None, ACC=_acc(a.dtype), BLOCK_C=block_c, BLOCK_M=block_m,
    )  # fmt: skip
    return y


def scale_shift_backward(
    g: Tensor,
    g_lay: Rows,
    a: Tensor | None,
    a_lay: Rows | None,
    v: Tensor,
    v_lay: Values,
    da: Tensor | None,
    da_lay: Rows | None,
    v_rows: int | None,
    o_rows: int | None,
    *,
    splits: int | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """One launch: ``da = g o v`` into ``da`` (None: not wanted), and the sums over each row's inner axis of
    ``g o a`` and of ``g`` as ``[v_rows, channels]`` / ``[o_rows, channels]`` (None: not wanted; 1 row: summed
    over the rows as well), in ``v``'s dtype. ``splits``: chunks per row (None: chosen for the device)."""
    rows, channels, inner = g_lay.rows, g_lay.channels, g_lay.inner
    block_c, block_m = _blocks(g_lay, 2048)
    n_c = triton.cdiv(channels, block_c)
    if splits is None:
        splits = triton.cdiv(_programs_wanted(g.device), rows * n_c) if (v_rows or o_rows) else triton.cdiv(inner, block_m)
    splits = max(1, min(splits, triton.cdiv(inner, block_m)))
    chunk = triton.cdiv(triton.cdiv(inner, splits), block_m) * block_m  # whole blocks per chunk
    splits = triton.cdiv(inner, chunk)
    dtype = v.dtype

    def partials(wanted: int | None) -> Tensor | None:
        if wanted is None:
            return None
        if splits == 1 and wanted == rows:  # the sums themselves, in their dtype: no further op
            return torch.empty(rows, channels, dtype=dtype, device=g.device)
        return torch.empty(splits, rows, channels, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=g.device)

    dv, do = partials(v_rows), partials(o_rows)
    a_arg, a_lay = (g, g_lay) if a is None else (a, a_lay)
    da_arg, da_lay = (g, g_lay) if da is None else (da, da_lay)
    _scale_shift_bwd[(rows * n_c * splits,)](
        g, a_arg, v, da_arg, g if dv is None else dv, g if do is None else do,
        rows, channels, inner, n_c, splits, chunk,
        g_lay.stride_row, g_lay.stride_channel, g_lay.stride_inner, a_lay.stride_row, a_lay.stride_channel,
        a_lay.stride_inner, v_lay.stride_row, v_lay.stride_channel,
        da_lay.stride_row, da_lay.stride_channel, da_lay.stride_inner,
        NEED_DA=da is not None, NEED_DV=dv is not None, NEED_DO=do is not None,
        ACC=_acc(g.dtype), BLOCK_C=block_c, BLOCK_M=block_m,
    )  # fmt: skip
    partial_v, partial_o = (t is not None and t.dim() == 3 for t in (dv, do))
    if not (partial_v or partial_o):
        return dv, do
    # a second launch adds the partial sums up (over the rows too where one row is wanted)
    v_out = torch.empty(v_rows, channels, dtype=dtype, device=g.device) if partial_v else None
    o_out = torch.empty(o_rows, channels, dtype=dtype, device=g.device) if partial_o else None
    block = _pow2(channels, 1024)
    n_c = triton.cdiv(channels, block)
    _sum_partials[(rows * n_c,)](
        dv if partial_v else g, do if partial_o else g, v_out if partial_v else g, o_out if partial_o else g,
        splits, rows, channels, n_c,
        HAS_P=partial_v, HAS_Q=partial_o, ALL_ROWS_P=v_rows == 1 and rows > 1, ALL_ROWS_Q=o_rows == 1 and rows > 1,
        ACC=_acc(dtype), BLOCK_C=block,
    )  # fmt: skip
    return (v_out if partial_v else dv), (o_out if partial_o else do)
