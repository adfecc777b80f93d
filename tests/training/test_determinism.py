"""Issue 5: with a fixed seed, two trainer runs give identical metrics on the CPU."""

from __future__ import annotations

import json

from bayesify.data import DataBundle, InMemoryDataset, load_data
from bayesify.training import TrainConfig, Trainer, build_model

TIMING = {"examples_per_s", "seconds", "time"}


def _small_digits() -> DataBundle:
    full = load_data("digits")
    train, test = full.train, full.test
    return DataBundle(
        "digits", InMemoryDataset(train.inputs[:256], train.labels[:256]), InMemoryDataset(test.inputs[:64], test.labels[:64]),
        10, (1, 8, 8), full.kind, full.mean, full.std,
    )  # fmt: skip


def _metrics(tmp_path, name: str, seed: int, data: DataBundle) -> list[dict]:
    config = TrainConfig(model="mlp", data="digits", epochs=2, batch_size=32, out=str(tmp_path / name), progress=False,
                         log_every=2, seed=seed, route="sample", posterior="cauchy", prior="cauchy")  # fmt: skip
    Trainer(config, build_model(config, data), data).run()
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def test_same_seed_same_metrics_other_seed_other_metrics(tmp_path) -> None:
    data = _small_digits()
    first = _metrics(tmp_path, "a", 7, data)
    second = _metrics(tmp_path, "b", 7, data)
    assert len(first) > 4
    assert first == second
    assert _metrics(tmp_path, "c", 8, data) != first
