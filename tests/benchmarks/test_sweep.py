"""The architecture sweep: convert real timm and torchvision models and check the converter's promises.

    .venv/bin/python -m pytest -m sweep tests/benchmarks/test_sweep.py                     # the CI sample
    BAYESIFY_SWEEP=all .venv/bin/python -m pytest -m sweep tests/benchmarks/test_sweep.py  # everything (hours)

The CI sample (the default, and what ``make test`` runs): every timm model family (module file)
once, by the first model in stable-hash order under ``CI_MAX_PARAMS`` parameters, plus every
torchvision classifier under the same size filter. ``BAYESIFY_SWEEP=all`` parametrizes over every
timm architecture and torchvision classifier instead; ``make sweep`` (``benchmarks/sweep.py
--all``) runs the same checks with a subprocess per shard, memory / time guards and a results
file. What is checked is in ``benchmarks/_sweep_checks.py``, shared by both.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("timm")
pytest.importorskip("torchvision")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _sweep_checks as checks  # noqa: E402

pytestmark = pytest.mark.sweep

FULL = os.environ.get("BAYESIFY_SWEEP", "").lower() == "all"
# the full run keeps the benchmark's guard against models too big for this machine's 24 GiB
MAX_PARAMS = int(float(os.environ.get("BAYESIFY_SWEEP_MAX_PARAMS", 5e8 if FULL else checks.CI_MAX_PARAMS)))
COMPONENTS = 2


@pytest.fixture
def one_thread():
    # the sweep runs beside other tests on 2 shared cores: one thread, restored afterwards
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.timeout(900 if FULL else 300)
@pytest.mark.parametrize("spec", checks.list_specs() if FULL else checks.ci_sample())
def test_converted_model_keeps_its_promises(spec: str, one_thread: None) -> None:
    picked_from_family = spec.startswith("timm-family/")
    if picked_from_family:
        picked, passed_over = checks.pick_from_family(
            spec, MAX_PARAMS, checks.ci_excluded, fallback_max_params=checks.CI_FAMILY_MAX_PARAMS
        )
        if picked is None:
            pytest.skip(f"{spec}: no model under {MAX_PARAMS / 1e6:.0f}M parameters (passed over {len(passed_over)})")
        print(f"{spec} -> {picked}")  # shown with a failure
        spec = picked
    try:
        # a family's fallback pick may be over MAX_PARAMS (up to CI_FAMILY_MAX_PARAMS)
        limit = max(MAX_PARAMS, checks.CI_FAMILY_MAX_PARAMS) if picked_from_family else MAX_PARAMS
        result = checks.check(spec, components=COMPONENTS, max_params=limit)
    except checks.CheckSkip as exc:
        pytest.skip(f"{spec}: {exc}")
    except checks.CheckFailure as exc:
        raise AssertionError(f"{spec}: {exc}") from exc
    assert result.params_added > 0, f"{spec}: nothing was converted"
    if result.bypassed_layers:  # allowed (summary() names them), but never silent
        print(f"{spec}: layers reported as not in the compute path: {result.bypassed_layers}")


def test_resnet50_parameter_count_matches_the_paper() -> None:
    # Dusenberry et al. 2020, Table 3: ResNet-50 25.6M parameters, rank-1 Gaussian (K=4) 26.0M
    torchvision = pytest.importorskip("torchvision")
    import bayesify

    model = torchvision.models.resnet50()
    before = sum(p.numel() for p in model.parameters())
    bayesify.convert(model, components=4)
    after = sum(p.numel() for p in model.parameters())
    assert round(before / 1e6, 1) == 25.6, before
    assert round(after / 1e6, 1) == 26.0, after
