"""``freeze_base(model)``: a Bayesian adapter, i.e. train only what bayesify added to a pretrained network.

After :func:`bayesify.convert`, the network's own parameters (its pretrained weights) and the
rank-1 parameters (factors ``r``, ``s``, per-component bias offsets) are all trainable.
:func:`freeze_base` turns off ``requires_grad`` on the former and keeps it on the latter: the
pretrained function stays fixed and only its rank-1 posterior is learned, about 1% of the
parameters of a ResNet (the factors scale the frozen weights per component, so the members
still differ in what they compute, not only in their noise).

A head made for a new task (new classes) is a parameter bayesify did not add: make it trainable
again after :func:`freeze_base` (``model.get_classifier().requires_grad_(True)`` for timm), or its
random weights are only rescaled by the factors.

Only parameters are frozen. Batch-norm running statistics are buffers: in ``model.train()``
they keep updating on the new data, as in any frozen-backbone fine-tune. Whether that is wanted
is the user's choice; to keep the pretrained statistics, put the normalisation layers back in
evaluation mode after each ``model.train()``::

    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.eval()

Example:
    >>> model = bayesify.convert(timm.create_model("resnet18", pretrained=True), init="preserve")
    >>> bayesify.freeze_base(model)
    >>> optimizer = torch.optim.Adam(p for p in model.parameters() if p.requires_grad)
    >>> bayesify.freeze_base(model, frozen=False)   # back to full fine-tuning

References:
    Dusenberry et al., ICML 2020 (rank-1 factors on shared weights); Houlsby et al., "Parameter-
    Efficient Transfer Learning for NLP", ICML 2019 (adapters on a frozen network).
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from bayesify.inspection import is_converted, rank1_parameters

__all__ = ["freeze_base"]

M = TypeVar("M", bound=nn.Module)


def freeze_base(model: M, frozen: bool = True) -> M:
    """Freeze every parameter of ``model`` that bayesify did not add; keep the rank-1 ones trainable.

    Args:
        model: a converted model (:func:`bayesify.convert`).
        frozen: True: the base parameters get ``requires_grad=False`` (an adapter). False: every
            parameter of the model gets ``requires_grad=True`` again (full fine-tuning; parts
            you froze yourself before must be frozen again).

    Returns:
        ``model`` itself. The rank-1 parameters have ``requires_grad=True`` in both cases (also
        if other code, such as peft's ``get_peft_model``, turned it off).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` has no converted layer (freezing it would leave nothing to train).

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        >>> model = bayesify.freeze_base(bayesify.convert(net, task="classification"))
        >>> sum(p.numel() for p in model.parameters() if p.requires_grad)   # the rank-1 parameters, K=4
        420
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"freeze_base() takes an nn.Module, got {type(model).__name__}.")
    if not is_converted(model):
        raise ValueError(
            f"{type(model).__name__} has no rank-1 layer, so freezing its parameters would leave nothing to train; "
            "call bayesify.convert(model) first."
        )
    rank1 = {id(p) for p in rank1_parameters(model)}
    for p in model.parameters():
        p.requires_grad_(id(p) in rank1 or not frozen)
    return model
