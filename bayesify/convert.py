"""``convert()``: turn any model into a rank-1 Bayesian neural net by model surgery."""

from __future__ import annotations

import fnmatch
from typing import Iterable, Mapping

from torch import nn

from bayesify import _routing
from bayesify.config import Rank1Config
from bayesify.modules import rank1_layers
from bayesify.options import Init, Perturbation, Posterior, Prior, Reduction
from bayesify.wrappers.attention import Rank1MultiheadAttention
from bayesify.wrappers.base import Rank1Layer
from bayesify.wrappers.bilinear import Rank1Bilinear
from bayesify.wrappers.condconv import condconv_mapping
from bayesify.wrappers.conv import Rank1Conv, Rank1ConvTranspose
from bayesify.wrappers.embedding import GaussianEmbedding
from bayesify.wrappers.linear import Rank1Linear
from bayesify.wrappers.recurrent import Rank1RNN, Rank1RNNCell

__all__ = ["convert", "default_mapping", "revert"]

# {source type: wrapper}; subclasses of a source type are converted by the same wrapper.
_DEFAULT_MAPPING: dict[type[nn.Module], type[Rank1Layer]] = {
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


# with convert(..., embeddings=True)
_EMBEDDING_MAPPING: dict[type[nn.Module], type[Rank1Layer]] = {
    nn.Embedding: GaussianEmbedding,
    nn.EmbeddingBag: GaussianEmbedding,
}


def default_mapping() -> dict[type[nn.Module], type[Rank1Layer]]:
    """A copy of the default ``{layer type: rank-1 wrapper}`` table.

    Extend it to convert your own layers: ``convert(model, mapping={**default_mapping(),
    MyLayer: MyRank1Layer})``, where ``MyRank1Layer`` subclasses
    :class:`~bayesify.wrappers.Rank1Layer`. Layers of optional libraries (timm's ``CondConv2d``)
    are in it once that library is imported.
    """
    return {**_DEFAULT_MAPPING, **condconv_mapping()}


def _lookup(module: nn.Module, mapping: Mapping[type, type[Rank1Layer]]) -> type[Rank1Layer] | None:
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


def _is_weight_bearing(module: nn.Module) -> bool:
    """Whether a module owns a parameter shaped like a matrix or kernel: 2+ axes longer than 1.

    Per-channel scales and tokens (``[C, 1, 1]``, ``[1, 1, D]``) are not; whether a table such as
    a position embedding is a linear map, ``summary(model, x)`` finds out by watching its use.
    """
    return any(sum(size > 1 for size in p.shape) >= 2 for p in module.parameters(recurse=False))


# kept deterministic by design, as in the paper: never reported as skipped linear maps
_DETERMINISTIC: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def _skip_reason(module: nn.Module) -> str | None:
    """Why a weight-bearing module without a wrapper stays deterministic, and how to change that."""
    kind = type(module).__name__
    if isinstance(module, _DETERMINISTIC):
        return None
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return (
            f"{kind} kept deterministic (embeddings are not rank-1 in the paper); convert(..., embeddings=True) "
            "makes it a Gaussian variational embedding"
        )
    return (
        f"{kind} has no rank-1 wrapper in the mapping; if it computes a linear map or a convolution, pass "
        f"mapping={{**bayesify.default_mapping(), {kind}: <your Rank1Layer subclass>}}"
    )


def convert(
    model: nn.Module,
    *,
    components: int = 4,
    prior: Prior | str = Prior.NORMAL,
    prior_mean: float | None = None,
    prior_std: float = 0.1,
    posterior: Posterior | str = Posterior.NORMAL,
    perturbation: Perturbation | str = Perturbation.MULTIPLICATIVE,
    init: Init | str = Init.PRESERVE,
    init_sign_p: float = 0.5,
    init_mean_std: float = 0.1,
    init_dropout: float | None = None,
    init_std: float | None = None,
    init_jitter: float = 0.0,
    clip: float | None = 10.0,
    batch_dim: int = 0,
    reduction: Reduction | str = Reduction.LOGITS,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    mapping: Mapping[type[nn.Module], type[Rank1Layer]] | None = None,
    embeddings: bool = False,
    embedding_prior_std: float = 1.0,
) -> nn.Module:
    """Make ``model`` a rank-1 Bayesian neural net, in place, and return it.

    Every module whose type (or a parent class of it) is in ``mapping`` becomes a rank-1
    layer: the same module object and the same Parameters, with ``W' = W o (r s^T)`` where
    r and s have a K-component mixture posterior. Only new state is added, so a pretrained
    checkpoint still loads and an optimizer created earlier still holds the weights.

    Args:
        model: any ``nn.Module`` (timm, torchvision, your own; the root may itself be a layer).
        components: K, the number of mixture components (paper: 4).
        prior: ``"normal"`` or ``"cauchy"`` prior on each entry of r and s.
        prior_mean: prior location; default 1 (multiplicative) or 0 (additive).
        prior_std: prior scale (paper: 0.1 CIFAR, 0.05 ImageNet).
        posterior: ``"normal"``, ``"cauchy"`` or ``"delta"`` (deterministic: BatchEnsemble).
        perturbation: ``"multiplicative"`` (``W o r s^T``) or ``"additive"``.
        init: posterior means: ``"preserve"`` (exactly the identity: keeps a pretrained model's
            function), ``"random_sign"`` (reference ``random_sign_init``, for training from
            scratch; +1 with probability ``init_sign_p``), or ``"normal"`` (spread
            ``init_mean_std`` around the identity).
        init_dropout: initial scale by the dropout parameterisation ``sqrt(p / (1 - p))``;
            default 1e-3 (Normal, std ~0.032) or 1e-6 (Cauchy), as the reference.
        init_std: initial scale directly (overrides ``init_dropout``).
        init_jitter: std of truncated-normal jitter on the raw scale (reference: 0.1).
        clip: samples of r and s are clipped to ``[-clip, clip]`` (reference: 10; None: off).
        batch_dim: where the batch lies in the model's inputs (and Linear layers' inputs).
        reduction: how evaluation reduces the K members: ``"logits"`` (log mean softmax),
            ``"binary_logits"`` (logit of mean sigmoid) or ``"mean"``.
        include: fnmatch patterns of module names to convert (a pattern covers everything
            below the module it names); default: all.
        exclude: fnmatch patterns of module names to leave deterministic.
        mapping: ``{layer type: wrapper}``; default :func:`default_mapping`.
        embeddings: also make ``nn.Embedding`` / ``nn.EmbeddingBag`` Gaussian variational
            embeddings (a Normal over each vector, mean = the original weight; the paper's
            MIMIC-III model). Off by default: embeddings stay deterministic, as the paper's
            rank-1 layers.
        embedding_prior_std: std of the Normal(0, std) prior of those embeddings.

    Returns:
        ``model`` itself, converted.

    Raises:
        ValueError: an invalid option, a pattern that matches no module, nothing to convert,
            or a second conversion with a different number of components.

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
    config = Rank1Config(
        components=components,
        prior=prior,
        prior_mean=prior_mean,
        prior_std=prior_std,
        posterior=posterior,
        perturbation=perturbation,
        init=init,
        init_sign_p=init_sign_p,
        init_mean_std=init_mean_std,
        init_dropout=init_dropout,
        init_std=init_std,
        init_jitter=init_jitter,
        clip=clip,
        batch_dim=batch_dim,
        reduction=reduction,
        embeddings=embeddings,
        embedding_prior_std=embedding_prior_std,
    )
    table = default_mapping() if mapping is None else dict(mapping)
    if config.embeddings:
        table = {**_EMBEDDING_MAPPING, **table}
    for source, wrapper in table.items():
        if not (isinstance(wrapper, type) and issubclass(wrapper, Rank1Layer)):
            raise TypeError(
                f"mapping[{source.__name__}]={wrapper!r} must be a subclass of bayesify.wrappers.Rank1Layer."
            )
    includes, excludes = _as_patterns("include", include), _as_patterns("exclude", exclude)

    context = _context_for(model, config)
    plan: list[tuple[str, nn.Module, type[Rank1Layer]]] = []
    skipped: dict[str, str] = {}
    used_patterns: set[str] = set()
    converted_prefixes: list[str] = []
    for name, module in model.named_modules():
        if any(p == "" or name.startswith(p + ".") for p in converted_prefixes if p != name):
            continue  # never convert inside a layer that is converted (it would stack factors)
        already = isinstance(module, Rank1Layer)
        wrapper = None if already else _lookup(module, table)
        if wrapper is None and not already:
            reason = _skip_reason(module) if _is_weight_bearing(module) else None
            if reason is not None:
                skipped[name] = reason
            continue
        hit_in = [p for p in includes or [] if _matches(name, p)]
        hit_ex = [p for p in excludes or [] if _matches(name, p)]
        used_patterns.update(hit_in, hit_ex)
        if already:  # converted before: left as it is
            converted_prefixes.append(name)
            continue
        if includes is not None and not hit_in:
            skipped[name] = "not matched by include"
            continue
        if hit_ex:
            skipped[name] = f"excluded by pattern {hit_ex[0]!r}"
            continue
        plan.append((name, module, wrapper))
        converted_prefixes.append(name)

    unused = [p for p in (includes or []) + (excludes or []) if p not in used_patterns]
    if unused:
        raise ValueError(
            f"pattern(s) {unused} matched no convertible module of {type(model).__name__}; patterns are fnmatch "
            "globs on qualified module names as printed by model.named_modules() (e.g. 'head', 'blocks.*.mlp')."
        )
    if not plan:
        already = next(rank1_layers(model), None) is not None
        if already:
            raise ValueError(
                f"{type(model).__name__} is already converted and nothing new matched; it was left unchanged. "
                "To change options, call bayesify.revert(model) and convert again."
            )
        raise ValueError(
            f"{type(model).__name__} has no layer to convert: none of its modules is an instance of "
            f"{sorted(t.__name__ for t in table)}. Pass mapping={{**bayesify.default_mapping(), YourLayer: "
            "YourRank1Layer} to convert other layer types."
        )

    # convert after the walk (never mutate the tree while iterating it)
    for name, module, wrapper in plan:
        new = wrapper.from_module(module, config, context)
        if new is not module:
            _replace(model, name, new)
            if name == "":
                model = new
    for name, _, _ in plan:
        context.skipped.pop(name, None)
    context.skipped.update(skipped)
    if not _routing.is_root(model):
        _routing.attach(model, context)
    return model


def _context_for(model: nn.Module, config: Rank1Config) -> _routing.Rank1Context:
    """The model's routing context: the existing one on a second conversion, else a new one."""
    existing = model.__dict__.get("_rank1_context")
    inner = [layer for _, layer in rank1_layers(model)]
    if existing is None and inner:
        existing = inner[0]._rank1_context  # a part of the model was converted on its own before
    if existing is None:
        return _routing.Rank1Context(config.components, batch_dim=config.batch_dim, reduction=config.reduction)
    if existing.components != config.components or existing.batch_dim != config.batch_dim:
        raise ValueError(
            f"{type(model).__name__} already has rank-1 layers with components={existing.components}, "
            f"batch_dim={existing.batch_dim}; a second convert() must use the same values (got "
            f"components={config.components}, batch_dim={config.batch_dim}), or call bayesify.revert(model) first."
        )
    # one context per model: rebind inner layers and drop routing hooks of inner roots
    for _, layer in rank1_layers(model):
        layer._rank1_context = existing
    for module in model.modules():
        if module is not model and _routing.is_root(module):
            _routing.detach(module)
            if not isinstance(module, Rank1Layer):
                del module._rank1_context
    return existing


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    if not name:
        return
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def revert(model: nn.Module) -> nn.Module:
    """Undo :func:`convert` in place: original classes, original state only. Returns ``model``."""
    for module in list(model.modules()):
        if _routing.is_root(module):
            _routing.detach(module)
        if not isinstance(module, Rank1Layer):
            module.__dict__.pop("_rank1_context", None)
    for _, layer in list(rank1_layers(model)):
        layer.revert()
    return model
