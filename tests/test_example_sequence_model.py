"""examples/sequence_model.py runs (``--smoke``) and prints its table."""

from __future__ import annotations

import math
import re

import pytest

from tests._example_table import read_table, run_example

pytest.importorskip("mnist1d")

COLUMNS = ("NLL", "AUC-PR", "AUC-ROC", "ECE", "accuracy", "seconds")


def test_smoke_run_prints_the_table() -> None:
    stdout = run_example("sequence_model.py", "--smoke", "--threads", "1")
    assert "output: binary" in stdout  # task="binary"
    assert re.search(r"^\s+embed\s+Embedding\s+\+", stdout, re.M)  # embeddings=True: a converted (Gaussian) embedding
    table = read_table(stdout, COLUMNS)
    for name, row in table.items():
        assert all(math.isfinite(v) for v in row.values()), name
        assert row["NLL"] > 0 and all(0 <= row[c] <= 1 for c in ("AUC-PR", "AUC-ROC", "ECE", "accuracy")), name
