"""The contract of every converted layer, and how a module becomes one in place.

A converted layer is the *same module object* with its class swapped for a generated subclass
``Rank1<Original>`` of both the bayesify layer class (e.g. :class:`~bayesify.layers.Rank1Linear`)
and the module's own class (e.g. timm's ``StdConv2d``), the way ``torch.nn.utils.parametrize``
does it. Hence:

* the original Parameters stay where they were (same objects, same ``state_dict`` keys), so an
  optimizer built before conversion and a pretrained checkpoint still apply;
* ``isinstance(layer, nn.Conv2d)`` and the original class's own ``forward`` (weight
  standardisation, same padding) still hold; hooks, device, dtype and ``training`` are kept;
* new state is only added, and every name bayesify adds starts with ``rank1_``;
* a checkpoint of the *unconverted* network loads with plain ``load_state_dict(sd, strict=True)``:
  every converted layer has a load pre-hook (:func:`_keep_rank1_state_if_absent`) that keeps its
  current rank-1 values when the incoming state dict holds none of its ``rank1_*`` keys. A state
  dict holding some but not all of them is a damaged converted checkpoint, and strict loading still
  reports the missing ones; the original keys are as strict as ever. A converted checkpoint's metadata says
  what its rank-1 values mean (perturbation, posterior): one of another meaning is refused. A layer
  converted on the meta device takes its initial rank-1 values from a checkpoint without them.

**The contract** (what a layer family implements; see ``docs/ARCHITECTURE.md`` for a complete
example of a user's own layer):

* :meth:`ConvertedLayer.rank1_setup` (required): create the factors with :meth:`rank1_factor` and
  the per-component bias offsets with :meth:`rank1_bias_offset`.
* ``forward``: ask :meth:`rank1_draw` for this call's routing, sample the factors, and compute
  with :func:`bayesify.layers.rank1_affine` (the one rank-1 op). :meth:`rank1_draw` first refuses, in one
  line, a layer one of whose own parameters has another shape than at conversion (:meth:`rank1_check`: a
  weight replaced later, as ``resize_token_embeddings`` does); a family that asks for no draw calls
  :meth:`rank1_check` itself.
* optional, with defaults: :meth:`rank1_batch_axis`, :meth:`rank1_input_axes`,
  :meth:`rank1_output_axes` (where the batch lies when the layer is itself the model),
  :meth:`rank1_kl_terms` (default: the factors' KL), :attr:`rank1_intercepted` with
  :meth:`rank1_functional_handlers` (weights other code uses directly), :meth:`revert`,
  :meth:`rank1_merge` (one member folded into the original parameters, for :func:`bayesify.merge`).

Per-layer state lives in one object, :class:`LayerState` (``layer.rank1_state``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import Tensor, nn

from bayesify.config import LayerOptions
from bayesify.layers._intercept import intercept
from bayesify.model_state import ModelState
from bayesify.variational.draws import Draw
from bayesify.variational.divergence import KLTerm, total_kl
from bayesify.variational.factor import Rank1Factor

__all__ = ["ConvertedLayer", "Draw", "LayerState", "Rank1Layer", "rank1_class"]

_GENERATED: dict[tuple[type, type], type] = {}


def rank1_class(layer_class: type["ConvertedLayer"], base: type[nn.Module]) -> type:
    """The generated subclass of ``layer_class`` and ``base`` (cached, so one class per pair)."""
    key = (layer_class, base)
    if key not in _GENERATED:
        name = f"Rank1{base.__name__}"
        cls = type(name, (layer_class, base), {"__rank1_wrapper__": layer_class, "__rank1_base__": base})
        cls.__qualname__ = name
        # a converted layer is a leaf for torch.fx, which decides by the class's module (torch.nn's are leaves): a
        # traced graph (torchvision's create_feature_extractor) calls the converted layer instead of tracing into its
        # routing, which decides on shapes. A subclass of another library's (timm's StdConv2d, a user's nn.Linear)
        # too, under a name in torch.nn's space that says whose it is (whole-model pickles rebuild it: _rebuild)
        torch_layer = base.__module__.startswith(("torch.nn.", "torch.ao.nn."))
        cls.__module__ = base.__module__ if torch_layer else f"torch.nn.modules.bayesify.{base.__module__}"
        _GENERATED[key] = cls
    return _GENERATED[key]


def layer_bias(module: nn.Module, name: str = "bias") -> Tensor | None:
    """The bias ``module`` adds: its Parameter (None with ``bias=False``), or the value a parametrization or
    pruning computes in the Parameter's place (``_parameters`` alone would read as no bias at all)."""
    if name in module._parameters:
        return module._parameters[name]
    return getattr(module, name, None)


def computed(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` is computed (a parametrization, pruning's mask) rather than a Parameter."""
    return name not in module._parameters and getattr(module, name, None) is not None


def _parameter(module: nn.Module, name: str) -> nn.Parameter | None:
    """The parameter ``name`` (dotted, relative to ``module``) or None, without ``__getattr__``."""
    module_name, _, param = name.rpartition(".")
    owner = module.get_submodule(module_name) if module_name else module
    return owner._parameters.get(param)


def _rebuild(layer_class: type["ConvertedLayer"], base: type[nn.Module]) -> nn.Module:
    """Unpickling: an empty instance of the generated class (its state is set right after)."""
    cls = rank1_class(layer_class, base)
    return cls.__new__(cls)


@dataclass
class LayerState:
    """Everything bayesify keeps on one converted layer (``layer.rank1_state``)."""

    options: LayerOptions  # what its factors are made with (the model-wide options are the model's: model.options)
    model: ModelState  # the state of the model it belongs to, shared by every layer of the model
    bias_offsets: dict[str, tuple[str, ...]] = field(default_factory=dict)  # rank1_bias*: the biases it offsets
    busy: bool = False  # inside the base class's own forward: its weight reads are plain
    cache: Any = None  # the draws of the forward pass in flight, for the layer's further calls in it (recurrent layers)
    bypassed_by: set[str] = field(default_factory=set)  # functions that used the weight directly (summary)
    intercepted_by: str | None = None  # the last function whose use of the weight was routed here
    other_bias: bool = False  # ... with a bias other than its own (its bias offsets left out: affine.py, merge)
    batch_independent: bool = False  # it ran on an input that does not depend on the batch (summary)
    batch_dim_hint: str = ""  # ... whose rows the model's input has at another dimension than batch_dim (summary)
    # where the batch lies in its inputs when its place in the model says (a Linear of torch's time-major transformer
    # layer, batch_first=False: 1, as that layer's attention); None: the model's batch_dim
    batch_axis: int | None = None
    unset: bool = False  # converted on the meta device: its rank-1 values are not made yet
    load_hook: int | None = None  # id of the load_state_dict pre-hook in the layer's hook dict (revert removes it)
    packed: dict[str, tuple[Any, int]] = field(default_factory=dict)  # bias offsets drawn with a group: (group, slot)
    # (module path, name, shape) of each of its own parameters when its rank1_* ones were made for them (a tuple:
    # a state unpickled from before it was kept has none, and checks nothing)
    shapes: tuple[tuple[tuple[str, ...], str, tuple[int, ...]], ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["cache"] = None  # draws of the last forward pass are not state
        return state

    def __deepcopy__(self, memo: dict) -> "LayerState":
        # a layer copied out of its model on its own (peft's modules_to_save, copy.deepcopy(model.head)) stays in
        # that model: it keeps the model's state, so the model's passes and mode() route it as every other layer.
        # Copied with its model (the root is being copied: deepcopy puts it in the memo before its state), it takes
        # the copied model state, as every other layer of the copy does.
        root = self.model.root
        alone = id(self.model) not in memo and root is not None and id(root) not in memo
        new = LayerState.__new__(LayerState)
        memo[id(self)] = new
        for name, value in self.__getstate__().items():
            new.__dict__[name] = value if name == "model" and alone else copy.deepcopy(value, memo)
        return new


def _keep_rank1_state_if_absent(
    layer: "ConvertedLayer",
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load pre-hook of every converted layer: an unconverted checkpoint keeps the current rank-1 values.

    If ``state_dict`` (torch's own copy, never the caller's dict) holds none of this layer's
    ``rank1_*`` keys, the layer's live rank-1 tensors are put in for them, so they load onto
    themselves (``copy_`` of a tensor onto itself is a no-op; ``assign=True`` re-assigns the same
    Parameter) and are not reported missing. If it holds some of them, nothing is added and
    strict loading reports the missing ones, as for any other key.
    """
    own = layer.rank1_state_dict()
    state = layer.rank1_state
    if any(prefix + key in state_dict for key in own):
        saved, now = local_metadata.get("rank1"), state.options.meaning
        differ = [] if saved is None else [k for k in now if k in saved and saved[k] != now[k]]
        if differ:
            if not any(message.startswith("the rank-1 values (of ") for message in error_msgs):  # (one per load)
                error_msgs.append(
                    f"the rank-1 values (of {prefix[:-1] or type(layer).__name__} and any other layer) were saved from "
                    "a model converted with " + ", ".join(f"{k}={saved[k]!r}" for k in differ) + " and mean "
                    "something else in this one (" + ", ".join(f"{k}={now[k]!r}" for k in differ) + "); they were "
                    "left as they were: convert with the options the checkpoint was made with."
                )
            for key, value in own.items():  # this layer's rank-1 values stay as they are
                state_dict[prefix + key] = value
            return
        state.unset = False
        return
    if state.unset and any(t.is_meta for t in own.values()):
        # still on the meta device, and the checkpoint's tensors of this layer are real (load_state_dict(...,
        # assign=True), as a large model is loaded): its rank-1 values are made where they are, then initialised
        device = next((v.device for k, v in state_dict.items() if k.startswith(prefix) and isinstance(v, Tensor)
                       and not v.is_meta and k[len(prefix):] not in own), None)  # fmt: skip
        if device is not None:
            _materialise(layer, device)
            own = layer.rank1_state_dict()
    if state.unset and not any(t.is_meta for t in own.values()):
        # converted on (or moved to) the meta device, then given memory (to_empty): the "current values" are
        # whatever that memory held, so the layer's initial values go in (what converting a real model would make)
        with torch.no_grad():
            layer.rank1_reset()
        state.unset = False
    for key, value in own.items():
        state_dict[prefix + key] = value


def _materialise(layer: nn.Module, device: torch.device) -> None:
    """Every meta ``rank1_*`` tensor of ``layer`` replaced by one of memory on ``device`` (values unset)."""
    for module in (layer, *(child for name, child in layer._modules.items() if name.startswith("rank1_"))):
        for name, value in [*module._parameters.items(), *module._buffers.items()]:
            if value is None or not value.is_meta or (module is layer and not name.startswith("rank1_")):
                continue
            made = torch.empty_like(value, device=device)
            if name in module._parameters:
                module._parameters[name] = nn.Parameter(made, requires_grad=value.requires_grad)
            else:
                module._buffers[name] = made


def _own_shapes(layer: nn.Module) -> tuple[tuple[tuple[str, ...], str, tuple[int, ...]], ...]:
    """``(module path, name, shape)`` of every parameter of ``layer`` but bayesify's own (``rank1_*``): what its
    ``rank1_*`` parameters are made for, as :meth:`ConvertedLayer.rank1_changed` compares them."""
    shapes = []
    for dotted, param in layer.named_parameters(remove_duplicate=False):
        *path, name = dotted.split(".")
        if not dotted.startswith("rank1_"):
            shapes.append((tuple(path), name, tuple(param.shape)))
    return tuple(shapes)


def _changed_message(name: str, now: tuple[int, ...], then: tuple[int, ...]) -> str:
    """The one line (after the layer's name) for a parameter whose shape changed since conversion."""
    return (
        f"its {name} is {list(now)} now, but its rank1_* parameters were made for {list(then)} by bayesify.convert "
        "(they do not follow a parameter replaced later, e.g. by resize_token_embeddings or pruning): make the "
        "change before bayesify.convert, or call bayesify.revert(model) and then bayesify.convert(model, ...) again "
        "(every layer's rank-1 values start anew)."
    )


def _reverted_class(cls: type) -> type:
    """The class a converted layer of class ``cls`` reverts to: the original's; where classes were made on top of the
    converted one since (torch's parametrize makes ``ParametrizedRank1Linear`` when a parametrization is registered
    after convert), the same made on top of the original's (``ParametrizedLinear``: its parametrized weight stays a
    property; the plain class had none, and the layer's next call failed)."""
    made = []
    while "__rank1_base__" not in cls.__dict__:
        made.append(cls)
        cls = cls.__bases__[0]
    reverted = cls.__rank1_base__
    for later in reversed(made):
        own = {k: v for k, v in later.__dict__.items() if k not in ("__dict__", "__weakref__")}
        reverted = type(later.__name__.replace(cls.__name__, reverted.__name__), (reverted,), own)
    return reverted


class ConvertedLayer(nn.Module):
    """Mixin base of every layer bayesify converts; found by ``isinstance`` by the model-level helpers.

    Never instantiated directly: :meth:`from_module` (what :func:`bayesify.convert` calls) turns
    an existing module into one. See the module doc for the contract.
    """

    rank1_intercepted: ClassVar[tuple[str, ...]] = ()
    """Attributes (weights) that code outside the layer may use in its own maths; see ``_intercept.py``."""
    __rank1_wrapper__: type["ConvertedLayer"]
    __rank1_base__: type[nn.Module]

    @classmethod
    def from_module(cls, module: nn.Module, options: LayerOptions, model: ModelState) -> nn.Module:
        """Make ``module`` a converted layer in place (same object, same Parameters) and return it."""
        if isinstance(module, ConvertedLayer):
            raise ValueError(f"{type(module).__name__} is already a rank-1 layer; convert each layer once.")
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(recurse=False)):
            raise ValueError(
                f"{type(module).__name__} has uninitialized (lazy) parameters, so its shape is unknown; run one "
                "forward pass on an example batch before bayesify.convert()."
            )
        module.__class__ = rank1_class(cls, type(module))
        state = module.__dict__["rank1_state"] = LayerState(options, model)
        state.load_hook = module.register_load_state_dict_pre_hook(_keep_rank1_state_if_absent).id
        try:
            module.rank1_setup(options)
        except Exception:
            module.revert()
            raise
        state.shapes = _own_shapes(module)
        # made on the meta device (a large model built without memory): no values yet, until a checkpoint with them
        # loads or one without them does (which then puts in their initial values: _keep_rank1_state_if_absent)
        state.unset = any(t.is_meta for t in module.rank1_state_dict().values())
        return module

    # ---- the contract ------------------------------------------------------------------------

    def rank1_setup(self, options: LayerOptions) -> None:
        """Create this layer's factors (:meth:`rank1_factor`) and bias offsets (:meth:`rank1_bias_offset`);
        ``options``: what its factors are made with (posterior, prior, initialisation, perturbation)."""
        raise NotImplementedError(f"{type(self).__name__} must implement rank1_setup(options).")

    def rank1_batch_axis(self, x: Any) -> int | None:
        """Where the batch lies in this layer's first input (None: one unbatched example).

        Used when the layer is itself the converted model; default: the conversion's ``batch_dim``.
        """
        return self.rank1_state.model.options.batch_dim

    def rank1_input_axes(self, args: tuple, kwargs: dict) -> list[int | None] | None:
        """The batch axis of each tensor leaf of ``(args, kwargs)`` (flattened in that order), or None
        for the model's ``batch_dim`` on every leaf. Used when the layer is itself the converted model."""
        return None

    def rank1_output_axes(self, output: Any) -> list[int | None] | None:
        """The batch axis of each tensor leaf of the layer's output, or None for the input's batch axis."""
        return None

    def rank1_kl_terms(self) -> Iterator[KLTerm]:
        """This layer's pieces of the model's KL divergence; default: one per (non-delta) factor."""
        for _, factor in self.rank1_factors():
            term = factor.kl_term()
            if term is not None:
                yield term

    def rank1_functional_handlers(self) -> dict[Callable, Callable]:
        """``{torch function: handler(args, kwargs)}`` for calls on an intercepted weight (see ``_intercept.py``)."""
        return {}

    def rank1_merge(self, component: int) -> dict[str, Tensor]:
        """This layer's own parameters with component ``component``'s posterior means folded in.

        What :func:`bayesify.merge` asks every layer. Returns ``{name: value}`` for the original
        parameters that change (names relative to this layer, as in its ``state_dict``: ``"weight"``,
        ``"out_proj.bias"``), such that the original module holding these values computes exactly
        what this layer computes under ``bayesify.mode(model, component=component, noise=False)``.
        It reads the layer and changes nothing. For the multiplicative perturbation, usually
        ``W' = W o (r_k s_k^T)`` (:func:`~bayesify.layers.folded.fold_weight`) and ``b' = b + delta_k``.

        Raises:
            ValueError: the member cannot be held by the original parameters (say why), e.g. an
                additive perturbation through zero padding, or a weight the module transforms itself.
            NotImplementedError: the family does not define it (this default).
        """
        family = getattr(type(self), "__rank1_wrapper__", type(self)).__name__
        raise NotImplementedError(
            f"{family} does not define rank1_merge(component), so bayesify.merge cannot fold its factors into "
            f"its weights; implement it in {family} (return the original parameters with component k's "
            "posterior means folded in)."
        )

    # ---- helpers for layer families ------------------------------------------------------------

    rank1_state: LayerState  # in the instance's __dict__ (a plain attribute: no property for torch.compile to trace)

    @property
    def rank1_options(self) -> LayerOptions:
        """What this layer's factors were made with (the model-wide options: ``self.rank1_state.model.options``)."""
        return self.rank1_state.options

    def rank1_draw(self, n: int, device: torch.device) -> Draw:
        """The routing of a call on ``n`` rows: each row's component (shared by every layer of the
        model within one forward pass), whether to sample, and the pass's draws to take the values from.
        Every family asks it before its maths, so a parameter replaced since conversion is refused here
        (:meth:`rank1_check`)."""
        self.rank1_check()
        return self.rank1_state.model.router.route(n, device, self)

    def rank1_changed(self) -> str | None:
        """None, or what is wrong with this layer since its ``rank1_*`` parameters were made: one of its own
        parameters replaced by one of another shape (``resize_token_embeddings``, pruning, ``layer.weight =
        nn.Parameter(...)``, a ``.data`` write), said in one line with the fix (what :func:`bayesify.summary` lists
        and :meth:`rank1_check` raises). A shape comparison per parameter: nothing dispatched, and constant in a
        traced graph (whose parameters have static shapes)."""
        for path, name, shape in self.rank1_state.shapes:
            owner: nn.Module = self
            for part in path:
                owner = owner._modules[part]  # type: ignore[assignment]
            param = owner._parameters.get(name)
            if param is not None and param.shape != shape:
                return _changed_message(".".join((*path, name)), tuple(param.shape), shape)
        return None

    def rank1_check(self) -> None:
        """Raise a one-line ``RuntimeError`` naming the layer if :meth:`rank1_changed` finds anything: the factors
        of another shape would fail deep inside the rank-1 maths (or, where they broadcast, compute nonsense)."""
        changed = self.rank1_changed()
        if changed is not None:
            raise RuntimeError(f"{self.rank1_state.model.router.layer_name(self)}: {changed}")

    def rank1_factor(self, features: int, options: LayerOptions | None = None) -> Rank1Factor:
        """A new factor of ``features`` entries (the model's K components), on this layer's device and dtype."""
        like = next(self.parameters(recurse=False), None)
        kwargs: dict[str, Any] = {}
        if like is not None:
            kwargs = {"device": like.device, "dtype": like.dtype if like.is_floating_point() else None}
        state = self.rank1_state
        return Rank1Factor(features, state.model.components, options or state.options, **kwargs)

    def rank1_bias_offset(self, name: str, features: int, *biases: str) -> nn.Parameter | None:
        """Declare ``name``: per-component offsets ``[K, features]`` (zero at init) of the original biases.

        Component k's effective bias is ``sum(biases) + offset[k]`` (the reference's own bias per
        component; here the original bias stays the shared, live Parameter). ``biases`` are the
        names of the original bias parameters, relative to this layer (``"bias"``,
        ``"out_proj.bias"``); the L2 prior is taken on the effective bias. If none of them exists
        (``bias=False``), no offset is created and None is registered. With no ``biases`` at all
        the offset stands alone (a bias the layer computes itself, e.g. CondConv's mixed bias):
        its L2 is on the offset.
        """
        present = tuple(b for b in biases if _parameter(self, b) is not None)
        if biases and not present:
            self.register_parameter(name, None)
            return None
        like = _parameter(self, present[0]) if present else next(self.parameters(recurse=False))
        offset = nn.Parameter(torch.zeros(self.rank1_state.model.components, features, device=like.device, dtype=like.dtype))
        self.register_parameter(name, offset)
        self.rank1_state.bias_offsets[name] = present
        return offset

    def rank1_bias_offsets(self) -> Iterator[tuple[Tensor, list[nn.Parameter]]]:
        """``(offset, [the original biases it offsets])`` for every declared bias offset (the offset a
        ``[K, features]`` Parameter of the layer)."""
        for name, biases in self.rank1_state.bias_offsets.items():
            offset = getattr(self, name)
            if offset is not None:
                yield offset, [_parameter(self, b) for b in biases]

    def rank1_location(self, name: str, component: int) -> Tensor | None:
        """Row ``component`` of the factor or per-component table ``name``: the factor's posterior
        location (what ``noise=False`` uses), or the bias offset; None for an offset set to None."""
        value = getattr(self, name)
        if isinstance(value, Rank1Factor):
            return value.loc[component]
        return None if value is None else value[component]

    def rank1_factors(self) -> Iterator[tuple[str, Rank1Factor]]:
        """The ``(name, factor)`` pairs of this layer."""
        for name, child in self.named_children():
            if isinstance(child, Rank1Factor):
                yield name, child

    def rank1_state_dict(self) -> dict[str, Tensor]:
        """This layer's own ``rank1_*`` entries of its ``state_dict`` (keys relative to the layer, values
        the live Parameters and buffers): what an unconverted checkpoint does not hold."""
        entries: dict[str, Tensor] = {}
        for name, value in [*self._parameters.items(), *self._buffers.items()]:
            if name.startswith("rank1_") and value is not None and name not in self._non_persistent_buffers_set:
                entries[name] = value
        for name, child in self._modules.items():
            if name.startswith("rank1_") and child is not None:
                entries.update(child.state_dict(prefix=f"{name}.", keep_vars=True))
        return entries

    @property
    def reset_parameters(self) -> Callable[[], None]:
        """The original layer's ``reset_parameters`` (its weight and bias drawn anew), then :meth:`rank1_reset`: a
        layer re-initialised re-initialises all it owns, its factors and bias offsets too, as a fresh conversion
        has them (a head reset for a new task kept its trained members). Absent where the original has none."""
        base = getattr(type(self).__rank1_base__, "reset_parameters", None)
        if base is None:
            raise AttributeError(f"{type(self).__rank1_base__.__name__} has no reset_parameters")

        def reset() -> None:
            base(self)
            with torch.no_grad():
                self.rank1_reset()

        return reset

    def rank1_reset(self) -> None:
        """Put this layer's rank-1 values at their initialisation (the factors' posterior at conversion, the bias
        offsets at zero)."""
        for _, factor in self.rank1_factors():
            factor.reset_parameters()
        for offset, _ in self.rank1_bias_offsets():
            offset.zero_()
        self.rank1_state.unset = False

    def _apply(self, fn: Callable, recurse: bool = True) -> nn.Module:
        # a layer moved to the meta device (model.to("meta")) has no rank-1 values from then on: a later
        # to_empty() gives them whatever memory held, which a checkpoint without them must not keep (load hook)
        super()._apply(fn, recurse)
        state = self.__dict__.get("rank1_state")
        if state is not None and any(t.is_meta for t in self.rank1_state_dict().values()):
            state.unset = True
        return self

    def rank1_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters that hold what bayesify added to this layer (factors, bias offsets and the like):
        its own, as ``named_parameters()`` lists them under ``rank1_*`` names."""
        seen: set[int] = set()
        owned = [p for name, p in self.named_parameters() if name.split(".")[0].startswith("rank1_")]
        for p in owned:
            if id(p) not in seen:
                seen.add(id(p))
                yield p

    def kl_divergence(self) -> Tensor:
        """KL of this layer's posteriors to their priors, summed over components and entries."""
        total = total_kl(self.rank1_kl_terms())
        if total is None:
            p = next(self.parameters(), None)
            return torch.zeros((), device=None if p is None else p.device)
        return total

    def revert(self) -> nn.Module:
        """Undo the conversion in place: the original class, with only its original state. (Its model's
        other layers then draw their own tables where they were drawn with this layer's: revert the whole
        model with :func:`bayesify.revert`.)"""
        for name, _ in list(self.rank1_factors()):
            delattr(self, name)
        for name in [n for n in self._parameters if n.startswith("rank1_")]:
            del self._parameters[name]
        state = self.__dict__.pop("rank1_state", None)
        if state is not None and state.load_hook is not None:
            self._load_state_dict_pre_hooks.pop(state.load_hook, None)
        self.__class__ = _reverted_class(type(self))
        return self

    # ---- plumbing ---------------------------------------------------------------------------

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # what the saved rank-1 values mean, in the state dict's per-module metadata (as a module's version): a
        # load into a layer of another meaning is refused (_keep_rank1_state_if_absent); formats that drop the
        # metadata (safetensors) load unchecked
        metadata = getattr(destination, "_metadata", None)
        state = self.__dict__.get("rank1_state")
        if metadata is not None and state is not None:
            metadata.setdefault(prefix[:-1], {})["rank1"] = state.options.meaning

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        if name in type(self).rank1_intercepted:
            state = self.__dict__.get("rank1_state")
            if state is not None and state.model.router.live() and not state.busy:
                return intercept(value, self)
        return value

    def __prepare_scriptable__(self) -> nn.Module:
        # torch.jit.script calls this on every sub-module before it compiles any: one line here, whatever the root's
        # class (a user's model holding converted layers too), where TorchScript failed deep inside on a forward's
        # *args; the trace's refusal is ModelState.begin's
        state = self.__dict__.get("rank1_state")
        root = state.model.root if state is not None else None  # (None in a copy before its first pass)
        raise RuntimeError(
            f"torch.jit.script cannot compile a converted {type(root).__name__ if root is not None else 'model'} "
            "(its rank-1 layers route their rows in Python on every pass). Use torch.export.export(model, (x,)) or "
            "torch.compile(model), or script one member as a plain network: "
            "torch.jit.script(bayesify.merge(model, component=k))."
        )

    def __reduce_ex__(self, protocol: int) -> tuple:
        # the generated class is not importable by name: rebuild it from (layer class, base)
        cls = type(self)
        return (_rebuild, (cls.__rank1_wrapper__, cls.__rank1_base__), self.__getstate__())


class Rank1Layer(ConvertedLayer):
    """Base of the layers whose weights get rank-1 factors: ``W' = W o (r s^T)`` per mixture component.

    Subclass it for a layer family of your own (register it with ``convert(model,
    mapping={**bayesify.default_mapping(), YourLayer: YourRank1Layer})``): implement
    :meth:`rank1_setup` and ``forward`` as in ``docs/ARCHITECTURE.md``.
    """
