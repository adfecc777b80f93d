"""Hugging Face ``transformers`` glue: the ``Trainer``'s weight-decay names and the KL term's share of a step under
gradient accumulation, and a merged model's tied weights.

transformers stays optional: nothing here imports it; the functions look for it in ``sys.modules``
(a model of its classes has imported it already).

Example:
    >>> class BayesianTrainer(transformers.Trainer):
    ...     def get_decay_parameter_names(self, model):  # no weight decay on bayesify's parameters
    ...         return bayesify.hf.decay_parameter_names(model, super().get_decay_parameter_names(model))
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from torch import nn

from bayesify.inspection import rank1_parameters

__all__ = ["block_class_names", "decay_parameter_names", "keep_untied", "kl_share"]


def kl_share(trainer: object, num_items_in_batch: object) -> float:
    """What ``Trainer.compute_loss`` multiplies the KL term by, so that an optimizer step counts it once.

    Under gradient accumulation the ``Trainer`` either divides each micro-batch's loss by the accumulation steps (a
    loss that is a per-batch mean: the KL is added whole, 1.0) or does not (a loss the model normalised over the
    whole accumulated batch with ``num_items_in_batch``, which weights every token alike: then 1 / the steps). Which
    one, transformers decides by ``loss_is_scaled_for_ga`` where the trainer sets it, else by whether the model
    takes ``num_items_in_batch`` (``model_accepts_loss_kwargs``) and got one, or a ``compute_loss_func`` is set; this
    reads the same attributes, so the recipe passes ``num_items_in_batch`` on and keeps the ``Trainer``'s
    token-weighted NLL (a per-batch mean weighted a short sequence's tokens above a long one's).

    Args:
        trainer: the ``transformers.Trainer`` (``self`` in ``compute_loss``).
        num_items_in_batch: ``compute_loss``'s argument, as given.
    """
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        accepts = getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None
        scaled = bool(accepts) or getattr(trainer, "compute_loss_func", None) is not None
    if not scaled:
        return 1.0
    steps = getattr(trainer, "current_gradient_accumulation_steps", None)
    if not isinstance(steps, int) or steps < 1:
        steps = trainer.args.gradient_accumulation_steps  # (before the first step sets it)
    return 1.0 / steps


def decay_parameter_names(model: nn.Module, names: Iterable[str]) -> list[str]:
    """``names`` (parameters of ``model`` to decay) without any parameter bayesify added.

    For ``transformers.Trainer.get_decay_parameter_names``, which decays every parameter but
    biases and norms, so the rank-1 factors' ``loc`` and ``rho`` too: decaying ``loc`` pulls the
    factors (centred at the prior mean 1) to 0, decaying ``rho`` *widens* the posterior. bayesify's
    parameters are told apart by identity (:func:`bayesify.rank1_parameters`), not by their names.

    Args:
        model: the model the names belong to (the converted model the ``Trainer`` optimises).
        names: qualified parameter names, as ``Trainer.get_decay_parameter_names`` returns them.
            A name that is no parameter of ``model`` (a slot holding None) is kept, as given.

    Returns:
        The names, in their order, less those of bayesify's parameters.

    Example:
        >>> class BayesianTrainer(Trainer):
        ...     def get_decay_parameter_names(self, model):
        ...         return bayesify.hf.decay_parameter_names(model, super().get_decay_parameter_names(model))
    """
    if isinstance(names, str):
        raise TypeError(f"names={names!r} must be a list of parameter names, not one string.")
    added = {id(p) for p in rank1_parameters(model)}
    params = dict(model.named_parameters(remove_duplicate=False))
    return [name for name in names if name not in params or id(params[name]) not in added]


def keep_untied(model: nn.Module, untied: Iterable[str]) -> list[str]:
    """Keep the parameters ``untied`` (qualified names) apart in every Hugging Face model inside ``model``.

    :func:`bayesify.merge` gives a converted layer whose weight was tied (a language-model head and
    its token embedding) its own merged copy. A Hugging Face model ties its weights again whenever
    it is asked to (``tie_weights()``, ``resize_token_embeddings``, loading a checkpoint), as its
    ``config.tie_word_embeddings`` says; that would throw the merged values away. So wherever a
    tie of such a model names an untied parameter, its config's ``tie_word_embeddings`` becomes
    False; the other ties under that flag (BART's encoder and decoder token embeddings) get their own
    copies too, as the model no longer knows they are tied: ``save_pretrained`` keeps all of them
    and a reload loads each. The model's tie list (``all_tied_weights_keys``) is brought up to date.

    Args:
        model: a plain model (``merge``'s copy, after ``revert``); not a Hugging Face model: nothing to do.
        untied: the qualified names of the parameters that merge untied.

    Returns:
        The names of the models (``""``: ``model`` itself) whose ``config.tie_word_embeddings`` became False.
    """
    untied = set(untied)
    base = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    if not untied or base is None:
        return []
    models = [(prefix, m) for prefix, m in model.named_modules(remove_duplicate=False) if isinstance(m, base)]
    configs: dict[int, object] = {}  # the configs whose flag goes, by id
    changed: list[str] = []
    ties: list[tuple[str, str, int]] = []  # (target, source, id of the config that ties them), full names
    for prefix, sub in models:
        if not getattr(sub.config, "tie_word_embeddings", False):
            continue
        if hasattr(sub, "get_expanded_tied_weights_keys"):  # transformers >= 5: the model's own tie list
            pairs = [(_join(prefix, t), _join(prefix, s)) for t, s in sub.get_expanded_tied_weights_keys().items()]
            breaks = any(t in untied or s in untied for t, s in pairs)
            ties.extend((t, s, id(sub.config)) for t, s in pairs)
        else:  # older: the flag ties the output embeddings to the input embeddings, the only tie merge can break
            breaks = any(_join(prefix, name) in untied for name, _ in sub.named_parameters(remove_duplicate=False))
        if breaks:
            configs[id(sub.config)] = sub.config
            changed.append(prefix)
    params = dict(model.named_parameters(remove_duplicate=False))
    for target, source, config in ties:
        if config in configs and target in params and params.get(source) is params[target]:
            owner, _, attr = target.rpartition(".")
            module = model.get_submodule(owner)
            shared = module._parameters[attr]
            module._parameters[attr] = nn.Parameter(shared.detach().clone(), shared.requires_grad)
            params[target] = module._parameters[attr]
    for config in configs.values():
        config.tie_word_embeddings = False
    for _, sub in models:  # the tie list that save_pretrained / from_pretrained read (transformers >= 5)
        if hasattr(sub, "all_tied_weights_keys") and hasattr(sub, "get_expanded_tied_weights_keys"):
            sub.all_tied_weights_keys = sub.get_expanded_tied_weights_keys(all_submodels=True)
    return changed


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def block_class_names(model: nn.Module) -> list[str] | None:
    """The classes a Hugging Face model says must never be split across devices (``_no_split_modules``: its
    transformer blocks), or None for a model that says nothing (for :func:`bayesify.training.shard`)."""
    names = getattr(model, "_no_split_modules", None)
    return list(names) if names else None
