"""Groups of a converted model's per-component tables, drawn together once per forward pass.

**Every layer owns its tables.** A factor's ``loc`` / ``rho`` are Parameters of its own
:class:`~bayesify.variational.factor.Rank1Factor` (``layer1.0.conv1.rank1_s.loc``), a bias offset is a
Parameter of its layer (``layer1.0.conv1.rank1_bias``). So whatever PyTorch lets a user do to a module does
for a layer's factors what it does for its weight: freezing a block freezes them, parameter groups by module
or by name include them, timm's layer decay scales them with their layer, a cast or a write through ``.data``
changes them.

**Why groups.** On a GPU a rank-1 training step is launch-bound, so its cost is the number of small ops it
issues. Drawn layer by layer, every layer's tables cost ~11 ops forward (gather, softplus, noise, clip) and
~17 backward. A :class:`TableGroup` names the tables of one kind that draw alike (factors of one posterior,
prior and clipping; or bias offsets, which are not sampled) and share a dtype and device. Once per forward
pass the router joins each group's tables into one ``[K, total]`` tensor (:meth:`TableGroup.joined`: one
``cat``, whose backward is one ``split_with_sizes_copy`` handing every Parameter its own contiguous
gradient) and draws the whole group at once (:meth:`TableGroup.draw_all`: one gather, one softplus, one
noise draw); each layer takes its columns. Table ``i`` is columns ``[start_i, start_i + features_i)``.

**Nothing outlives a pass.** The joined tensor is made from the Parameters as they are at each pass (read
from their modules' ``_parameters``), so a write through ``.data``, ``Module._apply`` (``.half()``, ``.to()``),
``load_state_dict(assign=True)`` or ``torch.func.functional_call`` is seen by the next pass. A group whose
tables are not alike at a pass (one cast on its own, a sharded ``DTensor`` under FSDP2, a table removed) is
not drawn ahead: its layers then draw their own tables, the same values by another path.

**Checkpoints.** Release 0.3 kept every group as two flat Parameters on the root, ``rank1_store_<i>_loc`` /
``_rho``; their checkpoints are split onto the layers' own keys when loaded (:func:`load_tables`, what the root's
load pre-hook does, which also refuses a checkpoint of another number of components in one line).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayesify._autograd import plain_ops
from bayesify.mixture import block_rows, component_rows, row_shape
from bayesify.options import Posterior
from bayesify.variational import distributions

if TYPE_CHECKING:
    from bayesify.config import LayerOptions

__all__ = ["TableGroup", "load_tables", "pack", "slots_of"]

FACTOR, OFFSET = "factor", "offset"


class _Join(torch.autograd.Function):
    """``torch.cat(tables, 1)`` whose backward is one ``split_with_sizes_copy``: each table's gradient arrives
    contiguous, so autograd hands it to the Parameter as it is (``cat``'s own backward slices, and every
    non-contiguous slice is then copied once more for its Parameter: two ops per table instead of one in all)."""

    @staticmethod
    def forward(ctx: Any, sizes: tuple[int, ...], *tables: Tensor) -> Tensor:  # type: ignore[override]
        ctx.sizes = sizes
        return torch.cat(tables, 1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (None, *torch.split_with_sizes_copy(grad, ctx.sizes, 1))


def _identity(tables: Sequence[Tensor | None]) -> tuple:
    """What tells a table apart from a changed one: the object, its version counter, where its values are."""
    return tuple((id(t), t._version, t.data_ptr(), t.dtype) if t is not None else None for t in tables)


def _dtensor_type() -> type | None:  # (no functools.cache: torch.compile warns on traced lru_cache calls)
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


class TableGroup:
    """Tables of one kind (see the module doc), held by their own modules and joined per pass.

    Args:
        kind: ``"factor"`` (sampled from its posterior; ``options`` says how) or ``"offset"`` (a bias offset:
            taken as it is).
        options: the options the factors were made with (posterior, prior, clipping); None for offsets.
        members: ``(module, name)`` of each table, in column order: a factor module and ``""`` (its ``loc``
            and ``rho``), or a layer and the name of its bias-offset Parameter.
        names: each table's checkpoint key, relative to the root (``"layer1.0.conv1.rank1_s"``,
            ``"layer1.0.conv1.rank1_bias"``): how a release-0.3 checkpoint's columns map onto them.
        key: the group's number among its model's groups (``ModelDraws.groups``), in the order they were made:
            also release 0.3's ``rank1_store_<key>_*`` checkpoint keys.
    """

    def __init__(
        self, kind: str, options: LayerOptions | None, members: Sequence[tuple[nn.Module, str]], names: Sequence[str], key: int
    ) -> None:
        self.kind = kind
        self.options = options
        self.members = tuple(members)
        self.names = tuple(names)
        self.key = key
        self.sizes = tuple(self._tensor(slot, "loc").shape[1] for slot in range(len(self.members)))
        starts, total = [], 0
        for size in self.sizes:
            starts.append(total)
            total += size
        self.starts = tuple(starts)

    def _tensor(self, slot: int, name: str) -> Tensor | None:
        module, attr = self.members[slot]
        return module._parameters.get(name if self.kind == FACTOR else attr)

    def table(self, slot: int, name: str = "loc") -> Tensor:
        """Table ``slot``'s ``loc`` (or ``rho``), ``[K, features]``: its module's own Parameter."""
        value = self._tensor(slot, name)
        assert value is not None, f"{name} of table {slot} is gone"
        return value

    @property
    def sampled(self) -> bool:
        """Whether its tables are drawn from a posterior with a scale (not offsets, not delta)."""
        return self.kind == FACTOR and self.options is not None and self.options.posterior is not Posterior.DELTA

    def tables(self, name: str = "loc") -> list[Tensor | None]:
        """Every table's ``loc`` (or ``rho``), as its module holds it now."""
        # (what _tensor reads, inline: Dynamo traces this in every compiled pass, a call per table)
        return [module._parameters.get(name if self.kind == FACTOR else attr) for module, attr in self.members]

    def joined(self, name: str = "loc", *, sharded: bool = False) -> Tensor | None:
        """The tables side by side, ``[K, total]``, made now from the modules' Parameters (one op, and one in the
        backward); None where they cannot be drawn as one: a table gone, another dtype or device than the first,
        a shape that changed, or (unless ``sharded``) a sharded ``DTensor``. With ``sharded`` the sharded tables
        are joined by ``torch.cat`` (a ``DTensor`` op), for the KL of a sharded model."""
        tables = self.tables(name)
        first = tables[0]
        if first is None:
            return None
        dtensor = _dtensor_type()
        for table, size in zip(tables, self.sizes):
            if table is None or table.dtype != first.dtype or table.device != first.device or table.dim() != 2:
                return None
            if table.shape[1] != size or table.shape[0] != first.shape[0]:
                return None
            if dtensor is not None and isinstance(table, dtensor) and not sharded:
                return None
        if len(tables) == 1:
            return first
        if (
            sharded
            or plain_ops()
            or not any(t.requires_grad for t in tables)
            or not torch.is_grad_enabled()
        ):
            return torch.cat(tables, 1)  # (a compiled graph fuses the cat; nothing to hand back without gradients)
        value = _Join.apply(self.sizes, *tables)
        self.__dict__.setdefault("_pass", {})[name] = (_identity(tables), value)
        return value

    def joined_again(self, name: str = "loc") -> Tensor | None:
        """:meth:`joined` for the KL of a training step: the forward pass's own joined tables while every table
        is still the very tensor it joined, unchanged (identity, ``_version``, storage), and gradients are on.

        Why: the KL and the draws then reach the Parameters through one node, so autograd adds their two
        gradients once per group instead of once per table (~80 ops a step for ResNet-18). It holds the
        tables' values of that pass only: an optimizer step, a cast, ``load_state_dict`` or a new ``.data``
        makes it join anew."""
        kept = self.__dict__.get("_pass", {}).get(name)
        fresh = kept is not None and torch.is_grad_enabled() and not plain_ops()
        if fresh and kept[0] == _identity(self.tables(name)):
            return kept[1]
        return self.joined(name)

    def draw_all(
        self,
        loc: Tensor,
        components: Tensor | None,
        noise: bool,
        scale: Tensor | None = None,
        blocks: tuple | None = None,
        eps: Tensor | None = None,
    ) -> Tensor:
        """Every table's value per entry of ``components``, ``[len(components), total]``: one gather, one noise
        draw and one clip for the whole group. ``loc`` is :meth:`joined`; ``components`` None means every
        component in order (the tables themselves, no gather); ``noise`` samples a factor group from its
        posterior with ``scale`` (its ``[K, total]`` posterior scale; offsets are never sampled). With
        ``blocks`` (contiguous runs of rows), ``components`` are the blocks' and there is a value per row, each
        from its block's component (:func:`~bayesify.mixture.block_rows`: a compiled graph's way). ``eps``: the
        random numbers to draw with (:meth:`noise`; drawn here if None)."""

        def entries(table: Tensor) -> Tensor:
            value = table if components is None else component_rows(components, table)
            return value if blocks is None else block_rows(value, blocks)

        value = entries(loc)
        if noise and self.sampled:
            assert scale is not None, "a sampled draw needs the posterior scale"
            options = self.options
            value = distributions.rsample(options.posterior, value, entries(scale), eps)
            if options.clip is not None:
                # reference: heavy tails clipped to [-10, 10]. hardtanh is that clamp with a one-op backward (clamp's
                # takes six); they differ only at exactly +-clip, where hardtanh passes no gradient
                value = F.hardtanh(value, -options.clip, options.clip)
        return value

    def noise(self, rows: int, after: Tensor | None = None) -> Tensor | None:
        """The random numbers :meth:`draw_all` would take for ``rows`` values of every table, ``[rows, total]``,
        drawn alone: for a pass whose tables cannot be joined (FSDP2 shards them until each block's forward),
        so that each layer's values (:meth:`draw_one`) are the very ones a joined draw would give. ``after``: the
        pass's previous draw (:func:`~bayesify.variational.distributions.noise_of`: a compiled graph's order)."""
        first = self._tensor(0, "loc")
        if not self.sampled or first is None:
            return None
        return distributions.noise_of(self.options.posterior, (rows, sum(self.sizes)), first.dtype, first.device, after)

    def draw_one(self, slot: int, components: Tensor | None, eps: Tensor) -> Tensor:
        """Table ``slot``'s values per entry of ``components`` from its columns of :meth:`noise`: what
        :meth:`draw_all` gives for those columns, elementwise the same ops on the layer's own Parameters."""
        loc, rho = self.table(slot, "loc"), self.table(slot, "rho")
        scale = distributions.scale(rho)
        if components is not None:
            loc, scale = component_rows(components, loc), component_rows(components, scale)
        start = self.starts[slot]
        value = distributions.rsample(self.options.posterior, loc, scale, eps[:, start : start + self.sizes[slot]])
        if self.options.clip is not None:
            value = F.hardtanh(value, -self.options.clip, self.options.clip)
        return value

    def take(self, value: Tensor, slots: Sequence[int] | None = None, like: tuple | None = None) -> dict[int, Tensor]:
        """Tables ``slots`` (sorted; default all) of ``value`` (from :meth:`draw_all`): ``{slot: values}``.

        The tables wanted are taken in one column gather (a table left out then costs nothing in the backward
        pass, where an unused piece of a split would cost a zero-filled gradient) and one split. ``like``
        ``(ndim, batch axis, channel axis)`` gives each piece the shape that broadcasts against an activation of
        that layout (``[m, F, 1, 1]`` for a 2-d convolution's input), so the layers need no view of their own.
        """
        slots = tuple(range(len(self.sizes))) if slots is None else tuple(slots)
        if len(slots) < len(self.sizes):
            value = value.index_select(1, self.columns_of(slots, value.device))
        axis = 1
        if like is not None:
            ndim, batch_axis, channel_axis = like
            shape = row_shape(value.shape[0], value.shape[1], ndim, batch_axis, channel_axis)
            axis = channel_axis
            if shape != tuple(value.shape):  # (a view to the same shape is still an op)
                value = value.view(shape)
        pieces = value.split([self.sizes[i] for i in slots], axis) if len(slots) > 1 else (value,)
        return {slot: piece for slot, piece in zip(slots, pieces)}  # (not dict(zip()): ~5x the lines Dynamo traces)

    def columns_of(self, slots: tuple[int, ...], device: torch.device) -> Tensor:
        """The index of tables ``slots``' columns on ``device``, made once (what :meth:`take` gathers them by)."""
        key = (slots, str(device))
        columns = self.__dict__.setdefault("_columns", {})
        if key not in columns:
            index = [c for i in slots for c in range(self.starts[i], self.starts[i] + self.sizes[i])]
            made = torch.tensor(index, device=device)
            if torch.is_inference_mode_enabled():  # an inference tensor, kept, would fail the next training step's
                return made  # backward ("Inference tensors cannot be saved for backward"): made again out of it
            columns[key] = made
        return columns[key]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_columns", None)  # device tensors derived from the layout
        state.pop("_pass", None)  # the last training pass's joined tables (joined_again): not state
        return state

    def __repr__(self) -> str:
        posterior = "" if self.options is None or self.kind == OFFSET else f", posterior={self.options.posterior}"
        return f"TableGroup({self.kind}, tables={len(self.sizes)}, columns={sum(self.sizes)}{posterior})"


def load_tables(groups: Sequence[TableGroup], state_dict: dict[str, Any], prefix: str, error_msgs: list[str]) -> None:
    """What a converted root's load pre-hook does (``model_state.py`` installs it) for its ``groups``: a checkpoint
    of release 0.3 mapped onto the layers' own keys, and a checkpoint of another number of components refused in
    one line.

    * release 0.3's flat keys (``rank1_store_<i>_loc`` / ``_rho``, ``[K, total]``): split by columns onto the
      keys of the tables they hold (``layer1.0.conv1.rank1_s.loc``, ...) and removed;
    * a table with another K than the model: a ``ValueError`` in one line naming both K and the fix, raised
      before anything is loaded (the root's pre-hook runs before any Parameter is copied).

    ``state_dict`` is torch's own copy of the caller's dict, so changing it here changes nothing of the caller's.
    The layers' own pre-hooks then keep the current rank-1 values of a checkpoint of the unconverted network.
    """
    for group in groups:
        for name in ("loc", "rho") if group.kind == FACTOR else ("loc",):
            flat = state_dict.pop(f"{prefix}rank1_store_{group.key}_{name}", None)
            if flat is None:
                continue
            if not isinstance(flat, Tensor) or flat.dim() != 2 or flat.shape[1] != sum(group.sizes):
                error_msgs.append(
                    f"{prefix}rank1_store_{group.key}_{name} (release 0.3's flat store) has shape "
                    f"{tuple(getattr(flat, 'shape', ()))}, not [K, {sum(group.sizes)}]: it was saved from another network"
                )
                continue
            for slot, piece in enumerate(flat.split(group.sizes, 1)):
                state_dict.setdefault(_key(group, slot, name, prefix), piece)
    wrong = _wrong_components(groups, state_dict, prefix)
    if wrong is not None:  # raised before anything is copied: the root's pre-hook runs first
        raise ValueError(
            f"the checkpoint holds a model converted with components={wrong[0]}, and this model has "
            f"components={wrong[1]}; convert it with bayesify.convert(model, components={wrong[0]}) before loading "
            "(for its shared weights alone, without the factors: load_state_dict(..., strict=False) into an unconverted copy "
            "of the network); nothing was loaded"
        )


def _key(group: TableGroup, slot: int, name: str, prefix: str) -> str:
    stem = prefix + group.names[slot]
    return f"{stem}.{name}" if group.kind == FACTOR else stem


def _wrong_components(groups: Sequence[TableGroup], state_dict: dict[str, Any], prefix: str) -> tuple[int, int] | None:
    """``(the checkpoint's K, the model's K)`` where a table of the checkpoint has another K; else None."""
    for group in groups:
        for slot in range(len(group.sizes)):
            value = state_dict.get(_key(group, slot, "loc", prefix))
            if isinstance(value, Tensor) and value.dim() == 2:
                ours = group.table(slot).shape[0]
                if value.shape[0] != ours:
                    return value.shape[0], ours
    return None


def _factor_key(factor: nn.Module) -> tuple:
    options, loc = factor.options, factor.loc
    prior_std = options.prior_std if options.posterior is not Posterior.DELTA else None
    return (FACTOR, loc.shape[0], options.posterior, options.prior, options.prior_mean, prior_std, options.clip, loc.dtype, loc.device)


def pack(root: nn.Module, layers: Iterable[nn.Module], groups: list[TableGroup]) -> None:
    """Put the factors and bias offsets of ``layers`` (converted, in no group yet) into new groups appended to
    ``groups`` (the model's: ``ModelDraws.groups``; ``root`` names the tables). The tables stay where they are;
    each learns its ``(group, slot)``."""
    factors: dict[tuple, list[nn.Module]] = {}
    offsets: dict[tuple, list[tuple[nn.Module, str]]] = {}
    for layer in layers:
        for _, factor in layer.rank1_factors():
            if not factor.packed:
                factors.setdefault(_factor_key(factor), []).append(factor)
        for name in layer.rank1_state.bias_offsets:
            table = layer._parameters.get(name)
            if table is not None and name not in layer.rank1_state.packed:
                offsets.setdefault((OFFSET, table.shape[0], table.dtype, table.device), []).append((layer, name))
    names = {id(module): name for name, module in root.named_modules()}

    def key(module: nn.Module, attr: str = "") -> str:
        name = names.get(id(module), "")
        return ".".join(n for n in (name, attr) if n)

    for members in factors.values():
        group = TableGroup(FACTOR, members[0].options, [(f, "") for f in members], [key(f) for f in members], len(groups))
        for slot, factor in enumerate(members):
            factor.rank1_slot = (group, slot)
        groups.append(group)
    for members in offsets.values():
        group = TableGroup(OFFSET, None, members, [key(layer, name) for layer, name in members], len(groups))
        for slot, (layer, name) in enumerate(members):
            layer.rank1_state.packed[name] = (group, slot)
        groups.append(group)


def slots_of(layer: nn.Module) -> list[tuple[TableGroup, int]]:
    """The ``(group, slot)`` of every table of a converted layer that is in a group."""
    slots = [factor.rank1_slot for _, factor in layer.rank1_factors() if factor.packed]
    return slots + list(layer.rank1_state.packed.values())
