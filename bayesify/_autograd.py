"""When bayesify's hand-written autograd Functions stand aside for the plain ops of the same maths.

Each Function (the per-row scalings, the folded weights and their concatenation, a group's join, the KL's sum, the
recurrence) dispatches fewer ops or saves fewer tensors than autograd's own graph, and writes out a backward only:
no forward-mode rule (``torch.autograd.forward_ad``: a ``jvp``), no functorch rule (``torch.func``), and traced,
one keeps a compiled graph out of AOTAutograd's cache. Where any of those is in force, the plain ops run.
"""

from __future__ import annotations

import torch

__all__ = ["plain_ops"]


def plain_ops() -> bool:
    """Whether the plain ops run instead of bayesify's autograd Functions: in a traced graph (``torch.compile``,
    ``torch.export``), under ``torch.func``'s transforms, or in forward-mode AD (a dual level open)."""
    return (
        torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0
    )
