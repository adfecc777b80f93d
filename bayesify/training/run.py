"""A run directory: what ``bayesify train`` leaves in ``--out``, and how a run is started, resumed or rebuilt
(the trainer, :mod:`bayesify.training.trainer`, trains it; :mod:`bayesify.training.evaluate_run` evaluates it).

    OUT/checkpoint.pt     model, optimizer, schedule, scaler, step / epoch / batch, config, RNG states
    OUT/metrics.jsonl     one JSON line per log window and per evaluation
    OUT/report.md, OUT/evaluation.json, OUT/*.png   written by ``bayesify evaluate``

The file names are spelled here only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import bayesify
from bayesify.inspection import model_task
from bayesify.predictive.tasks import Auto, Task, TaskName
from bayesify.training.checkpoint import load_checkpoint
from bayesify.training.config import TrainConfig
from bayesify.training.recipes import apply_preset
from bayesify.zoo.data import DataBundle
from bayesify.zoo.models import create_model
from bayesify.zoo.weights import load_weights

__all__ = [
    "CHECKPOINT",
    "EVALUATION",
    "METRICS",
    "REPORT",
    "build_model",
    "load_model_state",
    "load_run",
    "new_run_config",
    "restore_model",
    "resume_run_config",
    "run_task",
]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
REPORT = "report.md"
EVALUATION = "evaluation.json"


def _task_option(config: TrainConfig, bundle: DataBundle) -> TaskName | Task:
    # config.task, or with "auto" the data's own task (a name, as the config holds it)
    return TaskName.parse(bundle.task, "task") if config.task == TaskName.AUTO else config.task


def run_task(config: TrainConfig, bundle: DataBundle, model: nn.Module | None = None) -> Task:
    """What the run's model outputs: ``config.task``; with ``"auto"``, the task ``model`` was converted with where it
    was given one (``convert(net, task="binary")``: what its output means), else the data's own task. A task the
    config says that is not the converted model's is refused in one line."""
    said = config.rank1.replace(task=_task_option(config, bundle)).resolved_task()
    if model is None or not bayesify.is_converted(model):
        return said
    converted = model_task(model)
    if isinstance(converted, Auto):
        return said
    if config.task == TaskName.AUTO:
        return converted
    if said != converted:
        raise ValueError(
            f"the config says task={str(getattr(config.task, 'value', config.task))!r}, but "
            f"the model was converted with task {converted}; say one task (leave the config's 'auto' to train the "
            "model's)."
        )
    return said


def build_model(config: TrainConfig, bundle: DataBundle) -> nn.Module:
    """The run's model, seeded: ``create_model`` for the data and the task, its start weights (``pretrained``, or
    the file ``weights``) loaded, converted with ``config``'s options unless ``deterministic``, and with
    ``adapter`` only its rank-1 parameters left trainable (:func:`bayesify.freeze_base`)."""
    torch.manual_seed(config.seed)
    model = create_model(
        config.model,
        in_channels=bundle.in_channels,
        num_classes=bundle.outputs(run_task(config, bundle)),
        input_shape=bundle.input_shape,
        kind=bundle.kind,
        pretrained=config.pretrained,
    )
    if config.weights is not None:
        load_weights(model, config.weights)  # before conversion: the file holds the network's own keys
    if not config.deterministic:
        bayesify.convert(model, config.rank1.replace(task=_task_option(config, bundle)))
        if config.adapter:
            bayesify.freeze_base(model)
    return model


def without_start_weights(config: TrainConfig) -> TrainConfig:
    """The config that rebuilds a run's model for its checkpoint: no download, no weights file (the checkpoint
    holds the weights)."""
    return dataclasses.replace(config, pretrained=False, weights=None)


def new_run_config(explicit: dict[str, Any], preset: str | None = None) -> TrainConfig:
    """The config of a new run in ``explicit["out"]``: the preset (if any), then the explicit values.

    Raises:
        ValueError: ``out`` already holds a run, or ``model`` / ``data`` is missing.
    """
    out = Path(explicit.get("out", TrainConfig.out))
    if (out / CHECKPOINT).exists():
        raise ValueError(
            f"{out} already holds a checkpoint; pass --resume to continue that run, or choose another --out "
            "(nothing was overwritten)."
        )
    missing = [f"--{k}" for k in ("model", "data") if k not in explicit]
    if missing:
        raise ValueError(
            f"train needs {' and '.join(missing)} (e.g. --model cnn --data digits) unless it --resume's a run."
        )
    values = apply_preset(preset, explicit)
    if (values.get("pretrained") or values.get("weights")) and "init" not in explicit:
        values["init"] = "preserve"  # keep the pretrained network's function at the start
    return TrainConfig(**values)


def resume_run_config(explicit: dict[str, Any]) -> TrainConfig:
    """The config of the run in ``explicit["out"]`` with ``explicit`` values on top (e.g. more epochs).

    Raises:
        ValueError: no checkpoint there, or a different ``model`` / ``data`` than the run trained.
    """
    out = Path(explicit["out"])
    if not (out / CHECKPOINT).exists():
        raise ValueError(f"--resume: there is no checkpoint at {out / CHECKPOINT}; drop --resume to start a new run there.")
    checkpoint = load_checkpoint(out / CHECKPOINT)
    saved = checkpoint["config"]
    before, after = TrainConfig.from_dict(saved), TrainConfig.from_dict({**saved, **explicit, "resume": True})
    trained = int(checkpoint.get("epoch", 0))
    if "epochs" in explicit and after.epochs < trained:
        raise ValueError(
            f"--epochs {after.epochs} is fewer than the {trained} epochs the run in {out} has trained; resume with "
            f"--epochs {trained + 1} or more to train on (bayesify evaluate --out {out} evaluates it as it is)."
        )
    for key in _FIXED_AT_RESUME:
        if key in explicit and getattr(after, key) != getattr(before, key):
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"{_said(flag, getattr(after, key))} differs from the run in {out}, which trained with "
                f"{_said(flag, getattr(before, key))} (its checkpoint holds that model); resume without it, or train a "
                "new run in another --out."
            )
    return after


def _said(flag: str, value: Any) -> str:
    """An option as the command line says it: ``--adapter`` / ``--no-adapter``, ``--prior cauchy``."""
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value}"


# what the checkpoint's model is: the network, its data (classes, shapes) and every conversion option
_FIXED_AT_RESUME = ("model", "data", "adapter", "deterministic", *(f.name for f in dataclasses.fields(bayesify.Rank1Config)))


def load_run(out: str | Path) -> tuple[TrainConfig, dict[str, Any]]:
    """The config and the checkpoint state of the run in ``out`` (a CheckpointError names the fix)."""
    state = load_checkpoint(Path(out) / CHECKPOINT)
    return TrainConfig.from_dict(state["config"]), state


def restore_model(
    config: TrainConfig, state: dict[str, Any], bundle: DataBundle, *, checkpoint: str | Path | None = None
) -> nn.Module:
    """The run's model rebuilt and loaded with the checkpoint's weights (no pretrained download, no weights file).

    Raises:
        ValueError: the model that ``config.model`` builds now has other parameters than the checkpoint holds
            (its code changed since the run trained; see :func:`load_model_state`); ``checkpoint`` names the file.
    """
    model = build_model(without_start_weights(config), bundle)
    load_model_state(model, state["model"], config, checkpoint or Path(config.out) / CHECKPOINT)
    return model


def load_model_state(model: nn.Module, weights: Mapping[str, Any], config: TrainConfig, checkpoint: str | Path) -> None:
    """``model.load_state_dict(weights)`` (strict), where ``model`` was built from ``config`` to take a run's weights.

    Raises:
        ValueError: in one line, when the model has other parameters or buffers than the checkpoint holds,
            naming a key or two of each kind: the model that ``--model`` builds changed since the run trained (the
            file of a ``module:factory`` edited, another timm or torchvision version), and the weights are not its
            (torch has loaded the keys that fit, as ``load_state_dict`` does before it raises: discard the model).
    """
    try:
        model.load_state_dict(weights)
    except RuntimeError:  # torch's error lists every key on a line of its own; name a few, and the fix
        differences = _differences(model.state_dict(), weights)
        if not differences:
            raise
        raise ValueError(
            f"the model that --model {config.model} builds now does not match the weights in {checkpoint} "
            f"({'; '.join(differences)}): has its code changed since the run trained (an edited module:factory file, "
            "another timm or torchvision version)? Put it back as it was to use this run, or train a new run in "
            "another --out."
        ) from None


def _differences(current: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """What tells a model's state from a checkpoint's, a key or two of each kind (the network's own keys first)."""

    def named(keys: list[str], say: Callable[[str], str] = repr) -> str:
        keys = sorted(keys, key=lambda key: "rank1_" in key)  # (stable: the model's order otherwise)
        more = f" and {len(keys) - 2} more" if len(keys) > 2 else ""
        return ", ".join(say(key) for key in keys[:2]) + more

    def shape(value: Any) -> list[int]:
        return list(getattr(value, "shape", ()))

    missing = [key for key in current if key not in saved]
    unexpected = [key for key in saved if key not in current]
    reshaped = [key for key in current if key in saved and shape(current[key]) != shape(saved[key])]
    found = []
    if missing:
        found.append(f"not in the checkpoint: {named(missing)}")
    if unexpected:
        found.append(f"in the checkpoint, not in the model: {named(unexpected)}")
    if reshaped:
        found.append(
            "another shape: " + named(reshaped, lambda key: f"{key!r} ({shape(saved[key])} saved, {shape(current[key])} now)")
        )
    return found
