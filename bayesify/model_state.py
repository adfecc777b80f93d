"""The state of one converted model: :class:`ModelState`, the counterpart of each layer's ``LayerState``.

Everything bayesify keeps for a whole model is one object on the converted root, ``root.rank1_model``:

* ``options``: the options every layer shares (:class:`~bayesify.config.ModelOptions`: K, ``batch_dim``,
  ``sampling``, ``eval_noise``), frozen, one copy: layers read them from here, never a copy of their own;
* ``task``: what the root's output means, resolved once by ``convert()``;
* ``router``: which component each row of a pass goes through (``_router.py``: rows, blocks, tiling, splitting);
* ``draws``: the model's groups of tables and how each pass draws them (``variational/draws.py``);
* ``report``: what ``convert()`` left deterministic and why (:func:`bayesify.summary` reads it);
* the hooks it installed on the root: the forward pre- and post-hooks that route each pass, the load pre-hook
  that maps release 0.3's checkpoints, and ``no_weight_decay()``. :meth:`ModelState.detach` removes them all.

One forward pass: the pre-hook asks the router for the pass's rows (:meth:`Router.begin`), then the draws for
those rows (:meth:`ModelDraws.begin`), before any layer runs; each layer asks the router for its rows and takes
its values from the pass's draws (``variational/draws.py``'s ``Draw``); the post-hook hands a mixture's tiled
output to the task's reduction (:meth:`Router.end`).
"""

from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from bayesify import _weight_decay
from bayesify._router import Router
from bayesify.config import ModelOptions
from bayesify.options import Route
from bayesify.predictive.libraries import as_asked, named_outputs, restated_task
from bayesify.predictive.tasks import Auto, Task
from bayesify.variational import store
from bayesify.variational.draws import ModelDraws

__all__ = [
    "ConversionReport", "ModelState", "Skip", "SkipKind", "find_root", "is_root", "model_state", "split_output",
]  # fmt: skip

ATTRIBUTE = "rank1_model"  # where the root holds its ModelState (in its __dict__: not a submodule)


class SkipKind(str, Enum):
    """Why a weight-bearing module stayed deterministic."""

    NO_LAYER_CLASS = "no_layer_class"  # nothing in the mapping converts it (it may or may not be a linear map)
    EMBEDDING = "embedding"  # an embedding, deterministic unless embeddings=True
    NOT_INCLUDED = "not_included"
    EXCLUDED = "excluded"
    ADDED_LATER = "added_later"  # not there at conversion time


@dataclass(frozen=True)
class Skip:
    kind: SkipKind
    message: str

    @property
    def guessed(self) -> bool:
        """A static guess (it has a matrix and no layer class), not the user's choice: a probe may overrule it."""
        return self.kind in (SkipKind.NO_LAYER_CLASS, SkipKind.ADDED_LATER)


@dataclass
class ConversionReport:
    """What :func:`~bayesify.convert` left deterministic and why (read by :func:`bayesify.summary`)."""

    skipped: dict[str, Skip] = field(default_factory=dict)


@dataclass
class ModelState:
    """Everything bayesify keeps for one converted model (``root.rank1_model``; see the module doc)."""

    options: ModelOptions
    task: Task = field(default_factory=Auto)  # Auto: nobody said, and the model states nothing (predictive/tasks.py)
    router: Router = None  # type: ignore[assignment]  # (made from the options in __post_init__)
    draws: ModelDraws = None  # type: ignore[assignment]
    report: ConversionReport = field(default_factory=ConversionReport)
    handles: list[RemovableHandle] = field(default_factory=list)  # the hooks attach() installed on the root
    warned: set[str] = field(default_factory=set)  # the warnings given once per model (their kinds)
    # whether the last predict() through a module holding this model handed this model's output on as it is (the
    # module's output then means what this model's does: inspection.check_handed_on)
    handed_on: bool = True
    as_tuple: bool = False  # the pass in flight returns its named outputs as the tuple the call asked for
    checked_layers: tuple[int, ...] = ()  # (modules, converted layers' ids) when kl_divergence last looked for added ones

    def __post_init__(self) -> None:
        if self.router is None:
            self.router = Router(self.options)
        if self.draws is None:
            self.draws = ModelDraws(self.options.components)

    @property
    def components(self) -> int:
        """K, the number of mixture components."""
        return self.options.components

    def current_task(self, root: nn.Module | None = None) -> Task:
        """:attr:`task`, read again from the root's Hugging Face config where it changed since it was read
        (transformers sets ``config.problem_type`` in the first forward pass with labels; see :func:`restated_task`).
        ``root``: the converted root (default: the one this state is bound to)."""
        root = root if root is not None else self.root
        task = self.task if root is None else restated_task(root, self.task)
        if task is not self.task:  # (written only when it changed: nothing mutated on every pass, in a graph either)
            self.task = task
        return task

    @property
    def root(self) -> nn.Module | None:
        """The converted root (None before its first pass after a copy)."""
        return self.router.root

    # ---- the hooks on the root ------------------------------------------------------------------

    def attach(self, root: nn.Module, *, root_layout: bool = False) -> None:
        """Install this state on ``root`` with its hooks. ``root_layout``: the root is a converted layer, which
        states where the batch lies in its inputs and outputs (the layer contract's ``rank1_batch_axis`` ...)."""
        self.router.bind(root, root_layout=root_layout)
        root.__dict__[ATTRIBUTE] = self
        self.handles = [
            root.register_forward_pre_hook(_pre_hook, with_kwargs=True),
            # (first of the root's forward hooks: one registered before convert sees the reduced output too)
            root.register_forward_hook(_post_hook, with_kwargs=True, always_call=True, prepend=True),
            root.register_load_state_dict_pre_hook(_load_hook),
            root.register_state_dict_post_hook(_save_hook),
        ]
        _weight_decay.install(root)  # timm's optimizer factory: no weight decay on the rank-1 parameters

    def hook_bags(self, root: nn.Module) -> None:
        """Install :func:`_retile_flat_bag` on every ``nn.EmbeddingBag`` of ``root`` (converted or not) that has it not
        yet; the handles go with the root's, so ``revert`` removes them."""
        for module in root.modules():
            hooked = any(getattr(h, "func", None) is _retile_flat_bag for h in module._forward_pre_hooks.values())
            if isinstance(module, nn.EmbeddingBag) and not hooked:
                self.handles.append(module.register_forward_pre_hook(functools.partial(_retile_flat_bag, self)))

    def detach(self, root: nn.Module) -> None:
        """Remove what :meth:`attach` installed on ``root``, and this state itself."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        _weight_decay.remove(root)
        if root.__dict__.get(ATTRIBUTE) is self:
            del root.__dict__[ATTRIBUTE]

    def begin(self, root: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Before the root's forward: route the pass, then draw every group of tables for its rows."""
        if torch.jit.is_tracing():  # (its layers' choices read shapes as Python numbers, which the tracer makes tensors)
            raise RuntimeError(
                f"torch.jit.trace (and torch.onnx.export(..., dynamo=False), which uses it) cannot trace a converted "
                f"{type(root).__name__}: its routing decides in Python on every pass. Use torch.export.export(model, "
                "(x,)) or torch.onnx.export(model, (x,), dynamo=True), or trace one member as a plain network: "
                "bayesify.merge(model, component=k)."
            )
        if root.__dict__.get("_is_replica", False):  # (set by nn.Module._replicate_for_data_parallel)
            raise RuntimeError(
                f"nn.DataParallel made replicas of the converted {type(root).__name__} on several devices, which run in "
                "threads at once and would share its one routing of the pass (each replica's rows routed as another's); "
                "use DistributedDataParallel (one process per GPU: torchrun), or one device."
            )
        args, kwargs = self.router.begin(root, args, kwargs, self.task)
        state = self.router.state
        # a pass whose members are tiled reads each output by its name (a Hugging Face model asked for a tuple is
        # called for its ModelOutput), then hands back what the call asked for (end)
        self.as_tuple = False
        if state.spec.route in (Route.MIXTURE, Route.TILE):
            kwargs, self.as_tuple = named_outputs(root, kwargs)
            if not root.training and "batch statistics" not in self.warned and not torch.compiler.is_compiling():
                self.warned.add("batch statistics")  # (looked for once per model)
                _warn_batch_statistics(root)
        state.draws = self.draws.begin(
            state.spec.noise, state.rows, state.blocks, state.block_components, state.fixed_components, state.signature
        )
        return args, kwargs

    def end(self, root: nn.Module, output: object) -> object:
        """After the root's forward: the mixture's reduction of a tiled output, by the pass's task or the model's."""
        if not self.router.owns_pass():  # (a pass refused on this thread: another thread's is in flight)
            return output
        state = self.router.state
        error = sys.exc_info()[1]
        if output is None and error is not None and state is not None and state.members > 1 and self.router.active:
            # (torch calls this hook as the forward raises) the error names the tiled batch's rows, not the input's
            error.add_note(
                f"bayesify: {type(root).__name__} ran this pass on its tiled batch, each of the {state.batch} examples "
                f"given {state.members} times (one row per member: {state.members * state.batch} rows); the input "
                f"as given had shape {tuple(state.input_shape) if state.input_shape is not None else '?'}. Every input "
                f"with {state.batch} entries at dimension {state.axis} was tiled (with batch_dim > 0, a 1-D one of "
                "that size too, where the first input has it once): one that holds no batch and has that "
                "size by chance (a [T, T] attention mask, an RNN's initial state [layers, B, H]) is named in "
                "bayesify.convert(model, unbatched_inputs=[...])."
            )
        if state is not None and state.draws is not None:
            self.draws.end(state.draws)
        # a model's class outputs are looked at once for probabilities (a final softmax): one sync, in its first
        # mixture pass only
        look = state is not None and state.spec.route is Route.MIXTURE and "probabilities" not in self.warned
        output = self.router.end(root, output, self.current_task(root), look=look)
        if look and not torch.compiler.is_compiling():
            self.warned.add("probabilities")  # (looked at, and not refused)
        return as_asked(output) if self.as_tuple else output


def _warn_batch_statistics(root: nn.Module) -> None:
    """Warn where a tiled evaluation pass mixes its members: a batch norm that normalises by the batch's own
    statistics in evaluation (``track_running_stats=False``, or left in training mode) pools the K x B rows of every
    member, so member k is not ``mode(component=k)``'s and the predictive not the members' exact mixture."""
    pooled = [
        name or type(root).__name__ for name, m in root.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None)
    ]  # fmt: skip
    if pooled:
        warnings.warn(
            f"the batch norm layers {', '.join(map(repr, pooled[:3]))}{' ...' if len(pooled) > 3 else ''} of "
            f"{type(root).__name__} normalise by the statistics of the evaluation batch, which holds every member's "
            "rows: their statistics are pooled across the members, so the "
            "predictive is not their exact mixture. Give them running statistics (track_running_stats=True, trained) "
            "or a per-example norm (GroupNorm, LayerNorm), or evaluate one member at a time: bayesify.mode(model, "
            "component=k).",
            stacklevel=2,
        )


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return module.__dict__[ATTRIBUTE].begin(module, args, kwargs)


def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
    return module.__dict__[ATTRIBUTE].end(module, output)


def _retile_flat_bag(state: ModelState, bag: nn.Module, args: tuple) -> tuple | None:
    """An ``nn.EmbeddingBag`` called in its flat form (1-D tokens, one offset per bag) in a tiled pass whose batch
    came from another input (a recommender's dense features): the pass tiled the offsets, which have one entry per
    example, and not the tokens, so every member looked up the first member's tokens at offsets out of order (a
    mixture 0.4 off, silently). The members' tokens are tiled too and each member's offsets moved to its copy."""
    router = state.router
    members = router.tiles
    if members < 2 or len(args) < 2 or bag.include_last_offset:
        return None
    tokens, offsets = args[0], args[1]
    batch = router.state.batch
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or not isinstance(offsets, torch.Tensor):
        return None
    if offsets.dim() != 1 or offsets.shape[0] != members * batch or tokens.shape[0] == members * batch:
        return None
    shift = torch.arange(members, device=offsets.device).repeat_interleave(batch) * tokens.shape[0]
    rest = tuple(a.repeat(members) if isinstance(a, torch.Tensor) and a.shape == tokens.shape else a for a in args[2:])
    return (tokens.repeat(members), offsets + shift.to(offsets.dtype), *rest)


def _load_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    # (local_metadata, strict, missing_keys, unexpected_keys, error_msgs): see variational/store.load_tables
    _refuse_another_meaning(module, state_dict, prefix, args[0])
    store.load_tables(module.__dict__[ATTRIBUTE].draws.groups, state_dict, prefix, error_msgs=args[-1])


def _save_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict) -> None:
    """What each layer's saved rank-1 values mean, in the root's own metadata: a root loaded inside another module
    (a wrapper, a Lightning module) gets its local metadata only, not its layers' (torch hands a child's pre-hook a
    dict without them)."""
    local_metadata["rank1_meanings"] = {
        name: layer.rank1_state.options.meaning for name, layer in module.named_modules() if "rank1_state" in layer.__dict__
    }


def _refuse_another_meaning(root: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict) -> None:
    """Refuse in one line, before anything loads (the root's pre-hook runs first), a checkpoint whose rank-1 values
    mean something else in this model: saved under another ``perturbation`` or ``posterior`` (each layer's
    ``meaning``, in the root's metadata, or in the layers' of a checkpoint saved before it was kept there; a format
    without metadata, safetensors, loads unchecked). The layers' own pre-hooks keep the check for a layer loaded on
    its own."""
    meanings = local_metadata.get("rank1_meanings") if isinstance(local_metadata, dict) else None
    metadata = getattr(state_dict, "_metadata", None)
    if not meanings and not metadata:
        return
    for name, layer in root.named_modules():
        state = layer.__dict__.get("rank1_state")
        key = prefix + name if name else prefix[:-1]
        if state is None:
            continue
        saved = meanings.get(name) if meanings else (metadata or {}).get(key, {}).get("rank1")
        if not saved or not any(k.startswith(f"{key}.rank1_" if key else "rank1_") for k in state_dict):
            continue
        now = state.options.meaning
        differ = [k for k in now if k in saved and saved[k] != now[k]]
        if differ:
            said = ", ".join(f"{k}={saved[k]!r}" for k in differ)
            raise ValueError(
                f"the checkpoint's rank-1 values (of {key or type(layer).__name__}, and any other layer) were saved "
                f"from a model converted with {said}, and mean something else in this one ("
                + ", ".join(f"{k}={now[k]!r}" for k in differ)
                + f"); convert with bayesify.convert(model, {said}) before loading; nothing was loaded"
            )


def is_root(module: nn.Module) -> bool:
    """Whether ``module`` carries the routing hooks of a converted model."""
    return any(h is _pre_hook for h in module._forward_pre_hooks.values())


def find_root(model: nn.Module) -> nn.Module:
    """The module carrying the routing hooks of a converted model (also through wrappers such as DDP)."""
    for module in model.modules():
        if is_root(module):
            return module
    raise ValueError(
        f"{type(model).__name__} is not a converted model (no rank-1 routing found); call bayesify.convert(model) first."
    )


def hands_on_root_output(model: nn.Module) -> bool:
    """Whether ``model``'s output is its converted root's, as the root returns it: the root itself, or a wrapper
    whose forward hands the call on (DDP, ``nn.DataParallel``, ``AveragedModel``, ``torch.compile``'s). A module of
    one's own that holds a converted part (a backbone converted on its own, under a plain head) is not: what the
    part's output means says nothing of the whole's."""
    from torch.optim.swa_utils import AveragedModel

    while not is_root(model):
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel, AveragedModel)):
            model = model.module
        elif isinstance(model._modules.get("_orig_mod"), nn.Module):  # (torch.compile's OptimizedModule)
            model = model._modules["_orig_mod"]
        else:
            return False
    return True


def model_state(model: nn.Module) -> ModelState:
    """The :class:`ModelState` of a converted model (also through wrappers such as DDP), or of the converted
    layers inside a module that holds some of them without their root (a sub-module, a traced feature extractor)."""
    for module in model.modules():
        if is_root(module):
            return module.__dict__[ATTRIBUTE]
        layer_state = module.__dict__.get("rank1_state")
        if layer_state is not None:
            return layer_state.model
    return find_root(model).__dict__[ATTRIBUTE]  # (raises: not converted)


def split_output(model: nn.Module, output: Any) -> Any:
    """The last tiled forward's ``output`` of ``model`` with a member axis in front of each batched leaf."""
    root = find_root(model)
    return root.__dict__[ATTRIBUTE].router.split(root, output)
