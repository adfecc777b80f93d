"""Issue 5: with a fixed seed, two trainer runs give identical metrics on the CPU."""

from __future__ import annotations

import json

from bayesify.zoo.data import DataBundle
from bayesify.training import TrainConfig, Trainer, build_model

TIMING = {"examples_per_s", "seconds", "time"}


def _metrics(tmp_path, name: str, seed: int, data: DataBundle) -> list[dict]:
    config = TrainConfig(model="mlp", data="digits", epochs=2, batch_size=32, out=str(tmp_path / name), progress=False,
                         log_every=2, seed=seed, route="sample", posterior="cauchy", prior="cauchy")  # fmt: skip
    Trainer(config, build_model(config, data), data).run()
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def test_same_seed_same_metrics_other_seed_other_metrics(tmp_path, digits: DataBundle) -> None:
    data = digits
    first = _metrics(tmp_path, "a", 7, data)
    second = _metrics(tmp_path, "b", 7, data)
    assert len(first) > 4
    assert first == second
    assert _metrics(tmp_path, "c", 8, data) != first
