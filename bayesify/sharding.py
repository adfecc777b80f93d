"""What a model sharded with FSDP2 looks like to the core (``kl.py``, ``merge.py``) and to the trainer's
objective: whether a model is sharded, and a sharded value in full. Sharding itself lives in
``bayesify/training/fsdp.py``; ``bayesify.training.is_sharded`` is this module's."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["is_sharded", "whole"]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or a module inside it) was sharded with FSDP2's ``fully_shard``."""
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def whole(value: torch.Tensor) -> torch.Tensor:
    """``value`` in full on every rank: a sharded Parameter (``DTensor``) gathered, a partial sum over shards
    (``p.pow(2).sum()`` of one) summed over the ranks; a plain tensor as it is.
    Autograd-aware: the backward leaves each rank the gradient of its own shard (nothing to average), as for a
    full Parameter."""
    if dist.is_available() and dist.is_initialized():
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            return value.full_tensor()
    return value
