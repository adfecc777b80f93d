"""``benchmarks/overhead.py``: every row of every kind of model it measures (a timm classifier and a Hugging
Face language model), run end to end on tiny settings. Its ratios are measurements, not checked here."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import overhead  # noqa: E402

pytest.importorskip("timm")


def _args(**kwargs: object) -> argparse.Namespace:
    defaults = dict(components=4, batch=4, sampling="auto", repeats=1, compile=False, peers=False)
    return argparse.Namespace(**{**defaults, **kwargs})


@pytest.mark.parametrize("spec", ["resnet18:32", "gpt2-tiny:8"])
def test_every_row_of_a_model_is_measured(spec: str) -> None:
    if spec.startswith("gpt2"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    rows = overhead.model_rows(spec, _args(), torch.device("cpu"), None)
    assert [row[1] for row in rows] == ["training step, default route", "training step, tiled route", "evaluation, mixture of 4"]
    for row in rows:
        assert row[0] == f"{spec} B=4"
        assert math.isfinite(float(row[3])) and float(row[3]) > 0
    assert all(float(row[4]) > 0 for row in rows[:2])  # memory held for the backward pass


def test_a_language_model_is_trained_on_next_tokens_in_every_route() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    base, tokens = overhead._model("gpt2-tiny:8", torch.device("cpu"))
    x, y = overhead._inputs(base, tokens, 3, torch.device("cpu"))
    assert x.shape == y.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1])
    import bayesify

    model = bayesify.convert(base, components=2, **overhead._task(base))
    for route in (None, "tile"):
        model.zero_grad(set_to_none=True)
        overhead.make_step(model, x, y, route=route, kl=bayesify.kl_divergence)()
        assert all(torch.isfinite(p).all() for p in model.parameters())
