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

References:
    Dusenberry et al., ICML 2020, Eq. 1 and Sec. 3; edward2 ``DenseRank1`` / ``Conv2DRank1``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["broadcast_rows", "rank1_affine"]


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

    Returns:
        The layer's output for every row.
    """
    s = broadcast_rows(s.to(x.dtype), x.dim(), batch_axis, channel_axis)
    out = core(x + s if additive else x * s)
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
