"""examples/drop_in_loop.py runs (``--smoke``), prints its table, and differs from a plain loop only where it says."""

from __future__ import annotations

import ast
import math
from pathlib import Path

from tests._example_table import read_table, run_example

COLUMNS = ("NLL", "accuracy", "ECE", "seconds")


def test_smoke_run_prints_the_table() -> None:
    table = read_table(run_example("drop_in_loop.py", "--smoke", "--threads", "1"), COLUMNS)
    for name, row in table.items():
        assert all(math.isfinite(v) for v in row.values()), name
        assert row["NLL"] > 0 and 0 <= row["accuracy"] <= 1 and 0 <= row["ECE"] <= 1, name


def test_the_only_bayesify_calls_are_the_marked_ones() -> None:
    source = (Path(__file__).resolve().parents[1] / "examples" / "drop_in_loop.py").read_text()
    lines = source.splitlines()
    calls = [
        node for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name) and node.func.value.id == "bayesify"
    ]  # fmt: skip
    assert sorted(c.func.attr for c in calls) == ["convert", "kl_loss"]
    assert all("# bayesify" in lines[c.lineno - 1] for c in calls)
