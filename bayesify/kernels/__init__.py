"""Fused kernels for the per-row path on CUDA, and when they run.

:func:`bayesify.layers.rank1_affine` scales activations by per-row values: ``x o s`` before the layer's own map,
``y o r + offset`` after, and in the backward pass each scaling's gradient and its per-row sums. In torch ops the
backward of the output scaling alone is four launches over activation-sized tensors (``g o r``, ``g o y``, its sum,
the sum of ``g``); here every scaling is one Triton launch forward and one backward (:mod:`bayesify.kernels.scale`),
plus one ``sum`` where a row's sums are split across programs. On a GPU, where a rank-1 step is launch-bound, that
count is the time.

The kernels run when all of these hold, and the torch ops (the reference, and the CPU's path) otherwise:

* the tensors are plain CUDA tensors (no subclass, no ``vmap`` wrapper, no forward-mode AD in flight) of float32,
  bfloat16, float16 or float64, and no autograd graph is recorded through the kernels: they run inside the
  per-row path's autograd Functions (whose backward takes the torch ops under ``create_graph``) or without
  gradients;
* not inside ``torch.compile`` / ``torch.jit`` tracing: a compiled graph keeps the torch ops, which Inductor fuses
  itself, so the kernels need no fake implementation;
* Triton imports, and ``BAYESIFY_KERNELS`` is ``1`` (the switch, read at every call; **off by default**;
  ``backward``: the backward kernels only, the forward scalings as torch's ``mul`` / ``addcmul``);
* the layout reads as ``[rows, channels, inner]`` with one stride per axis: the batch axis (or none), the channel
  axis, and all other axes collapsing into one (tokens ``[B, T, C]``, ``[T, B, C]``, images NCHW or channels-last,
  ``[B, C]``). A transposed or sliced view whose other axes do not collapse takes the torch ops.

Why off by default (measured on an NVIDIA H200, torch 2.11, bf16, K=4, 2026-11-27; ``benchmarks/overhead.py
--device cuda --amp bf16 --default-route-only``, one process per row): the default-route step of GPT-2 small at
16 x 256 tokens took 3.06x the deterministic step with the kernels, 2.88x with the backward ones only, and 1.80-2.07x
with the torch ops (five runs); ViT-B/16 at B=128 1.55x with them against 1.46-1.66x without. The step is
launch-bound on the host, and the kernels' planning per call (layout, strides, grid) costs more host time than the
launches it saves. They stay, tested, for a faster planner (or CUDA graphs) to make them pay.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from bayesify.kernels.scale import Rows, Values

__all__ = ["SWITCH", "Plan", "enabled", "plan", "scale_shift", "scale_shift_backward"]

SWITCH = "BAYESIFY_KERNELS"

# where the kernels run; the tests add "cpu" with TRITON_INTERPRET=1 (Triton's interpreter)
_DEVICES = {"cuda"}
_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64})


def _switch() -> str:
    return os.environ.get(SWITCH, "0").strip().lower()


def enabled() -> bool:
    """Whether the switch turns the kernels on (``BAYESIFY_KERNELS=1`` / ``true`` / ``on`` / ``backward``; unset: off)."""
    return _switch() not in ("0", "false", "off", "no", "")


@functools.cache
def _triton() -> bool:
    try:
        import bayesify.kernels.scale  # noqa: F401  (Triton, and the kernels' definitions)
    except ImportError:
        return False
    return True


def _plain(t: Tensor) -> bool:
    return (
        type(t) is Tensor
        and t.layout is torch.strided
        and t.device.type in _DEVICES
        and t.dtype in _DTYPES
        and t.numel() > 0
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


def _usable(*tensors: Tensor | None) -> bool:
    """Whether the kernels may run on these tensors (the caller sees that no graph is recorded through them:
    they run inside autograd Functions, or without gradients)."""
    if torch.compiler.is_compiling() or not enabled() or torch.jit.is_tracing():  # (first: off is the default)
        return False
    present = [t for t in tensors if t is not None]
    device = present[0].device
    if device.type not in _DEVICES:
        return False
    if getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0:
        return False  # forward-mode AD: tangents would be dropped
    return all(_plain(t) and t.device == device for t in present) and _triton()


def _rows(t: Tensor, batch_axis: int | None, channel_axis: int) -> Rows | None:
    """``t`` as ``[rows, channels, inner]`` with one stride each, or None where its other axes do not collapse."""
    from bayesify.kernels.scale import Rows

    nd = t.dim()
    if nd == 0:
        return None
    c = channel_axis % nd
    b = None if batch_axis is None else batch_axis % nd
    if b == c:
        return None
    rows = 1 if b is None else t.shape[b]
    inner, stride_inner = 1, 0
    for i in reversed([i for i in range(nd) if i not in (b, c) and t.shape[i] != 1]):  # innermost first
        if inner == 1:
            inner, stride_inner = t.shape[i], t.stride(i)
        elif t.stride(i) == stride_inner * inner:
            inner *= t.shape[i]
        else:
            return None
    return Rows(rows, t.shape[c], inner, t.stride(b) if rows > 1 else 0, t.stride(c) if t.shape[c] > 1 else 0, stride_inner)


def _values(v: Tensor, like: Rows, batch_axis: int | None, channel_axis: int) -> Values | None:
    """Per-row values ``v`` (broadcastable against an activation laid out as ``like``) as ``[rows or 1, C]``:
    None unless they vary along the batch and channel axes only, batch first (so that their gradient, made
    ``[rows, C]``, reads in ``v``'s own shape)."""
    from bayesify.kernels.scale import Values

    lay = _rows(v, batch_axis, channel_axis)
    if lay is None or lay.inner != 1 or lay.rows not in (1, like.rows) or lay.channels != like.channels:
        return None
    if lay.rows > 1 and lay.channels > 1 and (batch_axis or 0) % v.dim() > channel_axis % v.dim():
        return None
    return Values(lay.rows, lay.stride_row, lay.stride_channel)


class Plan(NamedTuple):
    """How one scaling ``a o v (+ o)`` runs fused: the layouts of its operands and of its result."""

    a: Rows
    v: Values
    o: Values | None
    axes: tuple[int | None, int]
    forward: bool  # the forward scaling by the kernel too (else torch's op; the backward by the kernel either way)


def plan(a: Tensor, v: Tensor, o: Tensor | None, batch_axis: int | None, channel_axis: int) -> Plan | None:
    """The fused plan for ``a o v (+ o)`` (``v``, ``o`` broadcastable against ``a``), or None: the torch ops."""
    if not _usable(a, v, o) or a.dtype != v.dtype or (o is not None and o.dtype != a.dtype):
        return None
    lay = _rows(a, batch_axis, channel_axis)
    if lay is None:
        return None
    v_lay = _values(v, lay, batch_axis, channel_axis)
    o_lay = None if o is None else _values(o, lay, batch_axis, channel_axis)
    if v_lay is None or (o is not None and o_lay is None):
        return None
    return Plan(lay, v_lay, o_lay, (batch_axis, channel_axis), _switch() != "backward")


def scale_shift(p: Plan, a: Tensor, v: Tensor, o: Tensor | None = None) -> Tensor:
    """``a o v (+ o)`` in one launch, as :func:`plan` planned it."""
    if not p.forward:
        return a * v if o is None else torch.addcmul(o, a, v)
    from bayesify.kernels import scale

    y = torch.empty_like(a)  # a's strides where a is dense, else contiguous: either reads as [rows, channels, inner]
    y_lay = _rows(y, *p.axes)
    assert y_lay is not None
    return scale.scale_shift(a, p.a, v, p.v, o, p.o, y, y_lay)


def scale_shift_backward(
    p: Plan, g: Tensor, a: Tensor | None, v: Tensor, needs: tuple[bool, bool, bool], v_shape: torch.Size, o_shape: torch.Size | None
) -> tuple[Tensor | None, Tensor | None, Tensor | None] | None:
    """The gradients of ``a o v (+ o)`` from ``g`` in one launch (two where a row's sums are split):
    ``g o v``, ``sum g o a`` in ``v_shape``, ``sum g`` in ``o_shape``, each None where ``needs`` says so.
    None where ``g``'s layout (or the grad mode) does not allow the kernel: the caller takes the torch ops."""
    from bayesify.kernels import scale

    if torch.is_grad_enabled() or not _usable(g, a, v) or g.dtype != v.dtype:  # grad mode: a double backward
        return None
    batch_axis, channel_axis = p.axes
    g_lay = _rows(g, batch_axis, channel_axis)
    if g_lay is None or g_lay[:3] != p.a[:3]:
        return None
    a_lay = None if a is None else _rows(a, batch_axis, channel_axis)
    if needs[1] and (a is None or a_lay is None or a_lay[:3] != p.a[:3]):
        return None
    da = torch.empty_like(g) if needs[0] else None
    da_lay = None if da is None else _rows(da, batch_axis, channel_axis)
    assert not needs[0] or da_lay is not None  # empty_like: dense, as g's layout was
    o_rows = None if not needs[2] else (p.o.rows if p.o is not None else 1)
    dv, do = scale.scale_shift_backward(
        g, g_lay, a if needs[1] else None, a_lay, v, p.v, da, da_lay, p.v.rows if needs[1] else None, o_rows
    )
    return da, None if dv is None else dv.view(v_shape), None if do is None else do.view(o_shape)
