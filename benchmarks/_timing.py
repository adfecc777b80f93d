"""Timing shared by the benchmarks: side by side, round-robin, medians."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def time_steps(steps: list[Callable[[], object]], repeats: int, first: list[float] | None = None) -> list[float]:
    """Median seconds per call of each step, measured round-robin so that load on the machine hits all alike.
    ``first``, if given, receives the seconds of each step's first call (its warm-up: a compiled step's compilation)."""
    for step in steps:
        start = time.perf_counter()
        step()  # warm-up (and compilation, if any)
        if first is not None:
            first.append(time.perf_counter() - start)
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            start = time.perf_counter()
            step()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]
