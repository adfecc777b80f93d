"""FSDP2: a converted model sharded over 2 CPU processes (torchrun, gloo) equals the unsharded model.

Each test starts ``tests/training/_fsdp_worker.py`` under ``torchrun --nproc-per-node 2``; the worker compares,
on every rank and in float64, the sharded model's loss, KL and every gathered gradient with an unsharded copy
over three SGD steps, each from the same parameters (sampled, tiled and default routes; the KL also before any
forward pass, when every table is sharded), then the mixture evaluation after each step, ``bayesify.uncertainty``, and ``gather`` + ``merge``
of the result. It exits non-zero naming the first value that differs.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import bayesify

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="torch built without gloo"),
]

WORKER = Path(__file__).with_name("_fsdp_worker.py")
ROOT = Path(bayesify.__file__).resolve().parent.parent  # the checkout under test, not an installed copy


def run_worker(*args: str, nproc: int = 2, script: Path = WORKER) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


def explain(result: subprocess.CompletedProcess) -> str:
    """The launch's last 40 lines, after any earlier line naming an error: a rank's own traceback or abort comes
    before the launcher's summary of the failure, which alone fills the last lines."""
    lines = [l for l in (result.stdout + result.stderr).splitlines() if not l.startswith(("W1", "[W"))]
    cause = [l for l in lines[:-40] if re.search(r"Error|Traceback|Abort|abort|Signal|signal|terminate|what\(\)", l)]
    earlier = ["(earlier lines naming an error)", *cause[-30:], "(the last 40 lines)"] if cause else []
    return "\n".join(earlier + lines[-40:])


@pytest.mark.parametrize("model", ["vit", "gpt2", "resnet"])
def test_sharded_training_evaluation_and_merge_equal_the_unsharded_model(model):
    pytest.importorskip({"vit": "timm", "gpt2": "transformers", "resnet": "torchvision"}[model])
    result = run_worker(model)
    assert result.returncode == 0, explain(result)
    assert result.stdout.count(f"fsdp-worker {model} rank") == 2, explain(result)
