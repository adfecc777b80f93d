"""Data parallelism: 2 CPU processes (torchrun, gloo) equal 1 process on the combined batch.

The runs use the tiled route with a delta posterior (BatchEnsemble: no posterior noise), so the
forward pass draws no random numbers and both runs compute the same function of the same
data; only the order of floating-point sums differs (hence a tolerance, not bitwise).
"""

import os
import subprocess
import sys

import pytest
import torch

from bayesify.training import load_checkpoint

ARGS = [
    "train", "--model", "mlp", "--data", "digits", "--posterior", "delta", "--route", "tile", "--components", "2",
    "--batch-size", "32", "--epochs", "1", "--max-steps", "5", "--optimizer", "sgd", "--lr", "0.05", "--no-progress",
]  # fmt: skip


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_on_the_combined_batch(tmp_path):
    single = _run([sys.executable, "-m", "bayesify", *ARGS, "--out", str(tmp_path / "one")])
    assert single.returncode == 0, single.stderr
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "bayesify",
    ]
    ddp = _run([*launcher, *ARGS, "--out", str(tmp_path / "two")])
    assert ddp.returncode == 0, ddp.stderr

    one = load_checkpoint(tmp_path / "one" / "checkpoint.pt")
    two = load_checkpoint(tmp_path / "two" / "checkpoint.pt")
    assert one["step"] == two["step"] == 5
    assert len(two["rng"]) == 2  # each process's RNG state is kept for an exact resume
    for name, value in one["model"].items():
        assert torch.allclose(two["model"][name], value, atol=1e-6, rtol=1e-5), name
    assert one["optimizer"]["state"], "no optimizer step was taken"


@pytest.mark.slow
def test_a_batch_that_does_not_split_over_processes_names_the_fix(tmp_path):
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "bayesify",
    ]
    args = [a if a != "32" else "33" for a in ARGS]
    result = _run([*launcher, *args, "--out", str(tmp_path / "odd")])
    assert result.returncode != 0
    # each worker reports the user error in one line (the traceback after it is torchrun's own report)
    first = result.stderr.splitlines()[0]
    assert first.startswith("bayesify train: error: batch_size=33 cannot be split over 2 processes"), first


_WRAPPED_THEN_CONVERTED = """
import os, sys, torch, torch.distributed as dist
from torch import nn
import bayesify
from torch.distributed.fsdp import fully_shard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
for name, wrap in (("ddp", nn.parallel.DistributedDataParallel), ("fsdp", fully_shard)):
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    wrapped = wrap(net)
    for target in (wrapped, nn.Sequential(wrapped)):
        try:
            bayesify.convert(target, task="classification")
            print(name, "converted")
        except ValueError as error:
            print(name, "refused:", error)
    assert not bayesify.is_converted(net), name  # nothing was changed
dist.destroy_process_group()
"""


def test_a_model_wrapped_for_data_parallelism_is_refused_naming_the_order(tmp_path):
    """Converted after DistributedDataParallel or fully_shard wrapped it, a model's factors were never reduced across
    the processes: each rank trained a posterior of its own (15 of 15 rank-1 Parameters apart after 5 steps on 2
    ranks, in a new user's trial), silently."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "wrapped.py"
    script.write_text(_WRAPPED_THEN_CONVERTED)
    out = _run([sys.executable, str(script), str(port)])
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and all("refused" in line for line in lines), lines
    assert lines[0].startswith("ddp refused: convert() was given a DistributedDataParallel wrapper, which took")
    assert "convert first, then wrap: DistributedDataParallel(bayesify.convert(model))" in lines[0]
    assert "Sequential holds ('0') a DistributedDataParallel wrapper" in lines[1]
    assert "convert first, then shard: bayesify.training.shard(bayesify.convert(model))" in lines[2]


def test_nn_data_parallel_is_refused_where_its_replicas_would_share_one_routing():
    """nn.DataParallel on several GPUs replicates the model every step and runs the replicas in threads at once: the
    replicas of a converted root share its one routing of the pass, and a converted DataParallel's replicas see the
    tiled batch cut in pieces (each piece routed as the whole), silently. The replication is what the test makes
    (no GPUs here): the refusal is in the converted root's pass, and in convert() for a wrapped model."""
    from torch import nn

    import bayesify

    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"an nn.DataParallel wrapper.*bayesify.convert\(wrapper.module\)"):
        bayesify.convert(nn.DataParallel(net), task="classification")
    model = bayesify.convert(net, task="classification")
    x = torch.randn(5, 4)
    nn.DataParallel(model)(x)  # no GPUs (or one): no replicas, the model itself runs
    replica = model._replicate_for_data_parallel()
    with pytest.raises(RuntimeError, match="nn.DataParallel made replicas .*DistributedDataParallel"):
        replica(x)
