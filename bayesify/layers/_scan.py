"""The time loop of rank-1 recurrent layers, with a hand-written backward pass.

One :class:`RecurrentScan` call runs the whole recurrence of one layer and direction of an
LSTM, GRU or Elman RNN whose recurrent kernel carries per-example rank-1 factors:

    a_t = (h_{t-1} o s_h) W_hh^T                       (additive: (h_{t-1} + s_h) W_hh^T)
    LSTM:  g = xi_t + a_t o r_h;  i, f, o = sigmoid, g~ = tanh;  c_t = f c + i g~;  m = o tanh(c_t)
           h_t = m, or with a projection h_t = ((m o s_hr) W_hr^T) o r_hr
    GRU:   gh = a_t o r_h + b_h;  r, z = sigmoid(xi + gh);  n = tanh(xi_n + r gh_n);  h_t = n + z (h - n)
    RNN:   h_t = tanh / relu(xi_t + a_t o r_h)

``xi`` (the input projection of *all* time steps, one matmul made by the caller) comes in as
rows ``[N, G]`` in time-major order: step ``t`` owns rows ``offset_t : offset_t + batch_t``,
the first ``batch_t`` sequences of the (length-sorted) batch, exactly the layout of a
``PackedSequence``; a padded batch is the special case ``batch_t = B`` for every step.

Why a custom backward: autograd through a Python loop records ~15 nodes per step and, per
step, one matmul for the weight gradient. Here the per-step work is one matmul forward and one
backward (the state gradient); the gradients of ``W_hh``, ``W_hr`` and of the factors are single
large matmuls / reductions over all steps after the loop, and the gate derivatives are computed
for all steps at once. Its backward is not differentiable: a second derivative (``create_graph=True``) is refused
in one line; :func:`reference_scan` is the same recurrence in autograd's ops (no hand-written backward), which
``torch.func``'s transforms run (grad of grad included).

References:
    Dusenberry et al., ICML 2020, Sec. 3 and App. (rank-1 LSTM); edward2 ``LSTMCellRank1``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["RecurrentScan", "reference_scan", "row_positions"]


def row_positions(batch_sizes: Sequence[int], device: torch.device) -> Tensor:
    """The batch position of every row of a time-major packed layout (``[N]``, long)."""
    if all(size == batch_sizes[0] for size in batch_sizes):  # python ints: no tensor read (a torch.compile break)
        return torch.arange(batch_sizes[0], device=device).repeat(len(batch_sizes))
    sizes = torch.as_tensor(list(batch_sizes), dtype=torch.long)
    offsets = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    return (torch.arange(total) - offsets.repeat_interleave(sizes)).to(device)


def _row_sum(values: Tensor, pos: Tensor, batch: int, steps: int) -> Tensor:
    """Sum ``values [N, F]`` over the time steps of each batch position: ``[batch, F]``."""
    if values.shape[0] == batch * steps:  # uniform layout: a plain reduction
        return values.view(steps, batch, values.shape[-1]).sum(0)
    return values.new_zeros(batch, values.shape[1]).index_add_(0, pos, values)


def _with_rows(values: Tensor, per_position: Tensor, pos: Tensor, batch: int, steps: int, add: bool) -> Tensor:
    """``values [N, F]`` plus / times ``per_position [batch, F]`` spread to every row."""
    if values.shape[0] == batch * steps:  # uniform layout: broadcast, no gathered copy
        grid = values.view(steps, batch, values.shape[-1])
        return (grid + per_position if add else grid * per_position).view(values.shape)
    spread = per_position.index_select(0, pos)
    return values + spread if add else values * spread


def _one_step_back(rows: Tensor, first: Tensor, batch: int, reverse: bool) -> Tensor:
    """The rows ``[N, F]`` of a uniform time-major layout shifted one step back in scan order, with ``first``
    (the initial state) for the first step scanned: each row's previous state."""
    if rows.shape[0] == batch:
        return first.clone()
    return torch.cat((rows[batch:], first)) if reverse else torch.cat((first, rows[:-batch]))


class RecurrentScan(torch.autograd.Function):
    """``(out [N, P], h_n [B, P](, c_n [B, H]))`` of one layer and direction; see the module doc.

    Args (positional, for ``apply``):
        xi: ``[N, G]`` input projections incl. biases (and, additive, ``r_h`` for LSTM / RNN).
        h0: ``[B, P]``; c0: ``[B, H]`` (LSTM) or None.
        w_hh: ``[G, P]``; s_h: ``[B, P]``; r_h: ``[B, G]`` or None (additive: folded elsewhere).
        b_h: GRU recurrent bias ``[B, G]`` or None.
        w_hr, s_hr, r_hr: LSTM projection ``[P, H]``, ``[B, H]``, ``[B, P]`` or None.
        mode: ``"LSTM"``, ``"GRU"``, ``"RNN_TANH"`` or ``"RNN_RELU"``.
        batch_sizes: rows per time step (python ints).
        reverse: run from the last step to the first.
        additive: the factors are added (``h + s``, ``p + r_hr``) instead of multiplied.
    """

    # forward and backward are one loop each over the time steps, written out for LSTM / GRU / RNN together: a
    # step's ops share buffers and indices that helpers would pass back and forth (long on purpose); the backward
    # pass's work before and after its loop, all steps at once, is in the helpers below the class
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        xi: Tensor,
        h0: Tensor,
        c0: Tensor | None,
        w_hh: Tensor,
        s_h: Tensor,
        r_h: Tensor | None,
        b_h: Tensor | None,
        w_hr: Tensor | None,
        s_hr: Tensor | None,
        r_hr: Tensor | None,
        mode: str,
        batch_sizes: Sequence[int],
        reverse: bool,
        additive: bool,
    ) -> tuple[Tensor, ...]:
        n_rows, gates = xi.shape
        hidden = gates // {"LSTM": 4, "GRU": 3}.get(mode, 1)
        batch, width = h0.shape
        offsets = [0]
        for size in batch_sizes:
            offsets.append(offsets[-1] + size)
        order = range(len(batch_sizes) - 1, -1, -1) if reverse else range(len(batch_sizes))

        # every step on the whole batch (a padded batch): the state of step t is the output rows of the step
        # before it, so nothing is copied per step; h_{t-1} / c_{t-1} of every row are one shifted copy after
        uniform = bool(batch_sizes) and all(size == batch for size in batch_sizes)
        h = h0 if uniform else h0.clone()
        h_prev = None if uniform else xi.new_empty(n_rows, width)  # h_{t-1} of every row
        a_all = xi.new_empty(n_rows, gates)  # (h o s_h) W_hh^T of every row
        act = xi.new_empty(n_rows, gates)  # gate activations
        out = xi.new_empty(n_rows, width)
        w_t = w_hh.t()
        lstm, gru = mode == "LSTM", mode == "GRU"
        if lstm:
            c = c0 if uniform else c0.clone()  # type: ignore[union-attr]
            c_all = xi.new_empty(n_rows, hidden) if uniform else None  # c_t of every row (uniform)
            c_prev = None if uniform else xi.new_empty(n_rows, hidden)
            tanh_c = xi.new_empty(n_rows, hidden)
            proj = xi.new_empty(n_rows, width) if w_hr is not None else None
            w_hr_t = w_hr.t() if w_hr is not None else None
        if gru:
            gh_n = xi.new_empty(n_rows, hidden)

        for t in order:
            lo, size = offsets[t], batch_sizes[t]
            hi = lo + size
            hp = h if uniform else h[:size]
            if not uniform:
                h_prev[lo:hi] = hp  # type: ignore[index]
            hs = hp + s_h[:size] if additive else hp * s_h[:size]
            a = torch.mm(hs, w_t, out=a_all[lo:hi])
            x = xi[lo:hi]
            gate = act[lo:hi]
            if gru:
                gh = a if r_h is None else a * r_h[:size]
                if b_h is not None:
                    gh = gh + b_h[:size]
                # gate columns are written by assignment, not out= (a strided out= is a torch.compile graph break)
                rz = torch.sigmoid(x[:, : 2 * hidden] + gh[:, : 2 * hidden])
                gate[:, : 2 * hidden] = rz
                gh_n[lo:hi] = gh[:, 2 * hidden :]
                n = torch.tanh(torch.addcmul(x[:, 2 * hidden :], rz[:, :hidden], gh[:, 2 * hidden :]))
                gate[:, 2 * hidden :] = n
                h_new = torch.addcmul(n, rz[:, hidden:], hp - n, out=out[lo:hi])
            else:
                pre = x + a if r_h is None else torch.addcmul(x, a, r_h[:size])
                if lstm:
                    torch.sigmoid(pre, out=gate)
                    gate[:, 2 * hidden : 3 * hidden] = torch.tanh(pre[:, 2 * hidden : 3 * hidden])  # no strided out=
                    i, f, g, o = gate.chunk(4, 1)
                    cp = c if uniform else c[:size]
                    if uniform:
                        c_new = torch.addcmul(f * cp, i, g, out=c_all[lo:hi])  # type: ignore[index]
                        c = c_new
                    else:
                        c_prev[lo:hi] = cp  # type: ignore[index]
                        c_new = torch.addcmul(f * cp, i, g)
                        c[:size] = c_new
                    tc = torch.tanh(c_new, out=tanh_c[lo:hi])
                    if w_hr_t is not None:
                        m = o * tc
                        ms = m + s_hr[:size] if additive else m * s_hr[:size]  # type: ignore[index]
                        p = torch.mm(ms, w_hr_t, out=proj[lo:hi])  # type: ignore[index]
                        h_new = torch.add(p, r_hr[:size], out=out[lo:hi]) if additive else torch.mul(p, r_hr[:size], out=out[lo:hi])  # type: ignore[index]
                    else:
                        h_new = torch.mul(o, tc, out=out[lo:hi])
                elif mode == "RNN_TANH":
                    h_new = torch.tanh(pre, out=gate)
                    out[lo:hi] = h_new
                else:
                    h_new = torch.clamp(pre, min=0, out=gate)
                    out[lo:hi] = h_new
            if uniform:
                h = h_new
            else:
                h[:size] = h_new

        if uniform:  # h_{t-1} / c_{t-1} of every row: the outputs one step back, the initial state first
            h_prev = _one_step_back(out, h0, batch, reverse)
            h = h.clone()  # the final state: its own tensor, not a view of the output
            if lstm:
                c_prev = _one_step_back(c_all, c0, batch, reverse)  # type: ignore[arg-type]
                c = c.clone()
        ctx.meta = (mode, list(batch_sizes), offsets, list(order), additive, batch, hidden)
        ctx.save_for_backward(w_hh, s_h, r_h, b_h, w_hr, s_hr, r_hr)
        ctx.h_prev, ctx.a_all, ctx.act = h_prev, a_all, act
        if lstm:
            ctx.c_prev, ctx.tanh_c, ctx.proj = c_prev, tanh_c, proj
            return out, h, c
        if gru:
            ctx.gh_n = gh_n
        return out, h

    @staticmethod
    def backward(ctx: Any, d_out: Tensor, d_hn: Tensor, d_cn: Tensor | None = None) -> tuple[Tensor | None, ...]:
        # (not once_differentiable: its gradients of a second derivative came back None where they pass this layer
        # without reaching its inputs, silently; create_graph=True is the grad mode a backward runs in)
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"a converted {ctx.meta[0].split('_')[0]} layer's backward pass is written by hand and cannot be "
                "differentiated again (create_graph=True: a gradient penalty, a second-order update); take the second "
                "derivative with torch.func (torch.func.grad of torch.func.grad, or torch.func.hessian), which runs "
                "its recurrence with autograd's ops, or keep the layer plain with bayesify.convert(..., exclude=[...])."
            )
        return _scan_backward(ctx, d_out, d_hn, d_cn)


def _scan_backward(ctx: Any, d_out: Tensor, d_hn: Tensor, d_cn: Tensor | None) -> tuple[Tensor | None, ...]:
    """:meth:`RecurrentScan.backward`'s gradients (grad mode off)."""
    mode, batch_sizes, offsets, order, additive, _, hidden = ctx.meta
    w_hh, s_h, r_h, _, w_hr, s_hr, r_hr = ctx.saved_tensors
    h_prev, a_all, act = ctx.h_prev, ctx.a_all, ctx.act
    (n_rows, _), width = a_all.shape, h_prev.shape[1]
    lstm, gru = mode == "LSTM", mode == "GRU"

    dh = d_hn.clone()
    d_xi = torch.empty_like(a_all)  # gradient of the input projections
    d_pre = d_xi  # gradient of the recurrent pre-activation (a o r_h (+ b_h)); GRU: its own
    d_hs = h_prev.new_empty(n_rows, width)  # gradient of h_{t-1} o s_h
    # gate derivatives of every step, computed at once before the (sequential) loop
    m_all = d_h_rows = d_ms = None
    if lstm:
        dc = d_cn.clone()  # type: ignore[union-attr]
        scale, o_dtanh, f, o = _lstm_gate_derivatives(act, ctx.c_prev, ctx.tanh_c, hidden)
        if w_hr is not None:
            m_all = o * ctx.tanh_c
            d_h_rows = h_prev.new_empty(n_rows, width)
            d_ms = h_prev.new_empty(n_rows, hidden)
    elif gru:
        scale, scale_h, z = _gru_gate_derivatives(act, h_prev, ctx.gh_n)
        d_pre = torch.empty_like(a_all)
    else:
        scale = 1 - act * act if mode == "RNN_TANH" else (act > 0).to(act.dtype)

    for t in reversed(order):
        lo, size = offsets[t], batch_sizes[t]
        hi = lo + size
        dha = dh[:size] + d_out[lo:hi]
        if lstm:
            if w_hr is not None:
                d_h_rows[lo:hi] = dha  # type: ignore[index]
                dp = dha if additive else dha * r_hr[:size]
                dms = torch.mm(dp, w_hr, out=d_ms[lo:hi])  # type: ignore[index]
                dm = dms if additive else dms * s_hr[:size]
            else:
                dm = dha
            dca = torch.addcmul(dc[:size], dm, o_dtanh[lo:hi])
            dg = torch.mul(torch.cat((dca, dca, dca, dm), 1), scale[lo:hi], out=d_xi[lo:hi])
            dc[:size] = dca * f[lo:hi]
        elif gru:
            dha3 = torch.cat((dha, dha, dha), 1)
            torch.mul(dha3, scale[lo:hi], out=d_xi[lo:hi])
            dg = torch.mul(dha3, scale_h[lo:hi], out=d_pre[lo:hi])
        else:
            dg = torch.mul(dha, scale[lo:hi], out=d_xi[lo:hi])
        da = dg if r_h is None else dg * r_h[:size]
        dhs = torch.mm(da, w_hh, out=d_hs[lo:hi])
        dhp = dhs if additive else dhs * s_h[:size]
        if gru:
            dhp = torch.addcmul(dhp, dha, z[lo:hi])
        dh[:size] = dhp

    d_weights = _weight_grads(ctx, d_pre, d_hs, m_all, d_h_rows, d_ms)
    d_c0 = dc if lstm else None
    return d_xi, dh, d_c0, *d_weights, None, None, None, None


# the backward pass's phases that do not feed the recurrence: the gate derivatives of every step before its loop,
# the gradients of the weights and factors after it (each all steps at once)


def _lstm_gate_derivatives(
    act: Tensor, c_prev: Tensor, tanh_c: Tensor, hidden: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(scale, o_dtanh, f, o)`` of every LSTM row: ``d(i, f, g~, o) = (dc, dc, dc, dm) o scale``,
    ``dc += dm o o_dtanh``, ``dc_{t-1} = dc o f``."""
    i, f, g, o = act.chunk(4, 1)
    # [g i(1-i), c_prev f(1-f), i (1-g^2), tanh(c) o(1-o)], in place: few passes over N x 4H
    scale = torch.mul(act, 1 - act)
    hid = slice(2 * hidden, 3 * hidden)
    scale[:, hid] = torch.addcmul(torch.ones_like(g), g, g, value=-1)  # no strided out= (torch.compile)
    for block, factor in enumerate((g, c_prev, i, tanh_c)):
        scale[:, block * hidden : (block + 1) * hidden].mul_(factor)
    o_dtanh = torch.addcmul(torch.ones_like(tanh_c), tanh_c, tanh_c, value=-1).mul_(o)
    return scale, o_dtanh, f.contiguous(), o


def _gru_gate_derivatives(act: Tensor, h_prev: Tensor, gh_n: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(scale, scale_h, z)`` of every GRU row: ``d_xi = (dh, dh, dh) o scale``, ``d_pre = (dh, dh, dh) o scale_h``
    (the recurrent ``n`` pre-activation is ``r o gh_n``), ``dh_{t-1} += dh o z``."""
    r, z, n = act.chunk(3, 1)
    q1 = (1 - z) * (1 - n * n)
    q2 = (h_prev - n) * z * (1 - z)
    q3 = q1 * gh_n * r * (1 - r)
    scale = torch.cat([q3, q2, q1], 1)
    scale_h = torch.cat([q3, q2, q1 * r], 1)
    return scale, scale_h, z.contiguous()


def _weight_grads(
    ctx: Any, d_pre: Tensor, d_hs: Tensor, m_all: Tensor | None, d_h_rows: Tensor | None, d_ms: Tensor | None
) -> tuple[Tensor | None, ...]:
    """The gradients of ``w_hh, s_h, r_h, b_h, w_hr, s_hr, r_hr`` (None where not needed): one reduction or
    matmul over all steps each, from the per-row gradients the loop of :meth:`RecurrentScan.backward` wrote."""
    mode, batch_sizes, _, _, additive, batch, _ = ctx.meta
    _, s_h, r_h, b_h, w_hr, s_hr, r_hr = ctx.saved_tensors
    h_prev, a_all = ctx.h_prev, ctx.a_all
    steps = len(batch_sizes)
    pos = row_positions(batch_sizes, a_all.device)
    need = ctx.needs_input_grad
    d_whh = d_sh = d_rh = d_bh = d_whr = d_shr = d_rhr = None
    if need[3]:
        hs_all = _with_rows(h_prev, s_h, pos, batch, steps, additive)
        da_all = d_pre if r_h is None else _with_rows(d_pre, r_h, pos, batch, steps, False)
        d_whh = da_all.t() @ hs_all
    if need[4]:
        d_sh = _row_sum(d_hs if additive else d_hs * h_prev, pos, batch, steps)
    if r_h is not None and need[5]:
        d_rh = _row_sum(d_pre * a_all, pos, batch, steps)
    if b_h is not None and need[6]:
        d_bh = _row_sum(d_pre, pos, batch, steps)
    if mode == "LSTM" and w_hr is not None:
        if need[7]:
            ms_all = _with_rows(m_all, s_hr, pos, batch, steps, additive)  # type: ignore[arg-type]
            dp_all = d_h_rows if additive else _with_rows(d_h_rows, r_hr, pos, batch, steps, False)  # type: ignore[arg-type]
            d_whr = dp_all.t() @ ms_all  # type: ignore[union-attr]
        if need[8]:
            d_shr = _row_sum(d_ms if additive else d_ms * m_all, pos, batch, steps)  # type: ignore[operator,arg-type]
        if need[9]:
            d_rhr = _row_sum(d_h_rows if additive else d_h_rows * ctx.proj, pos, batch, steps)  # type: ignore[operator,arg-type]
    return d_whh, d_sh, d_rh, d_bh, d_whr, d_shr, d_rhr


def reference_scan(
    xi: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    w_hh: Tensor,
    s_h: Tensor,
    r_h: Tensor | None,
    b_h: Tensor | None,
    w_hr: Tensor | None,
    s_hr: Tensor | None,
    r_hr: Tensor | None,
    mode: str,
    batch_sizes: Sequence[int],
    reverse: bool,
    additive: bool,
) -> tuple[Tensor, ...]:
    """:class:`RecurrentScan`'s recurrence in autograd's ops, nothing written in place: the same arguments and
    outputs, differentiable any number of times, and what ``torch.func``'s transforms run (the Function has no
    functorch rules). A step at a time, so slower."""
    hidden = xi.shape[1] // {"LSTM": 4, "GRU": 3}.get(mode, 1)
    offsets = [0]
    for size in batch_sizes:
        offsets.append(offsets[-1] + size)
    h, c = h0, c0
    outs: list[Tensor | None] = [None] * len(batch_sizes)
    for t in range(len(batch_sizes) - 1, -1, -1) if reverse else range(len(batch_sizes)):
        lo, size = offsets[t], batch_sizes[t]
        x, hp = xi[lo : lo + size], h[:size]
        a = (hp + s_h[:size] if additive else hp * s_h[:size]) @ w_hh.t()
        if mode == "GRU":
            gh = a if r_h is None else a * r_h[:size]
            gh = gh if b_h is None else gh + b_h[:size]
            r, z = torch.sigmoid(x[:, : 2 * hidden] + gh[:, : 2 * hidden]).chunk(2, 1)
            n = torch.tanh(x[:, 2 * hidden :] + r * gh[:, 2 * hidden :])
            h_new = n + z * (hp - n)
        else:
            pre = x + (a if r_h is None else a * r_h[:size])
            if mode == "LSTM":
                i, f, g, o = pre.chunk(4, 1)
                c_new = torch.sigmoid(f) * c[:size] + torch.sigmoid(i) * torch.tanh(g)  # type: ignore[index]
                h_new = torch.sigmoid(o) * torch.tanh(c_new)
                if w_hr is not None:
                    p = (h_new + s_hr[:size] if additive else h_new * s_hr[:size]) @ w_hr.t()  # type: ignore[index]
                    h_new = p + r_hr[:size] if additive else p * r_hr[:size]  # type: ignore[index]
                c = torch.cat((c_new, c[size:]))  # type: ignore[index]
            else:
                h_new = torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)
        outs[t] = h_new
        h = torch.cat((h_new, h[size:]))
    out = torch.cat(outs) if outs else xi.new_zeros(0, h0.shape[1])  # type: ignore[arg-type]
    return (out, h, c) if mode == "LSTM" else (out, h)
