"""``benchmarks/ood_seeds.py``: its AUROC is scikit-learn's (ties included) and its seed lists parse; the run itself
needs the Fashion-MNIST / MNIST files (``make data``) and is a benchmark, not a test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import ood_seeds  # noqa: E402


def test_auroc_is_the_mann_whitney_statistic_with_ties_counted_half() -> None:
    metrics = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(0)
    inside, outside = torch.randint(0, 20, (300,), generator=g).float(), torch.randint(5, 25, (200,), generator=g).float()
    expected = metrics.roc_auc_score([0] * 300 + [1] * 200, torch.cat([inside, outside]).numpy())
    assert ood_seeds.auroc(inside, outside) == pytest.approx(expected, abs=1e-12)
    assert ood_seeds.auroc(torch.zeros(3), torch.ones(2)) == 1.0 and ood_seeds.auroc(torch.ones(3), torch.ones(2)) == 0.5


def test_seeds_parse_as_a_range_or_a_list() -> None:
    assert ood_seeds.seeds_of("0-3") == [0, 1, 2, 3] and ood_seeds.seeds_of("4,7") == [4, 7] and ood_seeds.seeds_of("5") == [5]
