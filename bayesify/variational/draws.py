"""The factors' draws: of one forward pass for the whole model (:class:`ModelDraws`, :class:`PassDraws`), and
of one layer call (:class:`Draw`, the one routing record a layer sees).

The router decides which component every row goes through (``bayesify/_router.py``); this module draws the
tables for those rows. At the start of every routed pass (the root's pre-hook: outside any checkpointed region,
so a recomputation in the backward pass takes the very same values; a reentrant one makes them again from the
layers' Parameters and the pass's random numbers, :meth:`ModelDraws._again`) :meth:`ModelDraws.begin` draws every group of
tables (:mod:`bayesify.variational.store`) in one go: a value per block (BLOCKS) and per row (ROWS), so that
the draws and the random numbers they use do not depend on which layers ask for which. Then it takes the tables
out as the layers took them in passes like this one (columns and broadcast shapes, learnt from their requests),
so a layer's values are ready-made views. A layer's call gets a :class:`Draw` from the router (its rows) and
takes its values through it (:meth:`Draw.sample`, :meth:`Draw.gather`), from the pass's draws where it can.

A group whose tables cannot be joined at the start of the pass (FSDP2 shards them until each block's forward)
draws only its random numbers there; each layer then makes its values from its own tables and its columns of
them (:meth:`~bayesify.variational.store.TableGroup.draw_one`): the same draws by another path.

Every dict here is keyed by the groups' numbers (``group.key``), not by the groups: older dynamo (torch 2.9)
breaks the graph on a user object as a dict key.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from bayesify.mixture import block_rows, row_shape
from bayesify.variational import distributions
from bayesify.variational.factor import Rank1Factor, sample_factors

__all__ = ["Block", "Draw", "ModelDraws", "PassDraws"]

BLOCKS, ROWS = "blocks", "rows"  # a value per block of rows, or per row (``per``)

Block = tuple[int, int]
"""``(start, stop)``: rows ``start:stop`` of a batch all go through one component.

Only the boundaries are Python numbers; which component a block goes through is a tensor
(``block_components``), so that a random order of the components needs no ``.tolist()`` (a graph
break under ``torch.compile``) and an exported graph keeps it symbolic."""


@dataclass
class PassDraws:
    """What one forward pass drew, and for which rows.

    ``full``: every table of a group, ``{(group number, per): [m, total]}``; ``taken``: the tables taken out of
    them as the layers take them, ``{(group number, per, like): {slot: values}}``; ``joined``: the groups' tables
    joined for this pass, ``{(group number, "loc" / "rho"): [K, total] or None}``; ``eps``: the random numbers
    of a group not joined this pass, ``{(group number, per): [m, total]}``.
    """

    source: "ModelDraws"  # the model's groups and learnt takes (what take() asks)
    noise: bool  # sample (else the posterior means)
    rows: Tensor  # the component of every row
    blocks: tuple[Block, ...] | None  # contiguous runs of rows of one component, covering the rows (None: no blocks)
    block_components: Tensor | None  # the component of every block
    every_component: bool  # the blocks are the K components in order: a value per block is the table itself
    signature: tuple  # passes alike draw alike (what ModelDraws learns the layers' requests by)
    full: dict = field(default_factory=dict)
    taken: dict = field(default_factory=dict)
    joined: dict = field(default_factory=dict)
    eps: dict = field(default_factory=dict)
    learnt: bool = False  # a layer asked for a table the model had not learnt it takes (ModelDraws.end)

    def components(self, per: str) -> Tensor | None:
        """The component of each value drawn ``per`` row or block: each row's, each block's, or None for the tables in
        order."""
        if per == ROWS:
            return self.rows
        return None if self.every_component else self.block_components

    def take(self, group: Any, slot: int, per: str, like: tuple | None = None, again: bool = False) -> Tensor | None:
        """Table ``slot`` of ``group`` as drawn for this pass (:meth:`ModelDraws.take`)."""
        return self.source.take(self, group, slot, per, like, again)


@dataclass
class ModelDraws:
    """A converted model's groups of tables (``convert`` sets them) and how its layers take their draws.

    ``needs`` ``{signature: {(per, like): {group number: {slot, ...}}}}`` is learnt from the layers' requests:
    a table first asked for is sliced out for its layer alone, and taken ahead from then on.
    """

    components: int
    groups: list = field(default_factory=list)
    needs: dict = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["needs"] = {}  # learnt again (a traced graph's requests are not state)
        return state

    def begin(
        self, noise: bool, rows: Tensor, blocks: tuple | None, block_components: Tensor | None, fixed: tuple | None, signature: tuple
    ) -> PassDraws:
        """Draw every table of the model for a pass routing ``rows`` (in ``blocks`` of ``block_components``, when
        they run so; ``fixed`` the blocks' components when the route fixes them), then take them out as the layers
        took them before."""
        every = fixed == tuple(range(self.components))
        draws = PassDraws(self, noise, rows, blocks, block_components, every, signature)
        scales: dict = {}  # group number: its posterior scale, shared by the draws per block and per row
        last = None  # the pass's last noise drawn: each draw follows it (a compiled graph then draws in this order)
        # a traced pass (torch.compile, torch.export; its batch may be symbolic) neither learns nor takes ahead
        needs = {} if torch.compiler.is_compiling() else self.needs.get(signature, {})
        for per in (BLOCKS, ROWS):
            if per == BLOCKS and block_components is None:
                continue
            if per == ROWS and not noise and not any(k == ROWS for k, _ in needs):
                # no noise, no random numbers to keep in step: a value per row ([K*B, total] in a mixture
                # evaluation) only once a layer has asked for one; until then it gathers its own
                continue
            components, blocks = draws.components(per), None
            count = self.components if components is None else components.shape[0]  # values drawn: rows or blocks
            if per == ROWS and torch.compiler.is_compiling() and _static(draws.blocks):
                # in a graph a row's value is its block's, expanded (block_rows: fused, where a gather per row is
                # a GEMM each way); eagerly one gather per row is fewer ops
                components, blocks = draws.block_components, draws.blocks
            for group in self.groups:
                if per == BLOCKS and not (noise and group.sampled):
                    continue  # no random numbers to keep in step: gathered when a layer asks (_full)
                loc = self._joined(draws, group, "loc")
                if loc is None:  # not joined this pass: only the random numbers now (the module doc)
                    if noise and group.sampled:
                        last = draws.eps[(group.key, per)] = group.noise(count, last)
                    continue
                scale = eps = None
                if noise and group.sampled:
                    if group.key not in scales:
                        rho = self._joined(draws, group, "rho")
                        scales[group.key] = None if rho is None else distributions.scale(rho)
                    scale = scales[group.key]
                    if scale is None:
                        continue
                    # kept for the pass: a recomputation in the backward pass makes a layer's values again from them
                    eps = last = draws.eps[(group.key, per)] = group.noise(count, last)
                full = group.draw_all(loc, components, noise, scale, blocks, eps)
                if torch.compiler.is_compiling():
                    # split here, in the root's pre-hook (a graph of its own under torch.compile(model)): the
                    # forward graph then gets each table's piece as an input of its own, read at offset 0, and
                    # inductor writes one kernel for the layers of a repeated block (a slice at an offset of its
                    # own in the forward graph is a kernel per layer: a ViT-tiny step compiled 88 kernels, not 34).
                    # The whole is not kept: an output of that graph, it would get a zero-filled gradient.
                    draws.taken[(group.key, per, None)] = _own_pieces(group.take(full))
                else:
                    draws.full[(group.key, per)] = full
        # what the layers took in passes like this one, taken ahead (never in a graph: learning would recompile it)
        for (per, like), groups in needs.items():
            for key, slots in groups.items():
                full = self._full(draws, key, per)
                if full is not None:
                    draws.taken[(key, per, like)] = self.groups[key].take(full, sorted(slots), like)
        return draws

    def take(
        self, draws: PassDraws, group: Any, slot: int, per: str, like: tuple | None = None, again: bool = False
    ) -> Tensor | None:
        """Table ``slot`` of ``group`` as drawn for the pass (``per``: BLOCKS or ROWS; ``like``: the shape to
        take it in, see :meth:`~bayesify.variational.store.TableGroup.take`, if it was taken so ahead),
        ``[m, features]`` otherwise; None where the layer draws its own (not one of this model's groups, or a
        value per row without noise not drawn for this pass). ``again``: for a layer run again in the backward
        pass (:meth:`_again`)."""
        if again:
            return self._again(draws, group, slot, per, like)
        traced = torch.compiler.is_compiling()
        # in a traced pass the group's tables come as they are ([m, features]: ``like`` is for the eager takes ahead),
        # split from the group once for the pass: its backward is one cat. Each slice's backward would be a
        # zero-padded copy of the whole group, and inductor sums them element by element (a test per table per
        # element: 93 of a ViT-tiny step's 220 ms on the CPU)
        values = draws.taken.get((group.key, per, None if traced else like))
        if values is not None and slot in values:
            return values[slot]
        if group.key >= len(self.groups) or self.groups[group.key] is not group:
            return None
        if traced:
            full = self._full(draws, group.key, per)
            if full is not None:  # (in the forward graph itself: its pieces stay views, no graph boundary)
                pieces = draws.taken[(group.key, per, None)] = group.take(full)
                return pieces[slot]
        else:
            shapes = self.needs.setdefault(draws.signature, {})
            slots = shapes.setdefault((per, like), {}).setdefault(group.key, set())
            draws.learnt = draws.learnt or slot not in slots
            slots.add(slot)
        full = self._full(draws, group.key, per)
        if full is not None:
            start = group.starts[slot]
            return full[:, start : start + group.sizes[slot]]
        eps = draws.eps.get((group.key, per))
        if eps is not None:  # this table's values from its own Parameters and its columns of the pass's noise
            return group.draw_one(slot, draws.components(per), eps)
        return None

    def end(self, draws: PassDraws) -> None:
        """After a pass in which a layer first asked for a table: make now what the next pass takes it with (the
        index of the columns a group's layers take), so that from the second pass on every pass runs the same ops
        and none makes a tensor from host data (a CUDA graph can capture after one warm-up pass)."""
        if not draws.learnt:
            return
        for groups in self.needs.get(draws.signature, {}).values():
            for key, slots in groups.items():
                group = self.groups[key]
                if len(slots) < len(group.sizes):
                    group.columns_of(tuple(sorted(slots)), group.table(min(slots)).device)

    def _again(self, draws: PassDraws, group: Any, slot: int, per: str, like: tuple | None) -> Tensor | None:
        """A layer's values for a recomputation in the backward pass (activation checkpointing): the pass's very
        values, made again from the layer's own Parameters and the pass's random numbers, in a graph of their own.
        Reentrant checkpointing backpropagates through the recomputation alone, which must not reach the pass's
        draws (they are in the outer graph: a second backward through them fails); None where the pass drew no
        random numbers for the table (the layer then takes its own posterior means or offsets: the same values)."""
        eps = draws.eps.get((group.key, per))
        if eps is None or group.key >= len(self.groups) or self.groups[group.key] is not group:
            return None
        value = group.draw_one(slot, draws.components(per), eps)
        return value if like is None else value.view(row_shape(value.shape[0], value.shape[1], *like))

    def _full(self, draws: PassDraws, key: int, per: str) -> Tensor | None:
        """Group ``key``'s values ``per`` block or row for the pass: as drawn ahead, or (a value per block that takes no
        random numbers: bias offsets, or the posterior means) gathered now, once, as the first layer asks."""
        full = draws.full.get((key, per))
        group = self.groups[key]
        if full is None and per == BLOCKS and draws.block_components is not None and not (draws.noise and group.sampled):
            # made inside the call of the first layer that asks: in a region a non-reentrant checkpoint recomputes,
            # what it saves is not the region's (its recomputation finds it made, and must save what the forward
            # did), so it saves under hooks of its own, on top of the checkpoint's
            with torch.autograd.graph.saved_tensors_hooks(_same, _same) if saved_tensors_hooked() else contextlib.nullcontext():
                loc = self._joined(draws, group, "loc")
                if loc is None:
                    return None
                full = draws.full[(key, per)] = group.draw_all(loc, draws.components(per), False)
        return full

    @staticmethod
    def _joined(draws: PassDraws, group: Any, name: str) -> Tensor | None:
        """``group``'s tables joined for this pass (:meth:`~bayesify.variational.store.TableGroup.joined`), once."""
        key = (group.key, name)
        if key not in draws.joined:
            draws.joined[key] = group.joined(name)
        return draws.joined[key]


class Draw(NamedTuple):
    """How one call of a layer is routed, and its values: the component of each row, whether to sample, the
    rows' blocks of one component each (when they run so; see :class:`bayesify.Sampling`). The router makes it
    (``Router.route``, by keyword), the layer takes its factors' values through it. A named tuple, not a
    dataclass: Dynamo traces its constructor in a few lines (a frozen dataclass made from a dict of options was
    ~75 a layer call, a twelfth of what a compiled ViT traced of bayesify).

    Inside a routed forward pass the values come from the pass's draws (:class:`PassDraws`, made for the whole
    model ahead of the pass, a group of tables at a time: :mod:`bayesify.variational.store`); taking them costs no
    op once the model has learnt how the layer takes them (the first pass slices them out). Outside a routed
    pass, or for a table in no group drawn ahead, the layer draws its own.

    Example:
        >>> draw = self.rank1_draw(x.shape[0], x.device)
        >>> s = draw.sample(self.rank1_s)          # [n, in_features], one vector per row
        >>> offset = draw.gather("rank1_bias")     # [n, out_features], the bias offset of each row's component
    """

    rows: Tensor  # [n] the component of each row
    noise: bool  # sample the factors (else their posterior means)
    blocks: tuple[Block, ...] | None = None  # contiguous runs of rows of one component, when the rows run so
    block_components: Tensor | None = None  # [len(blocks)] their components, on the rows' device
    fixed_components: tuple[int, ...] | None = None  # the blocks' components as ints, when the route fixes them
    per_block: bool = False  # one sample per block on the per-row path too (sampling='component')
    layer: Any = None  # the ConvertedLayer drawing (its bias offsets by name)
    draws: PassDraws | None = None  # the routed pass's draws, made ahead of it
    repeat: int = 1  # rows of this call per routed row: extra axes folded into the batch repeat each row's
    first_only: bool = False  # a batch-independent call: every row takes the pass's first row's component
    recompute: bool = False  # a layer run again in the backward pass (activation checkpointing)

    def sample(self, *factors: Rank1Factor, like: tuple[int, int, int] | None = None) -> Tensor | list[Tensor]:
        """One value of each factor per row, ``[n, features]``, from each row's component (a list for
        several factors, drawn together).

        ``like=(ndim, batch_axis, channel_axis)`` asks for the values in the shape that broadcasts
        against an activation of that layout (``[n, features, 1, 1]`` for a 2-d convolution's input) where
        they come so from the draw ahead, saving the layer a view per factor; they may also come as
        ``[n, features]``, so take either (:func:`~bayesify.layers.rank1_op.rank1_affine` does).
        """
        if self.per_block and self.blocks is not None:
            values = [block_rows(v, self.blocks) for v in self._blocks(factors)]
        else:
            values = self._ahead([f.__dict__.get("rank1_slot") for f in factors], ROWS, like)
            if values is None and torch.compiler.is_compiling() and _static(self.blocks):  # (as ModelDraws.begin's)
                values = sample_factors(factors, self.block_components, self.noise, self.blocks)
            elif values is None:
                values = sample_factors(factors, self.rows, self.noise)
        return values[0] if len(factors) == 1 else values

    def sample_blocks(self, *factors: Rank1Factor) -> Tensor | list[Tensor]:
        """One value of each factor per block, ``[len(blocks), features]`` (a list for several factors)."""
        values = self._blocks(factors)
        return values[0] if len(factors) == 1 else values

    def _blocks(self, factors: tuple[Rank1Factor, ...]) -> list[Tensor]:
        assert self.block_components is not None, "per-block samples need blocked rows"
        values = self._ahead([f.__dict__.get("rank1_slot") for f in factors], BLOCKS)
        return sample_factors(factors, self.block_components, self.noise) if values is None else values

    def gather(self, table: Tensor | str, like: tuple[int, int, int] | None = None) -> Tensor | None:
        """Row ``k`` of a ``[K, ...]`` per-component table for each row: ``[n, ...]``. ``table`` is a tensor,
        or the name of one of the layer's bias offsets (None if the layer has none of that name); ``like``
        as for :meth:`sample`."""
        drawn, own = self._table(table, ROWS, like)
        return drawn if own is None else own[self.rows]

    def gather_blocks(self, table: Tensor | str) -> Tensor | None:
        """Row ``k`` of a ``[K, ...]`` per-component table for each block (``table`` as for :meth:`gather`)."""
        assert self.block_components is not None, "gather_blocks() needs blocked rows"
        drawn, own = self._table(table, BLOCKS)
        return drawn if own is None else own[self.block_components]

    def _table(self, table: Tensor | str, per: str, like: tuple | None = None) -> tuple[Tensor | None, Tensor | None]:
        """``(its values drawn ahead, None)``, or ``(None, the table to gather from)``; ``(None, None)``: the layer
        has no bias offset of that name."""
        if not isinstance(table, str):
            return None, table
        slot = self.layer.rank1_state.packed.get(table)
        values = None if slot is None else self._ahead([slot], per, like)
        return (None, getattr(self.layer, table)) if values is None else (values[0], None)

    def _ahead(self, slots: list, per: str, like: tuple | None = None) -> list[Tensor] | None:
        """The values drawn ahead for these ``(group, slot)`` s, shaped for this call's rows; None if any was not."""
        if self.draws is None or self.layer is None:
            return None
        for slot in slots:  # (loops, not any() of a generator: Dynamo traces this for every layer call)
            if slot is None:
                return None
        if like is not None and not torch.compiler.is_compiling():  # (a traced pass takes no values shaped ahead)
            ndim, batch_axis, channel_axis = like
            like = (ndim, batch_axis % ndim, channel_axis % ndim)
            if self.repeat != 1 or self.first_only or per != ROWS or like[1] >= like[2]:
                like = None  # only the routed rows themselves, with the batch before the channels, come shaped
        values = [self.draws.take(group, index, per, like, again=self.recompute) for group, index in slots]
        for value in values:
            if value is None:
                return None
        if self.first_only:  # a batch-independent call: its rows all take the first row's (or block's) values
            return [v[:1] if per == BLOCKS else v[:1].expand(self.rows.shape[0], -1) for v in values]
        if self.repeat == 1 or per == BLOCKS:
            return values
        return [v.unsqueeze(1).expand(-1, self.repeat, -1).reshape(-1, v.shape[-1]) for v in values]


def _static(blocks: tuple[Block, ...] | None) -> bool:
    """Blocks whose sizes are plain numbers (an exported graph's batch may be symbolic: then a gather per row)."""
    # (len, not bool(): torch 2.9's Dynamo traces no bool() of a tuple)
    return blocks is not None and len(blocks) > 0 and all(type(a) is int and type(b) is int for a, b in blocks)


def saved_tensors_hooked() -> bool:
    """Whether a saved-tensors hook is in force (outside a compiled graph): a non-reentrant checkpoint's forward
    and recomputation run under one."""
    return not torch.compiler.is_compiling() and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _same(t: Tensor) -> Tensor:
    return t


def _own_pieces(pieces: dict[int, Tensor]) -> dict[int, Tensor]:
    """A compiled pass's pieces of a group, each in memory of its own: a column slice of the joined group, handed
    from the root's pre-hook graph to the forward graph, would have its gradient copied back into the slice's
    strides, one copy per table (AOTAutograd keeps a tangent in its output's layout: 147 copies in a ViT-tiny step)."""
    return {slot: piece.contiguous() for slot, piece in pieces.items()}
