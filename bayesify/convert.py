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
from typing import Iterable, Mapping, Unpack

from torch import nn

from bayesify._router import TORCH_TRANSFORMER_MODULES, input_positions
from bayesify.config import LayerOptions, Rank1Config, Rank1Options, options_doc, scoped
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
from bayesify.model_state import ATTRIBUTE, ConversionReport, ModelState, Skip, SkipKind, is_root
from bayesify.predictive.libraries import infer_task, said_of_model
from bayesify.predictive.tasks import Auto, Task, check_class_axis, resolve_task
from bayesify.sharding import is_sharded
from bayesify.variational import store
from bayesify.variational.factor import Rank1Factor

__all__ = ["ConversionReport", "Skip", "SkipKind", "added_after_conversion", "convert", "default_mapping", "revert"]

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


def added_after_conversion(root: nn.Module, skipped: Mapping[str, Skip]) -> dict[str, Skip]:
    """The weight-bearing modules of ``root`` (a converted root) that are not converted and that conversion did
    not leave deterministic on purpose (``skipped``, its report): put there since, as a head that
    ``reset_classifier`` or ``resize_token_embeddings`` made, or a block a user added. Norm layers are not
    counted (deterministic by design), nor what lies inside a converted layer."""
    layer_names = [name for name, _ in rank1_layers(root)]
    added = {}
    for name, module in root.named_modules():
        if isinstance(module, (ConvertedLayer, Rank1Factor)) or name in skipped or inside(name, layer_names):
            continue
        if is_weight_bearing(module) and static_skip(module) is not None:
            added[name] = Skip(SkipKind.ADDED_LATER, f"{type(module).__name__} is not converted (added after conversion?)")
    return added


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
    created earlier still holds the weights (not the new rank-1 parameters: add them with
    ``optimizer.add_param_group({"params": list(bayesify.rank1_parameters(model))})``, or make the
    optimizer after converting), and a checkpoint of the unconverted network still
    loads with ``model.load_state_dict(state, strict=True)`` (the rank-1 values are kept; see
    :mod:`bayesify.layers.base`). The root gets ``model.no_weight_decay()`` (timm's hook: its own
    names plus ``rank1_*`` globs), so ``timm.optim.create_optimizer_v2`` does not decay the
    rank-1 parameters; for torch optimizers use :func:`bayesify.training.param_groups`.

    Args:
        model: any ``nn.Module`` (timm, torchvision, your own; the root may itself be a layer).
        config: a :class:`~bayesify.Rank1Config` (default: the defaults); ``**options`` override it.
        include: fnmatch patterns of module names to convert (a pattern covers everything
            below the module it names); default: all.
        exclude: fnmatch patterns of module names to leave deterministic (on a converted model, a module put in
            since, such as a new head, that is to stay deterministic: said so, it is not warned of).
        mapping: ``{layer type: converted layer class}``; default :func:`default_mapping`.
        **options: the conversion options, each a field of :class:`~bayesify.Rank1Config`:

{options}

    Returns:
        ``model`` itself, converted.

    Raises:
        ValueError: an invalid option, a pattern that matches no module, nothing to convert,
            or a second conversion (of layers added since) that says other model-wide options
            (``components``, ``batch_dim``, ``sampling``, ``eval_noise``, another task than the one
            said); those it does not say are the model's. So are the layer options it does not say
            (``prior``, ``prior_std``, ``posterior``, ``perturbation``, ``init``...: the new layers take
            the converted layers' own, refused where those differ).
        TypeError: an unknown option.

    Example:
        >>> import torch, bayesify
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        >>> net = bayesify.convert(net, components=4, task="classification")  # a model of your own says what it outputs
        >>> net.eval()(torch.randn(5, 8)).shape      # mixture predictive, same shape as before
        torch.Size([5, 3])

    References:
        Dusenberry et al., "Efficient and Scalable Bayesian Neural Nets with Rank-1 Factors",
        ICML 2020.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() takes an nn.Module, got {type(model).__name__}.")
    _check_not_distributed(model)
    existing = _existing_state(model)
    second = existing is not None and config is None
    if second:
        # a second conversion (of a layer added since: a new head): the model-wide options not said are the model's
        options = {**{name: getattr(existing.options, name) for name in scoped(Rank1Config, "model")}, **options}  # type: ignore[typeddict-item]
    config = Rank1Config.from_options(config, **options)
    check_class_axis(config.task, config.class_axis)
    input_positions(model, config.unbatched_inputs)  # (an input the forward does not have: refused before any change)
    _check_transformer_layout(model, config.batch_dim)
    table = _swap_table(mapping, config)
    stated = infer_task(model)  # what the model states of its output (None: nothing)
    said = said_of_model(config.resolved_task(), stated)  # what the caller said of it (Auto: nothing)
    adopted = [] if existing is None else _foreign_layers(model, existing)
    state = _state_for(model, config, said)  # (every layer takes the model's state: the foreign ones are adopted)
    for layer in adopted:  # their tables leave the other model's groups, to join this one's (_finish)
        for _, factor in layer.rank1_factors():
            factor.rank1_slot = None
        layer.rank1_state.packed = {}
    plan, skipped = _plan(
        model, table, _as_patterns("include", include), _as_patterns("exclude", exclude), adopted=bool(adopted)
    )
    # one prior for every layer, its scale following the depth unless given (Rank1Config.resolved_prior_std)
    layer_options = config.layer_options(sum(issubclass(layer_class, Rank1Layer) for _, _, layer_class in plan))
    if second:  # and the layers' options not said are the model's layers' (a new head is one of them)
        said_of_layers = set(options) & set(scoped(Rank1Config, "layer"))
        repeated = not plan and not adopted and ATTRIBUTE in model.__dict__  # (a part converted before: a new root)
        if repeated and not any(skip.kind is SkipKind.EXCLUDED for skip in skipped.values()):
            # (an option said as None is unset: the default, which for a converted layer is what it has)
            return _repeated(model, layer_options, {name for name in said_of_layers if options[name] is not None})
        layer_options = _the_models_layer_options(model, layer_options, said=said_of_layers)
    for name, module, layer_class in plan:
        new = layer_class.from_module(module, layer_options, state)
        if new is not module:
            _replace(model, name, new)
            if name == "":
                model = new
    _time_major_layers(model)
    if isinstance(state.task, Auto):  # the one place convert decides it: what was said, else what the model states
        state.task = resolve_task(said, stated=stated, class_axis=config.class_axis)
    _finish(model, state, [name for name, _, _ in plan], skipped)
    return model


Plan = list[tuple[str, nn.Module, type[ConvertedLayer]]]


def _time_major_layers(model: nn.Module) -> None:
    """The feed-forward Linears of torch's time-major transformer layers (``batch_first=False``, torch's default) see
    ``[T, B, C]`` whatever the model's ``batch_dim``: their batch is at dimension 1, as the layer's attention takes
    it (a batch-first model that transposes around an encoder mixed the members there, silently where T == B)."""
    for module in model.modules():
        if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)) and not module.self_attn.batch_first:
            for linear in (getattr(module, "linear1", None), getattr(module, "linear2", None)):
                state = None if linear is None else linear.__dict__.get("rank1_state")
                if state is not None:
                    state.batch_axis = 1


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
    model: nn.Module, table: dict, includes: list[str] | None, excludes: list[str] | None, *, adopted: bool = False
) -> tuple[Plan, dict[str, Skip]]:
    """Which modules to convert (name, module, layer class) and why each other weight-bearing one is not
    (``adopted``: converted layers of another model were taken in, so a plan with nothing new is no mistake)."""
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
            return plan, skipped  # a second call: what it asks of the converted layers, convert() decides
        left_out = [name for name, skip in skipped.items() if skip.kind in (SkipKind.EXCLUDED, SkipKind.NOT_INCLUDED)]
        if left_out:
            said = ", ".join(f"{k}={v!r}" for k, v in (("include", includes), ("exclude", excludes)) if v is not None)
            raise ValueError(
                f"{said} left no layer of {type(model).__name__} to convert (it left out {', '.join(left_out[:5])}"
                f"{' ...' if len(left_out) > 5 else ''}); loosen the patterns."
            )
        raise ValueError(
            f"{type(model).__name__} has no layer to convert: none of its modules is an instance of "
            f"{sorted(t.__name__ for t in table)}. Pass mapping={{**bayesify.default_mapping(), YourLayer: "
            "YourRank1Layer} to convert other layer types."
        )
    return plan, skipped


def _finish(model: nn.Module, state: ModelState, names: list[str], skipped: dict) -> None:
    """After the swap: the conversion report, the model state on the root, the new tables in groups."""
    for name in names:
        state.report.skipped.pop(name, None)
    state.report.skipped.update(skipped)
    if not is_root(model):
        state.attach(model, root_layout=isinstance(model, ConvertedLayer))
    state.hook_bags(model)  # (an nn.EmbeddingBag's flat form in a tiled pass)
    # the factors and bias offsets not in a group yet, in groups drawn together once per pass (each stays its
    # layer's own Parameter); the layers' takes are learnt again with them
    store.pack(model, [layer for _, layer in rank1_layers(model)], state.draws.groups)
    state.draws.needs = {}


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


def _repeated(model: nn.Module, made: LayerOptions, said: set[str]) -> nn.Module:
    """A second conversion with nothing new to convert: ``model`` as it is where it asks for what the model has (a
    hook that converts again, as Lightning's ``configure_model`` is called in every stage), else the one-line error
    naming the options that would change (a converted layer keeps its options: changing them is a new conversion)."""
    theirs = [layer.rank1_state.options for layer in model.modules() if isinstance(layer, ConvertedLayer)]
    differ = sorted(
        name for name in said if any(getattr(options, name) != getattr(made, name) for options in theirs if isinstance(options, LayerOptions))
    )
    if differ:
        raise ValueError(
            f"{type(model).__name__} is already converted and nothing new matched; it was left unchanged, and its layers "
            f"keep their {', '.join(differ)}. To change options, call bayesify.revert(model) and convert again."
        )
    return model


def _the_models_layer_options(model: nn.Module, made: LayerOptions, said: set[str]) -> LayerOptions:
    """A second conversion's layer options: those ``said`` as ``made``, the others as the model's converted layers
    have them (not the defaults: a new head of a BatchEnsemble model with a Normal posterior, or the depth rule's
    prior scale for a model of one layer, 0.3 where the others have 0.087). Where its layers differ in an option
    not said, which one the new layers take cannot be told: it must be said."""
    theirs = [layer.rank1_state.options for layer in model.modules() if isinstance(layer, ConvertedLayer)]
    theirs = [options for options in theirs if isinstance(options, LayerOptions)]
    if not theirs:
        return made
    changes = {}
    for field in dataclasses.fields(LayerOptions):
        if field.name in said:
            continue
        values = {getattr(options, field.name) for options in theirs}
        if len(values) > 1:
            raise ValueError(
                f"the converted layers of {type(model).__name__} have different {field.name} values "
                f"({', '.join(sorted(map(str, values)))}), so the new layers cannot take the model's; pass "
                f"{field.name}=... to this convert()."
            )
        changes[field.name] = values.pop()
    return made.replace(**changes)


def _check_transformer_layout(model: nn.Module, batch_dim: int) -> None:
    """Refuse, before any change, torch's transformer module used as the model with a ``batch_dim`` that is not
    where its ``batch_first`` puts the batch: evaluation tiled the sequence (its mixture off by 0.76 on a time-major
    encoder), and a padding or attention mask failed inside torch."""
    if not isinstance(model, TORCH_TRANSFORMER_MODULES):
        return
    attention = next((m for m in model.modules() if isinstance(m, nn.MultiheadAttention)), None)
    batch_first = bool(getattr(model, "batch_first", getattr(attention, "batch_first", False)))
    expected = 0 if batch_first else 1
    if batch_dim != expected:
        raise ValueError(
            f"{type(model).__name__} (batch_first={batch_first}) takes its batch at dimension {expected} of its "
            f"inputs, and convert's batch_dim is {batch_dim}: convert with batch_dim={expected}."
        )


def _check_not_distributed(model: nn.Module) -> None:
    """Refuse a model already wrapped for data parallelism: DistributedDataParallel and FSDP2's ``fully_shard`` take
    the parameters when they wrap, so the factors convert adds would never be reduced across the processes (each
    rank would train a posterior of its own, silently); ``nn.DataParallel``'s replicas run in threads at once."""
    refusals = (
        (nn.parallel.DistributedDataParallel, (
            "a DistributedDataParallel wrapper, which took the model's parameters when it was made: the factors "
            "convert adds would never be averaged across the processes (each rank would train its own posterior); "
            "convert first, then wrap: DistributedDataParallel(bayesify.convert(model))."
        )),
        (nn.DataParallel, (
            "an nn.DataParallel wrapper, whose replicas of the model run in threads at once and would share one "
            "routing of the pass; convert the model itself (bayesify.convert(wrapper.module)) and, for several GPUs, "
            "wrap it in DistributedDataParallel (one process per GPU)."
        )),
    )  # fmt: skip
    for kind, why in refusals:
        wrapper = next((name for name, m in model.named_modules() if isinstance(m, kind)), None)
        if wrapper is not None:
            where = "convert() was given" if wrapper == "" else f"{type(model).__name__} holds ({wrapper!r})"
            raise ValueError(f"{where} {why}")
    if is_sharded(model):
        raise ValueError(
            f"{type(model).__name__} is sharded (FSDP2's fully_shard), whose units took the parameters when they were "
            "made: the factors convert adds would stay whole on every rank and never be reduced; convert first, then "
            "shard: bayesify.training.shard(bayesify.convert(model))."
        )


def _existing_state(model: nn.Module) -> ModelState | None:
    """The state of a model (or of a part of it) converted before, if any."""
    state = model.__dict__.get(ATTRIBUTE)
    if state is None:
        state = next((layer.rank1_state.model for _, layer in rank1_layers(model)), None)
    return state


def _foreign_layers(model: nn.Module, existing: ModelState) -> list[nn.Module]:
    """The converted layers of ``model`` that belong to another converted model (a trained head put on this network
    from another: ``a.head = copy.deepcopy(b.head)``, or a part converted on its own), for this model to adopt
    (their own options stay); one with another number of components is refused (its tables are ``[K, F]``)."""
    foreign = []
    for name, layer in rank1_layers(model):
        theirs = layer.rank1_state.model
        if theirs is existing:
            continue
        if theirs.options.components != existing.options.components:
            raise ValueError(
                f"{name} ({type(layer).__name__}) was converted with components={theirs.options.components} and "
                f"{type(model).__name__} with components={existing.options.components}; its tables cannot join this "
                "model's: convert that layer's original (bayesify.revert it) with the model's components."
            )
        foreign.append(layer)
    return foreign


def _state_for(model: nn.Module, config: Rank1Config, said: Task) -> ModelState:
    """The model's state: the existing one on a second conversion (whose model-wide options it must keep), else a
    new one."""
    existing = _existing_state(model)
    inner = [(name, layer) for name, layer in rank1_layers(model)]
    converted = type(model).__name__
    if existing is not None and ATTRIBUTE not in model.__dict__:  # a part of the model was converted on its own before
        existing.report = ConversionReport()  # (its names were relative to that part)
        converted = f"a part of {type(model).__name__} (holding {inner[0][0]!r})"
        # its task was about the part's output (a backbone's features: task="regression"), not this model's (a new
        # head's logits): decided again for this model, as for a first conversion (kept, the part's features
        # averaged the new head's logits, silently; an explicit task was refused)
        existing.task = Auto()
    inner = [layer for _, layer in inner]
    if existing is None:
        return ModelState(config.model_options())
    # the options every layer reads from the model state cannot change for some layers only (a task may be said
    # where none was, or left "auto": the model keeps its own)
    differ = [name for name in scoped(Rank1Config, "model") if getattr(existing.options, name) != getattr(config, name)]
    if not isinstance(said, Auto) and not isinstance(existing.task, Auto) and said != existing.task:
        differ.append("task")
    if differ:
        was = ", ".join(f"{name}={_shown(existing.task if name == 'task' else getattr(existing.options, name))}" for name in differ)
        got = ", ".join(f"{name}={_shown(said if name == 'task' else getattr(config, name))}" for name in differ)
        raise ValueError(
            f"{converted} was converted with {was}; a second convert() must use the same model-wide "
            f"option(s) (got {got}): pass those, or call bayesify.revert(model) and convert again."
        )
    # one state per model: every layer takes it, and a part converted on its own before is a root no more
    for layer in inner:
        layer.rank1_state.model = existing
    for module in model.modules():
        if module is not model and is_root(module):
            module.__dict__[ATTRIBUTE].detach(module)
    return existing


def _shown(value: object) -> str:
    """An option's value as a user writes it."""
    if isinstance(value, Task):
        return repr(str(value))
    return repr(getattr(value, "value", value))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    if not name:
        return
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def revert(model: nn.Module) -> nn.Module:
    """Undo :func:`convert` in place: original classes, original state only. Returns ``model``."""
    inside = {id(m) for m in model.modules()}
    foreign = [(name, root) for name, layer in rank1_layers(model)
               if (root := layer.rank1_state.model.root) is not None and id(root) not in inside
               and any(m is layer for m in root.modules())]  # fmt: skip
    if foreign:  # a layer shared with a converted model (not a copy of one): reverting it would take that model's factors
        name, root = foreign[0]
        raise ValueError(
            f"{type(model).__name__} holds layers of another converted model ({name!r}, converted with a "
            f"{type(root).__name__} it shares them with): revert that model, bayesify.revert(<that model>); reverting "
            "them here would take their trained factors from it."
        )
    for module in list(model.modules()):
        state = module.__dict__.get(ATTRIBUTE)
        if state is not None:
            state.detach(module)  # its hooks, its no_weight_decay(), itself
    for _, layer in list(rank1_layers(model)):
        layer.revert()
    return model
