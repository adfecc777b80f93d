"""examples/timm_one_liner.py runs (``--smoke``) and prints its table."""

from __future__ import annotations

import math

import pytest

from tests._example_table import read_table, run_example

pytest.importorskip("timm")
pytest.importorskip("sklearn")

COLUMNS = ("NLL", "accuracy", "ECE", "H(digits)", "MI(digits)", "H(noise)", "MI(noise)", "seconds")


def test_smoke_run_prints_the_table() -> None:
    stdout = run_example("timm_one_liner.py", "--smoke", "--threads", "1")
    assert "output: classification" in stdout  # the task came from the timm model: no task= was passed
    table = read_table(stdout, COLUMNS)
    for name, row in table.items():
        for column in ("NLL", "accuracy", "ECE", "H(digits)", "H(noise)", "seconds"):
            assert math.isfinite(row[column]), (name, column)
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["ECE"] <= 1
        assert 0 <= row["H(digits)"] <= math.log(10) + 1e-4 and 0 <= row["H(noise)"] <= math.log(10) + 1e-4
    assert math.isnan(table["deterministic"]["MI(digits)"])  # a plain net has no mutual information
    bnn = table["rank-1 BNN"]
    assert 0 <= bnn["MI(digits)"] <= bnn["H(digits)"] and 0 <= bnn["MI(noise)"] <= bnn["H(noise)"]
