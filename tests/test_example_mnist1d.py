"""examples/mnist1d_sequence.py: a smoke run (fast) and the full claim (slow)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mnist1d")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mnist1d_sequence.py"


def _run(*args: str) -> dict[str, dict[str, float]]:
    done = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=3000, check=True)
    rows = {}
    for name in ("deterministic", "rank-1 BNN"):
        line = next(l for l in done.stdout.splitlines() if l.startswith(name) and "seed" not in l)
        values = [float(v) for v in re.findall(r"\d+\.\d+", line[len(name) :])]
        rows[name] = dict(zip(("nll", "accuracy", "ece"), values))
    return rows


def test_example_runs() -> None:
    rows = _run("--smoke")
    for metrics in rows.values():
        assert 0 < metrics["nll"] < 3 and 0 <= metrics["ece"] <= 1


@pytest.mark.slow
def test_rank1_beats_its_deterministic_twin() -> None:
    rows = _run()  # 60 epochs, seed 0: a few minutes on one core
    assert rows["rank-1 BNN"]["nll"] < rows["deterministic"]["nll"]
    assert rows["rank-1 BNN"]["ece"] < rows["deterministic"]["ece"]
