"""Atomic checkpoints: a crash or SIGKILL while writing leaves the previous one loadable."""

import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from bayesify.training import checkpoint as ckpt
from bayesify.training.checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state


def test_round_trip_is_a_plain_dict(tmp_path):
    path = save_checkpoint({"model": {"w": torch.arange(3.0)}, "step": 7, "config": {"lr": 0.1}}, tmp_path / "c.pt")
    state = load_checkpoint(path)
    assert state["step"] == 7 and torch.equal(state["model"]["w"], torch.arange(3.0))
    assert state["format"] == "bayesify-checkpoint" and state["version"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary left behind


def test_a_failure_before_the_rename_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = save_checkpoint({"step": 1}, tmp_path / "c.pt")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint({"step": 2, "big": torch.zeros(1000)}, path)
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # the partial temp file was removed


def test_sigkill_in_the_middle_of_a_write_keeps_the_old_checkpoint(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint({"step": 1, "w": torch.ones(4)}, path)
    # a child process starts overwriting it, and is killed after the bytes are written but before fsync/rename
    script = textwrap.dedent(
        f"""
        import os, sys, time, torch
        from bayesify.training import checkpoint as ckpt
        def stall(fd):
            print("writing", flush=True)
            time.sleep(60)
        ckpt.os.fsync = stall
        ckpt.save_checkpoint({{"step": 2, "w": torch.zeros(1_000_000)}}, {str(path)!r})
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(4))
    # the torn temporary file is there but is not the checkpoint
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "c.pt"]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp")


def test_missing_corrupt_and_foreign_files_raise_with_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at .*train first"):
        load_checkpoint(tmp_path / "nope.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="corrupt or unreadable.*left as it is"):
        load_checkpoint(bad)
    assert bad.read_bytes() == b"not a checkpoint at all"
    good = save_checkpoint({"step": 3, "w": torch.randn(100)}, tmp_path / "t.pt")
    good.write_bytes(good.read_bytes()[:300])  # truncated
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(good)
    foreign = tmp_path / "f.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(CheckpointError, match="not a bayesify checkpoint"):
        load_checkpoint(foreign)


def test_rng_states_survive_a_weights_only_round_trip(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.normal()  # leave a cached gaussian in numpy's state
    save_checkpoint({"rng": rng_state()}, tmp_path / "c.pt")
    expected = (torch.rand(3), np.random.normal(size=3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    set_rng_state(load_checkpoint(tmp_path / "c.pt")["rng"])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.normal(size=3), expected[1])
    assert random.random() == expected[2]
