"""``bayesify train --strategy fsdp``: 2 CPU processes (torchrun, gloo) with the model sharded.

As in test_distributed.py the runs use the tiled route with a delta posterior (no posterior noise), so a
sharded run and a DDP run compute the same function of the same data: their weights after 5 SGD steps must
agree, and a sharded run stopped after 3 steps and resumed from its distributed checkpoint must end where the
uninterrupted run ends.
"""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from bayesify.training import TrainConfig, load_checkpoint
from tests.training.test_fsdp import ROOT

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="torch built without gloo")

ARGS = [
    "train", "--model", "mlp", "--data", "digits", "--posterior", "delta", "--route", "tile", "--components", "2",
    "--batch-size", "32", "--epochs", "1", "--optimizer", "adam", "--lr", "0.01", "--no-progress",
]  # fmt: skip
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "bayesify"]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.allclose(b[name], value, atol=1e-6, rtol=1e-5), name


@pytest.mark.slow
def test_fsdp_training_equals_ddp_and_resumes_from_its_distributed_checkpoint(tmp_path):
    ddp = _run([*TORCHRUN, *ARGS, "--max-steps", "5", "--strategy", "ddp", "--out", str(tmp_path / "ddp")])
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    fsdp = _run([*TORCHRUN, *ARGS, "--max-steps", "5", "--strategy", "fsdp", "--out", str(tmp_path / "fsdp")])
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    one, two = load_checkpoint(tmp_path / "ddp" / "checkpoint.pt"), load_checkpoint(tmp_path / "fsdp" / "checkpoint.pt")
    assert one["step"] == two["step"] == 5
    assert two["sharded"] == "checkpoint.dcp" and (tmp_path / "fsdp" / "checkpoint.dcp" / ".metadata").is_file()
    _same_weights(one["model"], two["model"])  # the gathered whole model, beside the distributed checkpoint

    part = _run([*TORCHRUN, *ARGS, "--max-steps", "3", "--strategy", "fsdp", "--out", str(tmp_path / "resumed")])
    assert part.returncode == 0, part.stderr[-3000:]
    rest = _run([*TORCHRUN, *ARGS, "--max-steps", "5", "--strategy", "fsdp", "--resume", "--out", str(tmp_path / "resumed")])
    assert rest.returncode == 0, rest.stderr[-3000:]
    resumed = load_checkpoint(tmp_path / "resumed" / "checkpoint.pt")
    assert resumed["step"] == 5
    _same_weights(two["model"], resumed["model"])  # Adam's moments came back from checkpoint.dcp

    # a resumed run keeps its strategy: in one process, one line naming torchrun
    wrong = _run([sys.executable, "-m", "bayesify", *ARGS, "--max-steps", "6", "--resume", "--out", str(tmp_path / "fsdp")])
    assert wrong.returncode != 0
    assert "start with `torchrun --nproc-per-node N" in wrong.stderr.splitlines()[0], wrong.stderr


def test_fsdp_in_one_process_names_torchrun(tmp_path):
    result = _run([sys.executable, "-m", "bayesify", *ARGS, "--max-steps", "1", "--strategy", "fsdp", "--out", str(tmp_path)])
    assert result.returncode != 0
    first = result.stderr.splitlines()[0]
    assert "strategy='fsdp' shards the model over several processes: start with `torchrun" in first, first


@pytest.mark.parametrize(
    "options, message",
    [
        ({"device": "xla"}, "does not run on XLA"),
        ({"deterministic": True}, "drop --deterministic"),
        ({"precision": "fp16"}, "use --precision bf16"),
        ({"compile": True}, "drop --compile"),
    ],
)
def test_unsupported_fsdp_combinations_name_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(strategy="fsdp", **options).validate()
