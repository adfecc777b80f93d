"""Training rank-1 BNNs as in the paper: the objective, optimizers, checkpoints, recipes, the trainer.

from bayesify.training import Objective, TrainConfig, Trainer, build_model, param_groups
"""

from bayesify.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from bayesify.training.config import Precision, TrainConfig
from bayesify.sharding import is_sharded
from bayesify.training.fsdp import find_blocks, gather, shard
from bayesify.training.objective import (
    Likelihood,
    Objective,
    kl_scale,
    l2_penalty,
    training_nll,
)
from bayesify.training.optim import OptimizerName, WarmupStepDecay, build_optimizer, param_groups
from bayesify.training.recipes import PRESETS, apply_preset
from bayesify.training.run import build_model, load_run, restore_model
from bayesify.training.sampler import ResumableBatchSampler
from bayesify.training.sharded_checkpoint import load_sharded, save_sharded
from bayesify.training.trainer import Trainer, train
from bayesify.training.evaluate_run import LoadedRun, evaluate_run, open_run

__all__ = [
    "PRESETS",
    "CheckpointError",
    "LoadedRun",
    "Likelihood",
    "Objective",
    "OptimizerName",
    "Precision",
    "ResumableBatchSampler",
    "TrainConfig",
    "Trainer",
    "WarmupStepDecay",
    "apply_preset",
    "build_model",
    "build_optimizer",
    "evaluate_run",
    "find_blocks",
    "gather",
    "is_sharded",
    "kl_scale",
    "l2_penalty",
    "load_checkpoint",
    "load_run",
    "load_sharded",
    "open_run",
    "param_groups",
    "restore_model",
    "save_checkpoint",
    "save_sharded",
    "shard",
    "train",
    "training_nll",
]
