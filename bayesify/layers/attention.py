"""Rank-1 ``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer`` / ``DecoderLayer`` /
``nn.Transformer``, whose attention it is).

Each projection gets its own rank-1 factors and per-component bias offsets: ``q``, ``k``, ``v``
(``s``: the projection's input size, i.e. ``embed_dim``, ``kdim`` or ``vdim``; ``r``: ``embed_dim``)
whether the weights are one fused ``in_proj_weight`` or separate ``q/k/v_proj_weight``, and the
output projection ``out_proj`` (``rank1_s_out`` / ``rank1_r_out``). The child ``out_proj`` stays
a plain Linear holding the shared weight: this layer does its maths.

The forward pass is torch's own ``F.multi_head_attention_forward`` step for step (every option:
``batch_first``, unbatched input, ``key_padding_mask``, ``attn_mask``, ``is_causal``,
``need_weights`` / ``average_attn_weights``, ``bias``, ``add_bias_kv``, ``add_zero_attn``,
dropout) with the four projections made rank-1. It never takes torch's inference fast path
(``torch._native_multi_head_attention``), and while the converted model runs, reading
``in_proj_weight`` from outside returns an intercepted view (see ``_intercept.py``), whose
``__torch_function__`` makes ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` skip
their fused fast paths (``torch._transformer_encoder_layer_fwd``, nested tensors) as well.

References:
    Dusenberry et al., ICML 2020, Sec. 3 (rank-1 factors on every weight matrix); Vaswani et al.,
    NeurIPS 2017 (multi-head attention).
"""

from __future__ import annotations

import math
import warnings
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from bayesify.config import LayerOptions
from bayesify.layers.base import Draw, Rank1Layer, layer_bias
from bayesify.layers.folded import fold_weight
from bayesify.layers.rank1_op import rank1_affine
from bayesify.options import Perturbation

__all__ = ["Rank1MultiheadAttention"]


def _canonical(mask: Tensor | None, name: str, other: Tensor | None, dtype: torch.dtype, check: bool = True) -> Tensor | None:
    """torch's ``F._canonical_mask``: a boolean mask becomes an additive float mask (-inf where True)."""
    if mask is None:
        return None
    if mask.dtype != torch.bool and not torch.is_floating_point(mask):
        raise AssertionError(f"only bool and floating types of {name} are supported")
    if check and other is not None and mask.dtype != other.dtype:
        warnings.warn(f"Support for mismatched {name} and attn_mask is deprecated. Use same type for both instead.")
    if not torch.is_floating_point(mask):
        mask = torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    return mask


def _disable_fused_fast_path(module: nn.Module, args: tuple) -> None:
    """A no-op forward pre-hook: its presence alone turns torch's fused fast path off.

    ``nn.TransformerEncoderLayer`` skips ``torch._transformer_encoder_layer_fwd`` when any of its
    submodules has a forward hook. Inside the converted model's forward, the intercepted weights
    already rule the fused kernel out; this covers an encoder layer called on its own (feature
    extraction from a submodule), which would otherwise silently run the deterministic weights.
    """
    return None


class Rank1MultiheadAttention(Rank1Layer):
    """Rank-1 ``nn.MultiheadAttention``: q, k, v and out projections each ``((x o s) W^T) o r + b_k``.

    Example:
        >>> layer = nn.TransformerEncoderLayer(64, 4, batch_first=True)
        >>> bayesify.convert(layer)          # self_attn (q, k, v, out) and linear1 / linear2 rank-1

    References:
        Dusenberry et al., ICML 2020.
    """

    # read from outside during a forward pass (e.g. TransformerEncoderLayer's fast-path checks):
    # an intercepted view, so those fused kernels are never taken
    rank1_intercepted = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias")

    def rank1_setup(self, options: LayerOptions) -> None:
        if _disable_fused_fast_path not in self._forward_pre_hooks.values():
            self.register_forward_pre_hook(_disable_fused_fast_path)
        e = self.embed_dim
        for name, fan_in in (("q", e), ("k", self.kdim), ("v", self.vdim), ("out", e)):
            setattr(self, f"rank1_s_{name}", self.rank1_factor(fan_in))
            setattr(self, f"rank1_r_{name}", self.rank1_factor(e))
        self.rank1_bias_offset("rank1_bias_in", 3 * e, "in_proj_bias")
        self.rank1_bias_offset("rank1_bias_out", e, "out_proj.bias")

    def revert(self) -> nn.Module:
        for key in [k for k, hook in self._forward_pre_hooks.items() if hook is _disable_fused_fast_path]:
            del self._forward_pre_hooks[key]
        return super().revert()

    def rank1_merge(self, component: int) -> dict[str, Tensor]:
        """Each projection's ``W' = W o (r_k s_k^T)``, ``b' = b + delta_k`` (additive: ``b' = b + W s_k + r_k +
        delta_k``): the q, k, v rows of a fused ``in_proj_weight`` or the separate ``q/k/v_proj_weight``, and
        ``out_proj``. ``bias_k`` / ``bias_v`` are appended after the projections and stay as they are."""
        params, at = self._parameters, partial(self.rank1_location, component=component)
        fused = params.get("in_proj_weight")
        names = ("in_proj_weight",) * 3 if fused is not None else ("q_proj_weight", "k_proj_weight", "v_proj_weight")
        weights = fused.chunk(3) if fused is not None else tuple(params[n] for n in names)
        in_bias, delta_in = params.get("in_proj_bias"), at("rank1_bias_in")
        out_weight, out_bias = self.out_proj._parameters["weight"], self.out_proj._parameters.get("bias")
        delta_out = at("rank1_bias_out")
        merged: dict[str, Tensor] = {}
        if self.rank1_options.perturbation is Perturbation.ADDITIVE:
            if in_bias is None or out_bias is None:
                raise ValueError(
                    "the additive perturbation shifts each projection by W s + r, and this MultiheadAttention has no "
                    "biases (bias=False) to hold the shift"
                )
            shifts = [F.linear(at(f"rank1_s_{n}"), w) + at(f"rank1_r_{n}") for n, w in zip("qkv", weights)]
            merged["in_proj_bias"] = in_bias + torch.cat(shifts) + delta_in
            shift_out = F.linear(at("rank1_s_out"), out_weight) + at("rank1_r_out")
            merged["out_proj.bias"] = out_bias + shift_out + delta_out
            return merged
        folded = [fold_weight(w, at(f"rank1_r_{n}"), at(f"rank1_s_{n}")) for n, w in zip("qkv", weights)]
        if fused is not None:
            merged["in_proj_weight"] = torch.cat(folded)
        else:
            merged.update(zip(names, folded))
        merged["out_proj.weight"] = fold_weight(out_weight, at("rank1_r_out"), at("rank1_s_out"))
        if in_bias is not None:
            merged["in_proj_bias"] = in_bias + delta_in
        if out_bias is not None:
            merged["out_proj.bias"] = out_bias + delta_out
        return merged

    # ---- a MultiheadAttention used as the model: where the batch lies (see _routing.py) --------

    def _rank1_qkv_axis(self) -> int:
        return 0 if self.batch_first else 1

    def rank1_batch_axis(self, query: Tensor) -> int | None:
        return self._rank1_qkv_axis() if query.dim() == 3 else None

    def rank1_input_axes(self, args: tuple, kwargs: dict) -> list[int | None]:
        # one axis per leaf, in the order _routing flattens (args, kwargs); attn_mask [L, S] is shared
        # by all examples and [B * heads, L, S] is tiled in forward (its first axis is not the batch)
        axis = self._rank1_qkv_axis()
        axes = {"query": axis, "key": axis, "value": axis, "key_padding_mask": 0}
        names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
        leaves: list[int | None] = []
        for name, value in [*zip(names, args), *kwargs.items()]:
            leaves += [axes.get(name)] * len(tree_flatten(value)[0])
        return leaves

    def rank1_output_axes(self, output: Any) -> list[int | None]:
        return [self._rank1_qkv_axis(), 0]

    # ---- maths ------------------------------------------------------------------------------

    def _rank1_project(self, x: Tensor, name: str, weight: Tensor, bias: Tensor | None, draw: Draw) -> Tensor:
        """``((x o s) W^T) o r + b + delta`` of ``x [L, B, F]``; per-example factors broadcast over L."""
        offset = None
        if bias is not None:
            index = {"q": 0, "k": 1, "v": 2, "out": 0}[name]
            e = self.embed_dim
            offset = bias + draw.gather("rank1_bias_out" if name == "out" else "rank1_bias_in")[:, index * e : (index + 1) * e]
        return rank1_affine(
            x,
            lambda v: F.linear(v, weight),
            draw.sample(getattr(self, f"rank1_s_{name}")),
            draw.sample(getattr(self, f"rank1_r_{name}")),
            offset,
            additive=self.rank1_options.perturbation is Perturbation.ADDITIVE,
            batch_axis=1,
            channel_axis=-1,
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        is_batched = query.dim() == 3
        key_padding_mask = _canonical(key_padding_mask, "key_padding_mask", attn_mask, query.dtype)
        attn_mask = _canonical(attn_mask, "attn_mask", None, query.dtype, check=False)
        if query.is_nested or key.is_nested or value.is_nested:
            raise AssertionError(
                "a rank-1 MultiheadAttention does not support NestedTensor input (torch supports it only on its "
                "deterministic fast path); pass padded tensors with a key_padding_mask."
            )
        if self.batch_first and is_batched:
            # keep the "is" relations (self-attention) through the transposes, as torch does
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        out, weights = self._rank1_attention(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        )
        if self.batch_first and is_batched:
            return out.transpose(1, 0), weights
        return out, weights

    def _rank1_attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """``F.multi_head_attention_forward`` (sequence first) with rank-1 projections: torch's function
        projects inside itself, so its steps are written out here (masks, projections, attention)."""
        is_batched = _check_shapes(query, key, value, key_padding_mask, attn_mask, self.num_heads)
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if query.shape[2] != self.embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but got {query.shape[2]}")
        if key.shape[:2] != value.shape[:2]:
            raise AssertionError(f"key's sequence and batch dims {key.shape[:2]} do not match value's {value.shape[:2]}")
        key_padding_mask, attn_mask, is_causal = self._rank1_masks(
            query, key_padding_mask, attn_mask, need_weights, is_causal
        )
        # the rank-1 projections: one sample per example, shared by every position
        draw = self.rank1_draw(query.shape[1], query.device)
        params = self._parameters
        fused = params.get("in_proj_weight")
        if fused is not None:
            w_q, w_k, w_v = fused.chunk(3)
        else:
            w_q, w_k, w_v = params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"]
        in_bias = params.get("in_proj_bias")
        b_q, b_k, b_v = in_bias.chunk(3) if in_bias is not None else (None, None, None)
        q = self._rank1_project(query, "q", w_q, b_q, draw)
        k = self._rank1_project(key, "k", w_k, b_k, draw)
        v = self._rank1_project(value, "v", w_v, b_v, draw)
        attn, weights = self._rank1_attend(q, k, v, key_padding_mask, attn_mask, need_weights, average_attn_weights, is_causal)
        out_proj = self.out_proj
        out = self._rank1_project(attn, "out", out_proj._parameters["weight"], layer_bias(out_proj), draw)
        if not is_batched:
            out = out.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights

    def _rank1_masks(
        self, query: Tensor, key_padding_mask: Tensor | None, attn_mask: Tensor | None, need_weights: bool, is_causal: bool
    ) -> tuple[Tensor | None, Tensor | None, bool]:
        """The masks as torch's attention takes them (float, tiled for a tiled batch), and the causal hint."""
        bsz, heads = query.shape[1], self.num_heads
        tiles = self.rank1_state.model.router.tiles
        if tiles > 1:
            # masks given per example for a tiled batch (the root tiles only tensors whose batch_dim holds
            # the batch): the same mask for every member
            if key_padding_mask is not None and key_padding_mask.shape[0] * tiles == bsz:
                key_padding_mask = torch.cat([key_padding_mask] * tiles)
            if attn_mask is not None and attn_mask.dim() == 3 and attn_mask.shape[0] * tiles == bsz * heads:
                attn_mask = torch.cat([attn_mask] * tiles)
        key_padding_mask = _canonical(key_padding_mask, "key_padding_mask", attn_mask, query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
                "`generate_square_subsequent_mask` to create this mask."
            )
        if is_causal and key_padding_mask is None and not need_weights:
            return key_padding_mask, None, is_causal  # scaled_dot_product_attention applies the causal mask itself
        attn_mask = _canonical(attn_mask, "attn_mask", None, query.dtype, check=False)
        return key_padding_mask, attn_mask, is_causal and key_padding_mask is None

    def _rank1_attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        need_weights: bool,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Multi-head attention of projected ``q [L, B, E]``, ``k``, ``v [S, B, E]``: ``([L, B, E], weights)``."""
        tgt_len, bsz, embed_dim = q.shape
        heads = self.num_heads
        head_dim = embed_dim // heads
        if attn_mask is not None:
            expected = {2: (tgt_len, k.shape[0]), 3: (bsz * heads, tgt_len, k.shape[0])}.get(attn_mask.dim())
            if expected is None:
                raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
            if tuple(attn_mask.shape) != expected:
                raise RuntimeError(
                    f"The shape of the {attn_mask.dim()}D attn_mask is {attn_mask.shape}, but should be {expected}."
                )
            if attn_mask.dim() == 2:
                attn_mask = attn_mask.unsqueeze(0)
        bias_k, bias_v = self._parameters.get("bias_k"), self._parameters.get("bias_v")
        if bias_k is not None and bias_v is not None:
            k = torch.cat([k, bias_k.repeat(1, bsz, 1)])
            v = torch.cat([v, bias_v.repeat(1, bsz, 1)])
            attn_mask, key_padding_mask = _pad_one(attn_mask), _pad_one(key_padding_mask)
        q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.view(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.view(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            zeros = torch.zeros((bsz * heads, 1, head_dim), dtype=k.dtype, device=k.device)
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
            attn_mask, key_padding_mask = _pad_one(attn_mask), _pad_one(key_padding_mask)
        src_len = k.size(1)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (bsz, src_len):
                raise AssertionError(
                    f"Expected key_padded_mask.shape to be {(bsz, src_len)}, but got {tuple(key_padding_mask.shape)}"
                )
            key_padding_mask = (
                key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src_len)
            )
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            q_scaled = q * math.sqrt(1.0 / float(head_dim))
            if attn_mask is not None:
                scores = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
            else:
                scores = torch.bmm(q_scaled, k.transpose(-2, -1))
            weights = F.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            attn = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len, bsz, embed_dim)
            weights = weights.view(bsz, heads, tgt_len, src_len)
            return attn, weights.mean(dim=1) if average_attn_weights else weights
        if attn_mask is not None:
            if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            else:
                attn_mask = attn_mask.view(bsz, heads, attn_mask.shape[-2], src_len)
        q = q.view(bsz, heads, tgt_len, head_dim)
        k = k.view(bsz, heads, src_len, head_dim)
        v = v.view(bsz, heads, src_len, head_dim)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        return attn.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim), None


def _pad_one(mask: Tensor | None) -> Tensor | None:
    """A mask with one more key position, unmasked (``bias_k`` / ``add_zero_attn``'s extra key)."""
    return None if mask is None else F.pad(mask, (0, 1))


def _check_shapes(
    query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None, attn_mask: Tensor | None, heads: int
) -> bool:
    """Whether the inputs are batched (3-d) or one unbatched sequence (2-d), checked as torch checks them."""
    dims = query.dim()
    if dims not in (2, 3):
        raise AssertionError(f"query should be unbatched 2D or batched 3D tensor but received {dims}-D query tensor")
    kind = "batched (3-D)" if dims == 3 else "unbatched (2-D)"
    if key.dim() != dims or value.dim() != dims:
        raise AssertionError(
            f"For {kind} `query`, expected `key` and `value` to be {dims}-D but found {key.dim()}-D and "
            f"{value.dim()}-D tensors respectively"
        )
    if key_padding_mask is not None and key_padding_mask.dim() != dims - 1:
        raise AssertionError(
            f"For {kind} `query`, expected `key_padding_mask` to be `None` or {dims - 1}-D but found "
            f"{key_padding_mask.dim()}-D tensor instead"
        )
    if attn_mask is not None:
        if attn_mask.dim() not in (2, 3):
            raise AssertionError(
                f"For {kind} `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found {attn_mask.dim()}-D "
                "tensor instead"
            )
        expected = (heads, query.shape[0], key.shape[0])
        if dims == 2 and attn_mask.dim() == 3 and attn_mask.shape != expected:
            raise AssertionError(f"Expected `attn_mask` shape to be {expected} but got {attn_mask.shape}")
    return dims == 3
