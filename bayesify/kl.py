"""The KL term of a converted model's training objective.

``kl_divergence(model)`` is the sum over every converted layer of KL(q || p), each layer stating
its pieces (:meth:`~bayesify.layers.ConvertedLayer.rank1_kl_terms`), taken in one concatenated
pass per prior (:func:`bayesify.variational.divergence.total_kl`). Divide it by the number of training
examples for the per-example ELBO term.
"""

from __future__ import annotations

import numbers
import warnings

import torch
from torch import Tensor, nn

from bayesify.convert import added_after_conversion, default_mapping
from bayesify.layers.base import ConvertedLayer
from bayesify.model_state import ModelState
from bayesify.variational.divergence import total_kl

__all__ = ["kl_divergence", "kl_loss"]


def kl_divergence(model: nn.Module) -> Tensor:
    """KL(q || p) of every variational posterior in ``model``, summed over components and layers.

    Divide by the number of training examples to get the per-example ELBO term:
    ``loss = nll + bayesify.kl_divergence(model) / len(train_set)``.

    Raises:
        ValueError: ``model`` has no converted layer.

    References:
        Dusenberry et al., ICML 2020, Eq. 3 (the reference sums over the K components).
    """
    return _kl_divergence(model)[0]


def _kl_divergence(model: nn.Module) -> tuple[Tensor, list[ConvertedLayer]]:
    """:func:`kl_divergence`, and the converted layers it summed over (one walk of the model a step)."""
    modules = list(model.modules())
    layers = [module for module in modules if isinstance(module, ConvertedLayer)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no rank-1 layers, so it has no KL term; call bayesify.convert(model) first."
        )
    if not torch.compiler.is_compiling():
        _warn_added_after_conversion(layers, len(modules))
    total = total_kl(term for layer in layers for term in layer.rank1_kl_terms())
    if total is None:  # only delta posteriors (BatchEnsemble)
        first = next((p for layer in layers for p in layer.rank1_parameters()), None)
        return (torch.zeros(()) if first is None else first.new_zeros(())), layers
    return total, layers  # (a sharded model's tables are summed over the ranks in total_kl: counted once in all)


def _warn_added_after_conversion(layers: list[ConvertedLayer], modules: int) -> None:
    """Warn, once per module, where a weight-bearing module was put in the model after :func:`~bayesify.convert`
    (a head that ``reset_classifier`` or ``resize_token_embeddings`` made, replacing a converted one): it trains as
    a plain layer that the K members share, which nothing else would say. Looked for again only when the model's
    modules changed since the last step (their number and the converted layers' identities, from the walk this
    step made anyway)."""
    state = layers[0].rank1_state.model
    seen = (modules, *map(id, layers))
    if state.checked_layers == seen or state.root is None:
        return
    state.checked_layers = seen
    convertible = tuple(default_mapping())  # (what a second convert() would convert: not a new embedding, say)
    for name, skip in added_after_conversion(state.root, state.report.skipped).items():
        if isinstance(state.root.get_submodule(name), convertible) and f"added {name}" not in state.warned:
            state.warned.add(f"added {name}")
            kind = skip.message.split(" ", 1)[0]
            warnings.warn(
                f"{name} ({kind}) was put in {type(state.root).__name__} after bayesify.convert and is not rank-1: its "
                "K members share it. Call bayesify.convert(model) again to convert it (the converted layers keep their "
                f"values; make the optimizer after it), or bayesify.convert(model, exclude=[{name!r}]) to keep it "
                "deterministic and say so.",
                stacklevel=3,
            )


def kl_loss(model: nn.Module, num_train: int, *, step: int | None = None, warmup_steps: int = 0) -> Tensor:
    """The KL term of one training step, for any training loop: ``w * kl_divergence(model) / num_train``.

    ``w = min(1, (step + 1) / warmup_steps)`` rises linearly from ~0 to 1 over the first
    ``warmup_steps`` optimizer steps (the paper anneals over 2/3 of training), then stays 1; without
    ``step`` (or with ``warmup_steps=0``) it is 1. Dividing by the number of training examples makes
    it the per-example KL of the ELBO, on the scale of a mean cross-entropy.

    Args:
        model: a converted model (or a wrapper of one, such as DDP).
        num_train: N, the number of training examples.
        step: the optimizer step about to be taken (0-based), for the warm-up.
        warmup_steps: steps over which the weight rises to 1.

    Example:
        >>> for step, (x, y) in enumerate(loader):
        ...     loss = F.cross_entropy(model(x), y) + bayesify.kl_loss(model, len(train_set), step=step,
        ...                                                            warmup_steps=total_steps * 2 // 3)

    References:
        Dusenberry et al., ICML 2020, Eq. 3 (the ELBO) and Sec. 5 (KL annealing).
    """
    num_train = _count("num_train", num_train, 1, "the number of training examples")
    warmup_steps = _count("warmup_steps", warmup_steps, 0, "steps of the warm-up; 0: none")
    if warmup_steps and step is None:  # (the weight would be 1 from the first step: the warm-up ignored, silently)
        raise ValueError(f"warmup_steps={warmup_steps} raises the KL's weight over the steps: pass step= too (the 0-based optimizer step).")
    weight = 1.0 if step is None else kl_scale(_count("step", step, 0, "the 0-based optimizer step"), warmup_steps)
    kl, layers = _kl_divergence(model)
    if not torch.compiler.is_compiling():
        _warn_fewer_than_a_batch(layers[0].rank1_state.model, num_train)
    return kl * (weight / num_train)


def _warn_fewer_than_a_batch(state: ModelState, num_train: int) -> None:
    """Warn, once per model, where ``num_train`` is fewer than the examples of the last forward pass: the number of
    batches given for the number of examples (``len(loader)`` for ``len(train_set)``) weighs the KL that many times
    too much."""
    passed = state.router.state
    if passed is None or passed.batch <= num_train or "num_train" in state.warned:
        return
    state.warned.add("num_train")
    warnings.warn(
        f"kl_loss(num_train={num_train}) is fewer than the {passed.batch} examples of the last forward pass: it is the "
        "number of training examples (len(train_set)), not of batches (len(loader)), and as given the KL weighs "
        f"{passed.batch / num_train:.3g}x or more what it should.",
        stacklevel=3,
    )


def _count(name: str, value: object, least: int, what: str) -> int:
    """``value`` as an int >= ``least`` (a Python, NumPy or one-element integer tensor count), or a one-line error."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point() and value.dtype != torch.bool:
        value = int(value.item())
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name}={value!r} must be {what} (an integer >= {least}).")
    return value


def kl_scale(step: int, annealing_steps: int) -> float:
    """``min(1, (step + 1) / annealing_steps)``: linear KL annealing (1 when ``annealing_steps <= 0``)."""
    if annealing_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / annealing_steps)
