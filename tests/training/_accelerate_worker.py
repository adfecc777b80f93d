"""One side of tests/training/test_accelerate_fsdp.py, run by ``accelerate launch --config_file FSDP2.yaml``.

The README's ``BayesianTrainer`` (tests/test_hf_trainer.py) trains a 2-layer GPT-2 for 3 steps; each rank prints
what accelerate made of the FSDP config: the wrapper's class and how many Parameters are sharded (DTensors).
"""

import os
import sys

import torch
from torch.distributed.tensor import DTensor
from transformers import TrainingArguments

from tests.test_hf_trainer import BayesianTrainer, counting_sequences, tiny_gpt2

torch.manual_seed(0)
model = tiny_gpt2()
args = TrainingArguments(
    output_dir=sys.argv[1], use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no",
    per_device_train_batch_size=4, learning_rate=1e-2, max_steps=3, logging_steps=1, disable_tqdm=True,
)  # fmt: skip
trainer = BayesianTrainer(model=model, args=args, train_dataset=counting_sequences(32, 0))
result = trainer.train()
assert torch.isfinite(torch.tensor(result.training_loss)), result
sharded = sum(isinstance(p, DTensor) for p in trainer.model.parameters())
total = len(list(trainer.model.parameters()))
# one write per line: print's text and newline are two writes, which the other rank's line can fall between
sys.stdout.write(f"accelerate-worker rank {os.environ.get('RANK')}: wrapper={type(trainer.model_wrapped).__name__} sharded={sharded}/{total}\n")
sys.stdout.flush()
# both ranks have said what they found: leave without the interpreter's teardown, in which gloo's threads have aborted
# a rank under load ("terminate called without an active exception", SIGABRT), failing a run whose checks passed
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
os._exit(0)
