"""Distributed checkpoints (``torch.distributed.checkpoint``) of a sharded converted model and its optimizer.

Each rank writes its own shards into one directory, with no gather to one process; loading reshards, so a
checkpoint saved by N ranks loads into M ranks, or into one process and an unsharded model (M = 1, with or
without a process group). Each layer's factors are sharded Parameters of its block like its weight, so they
need nothing of their own::

    save_sharded("run/checkpoint.dcp", model, optimizer)   # every rank calls it
    load_sharded("run/checkpoint.dcp", model, optimizer)   # a model built, converted and sharded the same way

The optimizer state is saved by parameter name (``get_state_dict``), so it loads into an optimizer over the
same Parameters whatever their sharding. The trainer keeps its other state (step, schedule, RNG) in its usual
``checkpoint.pt`` beside it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["load_sharded", "save_sharded"]


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False)


def save_sharded(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write ``model``'s (and ``optimizer``'s) state as a distributed checkpoint in ``directory``; every rank calls it.

    The new checkpoint is written beside the old one and renamed over it once every rank has finished, so a
    crash while saving leaves the previous checkpoint whole.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    partial = directory.with_name(f".{directory.name}.partial")
    if _is_main():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    optimizers = () if optimizer is None else (optimizer,)
    model_state, optimizer_state = get_state_dict(model, optimizers, options=_options())
    state = {"model": model_state} if optimizer is None else {"model": model_state, "optimizer": optimizer_state}
    dcp.save(state, checkpoint_id=partial)
    _barrier()
    if _is_main():
        old = directory.with_name(f".{directory.name}.old")
        if directory.exists():
            directory.rename(old)
        partial.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return directory


def load_sharded(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint of :func:`save_sharded` into ``model`` (and ``optimizer``), resharded to this run.

    ``model`` is built and converted as the saved one was; sharded over any number of ranks, or not at all.

    Raises:
        ValueError: ``directory`` holds no distributed checkpoint, or it holds no optimizer state and
            ``optimizer`` was given.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(directory)
    if not (directory / ".metadata").is_file():
        raise ValueError(f"{directory} is not a distributed checkpoint (no .metadata); save one with save_sharded().")
    optimizers = () if optimizer is None else (optimizer,)
    model_state, optimizer_state = get_state_dict(model, optimizers, options=_options())
    state = {"model": model_state} if optimizer is None else {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=directory)
    except Exception as error:  # DCP names the missing keys; say which checkpoint and what to do
        raise ValueError(
            f"{directory} does not fit this model{' and optimizer' if optimizer is not None else ''}: {error}; "
            "build and convert the model with the options of the saved run."
        ) from error
    if optimizer is None:
        set_state_dict(model, (), model_state_dict=state["model"], optim_state_dict={}, options=_options())
    else:
        set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=_options())
