"""Optimizers and learning-rate schedules of the paper's recipes.

* :func:`param_groups`: parameter groups for any torch optimizer. The point-estimated weights
  (decayed), the biases and normalisation parameters (not decayed), the rank-1 r / s factors at
  ``fast_weight_lr_multiplier`` times the base rate (the reference scales those parameters'
  gradients, which for SGD with momentum is the same as scaling their learning rate; with Adam a
  learning-rate multiplier is the meaningful form), and bayesify's other parameters (per-component
  bias offsets, embedding scales) at the base rate, as in the reference. No bayesify parameter is
  decayed: the factors are multiplicative and centred at the prior mean 1 (decaying ``loc``
  pulls it to 0; decaying ``rho`` widens the posterior), and the bias offsets have their L2
  prior in the objective. (timm's ``create_optimizer_v2`` gets the same answer from the
  ``no_weight_decay()`` hook that :func:`bayesify.convert` puts on the root.)
* :func:`build_optimizer`: SGD with Nesterov momentum (CIFAR / ImageNet recipes) or Adam /
  AdamW (MIMIC recipe).
* :class:`WarmupStepDecay`: the reference's ``WarmUpPiecewiseConstantSchedule``: linear warm-up
  from 0 over ``warmup_epochs``, then the base rate times ``decay_ratio ** i`` after the i-th
  decay epoch. Epochs are fractional (``step / steps_per_epoch``), as the reference.

Example:
    >>> groups = param_groups(model, lr=0.1, fast_weight_lr_multiplier=0.5)
    >>> optimizer = build_optimizer("sgd", groups, lr=0.1)
    >>> scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupStepDecay(100, 1, [80, 160, 180], 0.2))
"""

from __future__ import annotations

import fnmatch
from typing import Any, Sequence

import torch
from torch import nn

from bayesify.inspection import NORM_LAYERS, rank1_parameters
from bayesify.options import StrOption
from bayesify.variational.factor import Rank1Factor

__all__ = ["GROUPS", "OptimizerName", "WarmupStepDecay", "build_optimizer", "param_groups"]


class OptimizerName(StrOption):
    """The optimizers the trainer builds."""

    SGD = "sgd"
    """SGD with (Nesterov) momentum: the paper's CIFAR / ImageNet recipe."""
    ADAM = "adam"
    """Adam: the paper's MIMIC-III recipe."""
    ADAMW = "adamw"
    """AdamW (decoupled weight decay; bayesify's L2 prior lives in the objective instead)."""


GROUPS: tuple[str, ...] = ("weights", "no_decay", "rank1_factors", "rank1_other")
"""The names of :func:`param_groups`' groups, in their order."""


def _factor_parameter_ids(model: nn.Module) -> set[int]:
    """The Parameters holding r / s factors (each factor's own ``loc`` and ``rho``)."""
    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, Rank1Factor):
            ids.update(id(p) for p in module.parameters(recurse=False))
    return ids


def _own_no_weight_decay(model: nn.Module) -> list[str]:
    """The names / fnmatch globs the model itself keeps out of decay (timm's ``no_weight_decay()``)."""
    hook = getattr(model, "no_weight_decay", None)
    return [str(name) for name in hook()] if callable(hook) else []


def param_groups(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float | None = None,
    fast_weight_lr_multiplier: float = 1.0,
) -> list[dict[str, Any]]:
    """Parameter groups for any torch optimizer, with no weight decay on what bayesify added.

    * ``weights``: the point-estimated weights (2+ axes); ``lr``, ``weight_decay``.
    * ``no_decay``: biases, normalisation parameters, other 0-/1-d parameters and the names
      the model keeps out of decay itself (timm's ``model.no_weight_decay()``, e.g. ViT's
      ``pos_embed``); ``lr``, no decay.
    * ``rank1_factors``: the rank-1 r / s factors (``loc``, ``rho``);
      ``lr * fast_weight_lr_multiplier``, no decay.
    * ``rank1_other``: bayesify's other parameters (per-component bias offsets, Gaussian-
      embedding scales); ``lr``, no decay (the bias offsets' L2 prior is in the objective).

    Only parameters with ``requires_grad`` are included (so an adapter, see
    :func:`bayesify.freeze_base`, gets its rank-1 parameters only); empty groups are left out;
    a parameter shared by two modules appears once. Each group carries a ``name`` key (ignored
    by torch optimizers, useful in logs). With ``weight_decay=None`` the ``weights`` group has no
    ``weight_decay`` key, so the optimizer's own default applies to it (and only to it).

    Args:
        model: any model, converted or not (a plain model gets ``weights`` and ``no_decay``).
        lr: the base learning rate.
        weight_decay: the decay of the ``weights`` group; None: the optimizer's default.
        fast_weight_lr_multiplier: learning-rate multiplier of the rank-1 factors.

    Returns:
        The non-empty groups, in the order of :data:`GROUPS`.

    Raises:
        ValueError: a non-positive ``lr`` or multiplier, or a negative ``weight_decay``.

    Example:
        >>> optimizer = torch.optim.AdamW(param_groups(model, lr=1e-3, weight_decay=0.05))
        >>> [(g["name"], g["weight_decay"]) for g in optimizer.param_groups]
        [('weights', 0.05), ('no_decay', 0.0), ('rank1_factors', 0.0), ('rank1_other', 0.0)]
    """
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be > 0.")
    if not fast_weight_lr_multiplier > 0:
        raise ValueError(f"fast_weight_lr_multiplier={fast_weight_lr_multiplier!r} must be > 0 (1.0: same lr).")
    if weight_decay is not None and not weight_decay >= 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be >= 0 (or None: the optimizer's default).")
    members = _group_members(model)
    settings: dict[str, dict[str, Any]] = {
        "weights": {"lr": lr} if weight_decay is None else {"lr": lr, "weight_decay": weight_decay},
        "no_decay": {"lr": lr, "weight_decay": 0.0},
        "rank1_factors": {"lr": lr * fast_weight_lr_multiplier, "weight_decay": 0.0},
        "rank1_other": {"lr": lr, "weight_decay": 0.0},
    }
    return [{"params": members[n], **settings[n], "name": n} for n in GROUPS if members[n]]


def _group_members(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The trainable parameters of each of :data:`GROUPS` (possibly empty), by the rules of :func:`param_groups`."""
    factor_ids = _factor_parameter_ids(model)
    rank1_ids = {id(p) for p in rank1_parameters(model)}
    norm_ids = {id(p) for m in model.modules() if isinstance(m, NORM_LAYERS) for p in m.parameters(recurse=False)}
    own_no_decay = _own_no_weight_decay(model)
    members: dict[str, list[nn.Parameter]] = {name: [] for name in GROUPS}
    for name, p in model.named_parameters():  # a shared parameter is listed once
        if not p.requires_grad:
            continue
        if id(p) in factor_ids:
            group = "rank1_factors"
        elif id(p) in rank1_ids:
            group = "rank1_other"
        elif (
            p.ndim <= 1
            or name == "bias"
            or name.endswith(".bias")
            or id(p) in norm_ids
            or any(fnmatch.fnmatch(name, pattern) for pattern in own_no_decay)
        ):
            group = "no_decay"
        else:
            group = "weights"
        members[group].append(p)
    return members


def build_optimizer(
    name: OptimizerName | str,
    groups: list[dict[str, Any]],
    *,
    lr: float,
    momentum: float = 0.9,
    nesterov: bool = True,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """SGD (Nesterov momentum), Adam or AdamW over ``groups`` (see :func:`param_groups`)."""
    try:
        name = OptimizerName(str(name).lower())
    except ValueError:
        raise ValueError(f"optimizer={name!r} is not supported; choose one of: sgd, adam, adamw.") from None
    if name is OptimizerName.SGD:
        return torch.optim.SGD(
            groups, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0, weight_decay=weight_decay
        )
    if name is OptimizerName.ADAM:
        return torch.optim.Adam(groups, lr=lr, betas=betas, weight_decay=weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay)


class WarmupStepDecay:
    """Learning-rate factor per step: linear warm-up, then piecewise-constant step decay.

    ``factor(step) = epoch / warmup_epochs`` while ``epoch < warmup_epochs`` (only if
    ``warmup_epochs > 0``), then ``decay_ratio ** i`` from the i-th entry of
    ``[warmup_epochs] + decay_epochs`` on, with ``epoch = step / steps_per_epoch``. A picklable
    callable for ``torch.optim.lr_scheduler.LambdaLR``.

    Args:
        steps_per_epoch: optimizer steps per epoch.
        warmup_epochs: length of the linear warm-up (reference: 1 CIFAR, 5 ImageNet).
        decay_epochs: epochs at which the rate is multiplied by ``decay_ratio``.
        decay_ratio: the multiplier (reference: 0.2 CIFAR, 0.1 ImageNet).
    """

    def __init__(
        self,
        steps_per_epoch: int,
        warmup_epochs: float = 0.0,
        decay_epochs: Sequence[float] = (),
        decay_ratio: float = 0.1,
    ) -> None:
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch={steps_per_epoch!r} must be >= 1.")
        self.steps_per_epoch = steps_per_epoch
        self.warmup_epochs = float(warmup_epochs)
        self.decay_epochs = [float(e) for e in decay_epochs]
        if self.decay_epochs != sorted(self.decay_epochs):
            raise ValueError(f"decay_epochs={list(decay_epochs)!r} must be in increasing order (the k-th: decay_ratio**k).")
        self.decay_ratio = float(decay_ratio)

    def __call__(self, step: int) -> float:
        epoch = step / self.steps_per_epoch
        factor = 1.0
        if self.warmup_epochs > 0 and epoch < self.warmup_epochs:
            factor = epoch / self.warmup_epochs
        for index, start in enumerate([self.warmup_epochs, *self.decay_epochs]):
            if epoch >= start:
                factor = self.decay_ratio**index
        return factor
