"""``convert()``: turn any model into a rank-1 Bayesian neural net by model surgery; ``revert()`` undoes it.

The table of what converts to what is :func:`default_mapping` (data, as ``torch.ao``'s swap
tables): ``{source type: converted layer class}``, subclasses of a source type included. The
walk knows nothing about layers: each layer class converts a module in place with
:meth:`~bayesify.layers.ConvertedLayer.from_module`, after the walk (never mutating the tree
while iterating it).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Mapping, Unpack

from torch import nn

from bayesify import _router, _weight_decay
from bayesify.config import Rank1Config, Rank1Options, options_doc
from bayesify.inspection import NORM_LAYERS, inside, rank1_layers
from bayesify.layers.attention import Rank1MultiheadAttention
from bayesify.layers.base import ConvertedLayer, Rank1Layer
from bayesify.layers.bilinear import Rank1Bilinear
from bayesify.layers.condconv import Rank1CondConv2d
from bayesify.layers.conv import Rank1Conv, Rank1ConvTranspose
from bayesify.layers.embedding import GaussianEmbedding
from bayesify.layers.hf_conv1d import Rank1HFConv1D
from bayesify.layers.linear import Rank1Linear
from bayesify.layers.recurrent import Rank1RNN, Rank1RNNCell
from bayesify.predictive.libraries import infer_task
from bayesify.predictive.tasks import Auto, resolve_task
from bayesify.variational import store
from bayesify.variational.draws import ModelDraws

__all__ = ["ConversionReport", "Skip", "SkipKind", "convert", "default_mapping", "revert"]

# {source type: converted layer}; subclasses of a source type are converted by the same class.
_DEFAULT_MAPPING: dict[type[nn.Module], type[ConvertedLayer]] = {
    nn.Linear: Rank1Linear,
    nn.Conv1d: Rank1Conv,
    nn.Conv2d: Rank1Conv,
    nn.Conv3d: Rank1Conv,
    nn.ConvTranspose1d: Rank1ConvTranspose,
    nn.ConvTranspose2d: Rank1ConvTranspose,
    nn.ConvTranspose3d: Rank1ConvTranspose,
    nn.LSTM: Rank1RNN,
    nn.GRU: Rank1RNN,
    nn.RNN: Rank1RNN,
    nn.LSTMCell: Rank1RNNCell,
    nn.GRUCell: Rank1RNNCell,
    nn.RNNCell: Rank1RNNCell,
    nn.MultiheadAttention: Rank1MultiheadAttention,
    nn.Bilinear: Rank1Bilinear,
}

# layers of optional libraries, by (module, class name): in the table once that library is imported
_OPTIONAL_MAPPING: dict[tuple[str, str], type[ConvertedLayer]] = {
    ("timm.layers.cond_conv2d", "CondConv2d"): Rank1CondConv2d,
    ("transformers.pytorch_utils", "Conv1D"): Rank1HFConv1D,
}

# with convert(..., embeddings=True)
_EMBEDDING_MAPPING: dict[type[nn.Module], type[ConvertedLayer]] = {
    nn.Embedding: GaussianEmbedding,
    nn.EmbeddingBag: GaussianEmbedding,
}


def default_mapping() -> dict[type[nn.Module], type[ConvertedLayer]]:
    """A copy of the default ``{layer type: converted layer class}`` table.

    Extend it to convert your own layers: ``convert(model, mapping={**default_mapping(),
    MyLayer: MyRank1Layer})``, where ``MyRank1Layer`` subclasses :class:`bayesify.Rank1Layer`.
    Layers of optional libraries (timm's ``CondConv2d``, Hugging Face's ``Conv1D``) are in it once
    that library is imported: the library stays optional.
    """
    table = dict(_DEFAULT_MAPPING)
    for (module_name, class_name), layer_class in _OPTIONAL_MAPPING.items():
        source = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(source, type):
            table[source] = layer_class
    return table


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
    """What :func:`convert` left deterministic and why (kept on the root, read by :func:`bayesify.summary`)."""

    skipped: dict[str, Skip] = field(default_factory=dict)


def _lookup(module: nn.Module, mapping: Mapping[type, type[ConvertedLayer]]) -> type[ConvertedLayer] | None:
    # the closest mapped ancestor class wins, so subclasses (StdConv2d, ...) convert too
    for cls in type(module).__mro__:
        if cls in mapping:
            return mapping[cls]
    return None


def _as_patterns(name: str, value: str | Iterable[str] | None) -> list[str] | None:
    if value is None:
        return None
    patterns = [value] if isinstance(value, str) else list(value) if isinstance(value, Iterable) else None
    if patterns is None or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{name}={value!r} must be a string or a list of strings (fnmatch patterns on module names).")
    return patterns


def _matches(name: str, pattern: str) -> bool:
    # a pattern matches a module and everything below it: "blocks.0" covers "blocks.0.attn.qkv"
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[: i + 1]), pattern) for i in range(len(parts)))


def is_weight_bearing(module: nn.Module) -> bool:
    """Whether a module owns a parameter shaped like a matrix or kernel: 2+ axes longer than 1.

    Per-channel scales and tokens (``[C, 1, 1]``, ``[1, 1, D]``) are not; whether a table such as
    a position embedding is a linear map, ``summary(model, x)`` finds out by watching its use.
    """
    return any(
        sum(size > 1 for size in p.shape) >= 2
        for name, p in module.named_parameters(recurse=False)
        if not name.startswith("rank1_")  # bayesify's own
    )


def static_skip(module: nn.Module) -> Skip | None:
    """Why a weight-bearing module without a layer class stays deterministic, and how to change that."""
    kind = type(module).__name__
    if isinstance(module, NORM_LAYERS):
        return None  # deterministic by design, as in the paper
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return Skip(
            SkipKind.EMBEDDING,
            f"{kind} kept deterministic (embeddings are not rank-1 in the paper); convert(..., embeddings=True) "
            "makes it a Gaussian variational embedding",
        )
    return Skip(
        SkipKind.NO_LAYER_CLASS,
        f"{kind} has no rank-1 wrapper in the mapping; if it computes a linear map or a convolution, pass "
        f"mapping={{**bayesify.default_mapping(), {kind}: <your Rank1Layer subclass>}}",
    )


def convert(
    model: nn.Module,
    config: Rank1Config | None = None,
    *,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    mapping: Mapping[type[nn.Module], type[ConvertedLayer]] | None = None,
    **options: Unpack[Rank1Options],
) -> nn.Module:
    """Make ``model`` a rank-1 Bayesian neural net, in place, and return it.

    Every module whose type (or a parent class of it) is in ``mapping`` becomes a rank-1
    layer: the same module object and the same Parameters, with ``W' = W o (r s^T)`` where
    r and s have a K-component mixture posterior. Only new state is added, so an optimizer
    created earlier still holds the weights, and a checkpoint of the unconverted network still
    loads with ``model.load_state_dict(state, strict=True)`` (the rank-1 values are kept; see
    :mod:`bayesify.layers.base`). The root gets ``model.no_weight_decay()`` (timm's hook: its own
    names plus ``rank1_*`` globs), so ``timm.optim.create_optimizer_v2`` does not decay the
    rank-1 parameters; for torch optimizers use :func:`bayesify.training.param_groups`.

    Args:
        model: any ``nn.Module`` (timm, torchvision, your own; the root may itself be a layer).
        config: a :class:`~bayesify.Rank1Config` (default: the defaults); ``**options`` override it.
        include: fnmatch patterns of module names to convert (a pattern covers everything
            below the module it names); default: all.
        exclude: fnmatch patterns of module names to leave deterministic.
        mapping: ``{layer type: converted layer class}``; default :func:`default_mapping`.
        **options: the conversion options, each a field of :class:`~bayesify.Rank1Config`:

{options}

    Returns:
        ``model`` itself, converted.

    Raises:
        ValueError: an invalid option, a pattern that matches no module, nothing to convert,
            or a second conversion with other model-wide options (``components``, ``batch_dim``,
            ``sampling``, ``eval_noise``, another task than the one said).
        TypeError: an unknown option.

    Example:
        >>> import torch, bayesify
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        >>> net = bayesify.convert(net, components=4)
        >>> net.eval()(torch.randn(5, 8)).shape      # mixture predictive, same shape as before
        torch.Size([5, 3])

    References:
        Dusenberry et al., "Efficient and Scalable Bayesian Neural Nets with Rank-1 Factors",
        ICML 2020.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() takes an nn.Module, got {type(model).__name__}.")
    config = Rank1Config.from_options(config, **options)
    table = _swap_table(mapping, config)
    router = _router_for(model, config)
    plan, skipped = _plan(model, table, _as_patterns("include", include), _as_patterns("exclude", exclude))
    # the prior's scale follows the depth unless given (Rank1Config.resolved_prior_std)
    config = config.for_depth(sum(issubclass(layer_class, Rank1Layer) for _, _, layer_class in plan))
    for name, module, layer_class in plan:
        new = layer_class.from_module(module, config, router)
        if new is not module:
            _replace(model, name, new)
            if name == "":
                model = new
    _finish(model, config, router, [name for name, _, _ in plan], skipped)
    return model


Plan = list[tuple[str, nn.Module, type[ConvertedLayer]]]


def _swap_table(
    mapping: Mapping[type[nn.Module], type[ConvertedLayer]] | None, config: Rank1Config
) -> dict[type[nn.Module], type[ConvertedLayer]]:
    """``{source type: layer class}``: ``mapping`` (default :func:`default_mapping`), checked."""
    table = default_mapping() if mapping is None else dict(mapping)
    if config.embeddings:
        table = {**_EMBEDDING_MAPPING, **table}
    for source, layer_class in table.items():
        if not (isinstance(layer_class, type) and issubclass(layer_class, ConvertedLayer)):
            raise TypeError(
                f"mapping[{source.__name__}]={layer_class!r} must be a subclass of bayesify.layers.Rank1Layer "
                "(or bayesify.layers.ConvertedLayer)."
            )
    return table


def _plan(
    model: nn.Module, table: dict, includes: list[str] | None, excludes: list[str] | None
) -> tuple[Plan, dict[str, Skip]]:
    """Which modules to convert (name, module, layer class) and why each other weight-bearing one is not."""
    plan: Plan = []
    skipped: dict[str, Skip] = {}
    used_patterns: set[str] = set()
    converted: list[str] = []
    for name, module in model.named_modules():
        if inside(name, converted):
            continue  # never convert inside a layer that is converted (it would stack factors)
        already = isinstance(module, ConvertedLayer)
        layer_class = None if already else _lookup(module, table)
        if layer_class is None and not already:
            skip = static_skip(module) if is_weight_bearing(module) else None
            if skip is not None:
                skipped[name] = skip
            continue
        hit_in = [p for p in includes or [] if _matches(name, p)]
        hit_ex = [p for p in excludes or [] if _matches(name, p)]
        used_patterns.update(hit_in, hit_ex)
        if already:  # converted before: left as it is
            converted.append(name)
            continue
        if includes is not None and not hit_in:
            skipped[name] = Skip(SkipKind.NOT_INCLUDED, "not matched by include")
            continue
        if hit_ex:
            skipped[name] = Skip(SkipKind.EXCLUDED, f"excluded by pattern {hit_ex[0]!r}")
            continue
        plan.append((name, module, layer_class))
        converted.append(name)

    unused = [p for p in (includes or []) + (excludes or []) if p not in used_patterns]
    if unused:
        raise ValueError(
            f"pattern(s) {unused} matched no convertible module of {type(model).__name__}; patterns are fnmatch "
            "globs on qualified module names as printed by model.named_modules() (e.g. 'head', 'blocks.*.mlp')."
        )
    if not plan:
        if next(rank1_layers(model), None) is not None:
            raise ValueError(
                f"{type(model).__name__} is already converted and nothing new matched; it was left unchanged. "
                "To change options, call bayesify.revert(model) and convert again."
            )
        raise ValueError(
            f"{type(model).__name__} has no layer to convert: none of its modules is an instance of "
            f"{sorted(t.__name__ for t in table)}. Pass mapping={{**bayesify.default_mapping(), YourLayer: "
            "YourRank1Layer} to convert other layer types."
        )
    return plan, skipped


def _finish(model: nn.Module, config: Rank1Config, router: _router.Router, names: list[str], skipped: dict) -> None:
    """After the swap: the model's task, the conversion report, the routing hooks, the groups of tables."""
    if not _router.is_root(model) or isinstance(router.task, Auto):
        router.task = resolve_task(
            config.task, stated=infer_task(model), class_axis=config.class_axis, gaussian_variance=config.gaussian_variance
        )
    report = model.__dict__.get("_rank1_report") or ConversionReport()
    for name in names:
        report.skipped.pop(name, None)
    report.skipped.update(skipped)
    model.__dict__["_rank1_report"] = report
    if not _router.is_root(model):
        _router.attach(model, router, root_layout=isinstance(model, ConvertedLayer))
    # the factors and bias offsets in groups drawn together once per pass (each stays its layer's own Parameter)
    layers = [layer for _, layer in rank1_layers(model)]
    store.pack(model, layers)
    groups = list(dict.fromkeys(slot[0] for layer in layers for slot in store.slots_of(layer)))
    for key, group in enumerate(groups):
        group.key = key
    router.draws = ModelDraws(config.components, groups)  # (the layers' takes are learnt again for the new numbering)
    _weight_decay.install(model)  # timm's optimizer factory: no weight decay on the rank-1 parameters


convert.__doc__ = convert.__doc__.replace("{options}", options_doc(Rank1Config, indent="            "))
convert.__signature__ = inspect.signature(convert).replace(  # type: ignore[attr-defined]
    parameters=[
        *[p for p in inspect.signature(convert).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD],
        *[
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in dataclasses.fields(Rank1Config)
        ],
    ]
)


def _router_for(model: nn.Module, config: Rank1Config) -> _router.Router:
    """The model's router: the existing one on a second conversion, else a new one."""
    existing = model.__dict__.get("_rank1_router")
    inner = [layer for _, layer in rank1_layers(model)]
    if existing is None and inner:
        existing = inner[0].rank1_state.router  # a part of the model was converted on its own before
    if existing is None:
        return _router.Router(config)
    # the router owns the options every layer reads at run time: a second convert() cannot change them for some
    # layers only (a task may be said where none was, or left "auto": the model keeps its own)
    differ = [name for name in MODEL_WIDE if getattr(existing.config, name) != getattr(config, name)]
    task = config.resolved_task()
    if not isinstance(task, Auto) and not isinstance(existing.task, Auto) and task != existing.task:
        differ.append("task")
    if differ:
        was = ", ".join(f"{name}={_shown(existing, name)}" for name in differ)
        got = ", ".join(f"{name}={_shown(config, name)}" for name in differ)
        raise ValueError(
            f"{type(model).__name__} was converted with {was}; a second convert() must use the same model-wide "
            f"option(s) (got {got}): pass those, or call bayesify.revert(model) and convert again."
        )
    # one router per model: rebind inner layers and drop routing hooks of inner roots
    for _, layer in rank1_layers(model):
        layer.rank1_state.router = existing
    for module in model.modules():
        if module is not model and _router.is_root(module):
            _router.detach(module)
            if not isinstance(module, ConvertedLayer):
                del module._rank1_router
    return existing


MODEL_WIDE = ("components", "batch_dim", "sampling", "eval_noise")
"""Options read at run time from the model's router, never from one layer: the same for every layer of a model."""


def _shown(source: object, name: str) -> str:
    """An option's value as a user writes it (``source``: a router or a config)."""
    if name == "task":
        return repr(str(source.task if isinstance(source, _router.Router) else source.resolved_task()))
    value = getattr(source.config if isinstance(source, _router.Router) else source, name)
    return repr(getattr(value, "value", value))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    if not name:
        return
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def revert(model: nn.Module) -> nn.Module:
    """Undo :func:`convert` in place: original classes, original state only. Returns ``model``."""
    for module in list(model.modules()):
        if _router.is_root(module):
            _router.detach(module)
        module.__dict__.pop("_rank1_report", None)
        _weight_decay.remove(module)
        store.remove(module)
        if not isinstance(module, ConvertedLayer):
            module.__dict__.pop("_rank1_router", None)
    for _, layer in list(rank1_layers(model)):
        layer.revert()
    return model
