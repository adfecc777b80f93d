"""Evaluate a run directory of ``bayesify train``: ``report.md``, ``evaluation.json`` and plots.

    bayesify evaluate --out runs/rank1 --corruptions --baseline runs/det

From Python::

    from bayesify.training import evaluate_run
    results = evaluate_run("runs/rank1", corruptions="all", baseline="runs/det")
    results["clean"]["ece"], results["corrupted"]["mean"]["ece"]

The run's model is rebuilt from the configuration saved in its checkpoint, its weights loaded,
and it is evaluated on the clean test set (every metric of its task, members included), when asked
on the corrupted test sets (cNLL, cA, cECE), and against an out-of-distribution set (``ood``:
AUROC / AUPR / FPR@95 of each uncertainty score telling it from the test set). A ``baseline`` run (e.g. the deterministic network
trained with ``--deterministic``) on the same data is evaluated the same way, on the same
corrupted images, and drawn on the same axes. Posterior noise is seeded (0) for every test
set, so evaluating the same checkpoint twice gives the same numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from bayesify.config import Rank1Config, scoped
from bayesify.evaluation.corruptions import CORRUPTIONS, SEVERITIES, corrupt_images, parse_corruptions, parse_severities
from bayesify.evaluation.evaluator import collect_members, compare_corruptions, ood_detection
from bayesify.evaluation.metrics import member_log_probs_from_logits, mixture_log_probs, task_metrics
from bayesify.evaluation.report import markdown_report, reliability_diagram, severity_plot, write_json
from bayesify.inspection import rank1_layers
from bayesify.layers import Rank1Layer
from bayesify.predictive.tasks import Binary, Classification, Task
from bayesify.training.config import TrainConfig
from bayesify.training.distributed import resolve_device
from bayesify.training.run import CHECKPOINT, EVALUATION, REPORT, load_run, restore_model, run_task
from bayesify.zoo.data import DataBundle, DataKind, InMemoryDataset, data_names, load_data

__all__ = ["LoadedRun", "evaluate_run", "open_run"]

RELIABILITY_PLOT = "reliability.png"
CORRUPTION_PLOT = "corruptions.png"
_CAPTIONS = {"reliability": "reliability diagram", "corruptions": "corruption severity curves"}


@dataclass
class LoadedRun:
    """A trained run, ready to evaluate.

    Call the run on the data set's own inputs (``run(x)``: images in ``[0, 1]``, as ``run.data.test`` holds them):
    it normalises them as training did and calls the model. ``run.model`` itself is the network as trained, and
    expects *normalised* inputs (``run.model(run.data.normalize(x))``), like any network whose data pipeline
    normalises.

    Attributes:
        directory: the run directory (``--out`` of ``bayesify train``).
        config: the run's :class:`~bayesify.training.TrainConfig`, as saved in its checkpoint.
        model: the network with the checkpoint's weights, on the device, in eval mode; its inputs are normalised
            by ``data.normalize`` (per-channel statistics of the training set), as in training.
        data: the run's data set.
        step: the optimizer step the checkpoint was written at.
    """

    directory: Path
    config: TrainConfig
    model: nn.Module
    data: DataBundle
    step: int
    task: Task

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The model on raw inputs of the run's data set: ``model(data.normalize(x))``, on the model's device."""
        device = next(self.model.parameters()).device
        return self.model(self.data.normalize(x.to(device)), *args, **kwargs)

    @property
    def kind(self) -> str:
        """``"rank-1 K=4"`` or ``"deterministic"``."""
        return "deterministic" if self.config.deterministic else f"rank-1 K={self.config.components}"

    @property
    def label(self) -> str:
        """The kind and the directory name, e.g. ``"rank-1 K=4 (runs/a)"``: tells two runs apart."""
        return f"{self.kind} ({self.directory.name or self.directory})"


def open_run(
    out_dir: str | os.PathLike,
    *,
    device: str | torch.device = "auto",
    data_dir: str | os.PathLike | None = None,
    data: DataBundle | None = None,
) -> LoadedRun:
    """Rebuild the model of a run directory from its checkpoint.

    Args:
        out_dir: the directory ``bayesify train --out`` wrote.
        device: auto, cpu, cuda, cuda:N or xla.
        data_dir: where its data set is, if not where it was at training.
        data: the data set, already loaded (skips loading it again; it must be the run's).

    Raises:
        CheckpointError: no checkpoint, or an unreadable one (the message names the fix).
    """
    directory = Path(out_dir)
    config, state = load_run(directory)
    if data is None:
        data = load_data(config.data, data_dir or config.data_dir, seed=0)
    model = restore_model(config, state, data, checkpoint=directory / CHECKPOINT)  # weights from the checkpoint
    model.to(resolve_device(device)).eval()
    task = run_task(config, data, new_run=False)  # (the run trained with its options: they are not refused now)
    return LoadedRun(directory, config, model, data, int(state["step"]), task)


def evaluate_run(
    out_dir: str | os.PathLike,
    *,
    corruptions: str | Sequence[str] | None = None,
    severities: Sequence[int] = SEVERITIES,
    samples: int | None = None,
    batch_size: int = 256,
    max_examples: int | None = None,
    min_size: int = 32,
    device: str | torch.device = "auto",
    data_dir: str | os.PathLike | None = None,
    progress: bool | None = None,
    baseline: str | os.PathLike | None = None,
    ood: str | None = None,
) -> dict[str, Any]:
    """Evaluate the run in ``out_dir``; write its report, ``evaluation.json`` and plots there.

    Args:
        out_dir: the run directory of ``bayesify train``.
        corruptions: None (clean test set only), ``"all"`` (the 15 ImageNet-C corruptions), or
            names as a list or a comma-separated string. Image data only.
        severities: corruption severities, from 1 to 5.
        samples: M, posterior samples per component (None: each run's ``eval_samples``).
        batch_size: test examples per forward pass.
        max_examples: evaluate the first N test examples only (and the first N of an OOD data set).
        min_size: images smaller than this are corrupted at an upsampled size.
        device: auto, cpu, cuda, cuda:N or xla.
        data_dir: where the data set is, if not where it was at training.
        progress: a progress bar over the corrupted sets (None: only on a terminal).
        baseline: another run directory on the same data (e.g. the deterministic network),
            evaluated the same way and drawn on the same axes.
        ood: an out-of-distribution set to tell from the test set: another data set of the same
            input shape (e.g. ``cifar100`` against ``cifar10``), ``CORRUPTION[:SEVERITY]`` (the test set
            corrupted, default severity 5), or ``noise`` (uniform noise shaped as the inputs: in [0, 1] for
            images, over the span of the test inputs' own for features).

    Returns:
        What ``evaluation.json`` holds: ``step``, ``config``, ``settings``, ``clean``,
        ``corrupted`` (None without corruptions), ``baseline`` (the same for the baseline run,
        or None) and ``files`` (the paths written).

    Raises:
        ValueError: corruptions on non-image data, a baseline on other data, bad settings.
        CheckpointError: a missing or unreadable checkpoint.

    Example:
        >>> results = evaluate_run("runs/rank1", corruptions="fog,frost", baseline="runs/det")
        >>> results["corrupted"]["mean"]["accuracy"], results["baseline"]["corrupted"]["mean"]["accuracy"]
    """

    _check_settings(samples=samples, batch_size=batch_size, max_examples=max_examples, min_size=min_size)
    names = None if corruptions is None else parse_corruptions(corruptions)
    severities = parse_severities(severities)
    device = resolve_device(device)
    runs = _open_runs(out_dir, baseline, names is not None, device, data_dir)
    run = runs[-1]
    test = run.data.test
    if max_examples is not None:
        test = Subset(test, range(min(max_examples, len(test))))
    counts = [_samples(r, samples) for r in runs]

    ood_set, ood_description = (None, None) if ood is None else _ood_set(ood, run, test, data_dir, max_examples)
    clean = [_evaluate_clean(r, test, m, batch_size, device, ood_set) for r, m in zip(runs, counts)]
    corrupted: list[dict[str, Any] | None] = [None] * len(runs)
    if names is not None:
        corrupted = compare_corruptions(
            [(r.model, m) for r, m in zip(runs, counts)], test, corruptions=names, severities=severities,
            device=device, transform=run.data.normalize, batch_size=batch_size, min_size=min_size, progress=progress,
        )  # fmt: skip

    settings = {
        "samples": counts[-1],
        "batch_size": batch_size,
        "test_examples": len(test),
        "corruptions": list(names) if names is not None else None,
        "severities": list(severities) if names is not None else None,
        "min_size": min_size,
        "device": str(device),
        "checkpoint_step": run.step,
        "ood": ood,
        "ood_set": ood_description,
    }
    files = _write_plots(runs, clean, corrupted)
    results = _results(runs, clean, corrupted, settings, has_baseline=baseline is not None)
    _write_report(runs, results, files, settings)
    return results


def _open_runs(
    out_dir: str | os.PathLike,
    baseline: str | os.PathLike | None,
    corrupt: bool,
    device: torch.device,
    data_dir: str | os.PathLike | None,
) -> list[LoadedRun]:
    """The run of ``out_dir``, after its baseline when there is one (the order every helper below expects)."""

    run = open_run(out_dir, device=device, data_dir=data_dir)
    if corrupt and run.data.kind is not DataKind.IMAGE:
        raise ValueError(
            f"--corruptions applies to image data; {run.config.data} is {run.data.kind} data "
            "(evaluate without --corruptions)."
        )
    runs = [run]
    if baseline is not None:
        runs.insert(0, _load_baseline(baseline, run, device))
    return runs


def _results(
    runs: list[LoadedRun],
    clean: list[dict[str, Any]],
    corrupted: list[dict[str, Any] | None],
    settings: dict[str, Any],
    *,
    has_baseline: bool,
) -> dict[str, Any]:
    """What ``evaluation.json`` holds, ``files`` still empty (see :func:`evaluate_run`)."""

    run = runs[-1]
    results: dict[str, Any] = {
        "step": run.step,
        "config": run.config.to_dict(),
        "settings": settings,
        "clean": clean[-1]["metrics"],
        "corrupted": corrupted[-1],
        "baseline": None,
        "files": {},
    }
    if has_baseline:
        base = runs[0]
        results["baseline"] = {
            "run": str(base.directory),
            "label": base.label,
            "step": base.step,
            "config": base.config.to_dict(),
            "clean": clean[0]["metrics"],
            "corrupted": corrupted[0],
        }
    return results


def _write_report(
    runs: list[LoadedRun], results: dict[str, Any], files: dict[str, str], settings: dict[str, Any]
) -> None:
    """Write ``report.md`` and ``evaluation.json`` into the run directory; fill in ``results["files"]``."""

    run = runs[-1]
    report = markdown_report(
        results["clean"],
        results["corrupted"],
        title=f"{run.config.model} on {run.config.data}, {run.kind} (step {run.step})",
        images={_CAPTIONS[name]: Path(path).name for name, path in files.items()},
        config=_shown_config(run),
        settings=settings,
        label=run.label,
        baseline=None if results["baseline"] is None else {**results["baseline"], "config": _shown_config(runs[0])},
    )

    report_path = run.directory / REPORT
    report_path.write_text(report)
    results["files"] = {"report": str(report_path), "evaluation": str(run.directory / EVALUATION), **files}
    write_json(results, run.directory / EVALUATION)


def _shown_config(run: LoadedRun) -> dict[str, Any]:
    """The run's configuration for the report, an unset scale shown as the value it resolved to and why."""

    config = run.config.to_dict()
    layers = [layer for _, layer in rank1_layers(run.model)]
    if run.config.deterministic:  # nothing was converted: the rank-1 options did not apply
        rank1 = (*scoped(Rank1Config, "model"), *scoped(Rank1Config, "layer"), "embeddings", "embedding_prior_std")
        return {key: "- (not converted)" if key in rank1 else value for key, value in config.items()}
    if not layers:
        return config
    resolved = layers[0].rank1_options  # every layer of a model shares one prior (convert resolves it once)
    if run.config.prior_std is None:
        depth = sum(isinstance(layer, Rank1Layer) for layer in layers)
        config["prior_std"] = f"{resolved.prior_std:.3g} (unset: min(0.3, 0.4 / sqrt(L)) for L = {depth} rank-1 layers)"
    if run.config.init_std is None:
        if run.config.init_dropout is not None:
            why = f"sqrt(p / (1 - p)) of init_dropout p = {run.config.init_dropout:g}"
        elif str(run.config.posterior) == "cauchy":
            why = "sqrt(p / (1 - p)) of p = 1e-6 for a Cauchy posterior"
        else:
            why = "the prior's scale, so the posterior starts at the prior"
        config["init_std"] = f"{resolved.initial_std:.3g} (unset: {why})"
    return config


def _ood_set(
    spec: str, run: LoadedRun, test: Dataset, data_dir: str | os.PathLike | None, max_examples: int | None = None
) -> tuple[Dataset, str]:
    """The out-of-distribution set ``spec`` names (see :func:`evaluate_run`), shaped as the test inputs (a data
    set's first ``max_examples`` only, as the test set: an OOD set ten times the test set's size inflates the AUPR
    with OOD as positive), and what it is, in words (for the report)."""

    inputs = torch.stack([test[i][0] for i in range(len(test))])
    labels = torch.zeros(len(inputs), dtype=torch.long)  # OOD targets are never read
    name, _, severity = spec.partition(":")
    shape = " x ".join(map(str, inputs.shape[1:]))
    if name == "noise":
        generator = torch.Generator().manual_seed(0)
        noise = torch.rand(inputs.shape, generator=generator)
        if inputs.dim() >= 4:  # images in [0, 1], normalised by the data's transform as the test images are
            return InMemoryDataset(noise, labels), (
                f"{len(inputs)} inputs of uniform noise in [0, 1] (seed 0), each {shape} as the test inputs and "
                "normalised as they are: nothing like the training data"
            )
        # features (standardised: [0, 1] lies in their bulk): each uniform over the span of the test inputs' own,
        # every feature drawn apart, so the points fill the box around the data rather than the data
        low, high = inputs.amin(0), inputs.amax(0)
        return InMemoryDataset(low + noise * (high - low), labels), (
            f"{len(inputs)} inputs of uniform noise (seed 0), each feature drawn alone over the span of the test "
            "inputs' own (min to max): the box around the data, not its correlations"
        )
    if name in CORRUPTIONS:
        level = int(severity or 5)
        return InMemoryDataset(corrupt_images(inputs, name, level, seed=0), labels), (
            f"the {len(inputs)} test inputs under the corruption {name} at severity {level} of 5"
        )
    known = name.strip().lower().replace("_", "-") in data_names() or name.startswith("folder:")
    try:
        # the OOD set's files sit where the run's data set is, unless --data-dir says otherwise
        other = load_data(name, data_dir or run.config.data_dir, seed=0)
    except ValueError:
        if known:  # a data set by name whose files are missing: the loader's own message says what to do
            raise
        raise ValueError(
            f"ood={spec!r} is not a data set ({', '.join(data_names())}), a corruption ({', '.join(CORRUPTIONS)}) "
            "with an optional :severity, or 'noise'."
        ) from None
    if tuple(other.input_shape) != tuple(run.data.input_shape):
        raise ValueError(
            f"ood={spec!r} has inputs of shape {tuple(other.input_shape)} but {run.config.data} has "
            f"{tuple(run.data.input_shape)}; pick a data set of the same shape, a corruption or 'noise'."
        )
    ood_test = other.test
    if max_examples is not None and len(ood_test) > max_examples:
        ood_test = Subset(ood_test, range(max_examples))
        return ood_test, f"the first {max_examples} inputs of the test split of {name} (each {shape})"
    return ood_test, f"the test split of {name} ({len(ood_test)} inputs, each {shape})"


def _check_settings(*, samples: int | None, batch_size: int, max_examples: int | None, min_size: int) -> None:
    for name, value, least in (
        ("samples", samples, 1),
        ("batch_size", batch_size, 1),
        ("max_examples", max_examples, 1),
        ("min_size", min_size, 1),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"{name}={value!r} must be a positive integer.")


def _load_baseline(directory: str | os.PathLike, run: LoadedRun, device: str | torch.device) -> LoadedRun:

    saved, _ = load_run(directory)
    if saved.data != run.config.data:
        raise ValueError(
            f"baseline {directory} was trained on {saved.data!r} but {run.directory} on {run.config.data!r}; "
            "a baseline must be evaluated on the same test set: pass a run on the same data."
        )
    return open_run(directory, device=device, data=run.data)


def _samples(run: LoadedRun, samples: int | None) -> int:
    # M per component for a converted model; a deterministic one is a single member
    if run.config.deterministic:
        return 1
    return samples if samples is not None else run.config.eval_samples


def _evaluate_clean(
    run: LoadedRun, test: Dataset, samples: int, batch_size: int, device: torch.device, ood: Dataset | None = None
) -> dict[str, Any]:
    # one pass over the test set: K x M member predictions, then every metric of the task from them
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)  # the same noise draws on every evaluation of the same weights
        outputs, targets = collect_members(
            run.model, DataLoader(test, batch_size=batch_size), samples=samples, device=device,
            transform=run.data.normalize,
        )  # fmt: skip
        detection = None
        if ood is not None:  # scored from the sampled predictive (see ood_detection)
            detection = ood_detection(
                run.model, run.task, DataLoader(test, batch_size=batch_size), DataLoader(ood, batch_size=batch_size),
                samples=samples, device=device, transform=run.data.normalize, outputs=outputs,
            )  # fmt: skip
    components = 1 if run.config.deterministic else run.config.components
    metrics = task_metrics(run.task, outputs, targets, components=components)
    metrics.update(components=components, samples=samples)
    if detection is not None:
        metrics["ood"], metrics["ood_scoring"] = detection
    probs = None
    if isinstance(run.task, Classification) and outputs.dim() == 3:  # a reliability diagram of classes
        probs = mixture_log_probs(outputs.log_softmax(-1)).exp()
    elif isinstance(run.task, Binary) and outputs.dim() == 3 and outputs.shape[-1] == 1:
        probs = mixture_log_probs(member_log_probs_from_logits(outputs)).exp()
    return {"metrics": metrics, "probs": probs, "labels": targets}


def _write_plots(
    runs: list[LoadedRun], clean: list[dict[str, Any]], corrupted: list[dict[str, Any] | None]
) -> dict[str, str]:
    # the run under evaluation is last; a baseline, when there is one, first
    run = runs[-1]
    title = f"{run.config.model} on {run.config.data}"
    files = {}
    if clean[-1]["probs"] is not None:  # classes (a regression has its coverage in the report instead)
        files["reliability"] = str(run.directory / RELIABILITY_PLOT)
        has_baseline = len(runs) > 1 and clean[0]["probs"] is not None
        reliability_diagram(
            clean[-1]["probs"], clean[-1]["labels"].long(), files["reliability"], title=title, label=run.label,
            baseline=(clean[0]["probs"], clean[0]["labels"].long()) if has_baseline else None,
            baseline_label=runs[0].label,
        )  # fmt: skip
    if corrupted[-1] is not None:
        files["corruptions"] = str(run.directory / CORRUPTION_PLOT)
        severity_plot(
            corrupted[-1]["by_severity"], files["corruptions"],
            title=f"{title}: corrupted test sets, mean over {len(corrupted[-1]['results'])} corruption types",
            clean=clean[-1]["metrics"], label=run.label,
            baseline=corrupted[0]["by_severity"] if len(runs) > 1 else None,
            baseline_clean=clean[0]["metrics"], baseline_label=runs[0].label,
        )  # fmt: skip
    return files
