"""Rank-1 recurrent layers: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and the cells ``nn.LSTMCell``,
``nn.GRUCell``, ``nn.RNNCell`` (and subclasses of any of them).

As the reference ``LSTMCellRank1``, every layer and direction gets separate rank-1 factors on
its input kernel (``s_ih``: input size, ``r_ih``: gates) and its recurrent kernel (``s_hh``:
hidden or projection size, ``r_hh``: gates), plus per-component bias offsets:

    gates_t = ((x_t o s_ih) W_ih^T) o r_ih + ((h_{t-1} o s_hh) W_hh^T) o r_hh + b_ih + b_hh + delta_k

An LSTM with ``proj_size`` also gets factors on its projection ``W_hr`` (``s_hr``: hidden,
``r_hr``: proj size; the reference has no projection). For a GRU the recurrent bias stays on
the recurrent side (``r o (W_hn h + b_hn)``), so it gets its own offsets (``rank1_bias_hh*``).
The original weights and biases (``weight_ih_l0``, ``weight_hh_l0_reverse``, ...) are shared.

Samples are drawn once per example and held across all time steps: once per forward pass of
the converted model, so a model that steps a cell (or an ``nn.LSTM``) in its own loop keeps the
same weights for the whole sequence. The input projection of all time steps is one matmul
per layer and direction; the recurrence runs in :class:`~bayesify.layers._scan.RecurrentScan`
with a hand-written backward pass.

Where the batch lies is read from the layer (``batch_first``, unbatched 2-D input,
``PackedSequence``), not from ``convert(batch_dim=...)``. For a ``PackedSequence`` the samples of
example ``i`` follow it through ``sorted_indices``.

As the reference LSTM (and unlike its dense and convolutional layers), samples are not clipped
to ``[-clip, clip]``. Deviation from the reference: its per-component biases are full copies;
here ``b_k = b + delta_k`` with the original bias shared (the same family of functions).

References:
    Dusenberry et al., ICML 2020, Sec. 3 and App. (MIMIC-III LSTM); edward2 ``LSTMCellRank1``.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten

from bayesify._autograd import plain_ops
from bayesify.config import LayerOptions
from bayesify.layers._scan import RecurrentScan, reference_scan, row_positions
from bayesify.layers.base import Rank1Layer
from bayesify.layers.folded import fold_weight
from bayesify.layers.rank1_op import rank1_affine
from bayesify.options import Perturbation

__all__ = ["Rank1RNN", "Rank1RNNCell"]

_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


class _Rank1Recurrent(Rank1Layer):
    """What recurrent modules and cells share: factors per kernel, cached draws, input projection."""

    _rank1_mode: str

    # ---- set-up ---------------------------------------------------------------------------

    def _rank1_add_kernels(self, tag: str, options: LayerOptions) -> None:
        """Factors (and bias offsets) of the kernels ``weight_ih{tag}``, ``weight_hh{tag}``, ``weight_hr{tag}``."""
        params = self._parameters
        w_ih, w_hh, w_hr = params[f"weight_ih{tag}"], params[f"weight_hh{tag}"], params.get(f"weight_hr{tag}")
        unclipped = options.replace(clip=None)  # the reference LSTMCellRank1 does not clip its samples
        for kernel, weight in (("ih", w_ih), ("hh", w_hh), ("hr", w_hr)):
            if weight is None:
                continue
            setattr(self, f"rank1_s_{kernel}{tag}", self.rank1_factor(weight.shape[1], unclipped))
            setattr(self, f"rank1_r_{kernel}{tag}", self.rank1_factor(weight.shape[0], unclipped))
        gates = w_ih.shape[0]
        if self._rank1_mode == "GRU":  # the recurrent bias stays on the recurrent side: offsets of its own
            self.rank1_bias_offset(f"rank1_bias_ih{tag}", gates, f"bias_ih{tag}")
            self.rank1_bias_offset(f"rank1_bias_hh{tag}", gates, f"bias_hh{tag}")
        else:  # LSTM / RNN: both biases are added to the gates, one offset for their sum
            self.rank1_bias_offset(f"rank1_bias_ih{tag}", gates, f"bias_ih{tag}", f"bias_hh{tag}")

    def _rank1_tags(self) -> list[str]:
        """The suffixes of this layer's kernels (``_l0``, ``_l1_reverse``, ...; ``""`` for a cell)."""
        return [""]

    def rank1_merge(self, component: int) -> dict[str, Tensor]:
        """Every kernel ``W' = W o (r_k s_k^T)`` (``weight_ih``, ``weight_hh``, ``weight_hr``) and
        ``b_ih' = b_ih + delta_k`` (a GRU's ``b_hh' = b_hh + delta_hh_k``: its recurrent bias sits inside
        ``r o (W_hn h + b_hn)``). Additive: the gates' shift ``W_ih s_ih + r_ih + W_hh s_hh + r_hh`` goes
        into the biases (a GRU's recurrent part into ``b_hh``); refused with a projection (it has no bias)."""
        merged: dict[str, Tensor] = {}
        for tag in self._rank1_tags():
            merged.update(self._rank1_merge_kernels(tag, component))
        return merged

    def _rank1_merge_kernels(self, tag: str, component: int) -> dict[str, Tensor]:
        params, at = self._parameters, partial(self.rank1_location, component=component)
        gru = self._rank1_mode == "GRU"
        b_ih, b_hh = params.get(f"bias_ih{tag}"), params.get(f"bias_hh{tag}")
        delta_ih = at(f"rank1_bias_ih{tag}")
        delta_hh = at(f"rank1_bias_hh{tag}") if gru else None
        merged: dict[str, Tensor] = {}
        if self._rank1_additive:
            name = type(self).__rank1_base__.__name__
            if params.get(f"weight_hr{tag}") is not None:
                raise ValueError(
                    f"the additive perturbation shifts the projection of {name} (proj_size > 0) by W_hr s_hr + r_hr, "
                    "and the projection has no bias to hold it"
                )
            if b_ih is None or b_hh is None:
                raise ValueError(
                    f"the additive perturbation shifts the gates of {name}, which has no biases (bias=False) to hold it"
                )
            shift_ih = F.linear(at(f"rank1_s_ih{tag}"), params[f"weight_ih{tag}"]) + at(f"rank1_r_ih{tag}")
            shift_hh = F.linear(at(f"rank1_s_hh{tag}"), params[f"weight_hh{tag}"]) + at(f"rank1_r_hh{tag}")
            if gru:
                merged[f"bias_ih{tag}"] = b_ih + shift_ih + delta_ih
                merged[f"bias_hh{tag}"] = b_hh + shift_hh + delta_hh
            else:
                merged[f"bias_ih{tag}"] = b_ih + shift_ih + shift_hh + delta_ih
            return merged
        for kernel in ("ih", "hh", "hr"):
            weight = params.get(f"weight_{kernel}{tag}")
            if weight is not None:
                r, s = at(f"rank1_r_{kernel}{tag}"), at(f"rank1_s_{kernel}{tag}")
                merged[f"weight_{kernel}{tag}"] = fold_weight(weight, r, s)
        if b_ih is not None:
            merged[f"bias_ih{tag}"] = b_ih + delta_ih  # LSTM / RNN: the offset of b_ih + b_hh, held by b_ih
        if gru and b_hh is not None:
            merged[f"bias_hh{tag}"] = b_hh + delta_hh
        return merged

    # ---- per-forward samples ----------------------------------------------------------------

    def _rank1_draws(self, n: int, device: torch.device) -> dict[str, Tensor]:
        """Every factor sampled for ``n`` examples, and the bias offsets of their components.

        Within one forward pass of the converted model the same draws are returned for the same
        ``n``, so samples stay fixed across time steps and repeated calls (the reference draws
        once per sequence).
        """
        state = self.rank1_state
        router = state.model.router
        draw = self.rank1_draw(n, device)
        cache = state.cache
        key = (n if isinstance(n, int) else str(n), draw.noise, device)  # (a symbolic size, exported: its expression)
        if router.active and cache is not None and cache[0] is router.state and key in cache[1]:
            return cache[1][key]
        draws = {name: draw.sample(factor) for name, factor in self.rank1_factors()}
        for name in state.bias_offsets:
            offset = draw.gather(name)
            if offset is not None:
                draws[name] = offset
        if router.active:
            if cache is None or cache[0] is not router.state:  # (the pass, not its rows: tiled rows are kept across passes)
                cache = (router.state, {})
                state.cache = cache
            cache[1][key] = draws
        return draws

    def _rank1_check_time_axis(self, steps: int, batch: int, shape: tuple[int, ...]) -> None:
        """Refuse a call whose time steps are the pass's rows: the pass took its batch where this layer keeps time
        (a time-major model left at batch_dim=0: evaluation ran one sequence K x T long, each member starting from
        the last one's state, and training mixed the members), silently before."""
        router = self.rank1_state.model.router
        state = router.state
        if not router.active or state is None or state.axis is None:
            return
        rows = state.rows.shape[0]
        if steps != rows or batch % rows == 0:
            # (m x B rows, each example's m in a run: a word RNN over every sentence of each example, a column RNN
            # over an image's rows, whose length is the batch by chance, routes as documented)
            return
        hint = router.batch_dim_hint(batch)
        raise ValueError(
            f"{router.layer_name(self)} (batch_first={self.batch_first}) got an input of shape {shape} whose "
            f"{steps} time steps are the pass's rows (its batch: {batch}): bayesify took the model's batch where this "
            "layer keeps time." + (hint or " Convert with the batch_dim where the model's input holds its batch "
            "(a time-major model: batch_dim=1).")
        )

    def _rank1_untile_layers(self, state: Tensor, count: int, batch: int) -> Tensor:
        """A state ``[layers x directions, B, H]`` that the root's tiling repeated at dimension 0, where it holds its
        layers (an ``h0`` given to a batch-first model whose layers happen to number its batch: ``[K x L, B, H]``):
        its first copy, which this layer then tiles at its batch (every copy is the same)."""
        tiles = self.rank1_state.model.router.tiles
        # (its batch as given, or already each member's: a state carried from a tiled pass, [L, K x B, H])
        if tiles > 1 and state.shape[0] == count * tiles and state.shape[1] in (batch, batch // tiles):
            return state[:count]
        return state

    def _rank1_tile_state(self, state: Tensor, batch: int, dim: int) -> Tensor:
        """An initial state given for the B examples of a tiled (K x B) batch: the same for every member."""
        tiles = self.rank1_state.model.router.tiles
        size = state.shape[dim]
        if size != batch and tiles > 1 and size * tiles == batch:
            return torch.cat([state] * tiles, dim)
        return state

    # ---- maths ------------------------------------------------------------------------------

    @property
    def _rank1_additive(self) -> bool:
        return self.rank1_options.perturbation is Perturbation.ADDITIVE

    def _rank1_input_gates(self, x: Tensor, tag: str, draws: dict[str, Tensor], steps: int, pos: Tensor | None) -> Tensor:
        """``[N, G]`` input projections of every time step (one matmul), biases included.

        ``x`` is ``[N, F]`` in time-major packed order; ``pos`` the batch position of every row
        (None: uniform ``[steps, B]`` layout).
        """
        params, additive, mode = self._parameters, self._rank1_additive, self._rank1_mode
        batch = draws[f"rank1_s_ih{tag}"].shape[0]

        def per_row(v: Tensor) -> Tensor:  # [B, F] -> one per row of the layout below
            return v if pos is None else v.index_select(0, pos)

        # uniform layout: [steps, B, F], batch at axis 1; packed: [N, F] rows, factors gathered per row
        rows = x.view(steps, batch, x.shape[-1]) if pos is None else x
        offset: Tensor | None = params.get(f"bias_ih{tag}")
        if offset is not None:
            if mode != "GRU":  # GRU keeps b_hh on the recurrent side (inside r o (...))
                offset = offset + params[f"bias_hh{tag}"]
            offset = offset + per_row(draws[f"rank1_bias_ih{tag}"])
        if additive and mode != "GRU":  # the recurrent r_hh is a constant shift of the gates: added here once
            r_hh = per_row(draws[f"rank1_r_hh{tag}"])
            offset = r_hh if offset is None else offset + r_hh
        out = rank1_affine(
            rows,
            lambda v: F.linear(v, params[f"weight_ih{tag}"]),
            per_row(draws[f"rank1_s_ih{tag}"]),
            per_row(draws[f"rank1_r_ih{tag}"]),
            offset,
            additive=additive,
            batch_axis=1 if pos is None else 0,
            channel_axis=-1,
        )
        return out.reshape(x.shape[0], out.shape[-1])

    def _rank1_scan(
        self,
        xi: Tensor,
        h0: Tensor,
        c0: Tensor | None,
        tag: str,
        draws: dict[str, Tensor],
        batch_sizes: list[int],
        reverse: bool,
    ) -> tuple[Tensor, ...]:
        params, additive, mode = self._parameters, self._rank1_additive, self._rank1_mode
        r_h = None if additive else draws[f"rank1_r_hh{tag}"]
        b_h = None
        if mode == "GRU":
            b_hh = params.get(f"bias_hh{tag}")
            parts = [] if b_hh is None else [b_hh.unsqueeze(0), draws[f"rank1_bias_hh{tag}"]]
            if additive:
                parts.append(draws[f"rank1_r_hh{tag}"])
            if parts:
                b_h = parts[-1]
                for part in parts[:-1]:
                    b_h = b_h + part
        w_hr = params.get(f"weight_hr{tag}")
        s_hr = r_hr = None
        if w_hr is not None:
            s_hr, r_hr = draws[f"rank1_s_hr{tag}"], draws[f"rank1_r_hr{tag}"]
        tensors = [xi, h0, c0, params[f"weight_hh{tag}"], draws[f"rank1_s_hh{tag}"], r_h, b_h, w_hr, s_hr, r_hr]
        # under autocast the input projection comes in the lower precision: the recurrence runs in it too (as torch's
        # own nn.LSTM does), every tensor cast to it, with autocast off (the scan writes into buffers with out=,
        # which autocast does not cast)
        dtype = xi.dtype
        tensors = [t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != dtype else t for t in tensors]
        device = xi.device.type
        autocast = device in ("cpu", "cuda") and torch.is_autocast_enabled(device)
        # (torch.func's transforms and forward-mode AD run the recurrence in autograd's ops: the Function has no
        # rules for them; a traced graph keeps the Function, whose one node per layer compiles faster than a loop)
        scan = reference_scan if plain_ops() and not torch.compiler.is_compiling() else RecurrentScan.apply
        with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
            return scan(*tensors, mode, batch_sizes, reverse, additive)

    # ---- a recurrent layer used as the model: where the batch lies (see _routing.py) -------------

    def _rank1_io_axes(self, x: Any) -> tuple[int, int]:
        """``(axis of the input's batch, axis of the states' batch)``; for an unbatched input, where
        torch itself inserts the batch axis."""
        raise NotImplementedError

    def rank1_batch_axis(self, x: Any) -> int | None:
        if isinstance(x, PackedSequence):
            return 1  # the states' axis; the sequences themselves are tiled as a PackedSequence
        return self._rank1_io_axes(x)[0] if x.dim() == self._rank1_batched_dim else None

    def rank1_input_axes(self, args: tuple, kwargs: dict) -> list[int | None]:
        leaves, _ = tree_flatten((args, kwargs), is_leaf=lambda v: isinstance(v, PackedSequence))
        x = args[0] if args else kwargs.get("input")
        x_axis, state_axis = self._rank1_io_axes(x)
        return [x_axis if leaf is x else state_axis for leaf in leaves]

    def rank1_output_axes(self, output: Any) -> list[int | None]:
        leaves, _ = tree_flatten(output, is_leaf=lambda v: isinstance(v, PackedSequence))
        first = leaves[0] if leaves else None
        x_axis, state_axis = self._rank1_io_axes(first)
        return [x_axis if i == 0 else state_axis for i in range(len(leaves))]


class Rank1RNN(_Rank1Recurrent):
    """Rank-1 ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``: every option of torch's modules.

    ``num_layers``, ``bidirectional``, ``batch_first``, ``dropout`` between layers (training
    only), LSTM ``proj_size``, ``bias``, an initial state given or not, unbatched 2-D input and
    ``PackedSequence`` input; output and state shapes are torch's. Factors per layer and
    direction are named after the weight they scale: ``rank1_s_ih_l0``, ``rank1_r_hh_l1_reverse``,
    ``rank1_bias_ih_l0``, ...

    Example:
        >>> net = bayesify.convert(nn.Sequential(...nn.LSTM(8, 32, batch_first=True)...))
        >>> out, (h, c) = lstm(x)      # inside: one sample of every factor per example

    References:
        Dusenberry et al., ICML 2020; edward2 ``LSTMCellRank1``.
    """

    @property
    def _rank1_mode(self) -> str:  # type: ignore[override]
        return self.mode

    _rank1_batched_dim = 3

    def _rank1_io_axes(self, x: Any) -> tuple[int, int]:
        if isinstance(x, PackedSequence):
            return 0, 1
        return (0 if self.batch_first else 1), 1

    def _rank1_tags(self) -> list[str]:
        directions = ("", "_reverse") if self.bidirectional else ("",)
        return [f"_l{layer}{suffix}" for layer in range(self.num_layers) for suffix in directions]

    def rank1_setup(self, options: LayerOptions) -> None:
        if self.mode not in _GATES:
            raise TypeError(f"{type(self).__name__} has mode={self.mode!r}; rank-1 supports {sorted(_GATES)}.")
        for tag in self._rank1_tags():
            self._rank1_add_kernels(tag, options)

    def forward(self, input: Tensor | PackedSequence, hx: Any = None) -> tuple[Any, Any]:
        name = type(self).__rank1_base__.__name__
        mode = self.mode
        lstm = mode == "LSTM"
        directions = 2 if self.bidirectional else 1
        width = self.proj_size if getattr(self, "proj_size", 0) > 0 else self.hidden_size
        packed = isinstance(input, PackedSequence)
        if packed:
            x, batch_sizes_t, sorted_indices, unsorted_indices = input
            batch_sizes = [int(b) for b in batch_sizes_t.tolist()]
            batch, steps, unbatched = batch_sizes[0], len(batch_sizes), False
        else:
            if not isinstance(input, Tensor) or input.dim() not in (2, 3):
                got = f"{input.dim()}D" if isinstance(input, Tensor) else type(input).__name__
                raise ValueError(f"{name}: Expected input to be 2D or 3D, got {got} instead")
            unbatched = input.dim() == 2
            seq = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if self.batch_first else input)
            steps, batch = seq.shape[:2]
            if not unbatched:
                self._rank1_check_time_axis(steps, batch, tuple(input.shape))
            batch_sizes = [batch] * steps
            x = seq.reshape(steps * batch, seq.shape[2])
            sorted_indices = unsorted_indices = None
        if x.shape[-1] != self.input_size:
            raise RuntimeError(
                f"input.size(-1) must be equal to input_size. Expected {self.input_size}, got {x.shape[-1]}"
            )
        h0, c0 = self._rank1_initial_state(hx, batch, unbatched, x, sorted_indices, width)

        draws = self._rank1_draws(batch, x.device)
        if sorted_indices is not None:  # per-example samples follow each sequence into sorted order
            draws = {k: v.index_select(0, sorted_indices) for k, v in draws.items()}
        uniform = all(b == batch for b in batch_sizes)
        pos = None if uniform else row_positions(batch_sizes, x.device)

        layer_x = x
        h_n: list[Tensor] = []
        c_n: list[Tensor] = []
        tags = self._rank1_tags()
        for layer in range(self.num_layers):
            outs = []
            for direction in range(directions):
                k = layer * directions + direction
                tag = tags[k]
                xi = self._rank1_input_gates(layer_x, tag, draws, steps, pos)
                result = self._rank1_scan(xi, h0[k], c0[k] if lstm else None, tag, draws, batch_sizes, direction == 1)
                outs.append(result[0])
                h_n.append(result[1])
                if lstm:
                    c_n.append(result[2])
            layer_x = outs[0] if directions == 1 else torch.cat(outs, 1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                layer_x = F.dropout(layer_x, self.dropout, training=True)

        hidden: Any = torch.stack(h_n)
        cell = torch.stack(c_n) if lstm else None
        if unsorted_indices is not None:
            hidden = hidden.index_select(1, unsorted_indices)
            cell = cell.index_select(1, unsorted_indices) if cell is not None else None
        if packed:
            out_packed = PackedSequence(layer_x, batch_sizes_t, sorted_indices, unsorted_indices)
            return out_packed, ((hidden, cell) if lstm else hidden)
        out = layer_x.view(steps, batch, layer_x.shape[-1])
        if unbatched:
            out, hidden = out.squeeze(1), hidden.squeeze(1)
            cell = cell.squeeze(1) if cell is not None else None
        elif self.batch_first:
            out = out.transpose(0, 1).contiguous()
        return out, ((hidden, cell) if lstm else hidden)

    def _rank1_initial_state(
        self, hx: Any, batch: int, unbatched: bool, x: Tensor, sorted_indices: Tensor | None, width: int
    ) -> tuple[Tensor, Tensor | None]:
        lstm = self.mode == "LSTM"
        count = self.num_layers * (2 if self.bidirectional else 1)
        if hx is None:
            h0 = x.new_zeros(count, batch, width)
            return h0, (x.new_zeros(count, batch, self.hidden_size) if lstm else None)
        if lstm:
            if not (isinstance(hx, (tuple, list)) and len(hx) == 2):
                raise TypeError(f"LSTM hx must be a tuple (h_0, c_0) of tensors, got {type(hx).__name__}.")
            states = list(hx)
        else:
            states = [hx]
        want = 2 if unbatched else 3
        if any(s.dim() != want for s in states):
            kind = "unbatched 2-D" if unbatched else "batched 3-D"
            raise RuntimeError(
                f"For {kind} input, hx should also be {want}-D but got {[s.dim() for s in states]}-D tensor(s)"
            )
        if unbatched:
            states = [s.unsqueeze(1) for s in states]
        states = [self._rank1_untile_layers(s, count, batch) for s in states]
        states = [self._rank1_tile_state(s, batch, 1) for s in states]
        if sorted_indices is not None:
            states = [s.index_select(1, sorted_indices) for s in states]
        sizes = [(count, batch, width), (count, batch, self.hidden_size)]
        for i, (s, expected) in enumerate(zip(states, sizes)):
            if tuple(s.shape) != expected:
                which = f"hidden[{i}]" if lstm else "hidden"
                raise RuntimeError(f"Expected {which} size {expected}, got {list(s.shape)}")
        return states[0], (states[1] if lstm else None)


class Rank1RNNCell(_Rank1Recurrent):
    """Rank-1 ``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell``, batched ``[B, F]`` or unbatched ``[F]``.

    One call is one time step. Samples are drawn once per forward pass of the converted model
    and reused by every call in it, so a model that loops over time steps keeps one sample per
    example for the whole sequence (as the reference ``LSTMCellRank1`` inside an RNN layer). A
    converted cell called on its own (it is the root) draws afresh at every call; use
    ``bayesify.mode(model, noise=False)`` or loop inside a module to hold samples.

    References:
        Dusenberry et al., ICML 2020; edward2 ``LSTMCellRank1``.
    """

    @property
    def _rank1_mode(self) -> str:  # type: ignore[override]
        if isinstance(self, nn.LSTMCell):
            return "LSTM"
        if isinstance(self, nn.GRUCell):
            return "GRU"
        return "RNN_RELU" if self.nonlinearity == "relu" else "RNN_TANH"

    _rank1_batched_dim = 2

    def _rank1_io_axes(self, x: Any) -> tuple[int, int]:
        return 0, 0

    def rank1_setup(self, options: LayerOptions) -> None:
        if isinstance(self, nn.RNNCell) and self.nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNNCell nonlinearity={self.nonlinearity!r} is not 'tanh' or 'relu'.")
        self._rank1_add_kernels("", options)

    def forward(self, input: Tensor, hx: Any = None) -> Any:
        name = type(self).__rank1_base__.__name__
        lstm = self._rank1_mode == "LSTM"
        if input.dim() not in (1, 2):
            raise ValueError(f"{name}: Expected input to be 1D or 2D, got {input.dim()}D instead")
        batched = input.dim() == 2
        x = input if batched else input.unsqueeze(0)
        batch = x.shape[0]
        if hx is None:
            # two tensors, not one twice (an input given twice to the scan is a torch.compile graph break)
            states = [x.new_zeros(batch, self.hidden_size) for _ in range(2 if lstm else 1)]
        else:
            states = list(hx) if lstm else [hx]
            for i, s in enumerate(states):
                if s.dim() not in (1, 2):
                    which = f"hx[{i}]" if lstm else "hidden"
                    raise ValueError(f"{name}: Expected {which} to be 1D or 2D, got {s.dim()}D instead")
            states = [s if batched else s.unsqueeze(0) for s in states]
            states = [self._rank1_tile_state(s, batch, 0) for s in states]
        if x.shape[1] != self.input_size:
            raise RuntimeError(f"input has inconsistent input_size: got {x.shape[1]} expected {self.input_size}")
        draws = self._rank1_draws(batch, x.device)
        xi = self._rank1_input_gates(x, "", draws, 1, None)
        result = self._rank1_scan(xi, states[0], states[1] if lstm else None, "", draws, [batch], False)
        if lstm:
            h, c = result[1], result[2]
            return (h, c) if batched else (h.squeeze(0), c.squeeze(0))
        return result[1] if batched else result[1].squeeze(0)
