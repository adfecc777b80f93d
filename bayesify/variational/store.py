"""One flat store of a converted model's per-component tables: every factor's ``loc`` / ``rho`` and every
per-component bias offset, as the columns of a few ``[K, total]`` Parameters.

Why: on a GPU a rank-1 training step is launch-bound, so its cost is the number of small ops it issues. With
the tables kept per layer, every layer drew its own factors (gather, softplus, noise, clip: ~11 ops forward,
~17 backward), the KL concatenated them again, and the optimizer stepped 4-5 small Parameters per layer
(ResNet-18: 480 -> 1,990 ops dispatched per step). Kept flat, each forward pass draws every factor of the
model at once (:meth:`TableGroup.draw_all`: one gather, one softplus, one noise draw), each layer takes its
columns as views, the KL is one pass over the store, and the optimizer sees two or three tensors.

Layout: a :class:`TableGroup` holds tables of one kind that draw alike (factors of one posterior, prior and
clipping; or bias offsets, which are not sampled), of one dtype and device. Table ``i`` is columns
``[start_i, start_i + features_i)`` of the group's ``loc`` (and ``rho``): row ``k`` is component ``k``.
The groups' Parameters are registered on the converted root as ``rank1_store_<i>_loc`` / ``_rho`` (the
checkpoint's keys); a checkpoint of release 0.2, with one ``loc`` / ``rho`` per factor module and one table
per bias offset, is mapped onto them when it is loaded (:func:`load_store`).

A layer's factor (:class:`~bayesify.variational.factor.Rank1Factor`) or bias offset is *packed* once its
model's conversion ends (:func:`pack`): its own Parameters go, and reading ``factor.loc`` gives a view of
its columns (writes through it change the store). A group refers to the root that holds its Parameters, so a
converted layer deep-copied on its own takes a copy of its whole model with it (copy the model instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayesify.options import Posterior
from bayesify.variational import distributions

if TYPE_CHECKING:
    from bayesify.config import Rank1Config

__all__ = ["FactorStore", "TableGroup", "load_store", "pack", "remove", "slots_of"]

FACTOR, OFFSET = "factor", "offset"


class TableGroup:
    """The tables of one kind (see the module doc) as columns of ``loc`` (and ``rho``), ``[K, total]``.

    The two Parameters are registered on the model's root (``owner``) as ``rank1_store_<i>_loc`` and
    ``rank1_store_<i>_rho``: Parameters and not a child module, so that the root's own iteration (an
    ``nn.Sequential`` calls its children in turn) and indexing stay as they were. The group reads them
    from the root on every use, so a root that replaces its Parameters (``load_state_dict(assign=True)``,
    ``to_empty``) keeps working.

    Args:
        owner: the converted root the Parameters are registered on.
        index: the group's number in the root's store (its Parameters' names).
        kind: ``"factor"`` (sampled from its posterior; ``config`` says how) or ``"offset"`` (a bias
            offset: taken as it is).
        config: the options the factors were converted with (posterior, prior, clipping); None for offsets.
        loc, rho: the initial tables, ``[K, total]`` (``rho`` None for offsets and delta posteriors).
        sizes: the width of each table, in column order.
        legacy: each table's checkpoint key in release 0.2, relative to ``owner`` (see :func:`load_store`).
    """

    def __init__(
        self,
        owner: nn.Module,
        index: int,
        kind: str,
        config: Rank1Config | None,
        loc: Tensor,
        rho: Tensor | None,
        sizes: Sequence[int],
        legacy: Sequence[str] = (),
    ) -> None:
        self.owner = owner
        self.names = {"loc": f"rank1_store_{index}_loc", "rho": None if rho is None else f"rank1_store_{index}_rho"}
        # a factor's module ("layer1.0.conv1.rank1_s": keys .loc, .rho) or an offset's Parameter ("...rank1_bias")
        self.legacy = tuple(legacy)
        self.kind = kind
        self.config = config
        owner.register_parameter(self.names["loc"], nn.Parameter(loc))
        if rho is not None:
            owner.register_parameter(self.names["rho"], nn.Parameter(rho))
        self.sizes = tuple(sizes)
        self.key = -1  # its number among the groups its model's router draws (set by convert)
        starts, total = [], 0
        for size in self.sizes:
            starts.append(total)
            total += size
        self.starts = tuple(starts)

    @property
    def loc(self) -> nn.Parameter:
        return self.owner._parameters[self.names["loc"]]

    @property
    def rho(self) -> nn.Parameter | None:
        name = self.names["rho"]
        return None if name is None else self.owner._parameters[name]

    def parameters(self) -> Iterable[nn.Parameter]:
        """The group's Parameters (``loc``, and ``rho`` where it has one)."""
        return [p for p in (self.loc, self.rho) if p is not None]

    @property
    def sampled(self) -> bool:
        """Whether its tables are drawn from a posterior with a scale (not offsets, not delta)."""
        return self.rho is not None

    def table(self, slot: int, name: str = "loc") -> Tensor:
        """Table ``slot``'s ``loc`` (or ``rho``) as a ``[K, features]`` view of the store."""
        flat = self.loc if name == "loc" else self.rho
        assert flat is not None, f"{name} of a group without it"
        return flat[:, self.starts[slot] : self.starts[slot] + self.sizes[slot]]

    def draw_all(self, components: Tensor | None, noise: bool, scale: Tensor | None = None) -> Tensor:
        """Every table's value per entry of ``components``, ``[len(components), total]``: one gather, one noise
        draw and one clip for the whole group. ``components`` None means every component in order (the
        tables themselves, no gather); ``noise`` samples a factor group from its posterior (offsets are never
        sampled); ``scale`` is the posterior scale when the caller has it already (:meth:`scale`)."""
        loc = self.loc
        value = loc if components is None else F.embedding(components, loc)
        if noise and self.sampled:
            config = self.config
            scale = self.scale() if scale is None else scale
            value = distributions.rsample(config.posterior, value, scale if components is None else F.embedding(components, scale))
            if config.clip is not None:
                # reference: heavy tails clipped to [-10, 10]. hardtanh is that clamp with a one-op backward (clamp's
                # takes six); they differ only at exactly +-clip, where hardtanh passes no gradient
                value = F.hardtanh(value, -config.clip, config.clip)
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
            value = value.index_select(1, self._columns_of(slots, value.device))
        axis = 1
        if like is not None:
            ndim, batch_axis, channel_axis = like
            shape = [1] * ndim
            shape[batch_axis], shape[channel_axis] = value.shape
            axis = channel_axis
            if tuple(shape) != tuple(value.shape):  # (a view to the same shape is still an op)
                value = value.view(shape)
        pieces = value.split([self.sizes[i] for i in slots], axis) if len(slots) > 1 else (value,)
        return dict(zip(slots, pieces))

    def _columns_of(self, slots: tuple[int, ...], device: torch.device) -> Tensor:
        key = (slots, str(device))
        columns = self.__dict__.setdefault("_columns", {})
        if key not in columns:
            index = [c for i in slots for c in range(self.starts[i], self.starts[i] + self.sizes[i])]
            columns[key] = torch.tensor(index, device=device)
        return columns[key]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_columns", None)  # device tensors derived from the layout
        return state

    def scale(self) -> Tensor:
        """The posterior scale of every entry, ``[K, total]``."""
        assert self.rho is not None, "scale() of a group without a posterior scale"
        return distributions.scale(self.rho)

    def __repr__(self) -> str:
        posterior = "" if self.config is None or self.kind == OFFSET else f", posterior={self.config.posterior}"
        return f"TableGroup({self.names['loc']}: kind={self.kind}, tables={len(self.sizes)}, shape={tuple(self.loc.shape)}{posterior})"



class FactorStore(list):
    """The :class:`TableGroup` s of one converted model (``root.__dict__["rank1_store"]``)."""

    load_hook: int | None = None  # id of the owner's load_state_dict pre-hook (see load_store)


def store_of(root: nn.Module) -> FactorStore | None:
    """The store of a converted root (None if it has none)."""
    return root.__dict__.get("rank1_store")


def load_store(
    owner: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load pre-hook of the store's owner: what each group of ``owner.rank1_store`` loads.

    * the group's own keys (``rank1_store_<i>_loc`` / ``_rho``): as they are, once their K is checked;
    * else the keys of release 0.2 (one ``loc`` / ``rho`` per factor module, one ``[K, features]`` table per
      bias offset): assembled into the group's layout and removed;
    * else none of them (a checkpoint of the network before conversion): the current values are kept.

    A checkpoint of a model converted with another number of components is refused in one line that
    names both K and the fix (instead of one size mismatch per table). ``state_dict`` is torch's own
    copy of the caller's dict, so changing it here changes nothing of the caller's.
    """
    store = store_of(owner)
    if store is None:
        return
    for group in store:
        own = {name: prefix + key for name, key in group.names.items() if key is not None}
        if any(key in state_dict for key in own.values()):
            if _wrong_components(state_dict.get(own["loc"]), group, error_msgs):
                for key in own.values():
                    state_dict.pop(key, None)
            continue
        keys = [_legacy_keys(group, slot, prefix) for slot in range(len(group.sizes))]
        if not any(key in state_dict for slot_keys in keys for key in slot_keys.values()):
            for name, key in own.items():  # nothing of the group: keep it (it loads onto itself)
                state_dict[key] = getattr(group, name)
            continue
        for name, own_key in own.items():
            tables = []
            for slot, slot_keys in enumerate(keys):
                value = state_dict.pop(slot_keys.get(name, ""), None)
                if value is None:
                    missing_keys.append(slot_keys.get(name, f"{own_key}[:, {group.starts[slot]}:]"))
                    value = group.table(slot, name)
                elif _wrong_components(value, group, error_msgs):
                    break
                tables.append(value.to(group.loc.device))
            else:
                state_dict[own_key] = torch.cat(tables, 1)
                continue
            for slot_keys in keys:  # refused: leave nothing of this group to report again
                for key in slot_keys.values():
                    state_dict.pop(key, None)
            break


def _legacy_keys(group: TableGroup, slot: int, prefix: str) -> dict[str, str]:
    stem = prefix + group.legacy[slot] if slot < len(group.legacy) else None
    if stem is None:
        return {}
    if group.kind == OFFSET:
        return {"loc": stem}
    return {"loc": stem + ".loc", "rho": stem + ".rho"}


def _wrong_components(value: Any, group: TableGroup, error_msgs: list[str]) -> bool:
    """Whether a checkpoint's table has another K than the group (then one line says so, once)."""
    if not isinstance(value, Tensor) or value.dim() != 2 or value.shape[0] == group.loc.shape[0]:
        return False
    message = (
        f"the checkpoint holds a model converted with components={value.shape[0]}, and this model has "
        f"components={group.loc.shape[0]}; convert it with bayesify.convert(model, components={value.shape[0]}) "
        "before loading (or load the checkpoint into an unconverted copy of the network)"
    )
    if message not in error_msgs:
        error_msgs.append(message)
    return True


def _factor_key(factor: nn.Module) -> tuple:
    cfg, loc = factor.config, factor.loc
    prior_std = cfg.resolved_prior_std() if cfg.posterior is not Posterior.DELTA else None
    return (FACTOR, cfg.components, cfg.posterior, cfg.prior, cfg.prior_mean, prior_std, cfg.clip, loc.dtype, loc.device)


def pack(root: nn.Module, layers: Iterable[nn.Module]) -> list[TableGroup]:
    """Move the factors and bias offsets of ``layers`` (converted, not yet packed) into new groups of
    ``root``'s store (created if absent) and make each of them a view of its columns. Returns the new groups."""
    factors: dict[tuple, list[nn.Module]] = {}
    offsets: dict[tuple, list[tuple[nn.Module, str]]] = {}
    for layer in layers:
        for _, factor in layer.rank1_factors():
            if not factor.packed:
                factors.setdefault(_factor_key(factor), []).append(factor)
        for name in layer.rank1_state.bias_offsets:
            table = layer._parameters.get(name)
            if table is not None:
                offsets.setdefault((OFFSET, table.shape[0], table.dtype, table.device), []).append((layer, name))
    names = {id(module): name for name, module in root.named_modules()}

    def key(module: nn.Module, attr: str = "") -> str:
        name = names.get(id(module), "")
        return ".".join(n for n in (name, attr) if n)

    store = store_of(root)
    if store is None and (factors or offsets):
        store = root.__dict__["rank1_store"] = FactorStore()
        store.load_hook = root.register_load_state_dict_pre_hook(load_store).id
    groups = []
    for members in factors.values():
        first = members[0]
        rho = None if first.rho is None else torch.cat([f.rho.detach() for f in members], 1)
        group = TableGroup(root, len(store), FACTOR, first.config, torch.cat([f.loc.detach() for f in members], 1), rho,
                           [f.features for f in members], [key(f) for f in members])  # fmt: skip
        for slot, factor in enumerate(members):
            factor.rank1_pack(group, slot)
        store.append(group)
        groups.append(group)
    for members in offsets.values():
        tables = [layer._parameters[name] for layer, name in members]
        group = TableGroup(root, len(store), OFFSET, None, torch.cat([t.detach() for t in tables], 1), None,
                           [t.shape[1] for t in tables], [key(layer, name) for layer, name in members])  # fmt: skip
        for slot, (layer, name) in enumerate(members):
            del layer._parameters[name]
            layer.rank1_state.packed[name] = (group, slot)
        store.append(group)
        groups.append(group)
    return groups


def slots_of(layer: nn.Module) -> list[tuple[TableGroup, int]]:
    """The ``(group, slot)`` of every table of a converted layer that lives in a store."""
    slots = [factor.rank1_slot for _, factor in layer.rank1_factors() if factor.packed]
    return slots + list(layer.rank1_state.packed.values())


def remove(root: nn.Module) -> None:
    """Take ``root``'s store, its Parameters and its load hook away (reverting a model)."""
    store = root.__dict__.pop("rank1_store", None)
    if store is None:
        return
    for group in store:
        for name in group.names.values():
            if name is not None:
                root._parameters.pop(name, None)
    if store.load_hook is not None:
        root._load_state_dict_pre_hooks.pop(store.load_hook, None)
