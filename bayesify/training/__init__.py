"""Training rank-1 BNNs as in the paper: the objective, optimizers, checkpoints, the trainer.

from bayesify.training import Objective, TrainConfig, Trainer, build_model, param_groups
"""

from bayesify.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from bayesify.training.objective import Likelihood, Objective, kl_scale, l2_penalty, negative_log_likelihood, training_nll
from bayesify.training.optim import OptimizerName, WarmupStepDecay, build_optimizer, param_groups
from bayesify.training.sampler import ResumableBatchSampler
from bayesify.training.trainer import Precision, TrainConfig, Trainer, build_model

__all__ = [
    "CheckpointError",
    "Likelihood",
    "Objective",
    "OptimizerName",
    "Precision",
    "ResumableBatchSampler",
    "TrainConfig",
    "Trainer",
    "WarmupStepDecay",
    "build_model",
    "build_optimizer",
    "kl_scale",
    "l2_penalty",
    "load_checkpoint",
    "negative_log_likelihood",
    "training_nll",
    "param_groups",
    "save_checkpoint",
]
