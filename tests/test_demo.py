"""``make demo`` (examples/digits.py) runs end to end (its --smoke run: one short epoch)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_digits_demo_prints_both_models(tmp_path):
    result = subprocess.run(
        [sys.executable, "examples/digits.py", "--smoke", "--samples", "2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("deterministic ") for line in lines)
    assert any(line.startswith("rank-1 BNN ") for line in lines)
    assert (tmp_path / "rank-1" / "checkpoint.pt").is_file() and (tmp_path / "deterministic" / "metrics.jsonl").is_file()
