"""Shared by the example tests: run an example as a subprocess and read the table it prints."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str, timeout: float = 600) -> str:
    """stdout of ``python examples/<name> <args>`` with the current interpreter, importing this checkout's bayesify."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, f"{name} {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def read_table(stdout: str, columns: tuple[str, ...], rows: tuple[str, ...] = ("deterministic", "rank-1 BNN")) -> dict:
    """``{row: {column: value}}`` from the table at the end of ``stdout``: a header line ``model <columns>``,
    then one line per row name; ``-`` reads as nan. Fails unless the header and every row are there."""
    lines = stdout.splitlines()
    header = next((i for i, line in enumerate(lines) if line.split() == ["model", *columns]), None)
    assert header is not None, f"no header 'model {' '.join(columns)}' in:\n{stdout[-2000:]}"
    table = {}
    for line in lines[header + 1 : header + 1 + len(rows)]:
        name = next((r for r in rows if line.startswith(r)), None)
        assert name is not None, f"unexpected table row {line!r}"
        cells = line[len(name) :].split()
        assert len(cells) == len(columns), f"row {line!r} has {len(cells)} cells for {len(columns)} columns"
        table[name] = {c: math.nan if v == "-" else float(v) for c, v in zip(columns, cells)}
    assert list(table) == list(rows), f"rows {list(table)}, expected {list(rows)}"
    return table
