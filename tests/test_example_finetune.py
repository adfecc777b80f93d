"""examples/finetune.py: a smoke run (fast) and the claims of its docstring (slow)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune.py"
ROWS = ("pretrained, not fine-tuned", "deterministic", "rank-1, full", "rank-1 adapter")


def _run(*args: str) -> dict[str, dict[str, float]]:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=600, check=True
    )
    rows = {}
    for name in ROWS:
        line = next(line for line in done.stdout.splitlines() if line.startswith(name))
        nll, accuracy, ece = (float(v) for v in line[len(name) :].split()[:3])
        trainable = re.search(r"   ([\d,]+) \(", line)
        rows[name] = {
            "nll": nll,
            "accuracy": accuracy,
            "ece": ece,
            "trainable": int(trainable.group(1).replace(",", "")) if trainable else 0,
        }
    return rows


def test_example_runs_and_reports_every_variant() -> None:
    rows = _run("--smoke")
    for metrics in rows.values():
        assert 0 < metrics["nll"] < 5 and 0 <= metrics["accuracy"] <= 1 and 0 <= metrics["ece"] <= 1
    trainable = [rows[name]["trainable"] for name in ROWS]
    # nothing trained; every weight; every weight + the rank-1 parameters; the rank-1 parameters only
    assert trainable[0] == 0 and trainable[1] > 0
    assert trainable[2] - trainable[1] == trainable[3] > 0


@pytest.mark.slow
def test_both_rank1_variants_beat_the_deterministic_fine_tune() -> None:
    rows = _run()  # the default settings, seed 0: about 45 s on one core
    for name in ("rank-1, full", "rank-1 adapter"):
        assert rows[name]["nll"] < rows["deterministic"]["nll"] - 0.02, name
        assert rows[name]["ece"] < rows["deterministic"]["ece"], name
    assert rows["deterministic"]["accuracy"] > rows["pretrained, not fine-tuned"]["accuracy"] + 0.2
