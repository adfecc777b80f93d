"""The factors' draws of one forward pass, for the whole model at once: :class:`ModelDraws` and :class:`PassDraws`.

The router decides which component every row goes through (``bayesify/_router.py``); this module draws the
tables for those rows. At the start of every routed pass (the root's pre-hook: outside any checkpointed region,
so a recomputation in the backward pass takes the very same values) :meth:`ModelDraws.begin` draws every group of
tables (:mod:`bayesify.variational.store`) in one go: a value per block ("blocks") and per row ("rows"), so that
the draws and the random numbers they use do not depend on which layers ask for which. Then it takes the tables
out as the layers took them in passes like this one (columns and broadcast shapes, learnt from their requests),
so a layer's values are ready-made views. A layer asks :meth:`ModelDraws.take` for its table.

A group whose tables cannot be joined at the start of the pass (FSDP2 shards them until each block's forward)
draws only its random numbers there; each layer then makes its values from its own tables and its columns of
them (:meth:`~bayesify.variational.store.TableGroup.draw_one`): the same draws by another path.

Every dict here is keyed by the groups' numbers (``group.key``), not by the groups: older dynamo (torch 2.9)
breaks the graph on a user object as a dict key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from bayesify.variational import distributions

__all__ = ["ModelDraws", "PassDraws"]

BLOCKS, ROWS = "blocks", "rows"


@dataclass
class PassDraws:
    """What one forward pass drew, and for which rows.

    ``full``: every table of a group, ``{(group number, kind): [m, total]}``; ``taken``: the tables taken out of
    them as the layers take them, ``{(group number, kind, like): {slot: values}}``; ``joined``: the groups' tables
    joined for this pass, ``{(group number, "loc" / "rho"): [K, total] or None}``; ``eps``: the random numbers
    of a group not joined this pass, ``{(group number, kind): [m, total]}``.
    """

    noise: bool  # sample (else the posterior means)
    rows: Tensor  # the component of every row
    block_components: Tensor | None  # the component of every block (None: the rows run in no blocks)
    every_component: bool  # the blocks are the K components in order: a value per block is the table itself
    signature: tuple  # passes alike draw alike (what ModelDraws learns the layers' requests by)
    full: dict = field(default_factory=dict)
    taken: dict = field(default_factory=dict)
    joined: dict = field(default_factory=dict)
    eps: dict = field(default_factory=dict)

    def components(self, kind: str) -> Tensor | None:
        """The component of each value of ``kind``: each row's, each block's, or None for the tables in order."""
        if kind == ROWS:
            return self.rows
        return None if self.every_component else self.block_components


@dataclass
class ModelDraws:
    """A converted model's groups of tables (``convert`` sets them) and how its layers take their draws.

    ``needs`` ``{signature: {(kind, like): {group number: {slot, ...}}}}`` is learnt from the layers' requests:
    a table first asked for is sliced out for its layer alone, and taken ahead from then on.
    """

    components: int
    groups: list = field(default_factory=list)
    needs: dict = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["needs"] = {}  # learnt again (a traced graph's requests are not state)
        return state

    def begin(self, noise: bool, rows: Tensor, block_components: Tensor | None, fixed: tuple | None, signature: tuple) -> PassDraws:
        """Draw every table of the model for a pass routing ``rows`` (and blocks of ``block_components``; ``fixed``
        the blocks' components when the route fixes them), then take them out as the layers took them before."""
        every = fixed == tuple(range(self.components))
        draws = PassDraws(noise, rows, block_components, every, signature)
        scales: dict = {}  # group number: its posterior scale, shared by both kinds of draw
        # a traced pass (torch.compile, torch.export; its batch may be symbolic) neither learns nor takes ahead
        needs = {} if torch.compiler.is_compiling() else self.needs.get(signature, {})
        for kind in (BLOCKS, ROWS):
            if kind == BLOCKS and block_components is None:
                continue
            if kind == ROWS and not noise and not any(k == ROWS for k, _ in needs):
                # no noise, no random numbers to keep in step: a value per row ([K*B, total] in a mixture
                # evaluation) only once a layer has asked for one; until then it gathers its own
                continue
            components = draws.components(kind)
            for group in self.groups:
                if kind == BLOCKS and not (noise and group.sampled):
                    continue  # no random numbers to keep in step: gathered when a layer asks (_full)
                loc = self._joined(draws, group, "loc")
                if loc is None:  # not joined this pass: only the random numbers now (the module doc)
                    if noise and group.sampled:
                        draws.eps[(group.key, kind)] = group.noise(self.components if components is None else components.shape[0])
                    continue
                scale = None
                if noise and group.sampled:
                    if group.key not in scales:
                        rho = self._joined(draws, group, "rho")
                        scales[group.key] = None if rho is None else distributions.scale(rho)
                    scale = scales[group.key]
                    if scale is None:
                        continue
                draws.full[(group.key, kind)] = group.draw_all(loc, components, noise, scale)
        # (a compiled graph fuses the slices of its own: learning the takes would only recompile it)
        for (kind, like), groups in needs.items():
            for key, slots in groups.items():
                full = self._full(draws, key, kind)
                if full is not None:
                    draws.taken[(key, kind, like)] = self.groups[key].take(full, sorted(slots), like)
        return draws

    def take(self, draws: PassDraws, group: Any, slot: int, kind: str, like: tuple | None = None) -> Tensor | None:
        """Table ``slot`` of ``group`` as drawn for the pass (``kind``: "blocks" or "rows"; ``like``: the shape to
        take it in, see :meth:`~bayesify.variational.store.TableGroup.take`, if it was taken so ahead),
        ``[m, features]`` otherwise; None where the layer draws its own (not one of this model's groups, or a
        value per row without noise not drawn for this pass)."""
        values = draws.taken.get((group.key, kind, like))
        if values is not None and slot in values:
            return values[slot]
        if group.key >= len(self.groups) or self.groups[group.key] is not group:
            return None
        if not torch.compiler.is_compiling():
            shapes = self.needs.setdefault(draws.signature, {})
            shapes.setdefault((kind, like), {}).setdefault(group.key, set()).add(slot)
        full = self._full(draws, group.key, kind)
        if full is not None:
            start = group.starts[slot]
            return full[:, start : start + group.sizes[slot]]
        eps = draws.eps.get((group.key, kind))
        if eps is not None:  # this table's values from its own Parameters and its columns of the pass's noise
            return group.draw_one(slot, draws.components(kind), eps)
        return None

    def _full(self, draws: PassDraws, key: int, kind: str) -> Tensor | None:
        """Group ``key``'s values of ``kind`` for the pass: as drawn ahead, or (a value per block that takes no
        random numbers: bias offsets, or the posterior means) gathered now, once, as the first layer asks."""
        full = draws.full.get((key, kind))
        group = self.groups[key]
        if full is None and kind == BLOCKS and draws.block_components is not None and not (draws.noise and group.sampled):
            loc = self._joined(draws, group, "loc")
            if loc is None:
                return None
            full = draws.full[(key, kind)] = group.draw_all(loc, draws.components(kind), False)
        return full

    @staticmethod
    def _joined(draws: PassDraws, group: Any, name: str) -> Tensor | None:
        """``group``'s tables joined for this pass (:meth:`~bayesify.variational.store.TableGroup.joined`), once."""
        key = (group.key, name)
        if key not in draws.joined:
            draws.joined[key] = group.joined(name)
        return draws.joined[key]
