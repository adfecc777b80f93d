"""Per-forward routing of batch rows to mixture components: the :class:`Router` of a converted model.

A converted model owns one :class:`Router`, shared by all of its converted layers, attached to
the model's root module by two hooks that run around each forward pass:

* before it, the router resolves the route (training: one random component per example;
  evaluation: every example through every component, the mixture predictive; or what ``mode()``
  set), tiles the inputs along the batch when the route needs it, and records the component of
  every row in a :class:`ForwardState`, so that every layer routes an example through the *same*
  component;
* after it, the router reduces tiled outputs to the mixture predictive when the route asks.

Layers ask :meth:`Router.rows_for` for the component of each row of *their* input, which also
covers layers that fold extra axes into the batch (window attention: ``[B * windows, ...]``).

The router keeps three things apart: the model's settings (its :class:`~bayesify.config.Rank1Config`),
the ``mode()`` stack (:attr:`Router.overrides`), and the state of the forward pass in flight
(:attr:`Router.state`). The member layout and reductions live in :mod:`bayesify.mixture`.

A ``PackedSequence`` is one leaf: its batch is ``batch_sizes[0]`` sequences, tiled and reduced
per sequence. A converted layer used as the model says where the batch lies in each leaf of
its inputs and outputs (:meth:`~bayesify.layers.ConvertedLayer.rank1_input_axes` /
``rank1_output_axes``), e.g. an LSTM whose states ``[layers, B, H]`` have the batch elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from bayesify.mixture import reduce_members, split_members, tile
from bayesify.options import Reduction, Route

if TYPE_CHECKING:
    from bayesify.config import Rank1Config

__all__ = ["ForwardState", "RouteSpec", "Router", "attach", "detach", "find_root", "find_router", "is_root"]


@dataclass(frozen=True)
class RouteSpec:
    """What one forward pass does: route, noise, samples per component, reduction, component."""

    route: Route | None = None  # None: the default for the model's train/eval state
    noise: bool = True
    samples: int = 1
    reduction: Reduction | None = None
    component: int | None = None


@dataclass
class ForwardState:
    """The routing of the forward pass in flight (kept after it for a backward pass that recomputes it)."""

    spec: RouteSpec
    rows: Tensor  # component of every row of the routed batch
    batch: int  # examples in the batch as given
    axis: int | None  # batch axis of the inputs (None: one unbatched example)
    members: int  # copies of each example in the routed batch (K * samples when tiled, else 1)


@dataclass
class Router:
    """Routes the rows of every forward pass of one converted model (see the module doc)."""

    config: Rank1Config
    overrides: list[RouteSpec] = field(default_factory=list)  # the mode() stack: the last one is in force
    state: ForwardState | None = None
    active: bool = False  # inside the root's forward
    handles: list[RemovableHandle] = field(default_factory=list)

    @property
    def components(self) -> int:
        return self.config.components

    @property
    def batch_dim(self) -> int:
        return self.config.batch_dim

    @property
    def reduction(self) -> Reduction:
        return self.config.reduction

    def resolve(self, training: bool) -> RouteSpec:
        spec = self.overrides[-1] if self.overrides else RouteSpec()
        if spec.route is None:
            spec = replace(spec, route=Route.SAMPLE if training else Route.MIXTURE)
        return spec

    @property
    def tiles(self) -> int:
        """Copies of each example in the routed batch of the forward pass in flight (1 when not tiled)."""
        return self.state.members if self.active and self.state is not None else 1

    @property
    def rows(self) -> Tensor | None:
        return None if self.state is None else self.state.rows

    def live(self) -> bool:
        """Whether a forward pass of the converted root is routing rows right now.

        True inside the root's forward, and also in a backward pass that recomputes parts of the
        last forward (activation checkpointing): the recomputation must route every row through
        the component it went through, and torch's checkpoint replays the RNG, so the samples match.
        """
        return self.active or (self.state is not None and _in_backward())

    @property
    def noise(self) -> bool:
        """Whether layers sample their factors now (outside a routed forward pass: always)."""
        return self.state.spec.noise if self.live() and self.state is not None else True

    def rows_for(self, n: int, device: torch.device) -> Tensor:
        """Component index of each of the ``n`` rows of a layer's input."""
        rows = self.rows
        if rows is None or not self.live():
            # called outside the converted root's forward (a submodule used on its own):
            # no shared routing exists, so each row gets its own random component
            return torch.randint(self.components, (n,), device=device)
        total = rows.shape[0]
        if n == total:
            return rows
        if n % total == 0:
            # extra axes folded into the batch, batch-major (e.g. windows): repeat each row's component
            return rows.repeat_interleave(n // total)
        # a batch-independent input (e.g. a table fed through an MLP): one component for the whole call
        return rows[:1].expand(n)

    # ---- hooks on the root module ------------------------------------------------------------

    def begin(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        from bayesify.layers.base import ConvertedLayer

        spec = self.resolve(module.training)
        leaves, tree = tree_flatten((args, kwargs), is_leaf=_is_packed)
        first = next((t for t in leaves if isinstance(t, (Tensor, PackedSequence))), None)
        if first is None:
            raise TypeError(
                f"bayesify found no tensor input to route through the {self.components} mixture components; "
                "pass the batch as a tensor argument."
            )
        # a converted layer used as the model knows its own layout (batch axis, or None if unbatched)
        layer = module if isinstance(module, ConvertedLayer) else None
        axis = layer.rank1_batch_axis(first) if layer is not None else self.batch_dim
        if axis is not None and isinstance(first, Tensor) and first.dim() <= axis:
            raise TypeError(
                f"bayesify expects the batch at dimension {axis} of the model's first tensor input, which has "
                f"shape {tuple(first.shape)}; set convert(..., batch_dim=...) to where the batch lies."
            )
        if isinstance(first, PackedSequence):
            batch, device = int(first.batch_sizes[0]), first.data.device
        else:
            batch, device = (1 if axis is None else first.shape[axis]), first.device
        self.active = True
        if spec.route is Route.SAMPLE:
            self.state = ForwardState(spec, torch.randint(self.components, (batch,), device=device), batch, axis, 1)
            return args, kwargs
        if spec.route is Route.COMPONENT:
            rows = torch.full((batch,), spec.component, dtype=torch.long, device=device)
            self.state = ForwardState(spec, rows, batch, axis, 1)
            return args, kwargs
        # tile / mixture: member-major rows, component k owns rows [k*M*B, (k+1)*M*B)
        members = self.components * spec.samples
        rows = torch.arange(self.components, device=device).repeat_interleave(spec.samples * batch)
        self.state = ForwardState(spec, rows, batch, axis, members)

        axes = layer.rank1_input_axes(args, kwargs) if layer is not None else None
        if axes is None:
            axes = [(0 if t is first else None) if axis is None else axis for t in leaves]

        def tile_leaf(t: object, dim: int | None) -> object:
            if isinstance(t, PackedSequence):
                return _tile_packed(t, members) if int(t.batch_sizes[0]) == batch else t
            if not isinstance(t, Tensor) or dim is None:
                return t
            if axis is None:  # one unbatched example: the members become the batch
                return t.unsqueeze(dim).expand(*t.shape[:dim], members, *t.shape[dim:])
            if t.dim() > dim and t.shape[dim] == batch:
                return tile(t, members, dim)
            return t

        return tree_unflatten([tile_leaf(t, d) for t, d in zip(leaves, axes)], tree)

    def end(self, module: nn.Module, output: object) -> object:
        # rows stay in self.state for a backward pass that recomputes this forward (see live())
        self.active = False
        state = self.state
        if state is None or state.spec.route is not Route.MIXTURE:
            return output
        members, batch, axis = state.members, state.batch, state.axis
        reduction = state.spec.reduction or self.reduction
        leaves, tree = tree_flatten(output, is_leaf=_is_packed)
        axes = output_axes(module, output, len(leaves), axis)

        def reduce(t: object, dim: int | None) -> object:
            if isinstance(t, PackedSequence):
                return _reduce_packed(t, members, batch, reduction)
            if dim is None or not (
                isinstance(t, Tensor) and t.is_floating_point() and t.dim() > dim and t.shape[dim] == members * batch
            ):
                return t
            if axis is None:
                return reduce_members(t.movedim(dim, 0), reduction)
            return reduce_members(split_members(t, members, dim), reduction)

        return tree_unflatten([reduce(t, d) for t, d in zip(leaves, axes)], tree)

    def split(self, root: nn.Module, output: object) -> object:
        """The output of the root's last tiled forward with a member axis in front of each batched leaf.

        A leaf of shape ``[..., members * B, ...]`` (batch at its own axis) becomes
        ``[members, ..., B, ...]``: the members first, everything else as the model returns it.
        An unbatched example's leaves become ``[members, ...]``. PackedSequences and leaves
        without the tiled batch are returned as they are.
        """
        state = self.state
        assert state is not None, "split() follows a routed forward pass"
        batch, axis = state.batch, state.axis
        leaves, tree = tree_flatten(output, is_leaf=_is_packed)
        axes = output_axes(root, output, len(leaves), axis)

        def split_leaf(t: object, dim: int | None) -> object:
            if dim is None or not isinstance(t, Tensor) or t.dim() <= dim:
                return t
            if axis is None:
                return t.movedim(dim, 0)
            if t.shape[dim] % batch:
                return t
            return split_members(t, t.shape[dim] // batch, dim)

        return tree_unflatten([split_leaf(t, d) for t, d in zip(leaves, axes)], tree)


def output_axes(root: nn.Module, output: object, count: int, axis: int | None) -> list[int | None]:
    """The batch axis of each output leaf: the root layer's own statement, else the input's axis."""
    from bayesify.layers.base import ConvertedLayer

    if isinstance(root, ConvertedLayer):
        axes = root.rank1_output_axes(output)
        if axes is not None:
            return axes
    return [0 if axis is None else axis] * count


def _is_packed(value: object) -> bool:
    return isinstance(value, PackedSequence)


def _tile_packed(packed: PackedSequence, tiles: int) -> PackedSequence:
    """``tiles`` member-major copies of a packed batch: sequence ``k * B + i`` is sequence ``i``.

    Copies of one sequence are adjacent in the sorted order (all have its length), so every time
    step's rows are each row repeated ``tiles`` times.
    """
    data, batch_sizes, sorted_indices, _ = packed
    batch = int(batch_sizes[0])
    if sorted_indices is None:
        sorted_indices = torch.arange(batch, device=data.device)
    offsets = torch.arange(tiles, device=sorted_indices.device) * batch
    tiled_sorted = (sorted_indices.unsqueeze(1) + offsets).reshape(-1)
    unsorted = torch.empty_like(tiled_sorted)
    unsorted[tiled_sorted] = torch.arange(tiled_sorted.numel(), device=tiled_sorted.device)
    return PackedSequence(data.repeat_interleave(tiles, 0), batch_sizes * tiles, tiled_sorted, unsorted)


def _reduce_packed(packed: PackedSequence, tiles: int, batch: int, reduction: Reduction) -> object:
    """The mixture of a packed output of ``tiles * batch`` member-major sequences (any sorted order)."""
    data, batch_sizes, sorted_indices, unsorted_indices = packed
    if not data.is_floating_point() or int(batch_sizes[0]) != tiles * batch or bool((batch_sizes % tiles).any()):
        return packed
    steps, count = batch_sizes.numel(), tiles * batch
    device = data.device
    if sorted_indices is None:
        sorted_indices = unsorted_indices = torch.arange(count, device=device)
    # reduced order: the order of member 0's copies; row (t, q) gathers member k of sequence order[q]
    order = torch.argsort(unsorted_indices[:batch])
    sizes = batch_sizes // tiles
    offsets = (torch.cumsum(batch_sizes, 0) - batch_sizes).to(device)
    step = torch.repeat_interleave(torch.arange(steps, device=device), sizes.to(device))
    position = torch.arange(step.numel(), device=device) - (torch.cumsum(sizes, 0) - sizes).to(device)[step]
    members = torch.arange(tiles, device=device) * batch
    index = offsets[step].unsqueeze(0) + unsorted_indices[members.unsqueeze(1) + order[position].unsqueeze(0)]
    reduced = reduce_members(data[index], reduction)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(batch, device=device)
    return PackedSequence(reduced, sizes, order, inverse)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# ---- attaching a router to the root --------------------------------------------------------------


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return module._rank1_context.begin(module, args, kwargs)


def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
    return module._rank1_context.end(module, output)


def attach(root: nn.Module, router: Router) -> None:
    """Install ``router`` on ``root`` (as ``root._rank1_context``) with the hooks that route each forward pass."""
    root._rank1_context = router
    router.handles = [
        root.register_forward_pre_hook(_pre_hook, with_kwargs=True),
        root.register_forward_hook(_post_hook, with_kwargs=True, always_call=True),
    ]


def is_root(module: nn.Module) -> bool:
    """Whether ``module`` carries the routing hooks of a converted model."""
    return any(h is _pre_hook for h in module._forward_pre_hooks.values())


def detach(root: nn.Module) -> None:
    """Remove the routing hooks that :func:`attach` installed (the router attribute stays)."""
    router: Router = root._rank1_context
    for handle in router.handles:
        handle.remove()
    router.handles = []


def find_root(model: nn.Module) -> nn.Module:
    """The module carrying the routing hooks of a converted model (also through wrappers such as DDP)."""
    for module in model.modules():
        if is_root(module):
            return module
    raise ValueError(
        f"{type(model).__name__} is not a converted model (no rank-1 routing found); call bayesify.convert(model) first."
    )


def find_router(model: nn.Module) -> Router:
    """The router of a converted model (also through wrappers such as DDP)."""
    return find_root(model)._rank1_context


def split_output(model: nn.Module, output: Any) -> Any:
    """The last tiled forward's ``output`` of ``model`` with a member axis in front of each batched leaf."""
    root = find_root(model)
    return root._rank1_context.split(root, output)
