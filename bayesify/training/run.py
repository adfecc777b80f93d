"""A run directory: what ``bayesify train`` leaves in ``--out``, and how a run is started, resumed or rebuilt
(the trainer, :mod:`bayesify.training.trainer`, trains it; :mod:`bayesify.training.evaluate_run` evaluates it).

    OUT/checkpoint.pt     model, optimizer, schedule, scaler, step / epoch / batch, config, RNG states
    OUT/metrics.jsonl     one JSON line per log window and per evaluation
    OUT/report.md, OUT/evaluation.json, OUT/*.png   written by ``bayesify evaluate``

The file names are spelled here only.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

import bayesify
from bayesify.inspection import model_task
from bayesify.options import VarianceParameter
from bayesify.predictive.tasks import Auto, Task, TaskName
from bayesify.training.checkpoint import load_checkpoint
from bayesify.training.config import TrainConfig
from bayesify.training.recipes import apply_preset
from bayesify.zoo.data import DataBundle, data_names
from bayesify.zoo.models import create_model, new_classifier
from bayesify.zoo.weights import first_line, load_start_weights

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


def run_task(
    config: TrainConfig, bundle: DataBundle, model: nn.Module | None = None, *, new_run: bool | None = None
) -> Task:
    """What the run's model outputs: ``config.task``; with ``"auto"``, the task ``model`` was converted with where it
    was given one (``convert(net, task="binary")``: what its output means), else the data's own task.

    Refused in one line (the trainer asks this before it trains): a task the config says that is not the converted
    model's, a task the data's targets cannot train (``gaussian`` on class labels), and in a ``new_run`` (default:
    unless ``config.resume``) the options that cannot apply to it (``batch_dim`` other than 0, ``class_axis`` or a
    ``gaussian_variance`` for a task that has none)."""
    task = _run_task(config, bundle, model)
    _check_task_fits(bundle, task)
    if new_run is None:
        new_run = not config.resume
    if new_run:
        _check_options_apply(config, bundle, task)
    return task


def _run_task(config: TrainConfig, bundle: DataBundle, model: nn.Module | None) -> Task:
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


def _check_task_fits(bundle: DataBundle, task: Task) -> None:
    """Refuse a task the data's targets cannot train (``gaussian`` on class labels, ``multilabel`` on one label per
    example), which failed on the first batch in a torch message."""
    targets = _target_kind(bundle)
    if targets is None or task.name not in {str(name) for name in TaskName}:
        return  # targets that do not say what they are, or a task of the user's own: the likelihood will tell
    description, fits = targets
    if task.name not in fits:
        raise ValueError(
            f"--task {task.name} cannot train on {bundle.name}, whose targets are {description}: the tasks that fit "
            f"are {', '.join(fits)} (leave --task out for the data's own, {bundle.task})."
        )


def _check_options_apply(config: TrainConfig, bundle: DataBundle, task: Task) -> None:
    """Refuse in a new run the options that cannot apply to it, which else failed on the first batch in a torch
    message or were ignored: ``batch_dim`` other than 0 (the trainer's and the evaluator's batches are batch-first,
    as the data loader stacks them), ``class_axis`` / a ``gaussian_variance`` for a task that has none. (Not in a
    run that exists: it trained with them ignored, and cannot drop them.)"""
    if config.batch_dim != 0 and not config.deterministic:
        raise ValueError(
            f"--batch-dim {config.batch_dim}: the data loader hands the model batch-first inputs ([batch, "
            f"{', '.join(map(str, bundle.input_shape))}] for {bundle.name}), so the batch lies at 0; drop --batch-dim "
            "(it is for a model whose inputs hold the batch elsewhere, converted in Python with bayesify.convert)."
        )
    if config.class_axis is not None and task.name != "classification":
        raise ValueError(
            f"--class-axis {config.class_axis} says where the classes lie in a classification output, but this run's "
            f"task is {task.name}; drop --class-axis."
        )
    if config.gaussian_variance != VarianceParameter.LOG and task.name != "gaussian":
        raise ValueError(
            f"--gaussian-variance {config.gaussian_variance} says how a gaussian head encodes its variance, but this "
            f"run's task is {task.name}; drop --gaussian-variance."
        )


def _target_kind(bundle: DataBundle) -> tuple[str, tuple[str, ...]] | None:
    """What the data's targets are, in words, and the tasks that can train on them; None where one example does
    not tell (float targets of a set left at the default task: 0/1 labels or real values)."""
    try:  # (a data set's transform may draw: on a fork, the run's random numbers stay as they were)
        with torch.random.fork_rng(devices=[]):
            target = torch.as_tensor(bundle.test[0][1])
    except (IndexError, KeyError, TypeError, ValueError, RuntimeError):  # an empty set, examples of another form
        return None
    if target.dim() == 0 and not target.is_floating_point() and bundle.task == "classification":
        if bundle.num_classes == 2:
            return "one of 2 class labels per example", ("classification", "binary")
        return f"one of {bundle.num_classes} class labels per example", ("classification",)
    if target.is_floating_point() and bundle.task in ("regression", "gaussian"):
        return "real values (a regression)", ("gaussian", "regression")
    return None


def build_model(config: TrainConfig, bundle: DataBundle) -> nn.Module:
    """The run's model, seeded: ``create_model`` for the data and the task, its start weights (``pretrained``, or
    the file ``weights``) loaded, converted with ``config``'s options unless ``deterministic``, and with
    ``adapter`` only its rank-1 parameters left trainable (:func:`bayesify.freeze_base`).

    Raises:
        ValueError: in one line, a model that fails on the data's inputs or whose head the task cannot train (what
            else the run's options cannot train, the trainer refuses: :func:`run_task`).
    """
    task = _run_task(config, bundle, None)
    torch.manual_seed(config.seed)
    model = create_model(
        config.model,
        in_channels=bundle.in_channels,
        num_classes=bundle.outputs(task),
        input_shape=bundle.input_shape,
        kind=bundle.kind,
        pretrained=config.pretrained,
    )
    # before conversion: the file holds the network's own keys (a timm head of other classes stays new)
    new_head = None if config.weights is None else load_start_weights(model, config.weights)
    _check_takes_the_data(model, config, bundle, task)
    if not config.deterministic:
        task_option = _task_option(config, bundle)
        # (a run that trained with --class-axis on another task, ignored then, is rebuilt without it; new runs refuse it)
        other = isinstance(task_option, (str, TaskName)) and TaskName.parse(task_option, "task") is not TaskName.CLASSIFICATION
        class_axis = None if other else config.class_axis
        bayesify.convert(model, config.rank1.replace(task=task_option, class_axis=class_axis))
        if config.adapter:
            bayesify.freeze_base(model)
            head = new_head or (new_classifier(model) if config.pretrained else None)
            if head is not None:
                # a head made for the data's classes (timm's pretrained weights of another width): its random weights
                # must learn them, as the README's recipe says; frozen, they were only rescaled by the factors
                head.requires_grad_(True)
    return model


def _check_takes_the_data(model: nn.Module, config: TrainConfig, bundle: DataBundle, task: Task) -> None:
    """Call the network on two test examples before it is converted, so that a model that cannot take the data
    (a ``module:factory`` built for another input width) is named in one line with the shape it was given and the
    error's own message, not in a traceback from inside a converted layer. In evaluation mode, without gradients,
    on a fork of the random numbers: the run starts as it would without the call (BAYESIFY_DEBUG=1 shows the
    traceback, chained)."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:  # two examples, collated as the data loader does
            examples = [bundle.test[i] for i in range(min(2, len(bundle.test)))]  # type: ignore[arg-type]
            x = bundle.normalize(default_collate(examples)[0])
        except (IndexError, KeyError, TypeError, ValueError, RuntimeError):  # no (input, target) pairs: trainer says
            return
        was_training = model.training
        model.eval()
        try:
            output = model(x)
        except Exception as error:  # a user's model can raise anything; the line keeps its type and message
            raise ValueError(
                f"--model {config.model} fails on a batch of {bundle.name} inputs of shape {list(x.shape)}: "
                f"{first_line(error)}{_factory_arguments(config, bundle, task)}; build it for inputs of that shape "
                "(BAYESIFY_DEBUG=1 shows the traceback)."
            ) from error
        finally:
            model.train(was_training)
    _check_output_width(output, len(x), config, bundle, task)


def _check_output_width(output: Any, rows: int, config: TrainConfig, bundle: DataBundle, task: Task) -> None:
    """Refuse a head the task's likelihood cannot score (a factory that ignores ``num_classes``), where it failed on
    the first batch in a torch message; a ``[B, W]`` (or ``[B]``) tensor only, and a head wider than the classes
    trains."""
    if not isinstance(output, torch.Tensor) or output.dim() not in (1, 2) or len(output) != rows:
        return
    if _target_kind(bundle) is None:  # (targets that do not say what they are: the likelihood will tell)
        return
    width, wanted = (output.shape[1] if output.dim() == 2 else 1), bundle.outputs(task)
    if task.name == "classification" and config.class_axis is None and width < wanted:
        need = f"{wanted} outputs per example, one per class"
    elif task.name == "binary" and width != wanted:
        need = f"{wanted} output per example (the logit of class 1)"
    elif task.name in ("regression", "gaussian") and width != wanted:
        need = f"{wanted} outputs per example" + (" (means, then log-variances)" if task.name == "gaussian" else "")
    else:
        return
    raise ValueError(
        f"--model {config.model} gives outputs of shape {list(output.shape)} for a batch of {rows} {bundle.name} "
        f"inputs, but --task {task.name} on {bundle.name} trains {need}{_factory_arguments(config, bundle, task)}; "
        "build its head with num_classes outputs."
    )


def _factory_arguments(config: TrainConfig, bundle: DataBundle, task: Task) -> str:
    """What ``create_model`` offers a ``module:factory`` by keyword (it passes those the factory's signature names,
    and ``num_classes`` and ``in_channels`` to a ``**kwargs``); nothing for a library's or a built-in model."""
    if ":" not in config.model.removeprefix("timm:").removeprefix("torchvision:"):
        return ""
    return (
        f"; a factory is offered num_classes={bundle.outputs(task)}, in_channels={bundle.in_channels} (or "
        f"in_chans={bundle.in_channels}) and input_shape={bundle.input_shape}"
    )


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
    _check_data_name(str(explicit["data"]))
    values = apply_preset(preset, explicit)
    if (values.get("pretrained") or values.get("weights")) and "init" not in explicit:
        values["init"] = "preserve"  # keep the pretrained network's function at the start
    return TrainConfig(**values)


def _check_data_name(data: str) -> None:
    """A file or folder given as ``--data`` is named with what ``--data`` takes (``load_data`` would only say that
    it is no data set's name)."""
    known = [name for name in data_names() if name != "folder:PATH"]
    if data.startswith("folder:") or data.strip().lower().replace("_", "-") in (*known, "fashionmnist"):
        return
    path = Path(data).expanduser()
    if not ("/" in data or os.sep in data or path.suffix or path.exists()):
        return  # a name: load_data lists the known ones
    if path.is_dir():
        fix = (
            f"for an ImageNet-style tree of images ({path}/train/<class>/*.jpg, {path}/val/<class>/) pass "
            f"--data folder:{data}"
        )
    else:
        fix = (
            "for a file of your own (a table, arrays) load it in Python into a bayesify.zoo.data.DataBundle and train "
            "it with bayesify.training.Trainer"
        )
    raise ValueError(
        f"--data {data} is a path, not a data set's name; --data takes one of {', '.join(known)}, or folder:PATH "
        f"(an image tree); {fix}."
    )


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
    ended = int(checkpoint.get("batch", 0)) == 0  # (at an epoch's end: --epochs equal to those trains nothing)
    if "epochs" in explicit and (after.epochs < trained or (ended and after.epochs == trained)):
        raise ValueError(
            f"--epochs {after.epochs} is not more than the {trained} epochs the run in {out} has trained; resume with "
            f"--epochs {trained + 1} or more to train on (bayesify evaluate --out {out} evaluates it as it is)."
        )
    taken = int(checkpoint.get("step", 0))
    if explicit.get("max_steps") is not None and after.max_steps is not None and after.max_steps <= taken:
        # (it trained nothing and logged the same evaluation again)
        raise ValueError(
            f"--max-steps {after.max_steps} is not more than the {taken} steps the run in {out} has taken; resume with "
            f"--max-steps {taken + 1} or more to train on (bayesify evaluate --out {out} evaluates it as it is)."
        )
    for keys, holds in ((_FIXED_AT_RESUME, "its checkpoint holds that model"),
                        (_OPTIMISATION, "its optimizer, schedule and place in the epoch go on from the checkpoint")):  # fmt: skip
        for key in keys:
            if key in explicit and getattr(after, key) != getattr(before, key):
                flag = "--" + key.replace("_", "-")
                raise ValueError(
                    f"{_said(flag, getattr(after, key))} differs from the run in {out}, which trained with "
                    f"{_said(flag, getattr(before, key))} ({holds}); resume without it, or train a new run in another "
                    "--out."
                )
    return after


def _said(flag: str, value: Any) -> str:
    """An option as the command line says it: ``--adapter`` / ``--no-adapter``, ``--prior cauchy``."""
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value}"


# what the checkpoint's model is: the network, its data (classes, shapes) and every conversion option
_FIXED_AT_RESUME = ("model", "data", "adapter", "deterministic", *(f.name for f in dataclasses.fields(bayesify.Rank1Config)))
# what the checkpoint's optimizer and schedule were made with (a new value would be logged, not used)
_OPTIMISATION = (
    "optimizer", "lr", "momentum", "nesterov", "fast_weight_lr_multiplier", "warmup_epochs", "decay_epochs", "decay_ratio",
    "batch_size", "seed",
)  # fmt: skip


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
