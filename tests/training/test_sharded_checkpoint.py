"""Distributed checkpoints of a sharded converted model: resume equals the uninterrupted run, on 2 ranks and on 1.

The worker (``_dcp_worker.py``) saves after 2 Adam steps of a ViT sharded over 2 gloo processes and records step
3; a fresh 2-rank run resumes from the checkpoint (step 3 bitwise equal), and one plain process with an
unsharded model loads the same checkpoint (resharded from 2 ranks to 1) and takes step 3 on the whole batch.
"""

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from tests.training.test_fsdp import ROOT, explain, run_worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="torch built without gloo"),
]

WORKER = ROOT / "tests" / "training" / "_dcp_worker.py"


def test_a_distributed_checkpoint_resumes_on_two_ranks_and_loads_into_one_process(tmp_path):
    pytest.importorskip("timm")
    saved = run_worker("save", str(tmp_path), script=WORKER)
    assert saved.returncode == 0, explain(saved)
    assert (tmp_path / "checkpoint.dcp" / ".metadata").is_file()
    assert not (tmp_path / ".checkpoint.dcp.partial").exists()  # renamed into place once complete

    resumed = run_worker("resume", str(tmp_path), script=WORKER)
    assert resumed.returncode == 0, explain(resumed)
    assert resumed.stdout.count("dcp-worker resume rank") == 2, explain(resumed)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    single = subprocess.run([sys.executable, str(WORKER), "single", str(tmp_path)], capture_output=True, text=True,
                            timeout=240, env=env, cwd=ROOT)  # fmt: skip
    assert single.returncode == 0, explain(single)
    assert "dcp-worker single: ok" in single.stdout


def test_loading_a_directory_that_is_not_a_distributed_checkpoint_names_it(tmp_path):
    from torch import nn

    import bayesify
    from bayesify.training.sharded_checkpoint import load_sharded

    model = bayesify.convert(nn.Sequential(nn.Linear(3, 4)), components=2)
    with pytest.raises(ValueError, match="is not a distributed checkpoint"):
        load_sharded(tmp_path, model)
