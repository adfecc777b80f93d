"""Test helpers on a converted model's rank-1 tables (each factor's ``loc`` and each bias offset is a view of
the model's flat store, so writing through it changes the model)."""

from __future__ import annotations

import torch
from torch import nn

import bayesify


def perturb(model: nn.Module, loc_std: float = 0.3, offset_std: float | None = 0.2, identity: float = 1.0) -> nn.Module:
    """Factor means ``identity + loc_std * N(0, 1)`` and bias offsets ``N(0, offset_std)``, so that members differ."""
    with torch.no_grad():
        for _, layer in bayesify.rank1_layers(model):
            for _, factor in layer.rank1_factors():
                factor.loc.copy_(identity + loc_std * torch.randn_like(factor.loc))
            for name in layer.rank1_state.bias_offsets:
                offset = getattr(layer, name)
                if offset is not None and offset_std is not None:
                    offset.normal_(0, offset_std)
    return model
