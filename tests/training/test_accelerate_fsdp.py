"""The README's ``BayesianTrainer`` under ``accelerate launch`` with an FSDP2 config, 2 processes.

On the CPU accelerate does not shard: ``AcceleratorState`` applies FSDP only to accelerator back-ends
(accelerate/state.py), so with ``use_cpu: true`` the model is wrapped in DDP, silently. The CPU test pins that
down (docs/SCALING.md says so; it fails the day accelerate shards on the CPU, to update the docs); the sharded
run needs 2 GPUs and has not been run.
"""

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from tests.training.test_fsdp import ROOT, explain

pytestmark = pytest.mark.slow

CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
use_cpu: {use_cpu}
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: GPT2Block
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: false
"""


def launch(tmp_path, use_cpu: bool) -> subprocess.CompletedProcess:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    config = tmp_path / "fsdp2.yaml"
    config.write_text(CONFIG.format(use_cpu=str(use_cpu).lower()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with socket.socket() as probe:  # a free port: accelerate's default 29500 may be taken by another run
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port", str(port),
               str(ROOT / "tests" / "training" / "_accelerate_worker.py"), str(tmp_path / "out")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    if result.returncode != 0 and "accelerate-worker" not in result.stdout:
        # the launcher itself failed before any worker ran (seen once in ten runs on a loaded 2-core machine, a
        # rendezvous on a port just probed free): once more on a new port; the assertions stay the same
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            command[command.index("--main_process_port") + 1] = str(probe.getsockname()[1])
        result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    return result


def test_accelerate_ignores_an_fsdp_config_on_the_cpu_and_trains_with_ddp(tmp_path):
    result = launch(tmp_path, use_cpu=True)
    assert result.returncode == 0, explain(result)
    lines = re.findall(r"accelerate-worker rank \d+: wrapper=\w+ sharded=\d+/\d+", result.stdout)
    assert len(lines) == 2, explain(result)
    for line in lines:
        assert "wrapper=DistributedDataParallel sharded=0/" in line, line


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="accelerate shards with FSDP only on accelerators: needs 2 GPUs")
def test_bayesian_trainer_under_accelerate_fsdp2_on_gpus(tmp_path):  # not run yet: no GPU machine had 2 GPUs
    result = launch(tmp_path, use_cpu=False)
    assert result.returncode == 0, explain(result)
    lines = re.findall(r"accelerate-worker rank \d+: wrapper=\w+ sharded=\d+/\d+", result.stdout)
    assert len(lines) == 2 and all("sharded=0/" not in l for l in lines), explain(result)
