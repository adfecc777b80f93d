"""Optimizers and learning-rate schedules of the paper's recipes.

* :func:`param_groups`: the point-estimated weights in one group, the rank-1 r / s variational
  parameters in another whose learning rate is ``fast_weight_lr_multiplier`` times the base
  (the reference scales those parameters' gradients, which for SGD with momentum is the same
  as scaling their learning rate; with Adam a learning-rate multiplier is the meaningful form).
  The per-component biases stay with the weights, as in the reference.
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

from typing import Any, Sequence

import torch
from torch import nn

from bayesify.options import StrOption
from bayesify.variational.factor import Rank1Factor

__all__ = ["OptimizerName", "WarmupStepDecay", "build_optimizer", "param_groups"]


class OptimizerName(StrOption):
    """The optimizers the trainer builds."""

    SGD = "sgd"
    """SGD with (Nesterov) momentum: the paper's CIFAR / ImageNet recipe."""
    ADAM = "adam"
    """Adam: the paper's MIMIC-III recipe."""
    ADAMW = "adamw"
    """AdamW (decoupled weight decay; bayesify's L2 prior lives in the objective instead)."""


def _factor_parameter_ids(model: nn.Module) -> set[int]:
    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, Rank1Factor):
            ids.update(id(p) for p in module.parameters())
    return ids


def param_groups(model: nn.Module, *, lr: float, fast_weight_lr_multiplier: float = 1.0) -> list[dict[str, Any]]:
    """Optimizer parameter groups: ``weights`` at ``lr``, ``rank1_factors`` at ``lr * multiplier``.

    Only parameters with ``requires_grad`` are included; empty groups are left out. Each
    group carries a ``name`` key (ignored by torch optimizers, useful in logs).

    Raises:
        ValueError: a non-positive ``lr`` or multiplier.
    """
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be > 0.")
    if not fast_weight_lr_multiplier > 0:
        raise ValueError(f"fast_weight_lr_multiplier={fast_weight_lr_multiplier!r} must be > 0 (1.0: same lr).")
    fast_ids = _factor_parameter_ids(model)
    weights, fast, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (fast if id(p) in fast_ids else weights).append(p)
    groups = [
        {"params": weights, "lr": lr, "name": "weights"},
        {"params": fast, "lr": lr * fast_weight_lr_multiplier, "name": "rank1_factors"},
    ]
    return [g for g in groups if g["params"]]


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
