"""Per-forward routing of batch rows to mixture components: the :class:`Router` of a converted model.

A converted model's state (:class:`~bayesify.model_state.ModelState`, on its root) holds one :class:`Router`,
asked by the two hooks that run around each forward pass of the root and by every converted layer:

* before it, the router resolves the route (training: one random component per example;
  evaluation: every example through every component, the mixture predictive; or what ``mode()``
  set), tiles the inputs along the batch when the route needs it, and records the component of
  every row in a :class:`ForwardState`, so that every layer routes an example through the *same*
  component;
* after it, when the route asks for the mixture, the router hands the tiled output, with the batch axis of
  each leaf, to :func:`bayesify.predictive.outputs.reduce_output` (what each leaf means is the task's business).

Layers ask :meth:`Router.route` for the routing of *their* call (a :class:`~bayesify.variational.draws.Draw`: the
component of each row of their input, which also covers layers that fold extra axes into the batch, window
attention's ``[B * windows, ...]``; and the pass's draws to take their values from).

The router routes and nothing else: it reads the model's options (:class:`~bayesify.config.ModelOptions`, the
model's one copy) and keeps the ``mode()`` stack (:attr:`Router.overrides`) and the routing of the forward pass
in flight (:attr:`Router.state`). The factors' draws are ``variational/draws.py``'s, the member layout
:mod:`bayesify.mixture`'s, what an output means the task's.

A ``PackedSequence`` is one leaf: its batch is ``batch_sizes[0]`` sequences, tiled and reduced
per sequence. A converted layer used as the model says where the batch lies in each leaf of
its inputs and outputs (:meth:`~bayesify.layers.ConvertedLayer.rank1_input_axes` /
``rank1_output_axes``), e.g. an LSTM whose states ``[layers, B, H]`` have the batch elsewhere.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_unflatten

from bayesify.config import ModelOptions
from bayesify.mixture import split_members, tile
from bayesify.options import Route, Sampling
from bayesify.predictive.libraries import tower_batches
from bayesify.predictive.outputs import (
    check_rows,
    is_packed,
    members_own_pairs,
    output_key,
    primary_leaf,
    reduce_output,
    rows_axis,
)
from bayesify.predictive.tasks import Members, Task
from bayesify.variational.draws import Block, Draw, PassDraws, saved_tensors_hooked

__all__ = ["ForwardState", "RouteSpec", "Router", "is_example_list", "member_rows"]


_in_flight = threading.local()  # .routers: the routers of the converted models whose forward runs on this thread
_CLAIM = threading.Lock()  # a pass's claim on its model's routing: looked at and taken at once


def _passes_in_flight() -> list[Router]:
    """The routers whose root's forward pass is in flight on this thread, innermost last (kept eagerly only)."""
    routers = getattr(_in_flight, "routers", None)
    if routers is None:
        routers = _in_flight.routers = []
    return routers


@dataclass(frozen=True)
class RouteSpec:
    """What one forward pass does: route, noise, samples per component, task (for the mixture), component."""

    route: Route | None = None  # None: the default for the model's train/eval state
    noise: bool | None = None  # None: the default for the model's train/eval state
    samples: int = 1
    task: Task | None = None  # None: the model's
    component: int | None = None


@dataclass(kw_only=True)
class ForwardState:
    """The routing of the forward pass in flight (kept after it for a backward pass that recomputes it)."""

    spec: RouteSpec
    rows: Tensor  # component of every row of the routed batch
    blocks: tuple[Block, ...] | None = None  # the rows as contiguous runs of one component each (None: no such runs)
    block_components: Tensor | None = None  # [len(blocks)] the component of each block, on the rows' device
    fixed_components: tuple[int, ...] | None = None  # the blocks' components when the route fixes them (not sampled)
    batch: int  # examples in the batch as given
    axis: int | None  # batch axis of the inputs (None: one unbatched example)
    members: int = 1  # copies of each example in the routed batch (K * samples when tiled, else 1)
    inputs: dict = field(default_factory=dict)  # the call's keyword arguments as given (a task may read them)
    input_shape: tuple[int, ...] | None = None  # the first tensor input's shape as given (for an error message)
    draws: PassDraws | None = None  # the factors drawn for this pass (the model state sets it: variational/draws.py)
    module_ids: frozenset[int] | None = None  # the root's modules, where a foreign layer's call asked (Router._foreign_call)
    training: bool = True  # the root's train / eval state (a layer in the other one samples as its own says)
    checkpointed: bool = False  # a layer ran under activation checkpointing (its backward recomputes it: Router.reached)

    @property
    def signature(self) -> tuple:
        """What decides which tables a pass draws: passes alike draw alike (see :class:`ModelDraws`)."""
        return (self.spec.route, self.spec.noise, self.spec.samples, self.blocks is None, self.rows.shape[0])


@dataclass
class Router:
    """Routes the rows of every forward pass of one converted model (see the module doc)."""

    options: ModelOptions  # the model's one copy (its ModelState's)
    root_layout: bool = False  # the root is a converted layer that states the batch axes of its inputs and outputs
    overrides: list[RouteSpec] = field(default_factory=list)  # the mode() stack: the last one is in force
    state: ForwardState | None = None
    active: bool = False  # inside the root's forward
    root_ref: Any = None  # weakref.ref to the root (bind sets it; each pass renews it)
    # the tiled routes' row indices by (members, rows each, device): the same for every batch of a size, so made once
    # (five ops a pass, a tenth of a small model's evaluation)
    tiled_rows: dict = field(default_factory=dict)
    # the root's inputs that hold no batch (options.unbatched_inputs; a torch transformer's attention masks, which its
    # attention layers tile themselves): their positions and their keyword names
    unbatched: tuple[frozenset[int], frozenset[str]] = (frozenset(), frozenset())
    # the root's inputs that hold the batch at dimension 0 whatever batch_dim says: a torch transformer root's key
    # padding masks [B, S]
    batch_first: tuple[frozenset[int], frozenset[str]] = (frozenset(), frozenset())
    # the thread of the pass in flight, and of each mode() in force (eagerly): the routing of a pass is the model's,
    # so another thread's pass or mode() would route this one's rows (a plain eval call returned mode()'s member)
    thread: int | None = None
    override_threads: list[int] = field(default_factory=list)
    # the checkpointed passes the backward pass in progress reached: (its graph task, their states, weakly), so that a
    # recomputation in a backward that reached two of them (a loss over two forward passes) is refused
    reached: tuple[int, list] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # the forward pass in flight is not state to copy or save: after torch.export or torch.compile
        # it holds the tracer's fake tensors, which cannot be copied (copy.deepcopy, bayesify.merge)
        state = dict(self.__dict__)
        state["state"], state["active"], state["tiled_rows"] = None, False, {}
        # the root itself, which a weak reference cannot be copied or pickled as: a copy of the model (deepcopy,
        # torch.save / load) binds its own root at once, so that a layer copied out of it before its first pass still
        # knows its model (LayerState.__deepcopy__)
        state["root_ref"] = self.root
        # a mode() is the caller's block around this model: a copy (or a saved model) made inside it leaves it behind,
        # as the block's exit would not reach the copy
        state["overrides"], state["override_threads"], state["thread"] = [], [], None
        state["reached"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        root = state.pop("root_ref", None)
        self.__dict__.update(state)
        self.root_ref = None if root is None else weakref.ref(root)

    @property
    def root(self) -> nn.Module | None:
        """The converted root this router routes (None before its first pass after a copy)."""
        return None if self.root_ref is None else self.root_ref()

    def bind(self, root: nn.Module, *, root_layout: bool = False) -> None:
        """Route ``root``'s passes (``root_layout``: the root is a converted layer stating its batch axes)."""
        self.root_layout = root_layout
        self.root_ref = weakref.ref(root)
        masks = torch_masks(root)
        self.unbatched = input_positions(root, self.options.unbatched_inputs + masks["shared"])
        self.batch_first = input_positions(root, masks["padding"])

    def _member_rows(self, members: int, rows_each: int, device: torch.device) -> Tensor:
        """:func:`member_rows`, kept for the next pass alike (not in a traced graph, whose sizes may be symbolic)."""
        if torch.compiler.is_compiling() or not isinstance(rows_each, int) or torch.is_inference_mode_enabled():
            return member_rows(members, rows_each, device)  # (kept from inference mode, a training step would fail)
        key = (members, rows_each, device)
        rows = self.tiled_rows.get(key)
        if rows is None:
            if len(self.tiled_rows) >= 16:  # a few batch sizes (the last batch of an epoch) at most
                self.tiled_rows.clear()
            rows = self.tiled_rows[key] = member_rows(members, rows_each, device)
        return rows

    @property
    def components(self) -> int:
        return self.options.components

    def resolve(self, training: bool) -> RouteSpec:
        """The route in force: the innermost ``mode()``'s, its unset fields the defaults (:meth:`default_noise`)."""
        spec = self.overrides[-1] if self.overrides else RouteSpec()
        if spec.route is None:
            spec = replace(spec, route=Route.SAMPLE if training else Route.MIXTURE)
        if spec.noise is None:
            spec = replace(spec, noise=self.default_noise(training, spec.samples))
        return spec

    def takes_examples(self, args: tuple, spec: RouteSpec, task: Task | None) -> bool:
        """Whether the call's first argument is a list of examples (:func:`is_example_list`) under ``spec`` (a task
        it says wins) and the model's ``task``."""
        return len(args) > 0 and is_example_list(args[0], spec.task or task, self.options.batch_dim)

    def separate_batches(self, root: nn.Module, args: tuple, kwargs: dict) -> dict[str, int] | None:
        """The model's tower inputs (:func:`~bayesify.predictive.libraries.tower_batches`) when they hold batches of
        different sizes (CLIP's zero-shot: N images, M prompts), else None: one tiled pass cannot route both towers'
        members."""
        if torch.compiler.is_compiling():
            return None
        sizes = tower_batches(root, args, kwargs)
        return sizes if len(set(sizes.values())) > 1 else None

    def default_noise(self, training: bool, samples: int = 1) -> bool:
        """Whether to sample the factors where no ``mode()`` says: what an enclosing ``mode()`` said; else always in
        training, and in evaluation with several samples per component (M samples of one mean would be M copies),
        else as ``eval_noise`` says. (The one place this default is decided: ``predict()`` asks it too.)"""
        said = next((spec.noise for spec in reversed(self.overrides) if spec.noise is not None), None)
        if said is not None:
            return said
        return True if training or samples > 1 else self.options.eval_noise

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

    def noise_for(self, training: bool) -> bool:
        """Whether a layer in ``training`` mode samples its factors now: as the pass in flight says (for a layer in
        the root's train / eval state), or as ``mode()`` says, else the default for the layer's own state."""
        state = self.state
        if self.live() and state is not None:
            return state.spec.noise if training == state.training else self.layer_noise(training)
        return self.resolve(training).noise

    def layer_noise(self, training: bool) -> bool:
        """Whether a layer in ``training`` mode samples in a pass of the root in the other state: as ``mode()`` says,
        else as the layer's own state says, as a dropout does (a sub-module put in eval mode in a training step, a
        frozen backbone say, takes its posterior means; one put in training mode in an evaluation samples)."""
        state = self.state
        return self.default_noise(training, 1 if state is None else state.spec.samples)

    def route(self, n: int, device: torch.device, layer: nn.Module | None = None) -> Draw:
        """The routing of a layer call on ``n`` rows (a :class:`~bayesify.variational.draws.Draw`): each row's
        component, the rows as blocks of one component each when they run so, whether to sample, and the pass's
        draws. ``layer`` is the one asking (its train / eval state and name decide a call made outside the
        converted root's forward: :meth:`route_outside`)."""
        state = self.state
        if state is None or not self.live():
            return self.route_outside(n, device, layer)
        if self.active and not state.checkpointed and not torch.compiler.is_compiling():
            # a layer under activation checkpointing (the non-reentrant kind's saved-tensors hook, the reentrant kind's
            # no_grad): the backward pass will recompute it, and must find this pass again (end(), reached())
            state.checkpointed = saved_tensors_hooked() or not torch.is_grad_enabled()
        per_block = self.options.sampling is Sampling.COMPONENT
        # live but not active: a recomputation in the backward pass (activation checkpointing). Reentrant
        # checkpointing backpropagates through it, so its layers make their values again in a graph of their own
        # (Draw.recompute); the non-reentrant kind runs it under a saved-tensors hook that compares what it saves
        # with the forward's, so its layers take the pass's values, as views (saving nothing the forward did not)
        if not self.active and self.reached is not None and not torch.compiler.is_compiling():
            self._check_recomputed_pass(layer)
        again = not self.active and not torch.compiler.is_compiling() and not saved_tensors_hooked()
        noise = state.spec.noise if layer is None or layer.training == state.training else self.layer_noise(layer.training)
        # a layer whose noise is not the pass's (a sub-module in the other train / eval state) draws its own values
        draws = state.draws if noise == state.spec.noise else None
        rows, blocks, components, fixed, total = state.rows, state.blocks, state.block_components, state.fixed_components, state.rows.shape[0]
        if total == 0:
            # an empty batch: its rows take the per-row path (no blocks, so no zero-row blocks to fold); a
            # batch-independent input still has rows, and with no example to follow they go through component 0
            return Draw(rows=rows if n == 0 else rows.new_zeros(n), noise=noise, per_block=per_block, layer=layer, recompute=again)
        if n == total:
            return Draw(
                rows=rows, noise=noise, blocks=blocks, block_components=components, fixed_components=fixed,
                per_block=per_block, layer=layer, draws=draws, recompute=again,
            )  # fmt: skip
        if n % total == 0:
            # extra axes folded into the batch, batch-major (e.g. windows): repeat each row's component
            factor = n // total
            scaled = None if blocks is None else tuple((a * factor, b * factor) for a, b in blocks)
            return Draw(
                rows=rows[:, None].expand(total, factor).reshape(-1), noise=noise, blocks=scaled, block_components=components,
                fixed_components=fixed, per_block=per_block, layer=layer, draws=draws, repeat=factor, recompute=again,
            )  # fmt: skip
        # a batch-independent input (e.g. a table fed through an MLP): one component for the whole call
        first = rows[:1].expand(n)
        if blocks is None:
            return Draw(rows=first, noise=noise, per_block=per_block, layer=layer, draws=draws, first_only=True, recompute=again)
        return Draw(
            rows=first, noise=noise, blocks=((0, n),), block_components=components[:1], fixed_components=None if fixed is None else fixed[:1],
            per_block=per_block, layer=layer, draws=draws, first_only=True, recompute=again,
        )  # fmt: skip

    def check_unbatched(self, x: Tensor, channel_axis: int, layer: nn.Module | None) -> None:
        """A layer that takes ``x`` as one unbatched example, whose channels are the rows of the pass's tiled batch:
        the model's input was one example, whose dimension ``batch_dim`` the tiled route took as a batch and tiled
        for the members. Say so in one line, with the input's shape and the fix (torch's error names K x B rows)."""
        state = self.state
        if not self.live() or state is None or state.axis is None or state.members == 1:
            return
        if x.shape[channel_axis] != state.rows.shape[0]:
            return
        shape = tuple(state.input_shape) if state.input_shape is not None else None
        raise ValueError(
            f"{type(self.root).__name__ if self.root is not None else 'the model'} was given one unbatched example"
            f"{'' if shape is None else f' (an input of shape {shape})'}: bayesify took its dimension {state.axis} as "
            f"a batch of {state.batch} (batch_dim={state.axis}) and tiled it for the {state.members} members, but "
            f"{self.layer_name(layer)} takes its input as one example; pass a batch of one (x.unsqueeze({state.axis})), "
            f"or say where the batch lies with convert(..., batch_dim=...)."
        )

    def route_outside(self, n: int, device: torch.device, layer: nn.Module | None) -> Draw:
        """A layer called outside the converted root's forward (a sub-module on its own: timm's
        ``forward_features``, a feature extractor, a Hugging Face ``base_model``, one layer). No pass routes its
        rows, so they follow rules every layer of the call applies alike, never a random choice per layer:

        * ``mode(model, component=k)``: every row through member k (deterministic at ``noise=False``);
        * training (the sample route): the rows in K balanced blocks in component order (row ``i`` of ``n``
          through component ``i * K // n``, as every other layer of the call), factors sampled;
        * the mixture (evaluation's default) and the tiled route tile the inputs and reduce the outputs in the
          root's forward, which this call bypasses: a one-line error names what to do instead.
        """
        self._foreign_call(layer)
        training = True if layer is None else layer.training
        # the training route where the layer or the root trains (a frozen backbone put in eval in a training step
        # routes as the step does, at its posterior means; a head trained by itself while the root is in eval, on
        # cached features, samples); evaluation's where both are in eval. The layer's own state says whether it samples
        root = self.root
        routed = training or (root is not None and root.training)  # evaluation's route where both are in eval only
        spec = self.resolve(routed)
        noise = spec.noise if training == routed else self.default_noise(training, spec.samples)
        common = dict(noise=noise, per_block=self.options.sampling is Sampling.COMPONENT, layer=layer)
        if spec.route is Route.COMPONENT:
            rows = torch.full((n,), spec.component, dtype=torch.long, device=device)
            return Draw(rows=rows, blocks=((0, n),), block_components=rows[:1], fixed_components=(spec.component,), **common)
        if spec.route is Route.SAMPLE:
            if n == 0:
                return Draw(rows=torch.zeros(0, dtype=torch.long, device=device), **common)
            rows, blocks, components = _ordered_blocks(self.components, n, device)
            return Draw(rows=rows, blocks=blocks, block_components=components, fixed_components=tuple(range(len(blocks))), **common)
        why = "evaluation's mixture reduces the members' outputs" if spec.route is Route.MIXTURE else "route='tile' tiles the inputs"
        raise RuntimeError(
            f"{self.layer_name(layer)} was called outside the forward pass of its converted model ({type(self.root).__name__ if self.root is not None else 'its root'}), "
            f"and {why} in that pass only; call the whole model, or make the call inside `with bayesify.mode(model, "
            f"component=k):` (member k, k < {self.components}; noise=False for its posterior mean). Code that calls a part "
            "itself (timm's forward_features, a Hugging Face encoder-decoder's generate) needs that mode too."
        )

    def layer_name(self, layer: nn.Module | None) -> str:
        """``layer``'s class and its name in the root (for an error message)."""
        if layer is None:
            return "a converted layer"
        root = self.root
        name = None if root is None else next((n for n, m in root.named_modules() if m is layer), None)
        return f"{type(layer).__name__} {name!r}" if name else type(layer).__name__

    def batch_dim_hint(self, rows: int) -> str:
        """Where a layer's call has ``rows`` that are not the pass's batch, but the model's input has that size at
        another dimension than ``batch_dim``: a hint that the batch lies there (a time-major ``[T, B, C]`` input of a
        model converted with the default ``batch_dim=0``); else ''."""
        state = self.state
        if state is None or state.input_shape is None or state.axis is None or rows == state.batch:
            return ""
        if len(state.input_shape) > 3:  # an image's channels or sizes are no batch (maxvit's relative positions at 3
            return ""  # rows of a [B, 3, H, W] input were told batch_dim=1); a time-major input is [T, B] or [T, B, C]
        others = [i for i, size in enumerate(state.input_shape) if size == rows and i != state.axis]
        if len(others) != 1:
            return ""
        return (
            f" The model's input (shape {state.input_shape}) has {rows} at dimension {others[0]}: if its batch lies "
            f"there (a time-major [T, B, C] input), convert with batch_dim={others[0]}: the pass took dimension "
            f"{state.axis}'s {state.batch} as the batch."
        )

    def _foreign_call(self, layer: nn.Module | None) -> None:
        """Refuse a layer of this model that runs inside another converted model's forward pass, as a part of that
        model (moved there: ``a.head = copy.deepcopy(b.head)``): it would route its rows by this model's rules, not
        by the pass's, mixing two members in each row, silently in training. A part of this model called by
        another's forward (a converted teacher's ``forward_features`` inside a student's) is not such a layer."""
        if layer is None or torch.compiler.is_compiling():
            return
        passes = _passes_in_flight()
        if not passes or passes[-1] is self:
            return
        running = passes[-1]
        state, root = running.state, running.root
        if not running.active or state is None or root is None:
            return
        if state.module_ids is None:  # (once per pass, and only on this rare path)
            state.module_ids = frozenset(id(m) for m in root.modules())
        if id(layer) in state.module_ids:
            name = next((n for n, m in root.named_modules() if m is layer), "")
            origin = type(self.root).__name__ if self.root is not None else "one no longer there"
            raise RuntimeError(
                f"{type(layer).__name__} {name!r} runs in the forward pass of {type(root).__name__} as a part of it, but "
                f"belongs to another converted model ({origin}): it was put there from that model (a trained head on "
                "another network, say), and would route its rows by that model's rules, not this pass's; "
                f"bayesify.convert(model) on the {type(root).__name__} adopts it."
            )

    def claim(self, what: str) -> None:
        """Refuse, in one line, ``what`` (a forward pass, a ``mode()``) on this thread while another thread's pass or
        ``mode()`` uses the model's routing, which one model holds for one pass at a time; else this thread's."""
        me = threading.get_ident()
        with _CLAIM:
            other = self.thread is not None and self.thread != me and self.active
            if other or any(thread != me for thread in self.override_threads):
                raise RuntimeError(
                    f"{what} of a converted {type(self.root).__name__ if self.root is not None else 'model'} started on "
                    "one thread while another thread's forward pass or bayesify.mode() uses the model: a converted model "
                    "routes one pass at a time (its routing and mode() are the model's, not the thread's): enter mode() "
                    "on the thread that runs the pass (a generate in a Thread: inside its target), give each thread its "
                    "own copy (copy.deepcopy(model)), or serialise the calls (a threading.Lock)."
                )
            if what != "mode()":
                self.thread = me

    def owns_pass(self) -> bool:
        """Whether the pass in flight (if any) is this thread's: the root's post-hook of a pass refused by
        :meth:`claim` leaves the other thread's pass alone."""
        return torch.compiler.is_compiling() or self.thread is None or self.thread == threading.get_ident()

    def _enter(self) -> None:
        if not torch.compiler.is_compiling():
            self.claim("a forward pass")
        self.active = True
        if not torch.compiler.is_compiling():
            passes = _passes_in_flight()
            passes[:] = [router for router in passes if router.active]  # (a pass that ended in an error, left behind)
            passes.append(self)

    # ---- the root's forward pass (its model state's hooks call these) -------------------------

    def begin(self, module: nn.Module, args: tuple, kwargs: dict, task: Task | None = None) -> tuple[tuple, dict]:
        """Route the root's forward pass on ``args`` / ``kwargs`` (tiled for a mixture); ``task``: the model's."""
        if not torch.compiler.is_compiling() and (self.root_ref is None or self.root_ref() is not module):
            self.root_ref = weakref.ref(module)
        spec = self.resolve(module.training)
        if self.takes_examples(args, spec, task):
            return self._begin_list(module, spec, args, kwargs)
        leaves, tree = tree_flatten((args, kwargs), is_leaf=is_packed)
        held = self._leaves_in(self.unbatched, args, kwargs) if any(self.unbatched) else [False] * len(leaves)
        first = next((t for t, h in zip(leaves, held) if not h and isinstance(t, (Tensor, PackedSequence))), None)
        if first is None:
            raise TypeError(
                f"bayesify found no tensor input to route through the {self.components} mixture components; "
                "pass the batch as a tensor argument."
            )
        # a converted layer used as the model knows its own layout (batch axis, or None if unbatched): the layer
        # contract's rank1_batch_axis / rank1_input_axes / rank1_output_axes
        layer = module if self.root_layout else None
        axis = layer.rank1_batch_axis(first) if layer is not None else self.options.batch_dim
        if axis is not None and isinstance(first, Tensor) and first.dim() <= axis:
            raise TypeError(
                f"bayesify expects the batch at dimension {axis} of the model's first tensor input, which has "
                f"shape {tuple(first.shape)}; set convert(..., batch_dim=...) to where the batch lies."
            )
        if isinstance(first, PackedSequence):
            batch, device = int(first.batch_sizes[0]), first.data.device
        else:
            batch, device = (1 if axis is None else first.shape[axis]), first.device
        if spec.route in (Route.TILE, Route.MIXTURE) and (towers := self.separate_batches(module, args, kwargs)):
            given = ", ".join(f"{name} {size}" for name, size in towers.items())
            raise ValueError(
                f"{type(module).__name__} was given batches of different sizes ({given}), and one tiled pass routes "
                f"one batch through the {self.components} members (the other tower ran one member for all, silently); "
                "for the members' outputs call bayesify.predict(model, ...), which runs each member once on these "
                "inputs, or pass batches of one size."
            )
        self._enter()
        shape = tuple(first.shape) if isinstance(first, Tensor) else None  # (as given: for an error message, a hint)
        if spec.route is Route.SAMPLE:
            if self.options.sampling is Sampling.EXAMPLE:  # the reference: a random component per example
                rows = torch.randint(self.components, (batch,), device=device)
                self.state = ForwardState(spec=spec, rows=rows, batch=batch, axis=axis, input_shape=shape, training=module.training)
            else:
                rows, blocks, components = _balanced_blocks(self.components, batch, device)
                self.state = ForwardState(
                    spec=spec, rows=rows, blocks=blocks, block_components=components, batch=batch, axis=axis, input_shape=shape,
                    training=module.training,
                )  # fmt: skip
            return args, kwargs
        if spec.route is Route.COMPONENT:
            rows = torch.full((batch,), spec.component, dtype=torch.long, device=device)
            self.state = ForwardState(
                spec=spec, rows=rows, blocks=((0, batch),), block_components=rows[:1], fixed_components=(spec.component,),
                batch=batch, axis=axis, input_shape=shape, training=module.training,
            )  # fmt: skip
            return args, kwargs
        # tile / mixture: member-major rows, component k owns rows [k*M*B, (k+1)*M*B); one block per member
        members = self.components * spec.samples
        rows = self._member_rows(self.components, spec.samples * batch, device)
        blocks = tuple((i * batch, (i + 1) * batch) for i in range(members))
        components = self._member_rows(self.components, spec.samples, device)
        fixed = tuple(i // spec.samples for i in range(members))
        self.state = ForwardState(
            spec=spec, rows=rows, blocks=blocks, block_components=components, fixed_components=fixed, batch=batch,
            axis=axis, members=members, inputs=kwargs, input_shape=shape, training=module.training,
        )  # fmt: skip

        axes = layer.rank1_input_axes(args, kwargs) if layer is not None else None
        if axes is None:
            axes = [(0 if t is first else None) if axis is None else axis for t in leaves]
            if axis is not None and any(self.batch_first):  # (a time-major torch transformer's key padding mask)
                axes = [0 if b else a for a, b in zip(axes, self._leaves_in(self.batch_first, args, kwargs))]

        def unambiguous() -> bool:  # (asked only of a 1-D leaf: no guard on the sizes in a compiled pass otherwise)
            return shape is not None and list(shape).count(batch) == 1

        def tile_leaf(t: object, dim: int | None) -> object:
            if isinstance(t, PackedSequence):
                return _tile_packed(t, members) if int(t.batch_sizes[0]) == batch else t
            if not isinstance(t, Tensor) or dim is None:
                return t
            if axis is None:  # one unbatched example: the members become the batch
                return t.unsqueeze(dim).expand(*t.shape[:dim], members, *t.shape[dim:])
            if t.dim() > dim and t.shape[dim] == batch:
                return tile(t, members, dim)
            if t.dim() == 1 and dim > 0 and layer is None and t.shape[0] == batch and unambiguous():
                # one entry per example where the batch lies at another dimension (a time-major model's sequence
                # lengths [B], batch_dim=1): its one dimension is the batch's. Not where the first input has the
                # batch's size at another dimension too (T == B: a [T] vector of the time steps looks the same)
                return tile(t, members, 0)
            return t

        return tree_unflatten([t if h else tile_leaf(t, d) for t, d, h in zip(leaves, axes, held)], tree)

    @staticmethod
    def _leaves_in(inputs: tuple[frozenset[int], frozenset[str]], args: tuple, kwargs: dict) -> list[bool]:
        """For each leaf of ``(args, kwargs)`` (in ``tree_flatten``'s order), whether it is in one of ``inputs``
        (positions, keyword names: :func:`input_positions`)."""
        positions, names = inputs
        held: list[bool] = []
        for i, value in enumerate(args):
            held += [i in positions] * len(tree_flatten(value, is_leaf=is_packed)[0])
        for name, value in kwargs.items():
            held += [name in names] * len(tree_flatten(value, is_leaf=is_packed)[0])
        return held

    def _begin_list(self, module: nn.Module, spec: RouteSpec, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A list of examples (torchvision detection: images of different sizes) as the first argument.

        Its rows are not kept aligned with the examples inside such models (a detector's heads see a
        varying number of proposals per image), so every row of a forward pass goes through one
        component: one drawn per pass in training, the chosen one with ``mode(component=k)``. The
        members of a batch are one pass each (:func:`bayesify.predict` loops over them); a single
        tiled pass is refused rather than routed wrongly.
        """
        batch, device = len(args[0]), args[0][0].device
        if spec.route in (Route.TILE, Route.MIXTURE):
            raise ValueError(
                f"{type(module).__name__} takes a list of examples, whose members cannot share one tiled batch; use "
                "bayesify.predict(model, inputs) for the members (one pass each; bayesify.detection.fuse_detections "
                "merges a detector's boxes), or bayesify.mode(model, component=k) for one member."
            )
        component = spec.component if spec.route is Route.COMPONENT else int(torch.randint(self.components, ()))
        rows = torch.full((batch,), component, dtype=torch.long, device=device)
        self._enter()
        self.state = ForwardState(
            spec=spec, rows=rows, blocks=((0, batch),), block_components=rows[:1], batch=batch, axis=0, training=module.training
        )
        return args, kwargs

    def end(self, module: nn.Module, output: object, task: Task, look: bool = False) -> object:
        """After the root's forward: a mixture's tiled output reduced by the pass's task, else ``task`` (the model's);
        ``look``: the model's first mixture pass (see :func:`~bayesify.predictive.outputs.reduce_output`)."""
        # rows stay in self.state for a backward pass that recomputes this forward (see live())
        self.active = False
        if not torch.compiler.is_compiling():
            passes = _passes_in_flight()
            for i in range(len(passes) - 1, -1, -1):  # (by identity: a Router compares its fields)
                if passes[i] is self:
                    del passes[i]
                    break
            if not any(router is self for router in passes):
                self.thread = None
        state = self.state
        if state is None:
            return output
        inputs, state.inputs = state.inputs, {}  # not held past the pass (they may be large)
        if state.checkpointed and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._watch_backward(module, state, output)
        if state.spec.route is Route.TILE and getattr(primary_leaf(output), "ndim", 0) > 0:  # (not a scalar loss)
            # the tiled route hands its K*B rows back as they are: refuse an output without them, as the mixture does
            check_rows(module, output, members=state.members, batch=state.batch, axis=state.axis)
        if state.spec.route is not Route.MIXTURE:
            return output
        axes = self.output_axes(module, output, state.axis)
        return reduce_output(
            module, output, state.spec.task or task, members=state.members, batch=state.batch, axis=state.axis,
            axes=axes, inputs=inputs, look=look,
        )  # fmt: skip

    def _watch_backward(self, root: nn.Module, state: ForwardState, output: object) -> None:
        """A pass whose layers ran under activation checkpointing: when a backward pass reaches its output, its
        routing becomes the router's again, for the recomputation of its layers (another pass since, a monitoring
        pass in evaluation or a second view, left its own rows there: the recomputation took them, its gradients
        silently wrong or a shape error inside torch). A recomputation in a backward that reached two such passes is
        refused (:meth:`_check_recomputed_pass`): which pass it belongs to cannot be told."""
        leaves = [t for t in tree_flatten(output, is_leaf=is_packed)[0] if isinstance(t, Tensor) and t.requires_grad]
        if not leaves:
            return
        # (the hook holds the pass's state as long as the output's graph holds the hook: the recomputation needs it)
        def reached(grad: Tensor) -> None:
            task = torch._C._current_graph_task_id()
            if self.reached is None or self.reached[0] != task:
                self.reached = (task, [])
            if not any(ref() is state for ref in self.reached[1]):
                self.reached[1].append(weakref.ref(state))
            self.state = state  # (its rows and draws, for the recomputation: route() reads them)

        for leaf in leaves:
            leaf.register_hook(reached)

    def _check_recomputed_pass(self, layer: nn.Module | None) -> None:
        """A recomputation (activation checkpointing) in a backward pass that reached two checkpointed forward passes:
        which one's rows it recomputes cannot be told (their layers and shapes alike); refused in one line."""
        if self.reached is None or self.reached[0] != torch._C._current_graph_task_id():
            return
        passes = {id(state) for ref in self.reached[1] if (state := ref()) is not None}
        if len(passes) > 1:
            name = type(self.root).__name__ if self.root is not None else "the model"
            raise RuntimeError(
                f"this backward pass recomputes activation-checkpointed layers ({self.layer_name(layer)}) of one of "
                f"{len(passes)} forward passes of {name} it reached (a loss over several calls: two views, R-Drop), "
                "whose rows went through other members, and bayesify cannot tell which; pass the inputs as one batch "
                "(torch.cat), or call backward() after each forward pass (gradients accumulate), or leave "
                "checkpointing off."
            )

    def output_axes(self, root: nn.Module, output: object, axis: int | None) -> list[int | None]:
        """The batch axis of each output leaf: the root layer's own statement, else the input's axis."""
        count = len(tree_flatten(output, is_leaf=is_packed)[0])
        axes = root.rank1_output_axes(output) if self.root_layout else None
        return [0 if axis is None else axis] * count if axes is None else axes

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
        leaves, tree = tree_flatten_with_path(output, is_leaf=is_packed)
        axes = self.output_axes(root, output, axis)

        def split_leaf(path: tuple, t: object, dim: int | None) -> object:
            if axis is not None and batch:  # (the batch may lie elsewhere in an output: as the reduction finds it)
                t = members_own_pairs(output_key(path), t, state.members, batch)
                dim = rows_axis(t, dim, state.members * batch)
            if dim is None or not isinstance(t, Tensor) or t.dim() <= dim:
                return t
            if axis is None:
                return t.movedim(dim, 0)
            if batch == 0:  # an empty batch: every member is empty too (a leaf with rows is not batched)
                return split_members(t, state.members, dim) if t.shape[dim] == 0 else t
            if t.shape[dim] % batch:
                return t
            return split_members(t, t.shape[dim] // batch, dim)

        return tree_unflatten([split_leaf(path, t, d) for (path, t), d in zip(leaves, axes)], tree)


def _balanced_blocks(components: int, batch: int, device: torch.device) -> tuple[Tensor, tuple[Block, ...], Tensor]:
    """The sample route's ``(rows, blocks, block_components)``: contiguous, balanced blocks, one per
    component, the components in a random order.

    A uniform, stratified assignment (the data is shuffled anyway): every component gets
    ``batch // K`` or one more rows, and which component takes which block is random, so an
    unshuffled batch is no worse off than with one random component per example. The blocks depend
    on the batch size alone; the order stays a tensor (no ``.tolist()``: ``torch.compile`` traces it
    without a graph break). It is drawn on the CPU, and no device sync is needed to know the blocks.
    """
    if not isinstance(batch, int) and torch.compiler.is_exporting():  # a symbolic batch: dynamic_shapes on it
        raise ValueError(
            "the training route splits the batch into blocks of Python-number sizes, so a model in training exports "
            "with a static batch only: export it in evaluation (model.eval(): the mixture, any batch size), or "
            "without dynamic_shapes on the batch."
        )
    # (not divmod: torch.compile's symbolic batch, under dynamic=True or from a second batch size such as an epoch's
    # last partial one, takes // and % and specialises on the remainder; divmod failed the step under
    # fullgraph=True and broke the graph without it)
    base, extra = batch // components, batch % components
    sizes = [size for size in [base + 1] * extra + [base] * (components - extra) if size]
    ends = list(itertools.accumulate(sizes))
    blocks = tuple((end - size, end) for size, end in zip(sizes, ends))
    order = torch.randperm(components)
    if len(sizes) < components:  # (a slice of all of it is still an op)
        order = order[: len(sizes)]
    if torch.compiler.is_compiling():
        # output_size: the length is known, so tracing it is no data-dependent shape
        # (an empty batch has no blocks: the sizes must still be integers, as an empty list makes a float tensor)
        rows = order.repeat_interleave(torch.tensor(sizes, dtype=torch.long), output_size=batch)
    else:  # the same, as one gather by each row's block number (made once per batch size): two ops fewer a step
        rows = order.index_select(0, _block_numbers(tuple(sizes)).to(order.device))
    return rows.to(device, non_blocking=True), blocks, order.to(device, non_blocking=True)


def _ordered_blocks(components: int, batch: int, device: torch.device) -> tuple[Tensor, tuple[Block, ...], Tensor]:
    """:func:`_balanced_blocks` with the components in order (block k through component k): the same for every
    layer of a call outside the root's forward, so they all route a row alike with no shared state."""
    base, extra = divmod(batch, components)
    sizes = tuple(size for size in [base + 1] * extra + [base] * (components - extra) if size)
    ends = list(itertools.accumulate(sizes))
    blocks = tuple((end - size, end) for size, end in zip(sizes, ends))
    return _block_numbers(sizes).to(device), blocks, torch.arange(len(sizes), device=device)


def _block_numbers(sizes: tuple[int, ...]) -> Tensor:
    """``[0, 0, ..., 1, ...]``: the block of each row, for blocks of ``sizes`` rows (on the CPU, as the order); kept
    for the next pass alike, except one made in inference mode (an inference tensor fails a later backward)."""
    return _made_block_numbers(sizes) if torch.is_inference_mode_enabled() else _kept_block_numbers(sizes)


def _made_block_numbers(sizes: tuple[int, ...]) -> Tensor:
    cpu = torch.device("cpu")  # whatever default device is in force when it is first made (it is kept)
    return torch.arange(len(sizes), device=cpu).repeat_interleave(torch.tensor(sizes, dtype=torch.long, device=cpu))


_kept_block_numbers = functools.lru_cache(maxsize=16)(_made_block_numbers)


def member_rows(components: int, rows_each: int, device: torch.device) -> Tensor:
    """``[k, k, ..., k+1, ...]``: component k for rows ``[k * rows_each, (k + 1) * rows_each)``.

    Written as a broadcast rather than ``repeat_interleave`` so that exported graphs (ONNX) keep a
    dynamic batch (onnxscript's ``repeat_interleave`` with a symbolic count is off by one).
    """
    return torch.arange(components, device=device)[:, None].expand(components, rows_each).reshape(-1)


# torch's transformer modules: a model of these takes the batch where batch_first says (convert checks), attention
# masks [L, S] shared by the batch or [B * heads, L, S] (its attention layers tile those), key padding masks [B, S]
TORCH_TRANSFORMER_MODULES = (
    nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer
)


def torch_masks(root: nn.Module) -> dict[str, tuple[str, ...]]:
    """The inputs of a torch transformer module's forward (the root) that follow torch's mask conventions whatever
    ``batch_dim`` says: ``padding``, its key padding masks ``[B, S]``; ``shared``, its attention masks, which it leaves
    to its attention layers. (Where the sequence is as long as the batch, tiling these at ``batch_dim`` tiled the
    wrong axis: an error inside torch.) A model of one's own lays its masks out as it likes: none here."""
    if not isinstance(root, TORCH_TRANSFORMER_MODULES):
        return {"padding": (), "shared": ()}
    names = list(inspect.signature(root.forward).parameters)
    padding = tuple(n for n in names if n.endswith("key_padding_mask"))
    shared = tuple(n for n in names if n in ("mask", "src_mask", "tgt_mask", "memory_mask"))
    return {"padding": padding, "shared": shared}


def input_positions(root: nn.Module, inputs: tuple[str | int, ...]) -> tuple[frozenset[int], frozenset[str]]:
    """The positions and keyword names of ``root``'s forward inputs named in ``inputs`` (names or positions), from
    its signature; an input it cannot have is refused in one line."""
    if not inputs:
        return frozenset(), frozenset()
    try:
        parameters = list(inspect.signature(root.forward).parameters.values())
    except (TypeError, ValueError):  # no signature at hand: take the names and positions as given
        parameters = []
    P = inspect.Parameter
    positional = [p.name for p in parameters if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name for p in parameters if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    open_ended = not parameters or any(p.kind is P.VAR_KEYWORD for p in parameters)
    more_positions = not parameters or any(p.kind is P.VAR_POSITIONAL for p in parameters)
    positions, names = set(), set()
    for entry in inputs:
        if isinstance(entry, int):
            if entry >= len(positional) and not more_positions:
                raise ValueError(
                    f"unbatched_inputs names position {entry}, but {type(root).__name__}.forward takes "
                    f"{len(positional)} positional input(s) ({', '.join(positional)}); name an input it has."
                )
            positions.add(entry)
            if entry < len(positional):
                names.add(positional[entry])
        else:
            if entry not in keywords and entry not in positional and not open_ended:
                raise ValueError(
                    f"unbatched_inputs names {entry!r}, which is not an input of {type(root).__name__}.forward"
                    f"({', '.join(p.name for p in parameters)}); name one of its inputs."
                )
            names.add(entry)
            if entry in positional:
                positions.add(positional.index(entry))
    return frozenset(positions), frozenset(names)


def is_example_list(value: object, task: Task | None = None, batch_axis: int | None = 0) -> bool:
    """Whether ``value`` is a list of examples (torchvision detection's images, each of its own size): a plain list
    (or tuple; not a PackedSequence or another named tuple) of tensors given to a model whose members are returned as
    they are (``task`` :class:`Members`: a detector), or whose tensors do not share one size at the batch axis. Tensors
    that do (views or parts of one batch, ``[x_img [B, 16], x_meta [B, 8]]``) are a container of batches, routed as a
    dict's values are."""
    if type(value) not in (list, tuple) or not value or not all(isinstance(v, Tensor) for v in value):
        return False
    if isinstance(task, Members) or batch_axis is None:
        return True
    return len({v.shape[batch_axis] if v.dim() > batch_axis else None for v in value} - {None}) != 1 or any(
        v.dim() <= batch_axis for v in value
    )


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


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1

