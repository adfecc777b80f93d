"""Per-forward routing of batch rows to mixture components.

A converted model owns one :class:`Rank1Context`, shared by all of its rank-1 layers. Hooks on
the model's root module run around each forward pass:

* before it, they choose the route (training: one random component per example; evaluation:
  every example through every component, the mixture predictive; or whatever ``mode()`` set),
  tile the inputs along the batch dimension when the route needs it, and store the component
  index of every row, so that all layers route an example through the *same* component;
* after it, they reduce tiled outputs to the mixture predictive when the route asks for it.

Layers ask :meth:`Rank1Context.rows_for` for the component of each row of *their* input, which
also covers layers that fold extra axes into the batch (window attention: ``[B * windows, ...]``).

A ``PackedSequence`` is one leaf: its batch is ``batch_sizes[0]`` sequences, tiled and reduced
per sequence. A converted layer used as the model may say where the batch lies in each leaf of
its inputs and outputs (``_rank1_input_axes`` / ``_rank1_output_axes``: one axis or None per
leaf), e.g. an LSTM whose states ``[layers, B, H]`` have the batch elsewhere than its input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_unflatten

from bayesify.options import Reduction, Route

__all__ = ["Rank1Context", "RouteSpec"]


@dataclass(frozen=True)
class RouteSpec:
    """What one forward pass does: route, noise, samples per component, reduction, component."""

    route: Route | None = None  # None: the default for the model's train/eval state
    noise: bool = True
    samples: int = 1
    reduction: Reduction | None = None
    component: int | None = None


@dataclass
class Rank1Context:
    """State shared by the rank-1 layers of one converted model."""

    components: int
    batch_dim: int = 0
    reduction: Reduction = Reduction.LOGITS
    # an explicit mode() in force (a stack: nested mode() calls restore the outer one)
    overrides: list[RouteSpec] = field(default_factory=list)
    # per-forward state, set by the root's pre-hook and cleared by its post-hook
    active: bool = False
    rows: Tensor | None = None
    noise: bool = True
    spec: RouteSpec | None = None
    batch_size: int = 0
    axis: int | None = 0  # batch axis of this forward's inputs (None: one unbatched example)
    # weight-bearing modules left deterministic at conversion, with why (for summary())
    skipped: dict[str, str] = field(default_factory=dict)

    def resolve(self, training: bool) -> RouteSpec:
        spec = self.overrides[-1] if self.overrides else RouteSpec()
        if spec.route is None:
            spec = replace(spec, route=Route.SAMPLE if training else Route.MIXTURE)
        return spec

    @property
    def tiles(self) -> int:
        spec = self.spec
        if spec is None or spec.route in (Route.SAMPLE, Route.COMPONENT):
            return 1
        return self.components * spec.samples

    def live(self) -> bool:
        """Whether a forward pass of the converted root is routing rows right now.

        True inside the root's forward, and also in a backward pass that recomputes parts of the
        last forward (activation checkpointing): the recomputation must route every row through
        the component it went through, and torch's checkpoint replays the RNG, so the samples match.
        """
        return self.active or (self.rows is not None and _in_backward())

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
        spec = self.resolve(module.training)
        leaves, tree = tree_flatten((args, kwargs), is_leaf=_is_packed)
        first = next((t for t in leaves if isinstance(t, (Tensor, PackedSequence))), None)
        if first is None:
            raise TypeError(
                f"bayesify found no tensor input to route through the {self.components} mixture components; "
                "pass the batch as a tensor argument."
            )
        # a converted layer used as the model knows its own layout (batch axis, or None if unbatched)
        axis = module._rank1_batch_axis(first) if hasattr(module, "_rank1_batch_axis") else self.batch_dim
        if axis is not None and isinstance(first, Tensor) and first.dim() <= axis:
            raise TypeError(
                f"bayesify expects the batch at dimension {axis} of the model's first tensor input, which has "
                f"shape {tuple(first.shape)}; set convert(..., batch_dim=...) to where the batch lies."
            )
        if isinstance(first, PackedSequence):
            batch, device = int(first.batch_sizes[0]), first.data.device
        else:
            batch, device = (1 if axis is None else first.shape[axis]), first.device
        self.spec, self.noise, self.batch_size, self.active = spec, spec.noise, batch, True
        self.axis = axis
        if spec.route is Route.SAMPLE:
            self.rows = torch.randint(self.components, (batch,), device=device)
            return args, kwargs
        if spec.route is Route.COMPONENT:
            self.rows = torch.full((batch,), spec.component, dtype=torch.long, device=device)
            return args, kwargs
        # tile / mixture: member-major rows, component k owns rows [k*M*B, (k+1)*M*B)
        tiles = self.tiles
        self.rows = torch.arange(self.components, device=device).repeat_interleave(spec.samples * batch)

        if hasattr(module, "_rank1_input_axes"):
            axes = module._rank1_input_axes(args, kwargs)
        else:
            axes = [(0 if t is first else None) if axis is None else axis for t in leaves]

        def tile(t: object, dim: int | None) -> object:
            if isinstance(t, PackedSequence):
                return _tile_packed(t, tiles) if int(t.batch_sizes[0]) == batch else t
            if not isinstance(t, Tensor) or dim is None:
                return t
            if axis is None:  # one unbatched example: the members become the batch
                return t.unsqueeze(dim).expand(*t.shape[:dim], tiles, *t.shape[dim:])
            if t.dim() > dim and t.shape[dim] == batch:
                return torch.cat([t] * tiles, dim=dim)
            return t

        return tree_unflatten([tile(t, d) for t, d in zip(leaves, axes)], tree)

    def end(self, module: nn.Module, output: object) -> object:
        spec, batch, tiles, axis = self.spec, self.batch_size, self.tiles, self.axis
        # rows and noise stay for a backward pass that recomputes this forward (see live())
        self.active, self.spec = False, None
        if spec is None or spec.route is not Route.MIXTURE:
            return output
        reduction = spec.reduction or self.reduction
        leaves, tree = tree_flatten(output, is_leaf=_is_packed)
        axes = _output_axes(module, output, len(leaves), axis)

        def reduce(t: object, dim: int | None) -> object:
            if isinstance(t, PackedSequence):
                return _reduce_packed(t, tiles, batch, reduction)
            if dim is None or not (
                isinstance(t, Tensor) and t.is_floating_point() and t.dim() > dim and t.shape[dim] == tiles * batch
            ):
                return t
            if axis is None:
                return _reduce(t.movedim(dim, 0), reduction)
            members = t.movedim(dim, 0).reshape(tiles, batch, *t.shape[:dim], *t.shape[dim + 1 :])
            return _reduce(members, reduction).movedim(0, dim)

        return tree_unflatten([reduce(t, d) for t, d in zip(leaves, axes)], tree)


def _output_axes(root: nn.Module, output: object, count: int, axis: int | None) -> list[int | None]:
    """The batch axis of each output leaf: the root layer's own statement, else the input's axis."""
    if hasattr(root, "_rank1_output_axes"):
        return root._rank1_output_axes(output)
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
    reduced = _reduce(data[index], reduction)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(batch, device=device)
    return PackedSequence(reduced, sizes, order, inverse)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _reduce(members: Tensor, reduction: Reduction) -> Tensor:
    """Reduce ``[members, B, ...]`` to ``[B, ...]``."""
    count = members.shape[0]
    if reduction is Reduction.MEAN:
        return members.mean(0)
    if reduction is Reduction.BINARY_LOGITS:
        # logit(mean sigmoid) = log(mean p) - log(mean (1 - p)), both computed in log space
        log_p = torch.logsumexp(torch.nn.functional.logsigmoid(members), 0)
        log_q = torch.logsumexp(torch.nn.functional.logsigmoid(-members), 0)
        return log_p - log_q
    if members.shape[-1] == 1:
        raise ValueError(
            "reduction='logits' (log of the mean softmax) needs one output per class, but the model's output "
            "has a single column; use reduction='binary_logits' for a one-logit binary classifier or "
            "reduction='mean' for regression (convert(..., reduction=...) or bayesify.mode(..., reduction=...))."
        )
    return torch.logsumexp(torch.log_softmax(members.float(), -1), 0).to(members.dtype) - math.log(count)


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return module._rank1_context.begin(module, args, kwargs)


def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
    return module._rank1_context.end(module, output)


def attach(root: nn.Module, context: Rank1Context) -> None:
    """Install ``context`` on ``root`` with the hooks that route each forward pass."""
    root._rank1_context = context
    root.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    root.register_forward_hook(_post_hook, with_kwargs=True, always_call=True)


def is_root(module: nn.Module) -> bool:
    """Whether ``module`` carries the routing hooks of a converted model."""
    return any(h is _pre_hook for h in module._forward_pre_hooks.values())


def detach(root: nn.Module) -> None:
    """Remove the routing hooks that :func:`attach` installed (the context attribute stays)."""
    for hooks, fn in ((root._forward_pre_hooks, _pre_hook), (root._forward_hooks, _post_hook)):
        for key in [k for k, h in hooks.items() if h is fn]:
            del hooks[key]
            root._forward_hooks_with_kwargs.pop(key, None)
            root._forward_pre_hooks_with_kwargs.pop(key, None)
            root._forward_hooks_always_called.pop(key, None)


def find_root(model: nn.Module) -> nn.Module:
    """The module carrying the routing hooks of a converted model (also through wrappers such as DDP)."""
    for module in model.modules():
        if is_root(module):
            return module
    raise ValueError(
        f"{type(model).__name__} is not a converted model (no rank-1 routing found); call bayesify.convert(model) first."
    )


def find_context(model: nn.Module) -> Rank1Context:
    """The routing context of a converted model (also through wrappers such as DDP)."""
    return find_root(model)._rank1_context


def split_members(root: nn.Module, output: object) -> object:
    """The output of the root's last tiled forward with a member axis in front of each batched leaf.

    A leaf of shape ``[..., members * B, ...]`` (batch at its own axis) becomes
    ``[members, ..., B, ...]``: the members first, everything else as the model returns it.

    Uses the batch axis of that forward (a converted layer used as the model states one per
    output, e.g. a sequence-first LSTM's states); an unbatched example's leaves become
    ``[members, ...]``. PackedSequences and leaves without the tiled batch are returned as they are.
    """
    context: Rank1Context = root._rank1_context
    batch, axis = context.batch_size, context.axis
    leaves, tree = tree_flatten(output, is_leaf=_is_packed)
    axes = _output_axes(root, output, len(leaves), axis)

    def split(t: object, dim: int | None) -> object:
        if dim is None or not isinstance(t, Tensor) or t.dim() <= dim:
            return t
        if axis is None:
            return t.movedim(dim, 0)
        if t.shape[dim] % batch:
            return t
        t = t.movedim(dim, 0)
        return t.reshape(t.shape[0] // batch, batch, *t.shape[1:]).movedim(1, dim + 1)

    return tree_unflatten([split(t, d) for t, d in zip(leaves, axes)], tree)
