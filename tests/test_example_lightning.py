"""examples/lightning_digits.py runs (``--smoke``) and prints its table."""

from __future__ import annotations

import math

import pytest

from tests._example_table import read_table, run_example

pytest.importorskip("lightning")
pytest.importorskip("sklearn")

COLUMNS = ("NLL", "accuracy", "ECE", "seconds")


def test_smoke_run_prints_the_table() -> None:
    stdout = run_example("lightning_digits.py", "--smoke", "--threads", "1")
    table = read_table(stdout, COLUMNS)
    for name, row in table.items():
        assert all(math.isfinite(v) for v in row.values()), name
        assert row["NLL"] > 0 and 0 <= row["accuracy"] <= 1 and 0 <= row["ECE"] <= 1, name
