import os

import pytest
import torch

# two cores in CI, shared by the test process: keep torch from oversubscribing them
torch.set_num_threads(int(os.environ.get("BAYESIFY_TEST_THREADS", "2")))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
