"""``merge()``: one member of a converted model as a plain model, for deployment.

The returned model is a copy of the original network with component k's posterior means folded
into its weights: the original classes, the original ``state_dict`` keys, no hooks and no rank-1
state, so it runs at the original cost and exports, quantises or saves like any plain model. Its
output is member k's, i.e. what the converted model computes under
``bayesify.mode(model, component=k, noise=False)``. The maths of each layer family is its
:meth:`~bayesify.ConvertedLayer.rank1_merge`; for the multiplicative perturbation
``W' = W o (r_k s_k^T)`` and ``b' = b + delta_k``.

References:
    Dusenberry et al., "Efficient and Scalable Bayesian Neural Nets with Rank-1 Factors", ICML 2020, Eq. 1.
"""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict

import torch
from torch import Tensor, nn

from bayesify.convert import revert
from bayesify.hf import keep_untied
from bayesify.inspection import num_components, rank1_layers
from bayesify.sharding import is_sharded

__all__ = ["merge"]

def merge(model: nn.Module, component: int) -> nn.Module:
    """A new plain model: ``model``'s member ``component`` with its posterior means in the weights.

    ``model`` is left untouched. Gaussian embeddings become their mean (the original table).
    Parameters that other modules share (tied weights, e.g. a language model's head and its token
    embedding) are untied: the converted layer gets its own merged copy, with a warning. A Hugging
    Face model's ``config.tie_word_embeddings`` becomes False in the copy, so that ``tie_weights()``,
    ``resize_token_embeddings`` and ``save_pretrained`` / ``from_pretrained`` keep them apart
    (:func:`bayesify.hf.keep_untied`).

    Args:
        model: a converted model (or a converted layer used as the model).
        component: the member to keep, in ``[0, K)``.

    Returns:
        A deep copy of ``model`` with no bayesify state, whose output equals the converted model's
        under ``bayesify.mode(model, component=component, noise=False)``.

    Raises:
        ValueError: ``model`` is not converted, ``component`` is out of range, or a layer cannot hold
            the member in its original parameters (the message names the layer and why; e.g. an
            additive perturbation through zero padding, or timm's ``StdConv2d``, which standardises
            its weight).
        NotImplementedError: a user-defined layer family without :meth:`~bayesify.ConvertedLayer.rank1_merge`.

    Example:
        >>> model = bayesify.convert(net, components=4)
        >>> ...  # train
        >>> member = bayesify.merge(model, component=2)      # a plain `net`, zero overhead
        >>> torch.onnx.export(member.eval(), (x,), "member2.onnx", dynamo=True)

    References:
        Dusenberry et al., ICML 2020, Eq. 1 (``W o (r s^T)``).
    """
    _check_mergeable(model, component)
    try:
        merged = copy.deepcopy(model)
    except RuntimeError:
        # torch copies no computed tensor (pruning's weight, old-style weight norm's): the layer's own refusal says
        # what to do first, where it has one
        with torch.no_grad():
            _member_values(model, component)
        raise
    with torch.no_grad():
        updates = _member_values(merged, component)
        untied = _write_values(merged, updates)
    merged = revert(merged)
    _warn_untied(merged, untied, component)
    return merged


def _check_mergeable(model: nn.Module, component: int) -> None:
    """Raise the error :func:`merge` documents for a model it cannot merge or a component out of range."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"merge() takes a converted nn.Module, got {type(model).__name__}.")
    if next(rank1_layers(model), None) is None:
        raise ValueError(
            f"{type(model).__name__} has no rank-1 layers to merge; merge() takes a model returned by bayesify.convert."
        )
    if is_sharded(model):
        raise ValueError(
            f"{type(model).__name__} is sharded (FSDP); gather it first: plain = bayesify.training.gather(model, "
            "into=<the same model, converted, unsharded>), then bayesify.merge(plain, component)."
        )
    for _, layer in rank1_layers(model):
        layer.rank1_check()  # a parameter replaced since conversion (its factors do not fit it): one line, first
    k = num_components(model)
    if isinstance(component, bool) or not isinstance(component, int) or not 0 <= component < k:
        raise ValueError(f"component={component!r} must be an integer in [0, {k}) (the model has K={k} components).")


def _member_values(merged: nn.Module, component: int) -> list[tuple[str, nn.Module, dict[str, Tensor]]]:
    """``(name, layer, {parameter name: merged value})`` of every rank-1 layer, all computed before any is written
    (a parameter may be read by two layers); a layer's error is re-raised naming the layer."""
    updates: list[tuple[str, nn.Module, dict[str, Tensor]]] = []
    for name, layer in rank1_layers(merged):
        try:
            values = layer.rank1_merge(component)
        except (ValueError, NotImplementedError) as error:
            where = repr(name) if name else "the model"
            kind = type(layer).__rank1_base__.__name__
            message = f"bayesify.merge cannot fold component {component} into {where} ({kind}): {error}"
            raise type(error)(message if message.endswith(".") else message + ".") from None
        updates.append((name, layer, values))
    return updates


def _write_values(merged: nn.Module, updates: list[tuple[str, nn.Module, dict[str, Tensor]]]) -> dict[str, list[str]]:
    """Write the merged values into the layers' parameters, in place, and return the untied ones: a parameter that
    other modules share gets its own merged copy instead (``{its full name: the names it was shared with}``)."""
    holders, names = _parameter_holders(merged)
    untied: dict[str, list[str]] = {}
    for layer_name, layer, values in updates:
        for param_name, value in values.items():
            owner_name, _, attr = param_name.rpartition(".")
            owner = layer.get_submodule(owner_name) if owner_name else layer
            param = owner._parameters[attr]
            assert param is not None and param.shape == value.shape, f"{param_name} keeps its shape"
            if len(holders[id(param)]) > 1:  # tied: give this layer its own merged copy
                full = f"{layer_name}.{param_name}" if layer_name else param_name
                untied[full] = [n for n in names[id(param)] if n != full]
                owner._parameters[attr] = nn.Parameter(value.to(param.dtype).clone(), param.requires_grad)
            else:
                param.copy_(value)
    return untied


def _warn_untied(merged: nn.Module, untied: dict[str, list[str]], component: int) -> None:
    """Keep a Hugging Face model's untied parameters apart, and warn about each untied parameter (see :func:`merge`)."""
    # a Hugging Face model would tie them again (tie_weights(), resize_token_embeddings, a reload)
    flags = [f"merged.{p}.config" if p else "merged.config" for p in keep_untied(merged, untied)]
    kept = (
        f"{' and '.join(f + '.tie_word_embeddings' for f in flags)} {'is' if len(flags) == 1 else 'are'} now False, "
        "so that tie_weights() and resize_token_embeddings keep them apart"
        if flags
        else "tying them again would undo the merge"
    )
    for full, others in untied.items():
        warnings.warn(
            f"bayesify.merge: {full} was shared with {', '.join(others)}; the merged model holds its own copy with "
            f"component {component} folded in, so they are no longer tied ({kept}).",
            stacklevel=3,  # merge()'s caller: this helper is called from merge()
        )


def _parameter_holders(model: nn.Module) -> tuple[dict[int, set[tuple[int, str]]], dict[int, list[str]]]:
    """For each parameter: the distinct ``(module, attribute)`` slots holding it, and its qualified names."""
    holders: dict[int, set[tuple[int, str]]] = defaultdict(set)
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                holders[id(param)].add((id(module), attr))
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return holders, names
