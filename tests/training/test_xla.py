"""The torch-xla path, run for real on the XLA CPU backend (``make test-xla``: PJRT_DEVICE=CPU).

Skipped where torch-xla is not installed (the main venv: torch-xla pins its own torch).
"""

import json
import os

import pytest
import torch

pytestmark = pytest.mark.xla

torch_xla = pytest.importorskip("torch_xla")


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", os.environ.get("PJRT_DEVICE", "CPU"))


def test_cli_trains_on_an_xla_device_and_the_checkpoint_loads_on_the_cpu(tmp_path, capsys):
    from bayesify import cli
    from bayesify.training import load_checkpoint

    out = tmp_path / "xla"
    code = cli.main(["train", "--model", "mlp", "--data", "digits", "--device", "xla", "--route", "tile",
                     "--batch-size", "64", "--epochs", "1", "--max-steps", "4", "--log-every", "2",
                     "--out", str(out), "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4] and all(r["loss"] == r["loss"] for r in train)
    state = load_checkpoint(out / "checkpoint.pt")
    assert state["step"] == 4 and state["config"]["device"] == "xla"
    assert all(t.device.type == "cpu" for t in state["model"].values())
    assert state["optimizer"]["state"], "the optimizer never stepped"
    # the weights moved away from their initial values
    from bayesify.zoo.data import load_data
    from bayesify.training import TrainConfig, build_model

    initial = build_model(TrainConfig.from_dict(state["config"]), load_data("digits")).state_dict()
    assert not torch.equal(initial["1.weight"], state["model"]["1.weight"])
    assert cli.main(["evaluate", "--out", str(out), "--device", "cpu", "--max-examples", "50"]) == 0
