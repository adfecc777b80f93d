"""``torch.compile`` of converted models: bayesify's code causes no graph breaks.

Graph breaks are counted (``torch._dynamo.utils.counters["graph_break"]`` after
``torch._dynamo.reset()``), not graphs: ``torch.compile(model)`` runs a module's forward hooks
outside dynamo (``nn.Sequential`` excepted), so the routing pre-hook, the forward and, in
evaluation, the mixture post-hook are compiled as separate frames without any break between them.
The ``eager`` backend is enough to find breaks (they are dynamo's, whatever the backend) and keeps
the tests fast. The other layer families: ``tests/layers/test_compile_families.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import bayesify
from tests._rank1 import perturb


def compiled_breaks(model: nn.Module, *inputs: torch.Tensor, calls: int = 1) -> tuple[dict[str, int], list[int]]:
    """``({reason: count}, [graphs after each call])`` of ``calls`` forward passes of ``torch.compile(model)``."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    graphs = []
    for _ in range(calls):
        compiled(*inputs)
        graphs.append(counters["stats"]["unique_graphs"])
    return {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}, graphs


def perturbed(net: nn.Module, **options) -> nn.Module:
    model = bayesify.convert(net, components=4, task="classification", **options)
    return perturb(model)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 5),
    )  # fmt: skip


def _vit() -> nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=5
    )


MODELS = {"cnn": (_cnn, (8, 3, 8, 8)), "vit": (_vit, (4, 3, 32, 32))}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(MODELS))
def test_no_graph_breaks_from_bayesify(name: str, training: bool) -> None:
    make, shape = MODELS[name]
    plain = make().train(training)
    model = perturbed(copy.deepcopy(plain)).train(training)  # train: sample route; eval: mixture route
    x = torch.randn(*shape)
    breaks, graphs = compiled_breaks(model, x, calls=3)
    plain_breaks, _ = compiled_breaks(plain, x)
    assert breaks == plain_breaks, f"graph breaks from bayesify: {breaks}"
    # the random order of the components in training is a tensor: no recompilation from one step to the next
    assert graphs[0] == graphs[-1]
    copy.deepcopy(model)  # nothing of the traced forward passes is left in the model's state


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_mixture_equals_eager(name: str) -> None:
    make, shape = MODELS[name]
    model = perturbed(make()).eval()
    x = torch.randn(*shape)
    torch._dynamo.reset()
    with torch.no_grad(), bayesify.mode(model, noise=False):
        torch.testing.assert_close(torch.compile(model, backend="eager")(x), model(x))
