"""``model.no_weight_decay()`` on a converted root: keeps timm's optimizer factory off the rank-1 parameters.

The rank-1 factors are multiplicative and centred at the prior mean 1: decaying ``loc`` towards 0
shrinks the layer's function, and decaying ``rho`` towards 0 *widens* the posterior (the scale
tends to ``softplus(0) = 0.69``). The per-component bias offsets have their L2 prior on the
effective bias in the objective. So none of bayesify's parameters belongs in a weight-decay group.

``timm.optim.create_optimizer_v2(model, ..., weight_decay=wd)`` (plain or with ``layer_decay``)
asks the model it is given for ``model.no_weight_decay()``: names or fnmatch globs of parameters
to keep out of decay. :func:`bayesify.convert` sets that, on the root only, to a
:class:`NoWeightDecay`: the class's own names (ViT's ``pos_embed``, ``cls_token``, ...) plus
:data:`RANK1_PATTERNS`. It is an object rather than a lambda so that ``torch.save(model)`` and
``copy.deepcopy`` keep working; :func:`bayesify.revert` removes it.

Example:
    >>> model = bayesify.convert(timm.create_model("vit_tiny_patch16_224"))
    >>> sorted(model.no_weight_decay())
    ['*.rank1_*', 'cls_token', 'dist_token', 'pos_embed', 'rank1_*', 'reg_token']
    >>> optimizer = timm.optim.create_optimizer_v2(model, "adamw", weight_decay=0.05)  # rank-1: no decay

References:
    timm ``optim/_optim_factory.py`` (``no_weight_decay`` of the model passed in) and
    ``optim/_param_groups.py`` (fnmatch on parameter names).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["RANK1_PATTERNS", "NoWeightDecay", "install", "remove"]

RANK1_PATTERNS: tuple[str, ...] = ("rank1_*", "*.rank1_*")
"""fnmatch globs of every parameter name bayesify adds (each added name starts with ``rank1_``)."""

_ATTRIBUTE = "no_weight_decay"


class NoWeightDecay:
    """The instance-level ``no_weight_decay()`` of a converted root: its own names plus :data:`RANK1_PATTERNS`.

    Args:
        root: the converted model; its class's ``no_weight_decay()`` (if any) is asked on each call.
        previous: an instance-level ``no_weight_decay`` the root had before conversion (asked
            instead of the class's, and put back by :func:`remove`).
    """

    def __init__(self, root: nn.Module, previous: Callable[[], Any] | None = None) -> None:
        self.root = root
        self.previous = previous

    def __call__(self) -> set[str]:
        own = self.previous if self.previous is not None else _class_hook(self.root)
        names = set(own()) if own is not None else set()
        return names | set(RANK1_PATTERNS)

    def __repr__(self) -> str:
        return f"NoWeightDecay({type(self.root).__name__}: own names + {list(RANK1_PATTERNS)})"


def _class_hook(root: nn.Module) -> Callable[[], Any] | None:
    # the class attribute bound to root through the descriptor protocol (a method, staticmethod, ...)
    attr = inspect.getattr_static(type(root), _ATTRIBUTE, None)
    if attr is None:
        return None
    bound = attr.__get__(root, type(root)) if hasattr(attr, "__get__") else attr
    return bound if callable(bound) else None


def install(root: nn.Module) -> None:
    """Set ``root.no_weight_decay`` to a :class:`NoWeightDecay` (once; a second conversion keeps it)."""
    current = root.__dict__.get(_ATTRIBUTE)
    if isinstance(current, NoWeightDecay):
        return
    root.__dict__[_ATTRIBUTE] = NoWeightDecay(root, previous=current)


def remove(module: nn.Module) -> None:
    """Undo :func:`install` on ``module`` (nothing if it has none)."""
    current = module.__dict__.get(_ATTRIBUTE)
    if not isinstance(current, NoWeightDecay):
        return
    if current.previous is not None:
        module.__dict__[_ATTRIBUTE] = current.previous
    else:
        del module.__dict__[_ATTRIBUTE]
