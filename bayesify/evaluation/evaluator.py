"""Run a (converted or plain) model over a test set and compute the paper's metrics.

A converted model is evaluated as the uniform mixture of its K components x M samples each
(:func:`bayesify.predict` with ``samples=M``, posterior noise on, as the reference); a plain
model is the one-member case, so the same code compares deterministic and rank-1 networks.

Example:
    >>> results = evaluate(model, test_loader, samples=4, transform=bundle.normalize)
    >>> results["nll"], results["accuracy"], results["ece"]
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from bayesify._router import is_example_list
from bayesify.evaluation.corruptions import (
    SEVERITIES,
    corrupt_images,
    corruption_seed,
    parse_corruptions,
    parse_severities,
)
from bayesify.evaluation.metrics import as_class_labels, compute_metrics, member_log_probs_from_logits, task_metrics
from bayesify.evaluation.ood import ood_metrics_per_score, ood_scores, score_notes
from bayesify.inspection import check_handed_on, is_converted, model_task, num_components
from bayesify.mode import predict
from bayesify.model_state import model_state
from bayesify.predictive.libraries import padding_targets, predicts_next_token, with_decoder_inputs
from bayesify.predictive.outputs import check_leaf, described, leaf_task, rows_axis, selected_output
from bayesify.predictive.tasks import Auto, Binary, Classification, Task, refuse_sigmoid_outputs

__all__ = [
    "collect_members",
    "compare_corruptions",
    "evaluate",
    "evaluate_corruptions",
    "model_task",
    "ood_detection",
    "predict_members",
]

Transform = Callable[[Tensor], Tensor]
Batch = tuple[Tensor, Tensor] | Mapping[str, object]
"""A batch: an ``(inputs, target)`` pair, or a mapping (a Hugging Face data set's ``{"input_ids", "attention_mask",
"labels"}``) whose ``label_key`` entry is the target and whose other entries are the model's keyword inputs."""


@torch.no_grad()
def collect_members(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    samples: int = 1,
    device: torch.device | str = "cpu",
    transform: Transform | None = None,
    corrupt: Callable[[Tensor, int], Tensor] | None = None,
    noise: bool | None = None,
    output: object = None,
    label_key: str = "labels",
) -> tuple[Tensor, Tensor]:
    """The raw member outputs ``[K * M, N, ...]`` (component-major) and the targets ``[N, ...]``, on the CPU (an
    output that holds its examples at another axis, a time-major ``[T, B, C]`` with ``batch_dim=1``, keeps its
    layout: ``[K * M, T, N, C]`` and ``[T, N]``).

    Args:
        model: a converted model (K components) or a plain one (one member).
        batches: ``(inputs, targets)`` batches, e.g. a ``DataLoader``, or mappings (a Hugging Face data set's
            ``{"input_ids", "attention_mask", "labels"}``): the ``label_key`` entry is the target, the other
            entries go to the model as keyword arguments (``model(**inputs)``), their tensors moved to ``device``.
            A 0-d target marks one example (a ``DataLoader`` with ``batch_size=None``), given to the model as a
            batch of one.
        samples: M, posterior samples per component (ignored for a plain model).
        device: where the model runs.
        transform: applied to inputs on the device before the model (e.g. normalisation); a mapping batch's
            inputs are the mapping of keyword inputs (``transform`` returns the mapping given to the model).
        corrupt: ``corrupt(inputs, batch_index)`` applied to the raw inputs before ``transform``.
        noise: sample the factors (True) or use the posterior means (False); None: as
            :func:`bayesify.predict` decides (sampled for ``samples > 1``, else the model's default).
        output: the part of a structured output to collect (see :func:`evaluate`); default: the one
            :func:`bayesify.uncertainty` decomposes.
        label_key: the target's entry in a mapping batch.
    """
    with evaluation_mode(model):
        return _collect_members(
            model, batches, samples, device, transform, corrupt, noise, output, label_key=label_key
        )[:2]


@contextlib.contextmanager
def evaluation_mode(*models: nn.Module) -> Iterator[None]:
    """``models`` in ``eval()`` inside, each module's own train / eval flag as it was after (a mid-epoch
    evaluation leaves a training loop training, and a norm layer the user froze with ``.eval()`` frozen)."""
    flags = [(module, module.training) for model in models for module in model.modules()]
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


def _collect_members(
    model: nn.Module, batches: Iterable[Batch], samples: int, device: torch.device | str,
    transform: Transform | None, corrupt: Callable[[Tensor, int], Tensor] | None, noise: bool | None,
    output: object = None, *, labels: bool | None = True, task: Task | None = None, label_key: str = "labels",
    padding_label: int | None = None, name: str = "the test set",
) -> tuple[Tensor, Tensor, object]:  # fmt: skip
    """:func:`collect_members`, and the key of the output collected (None: the model returns one tensor);
    ``labels``: the targets are scored (a language model's logits and labels are then aligned; False: an OOD set,
    whose mappings need no target and whose targets come back empty; None: the targets where the batches hold
    them, aligned as with True, else empty); ``task``: the model's, checked to name one for the output collected
    at the first batch (not after the whole set); ``padding_label``: a mapping batch that holds no target but an
    ``attention_mask`` (tokens with no labels: an OOD set) gets targets of this label at its padding positions, 0
    elsewhere, so that the scoring leaves the padding out as it does the labelled set's; ``name``: the set's, for
    an error."""
    converted = is_converted(model)
    next_token = labels is not False and predicts_next_token(model)
    batch_dim = model_state(model).options.batch_dim if converted else 0
    outputs, targets, key = [], [], None
    axes: set[tuple[int, int | None]] = set()  # where each batch's output and target hold the examples
    for index, batch in enumerate(batches):
        x, y = _read_batch(batch, label_key, labels=bool(labels))
        # one example and its label, not a batch (a DataLoader with batch_size=None): a batch of one
        if y is not None and y.dim() == 0:
            x, y = _inputs_map(x, lambda t: t.unsqueeze(batch_dim)), y.unsqueeze(0)
        if corrupt is not None:
            x = corrupt(x, index)
        x = _inputs_map(x, lambda t: t.to(device))
        if transform is not None:
            x = transform(x)
        if y is not None:
            x = with_decoder_inputs(model, x, y.to(device))
        elif padding_label is not None and labels is None:
            y = padding_targets(x, padding_label)  # (after the decoder inputs: a target made here makes none)
        value = _forward(model, x, converted, samples, noise, task, batch_dim)
        members, key = selected_output(value, output, type(model).__name__, "evaluate()")
        if not converted:
            members = members.unsqueeze(0)
        if task is not None and not outputs:
            scored = leaf_task(task, key, model)
            if isinstance(scored, Binary):  # (a final sigmoid: its probabilities would be taken as logits)
                refuse_sigmoid_outputs(members, model_state(model).root or model if converted else model)
            # the pass's batch: a member's output may hold it at another axis than the input (a time-major RNN's last step)
            if converted:
                check_leaf(scored, key, model, members.shape[1:], batch_dim, model_state(model).router.state.batch)
            else:
                check_leaf(scored, key, model, members.shape[1:], batch_dim if batch_dim < members.dim() - 1 else None)
        if next_token and key == "logits" and y is not None:  # as the model's own loss: logits at t, label at t + 1
            members, y = _next_token(model, members, y)
        # batches join along their examples: a time-major output [T, B, C] (batch_dim=1) at B, not at T (which
        # joined batches of one size, and a smaller last batch failed); where T == B, at the input's batch_dim
        examples = model_state(model).router.state.batch if converted else None
        out_axis = 0 if examples is None else _examples_axis(members.shape[1:], batch_dim, examples, task, key, model)
        target_axis = None if y is None or examples is None else rows_axis(y, batch_dim, examples)
        axes.add((out_axis or 0, target_axis))
        outputs.append(members.float().cpu())
        if labels is not False and y is not None:
            targets.append(y.cpu())
    if not outputs:
        raise ValueError(f"{name} is empty: nothing to evaluate.")
    if labels is None and 0 < len(targets) < len(outputs):
        raise ValueError(
            f"{len(targets)} of the {len(outputs)} batches hold targets (under label_key={label_key!r}, or as pairs) "
            "and the others do not: give every batch its targets, or none."
        )
    if len(axes) > 1:
        raise ValueError(
            f"the batches of {name} hold their examples at different axes of the output and target ({sorted(axes)}): "
            f"give every batch one layout (the batch at batch_dim={batch_dim})."
        )
    out_axis, target_axis = axes.pop()
    joined = torch.cat(targets, target_axis or 0) if targets else torch.empty(0)
    return torch.cat(outputs, 1 + out_axis), joined, key


def _examples_axis(shape: torch.Size, batch_dim: int, examples: int, task: Task | None, key: object, model: nn.Module) -> int:
    """The axis of a member's output ``shape`` that holds the pass's ``examples``: the input's ``batch_dim`` where it
    has that size, else the one other axis of that size; a classifier's class axis never (a time-major RNN's last
    step ``[B, C]`` with B == C, batch_dim=1, was joined at its classes)."""
    classes = None
    if task is not None and not isinstance(task, Auto):
        scored = leaf_task(task, key, model)
        classes = scored.axis(shape) if isinstance(scored, Classification) and len(shape) else None
    found = [i for i, size in enumerate(shape) if size == examples and i != classes]
    return batch_dim if batch_dim in found else (found[0] if found else 0)


def _read_batch(batch: object, label_key: str | None, *, labels: bool = True) -> tuple[object, Tensor | None]:
    """A batch's model inputs and its target: an ``(inputs, target)`` pair's two, or a mapping's entries other than
    ``label_key`` (a dict of keyword inputs) and that entry. ``labels`` False (an OOD set): a mapping may have no
    target, and a batch may be the inputs alone (a tensor, or a one-tuple: ``TensorDataset(inputs)``'s) (None).
    ``label_key`` None: only pairs are taken (the corruption benchmark corrupts images)."""
    if isinstance(batch, Mapping) and label_key is not None:
        if label_key in batch:
            return {k: v for k, v in batch.items() if k != label_key}, torch.as_tensor(batch[label_key])
        if not labels:
            return dict(batch), None
        hint = " (label_key='label')" if "label" in batch and label_key != "label" else ""
        raise ValueError(
            f"a mapping batch holds its target under label_key={label_key!r}, but the batch is {described(batch)}; "
            f"name the target's entry with label_key={hint}, or pass (inputs, target) pairs."
        )
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
        return x, torch.as_tensor(y)
    if not labels and isinstance(batch, Tensor):  # an OOD set of inputs alone (noise, another domain)
        return batch, None
    if not labels and isinstance(batch, (tuple, list)) and len(batch) == 1:  # TensorDataset(inputs)'s batches
        return batch[0], None
    given = f"a tensor of shape {tuple(batch.shape)}" if isinstance(batch, Tensor) else described(batch)
    accepted = "an (inputs, target) pair" if label_key is None else (
        f"an (inputs, target) pair or a mapping of the model's keyword inputs with the target under {label_key!r}"
    )  # fmt: skip
    if not labels:
        accepted = f"inputs, (inputs,), {accepted}"
    raise ValueError(f"{'an OOD' if not labels else 'a'} batch must be {accepted}; got {given}.")


def _inputs_map(x: object, f: Callable[[Tensor], Tensor]) -> object:
    """``f`` applied to the inputs ``x``: a tensor, a mapping batch's tensors (its other entries as they are), or a
    tuple / list of them (a model's positional inputs, a detector's images)."""
    if isinstance(x, Mapping):
        return {k: f(v) if isinstance(v, Tensor) else v for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(f(v) if isinstance(v, Tensor) else v for v in x)
    return f(x)


def _positional_inputs(model: nn.Module, x: object, task: Task | None, batch_dim: int = 0) -> bool:
    """Whether the inputs ``x`` are a tuple / list of the model's positional inputs (``((x1, x2), y)`` or
    ``((x, mask), y)`` batches; a DataLoader hands the inner tuple on as a list): tensors of one batch, as many as its
    forward takes positionally (a detector's list of images, one size each or a model that returns its members as
    they are, is its one input)."""
    if not isinstance(x, (tuple, list)) or len(x) < 2 or not all(isinstance(v, Tensor) for v in x):
        return False
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    P = inspect.Parameter
    positional = [p for p in parameters if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is P.empty]
    more = any(p.kind is P.VAR_POSITIONAL for p in parameters)
    # an optional input a tensor would fill must default to None (forward(x, mask=None)), not to a number or a flag
    # (forward(views, scale=1.0) takes the tuple as its one input)
    filled = positional[len(required) : len(x)]
    if not (len(required) <= len(x) and (more or len(x) <= len(positional)) and all(p.default is None for p in filled)):
        return False
    # a forward that needs one input (a detector's forward(images, targets=None)) takes a list of examples as it
    return len(required) >= 2 or not is_example_list(x, task, batch_dim)


def _forward(
    model: nn.Module, x: object, converted: bool, samples: int, noise: bool | None, task: Task | None = None,
    batch_dim: int = 0,
) -> object:
    """The model on the inputs ``x`` (a mapping: its keyword inputs; a tuple of its positional inputs): a converted
    model's members (:func:`bayesify.predict`), a plain model's output."""
    if isinstance(x, Mapping):
        args, kwargs = (), dict(x)
    else:
        args, kwargs = (tuple(x) if _positional_inputs(model, x, task, batch_dim) else (x,)), {}
    return predict(model, *args, samples=samples, noise=noise, **kwargs) if converted else model(*args, **kwargs)


def _next_token(model: nn.Module, members: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """A language model's logits ``[S, B, T, V]`` at positions ``0 .. T-2`` and its labels ``[B, T]`` at ``1 .. T-1``:
    the logits at t predict the token at t + 1 (the model's own loss shifts its labels so)."""
    if members.dim() != 4 or labels.shape != members.shape[1:3]:
        raise ValueError(
            f"{type(model).__name__} predicts the next token: evaluate() scores its logits at each position against "
            f"the label one position on, so it needs a label per token of shape {tuple(members.shape[1:3])} (the "
            f"input ids, as the model's own labels= takes them), got {tuple(labels.shape)}."
        )
    return members[:, :, :-1], labels[:, 1:]


def predict_members(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    samples: int = 1,
    device: torch.device | str = "cpu",
    transform: Transform | None = None,
    corrupt: Callable[[Tensor, int], Tensor] | None = None,
    label_key: str = "labels",
) -> tuple[Tensor, Tensor]:
    """A classifier's member log-probabilities ``[K * M, N, C]`` (component-major) and labels ``[N]``.

    A one-logit binary classifier becomes two classes (see
    :func:`~bayesify.evaluation.metrics.member_log_probs_from_logits`). Other outputs, and the batches taken:
    :func:`collect_members`.
    """
    members, labels = collect_members(
        model, batches, samples=samples, device=device, transform=transform, corrupt=corrupt, label_key=label_key
    )
    log_probs = member_log_probs_from_logits(members)
    return log_probs, as_class_labels(labels, log_probs.shape[-1])


def _prepare(x: Tensor, device: torch.device | str, transform: Transform | None) -> Tensor:
    x = x.to(device)
    return transform(x) if transform is not None else x


@torch.no_grad()
def _member_log_probs(model: nn.Module, x: Tensor, samples: int) -> Tensor:
    # [K * M, B, C] on the CPU: every member of a converted model, the one member of a plain one
    members = predict(model, x, samples=samples) if is_converted(model) else model(x).unsqueeze(0)
    if not isinstance(members, Tensor) or members.dim() != 3:
        shape = tuple(members.shape[1:]) if isinstance(members, Tensor) else type(members).__name__
        raise ValueError(
            f"the corruption benchmark scores image classifiers, whose output is [B, C] class logits; "
            f"{type(model).__name__} returned {shape}. For another output, corrupt the images with "
            "bayesify.evaluation.corrupt_images and score them with evaluate()."
        )
    return member_log_probs_from_logits(members).cpu()


def _check_classifier(model: nn.Module) -> None:
    """Before any work: a converted model's task is class logits on the last axis (what the benchmark scores)."""
    if not is_converted(model):
        return
    task = model_task(model)
    if not isinstance(task, Classification):  # (its output's shape is checked at the first batch)
        raise ValueError(
            f"the corruption benchmark scores image classifiers ([B, C] class logits); {type(model).__name__}'s "
            f"output is {task}. For another task, corrupt the images with bayesify.evaluation.corrupt_images and "
            "score them with evaluate()."
        )


@dataclass
class _RandomStream:
    """The torch random numbers (CPU and CUDA generators) one model draws as if it ran alone.

    Several models evaluated batch by batch on the same corrupted images each continue their
    own stream, so each sees the posterior noise it would see evaluated on its own.
    """

    state: tuple[Tensor, list[Tensor]]
    devices: list[torch.device]

    @classmethod
    def seeded(cls, seed: int, device: torch.device) -> _RandomStream:
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return cls(_capture(devices), devices)

    def copy(self) -> _RandomStream:
        """A stream that continues from this one's state on its own."""
        return _RandomStream(self.state, self.devices)

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """Draw from this stream inside the block; the caller's generators are left as they were."""
        with torch.random.fork_rng(devices=self.devices):
            cpu, cuda = self.state
            torch.set_rng_state(cpu)
            for device, state in zip(self.devices, cuda):
                torch.cuda.set_rng_state(state, device)
            yield
            self.state = _capture(self.devices)


def _capture(devices: list[torch.device]) -> tuple[Tensor, list[Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _loader(data: Dataset | DataLoader, batch_size: int) -> DataLoader:
    if isinstance(data, DataLoader):
        return data
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def evaluate(
    model: nn.Module,
    data: Dataset | DataLoader,
    *,
    samples: int = 1,
    device: torch.device | str = "cpu",
    transform: Transform | None = None,
    batch_size: int = 256,
    bins: int = 15,
    members: bool = True,
    task: object = None,
    ood: Dataset | DataLoader | None = None,
    output: object = None,
    ignore_index: int | None = None,
    label_key: str = "labels",
) -> dict[str, object]:
    """The paper's metrics of ``model`` on ``data``, for its task, and OOD detection against ``ood``.

    Classification (and binary / multi-label): NLL, accuracy, ECE, Brier (+ AUC-PR / AUC-ROC for
    two classes), per member and diversity; a dense output's pixels or tokens count as examples
    (segmentation: logits ``[B, C, H, W]`` against labels ``[B, H, W]``). Regression / Gaussian heads: RMSE,
    MAE, NLL, interval coverage, calibration error, sharpness (see :mod:`bayesify.evaluation.regression`).

    A model whose output is a structure is scored on one part of it: by default the one
    :func:`bayesify.uncertainty` decomposes (a Hugging Face ``logits``, a torchvision segmentation model's
    ``out``, a tuple's first element), with that part's task. A Hugging Face language model that predicts the
    next token is scored as its own loss scores it: the logits at each position against the label one
    position on (labels as its ``labels=`` takes them: the input ids).

    Args:
        data: a ``Dataset`` (batched by ``batch_size``) or a ``DataLoader`` of ``(inputs, target)`` pairs, or of
            mappings such as a Hugging Face data set's ``{"input_ids", "attention_mask", "labels"}`` (what
            ``transformers.Trainer`` takes): the ``label_key`` entry is the target and the others go to the model
            as keyword arguments (``model(**inputs)``, so an attention mask is honoured), their tensors moved to
            ``device``; a sequence-to-sequence model (T5, BART) given no ``decoder_input_ids`` gets them made from
            the labels, as its own forward makes them from ``labels=``. A 0-d target marks one example, given to the
            model as a batch of one. A model of several inputs takes ``((x1, x2), target)`` pairs: the tuple (a
            DataLoader's list) is its positional inputs. Any other batch is refused in one line naming it.
        task: what the output means (default: the converted model's, see :func:`model_task`).
        ood: an out-of-distribution set (its targets are ignored; its mappings need no ``label_key`` entry):
            adds ``ood``, the AUROC, AUPR and FPR@95 of each uncertainty score (max probability, entropy, mutual
            information; for regression the total and epistemic variances) separating it from ``data``, scored
            from the sampled predictive (:func:`ood_detection`), and ``ood_scoring``, how.
        output: the part of a structured output to score: a dict key (``"aux"``), a tuple index or an
            attribute name; needed where no part is the primary one (a one-line error names the parts).
        ignore_index: a class label that marks targets to leave out of every metric (255 in segmentation masks,
            -100 in Hugging Face labels), the OOD table too (and the OOD set's positions so marked, where its
            batches hold targets, or else an ``attention_mask``: its padding); without it such a label is refused, naming
            this option.
        label_key: the target's entry in a mapping batch (``"label"`` in a data set not yet collated by
            transformers).

    Returns:
        The metrics, plus ``components``, ``samples`` and ``task`` (with ``output``, the part scored, for a
        structured output, and ``ignored``, the number of targets left out, with ``ignore_index``). The
        model's RNG use (posterior noise) does not touch the caller's generator state: evaluation runs inside
        ``torch.random.fork_rng``, seeded, so the same weights give the same numbers at the same ``batch_size``
        (sampled members draw per batch: another batch size draws other noise).
    """
    _check_bins(bins)
    _check_ignore_index(ignore_index)
    device = torch.device(device)
    k = num_components(model)
    said, task = task, model_task(model, task, needed_by="evaluate()")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)  # the same noise draws on every evaluation of the same weights
        with evaluation_mode(model), torch.no_grad():
            outputs, targets, key = _collect_members(
                model, _loader(data, batch_size), samples, device, transform, None, None, output, task=task,
                label_key=label_key,
            )  # fmt: skip
        check_handed_on(model, said, "evaluate()")
        scored = leaf_task(task, key, model)
        detection = None
        if ood is not None:
            detection = ood_detection(
                model, scored, _loader(data, batch_size), _loader(ood, batch_size), samples=samples, device=device,
                transform=transform, outputs=outputs, output=key, label_key=label_key, ignore_index=ignore_index,
                targets=targets,
            )  # fmt: skip
    results = task_metrics(
        scored, outputs, targets, components=k, bins=bins, members=members, ignore_index=ignore_index
    )
    results.update(components=k, samples=samples if is_converted(model) else 1, task=str(scored))
    if key is not None:
        results["output"] = key
    if detection is not None:
        results["ood"], results["ood_scoring"] = detection
    return results


OOD_SAMPLES = 4
"""Posterior samples per component behind the OOD scores where the evaluation itself runs at the
posterior means (``samples=1``): the epistemic scores need the posterior's spread, as in
:func:`bayesify.uncertainty` (whose default this is)."""


@torch.no_grad()
def ood_detection(
    model: nn.Module,
    task: Task,
    data: Iterable[Batch],
    ood: Iterable[Batch],
    *,
    samples: int = 1,
    device: torch.device | str = "cpu",
    transform: Transform | None = None,
    outputs: Tensor | None = None,
    output: object = None,
    label_key: str = "labels",
    ignore_index: int | None = None,
    targets: Tensor | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, object]]:
    """How well each uncertainty score tells ``ood`` from ``data``, scored from the sampled predictive.

    A converted model's scores come from K x M members drawn from the posterior, as
    :func:`bayesify.uncertainty` draws them (M = ``samples``, or :data:`OOD_SAMPLES` when
    ``samples`` is 1): the K posterior means that evaluation uses by default barely differ, so
    their mutual information (the members' disagreement) says little. A plain model is its one
    network.

    Args:
        model: a converted or a plain model.
        task: what its output means.
        data: the in-distribution batches; ``ood``: the out-of-distribution ones (targets ignored: a mapping's
            ``label_key`` entry is left out, and a mapping without one passes every entry to the model).
        samples: M of the evaluation.
        device, transform, label_key: as for :func:`collect_members`.
        outputs: ``data``'s members as the evaluation collected them with ``samples``: reused when
            they are sampled already (``samples > 1``) or the model is plain.
        output: the part of a structured output to score (see :func:`evaluate`); ``task`` may be the
            model's mapping of outputs to tasks, or that part's task.
        ignore_index: positions whose target is this label (padding tokens, unlabelled pixels) are not scored,
            in ``data`` and in ``ood`` where its batches hold targets (a mapping's ``label_key`` entry, or pairs),
            or, holding none, an ``attention_mask`` (its padding is left out); ``data``'s targets are then needed.
        targets: ``data``'s targets as the evaluation collected them alongside ``outputs``.

    Returns:
        ``(table, scoring)``: :func:`~bayesify.evaluation.ood.ood_metrics_per_score` of the two sets,
        and how they were scored: ``components``, ``samples``, ``sampled`` (posterior noise on) and
        ``notes`` (``{score: why it is uninformative, or that it ranks below chance}``, see
        :func:`~bayesify.evaluation.ood.score_notes`).
    """
    converted = is_converted(model)
    k = num_components(model)
    m = (samples if samples > 1 else OOD_SAMPLES) if converted else 1

    _check_ignore_index(ignore_index)
    # the targets are read only to leave ignore_index's positions out (then aligned as evaluation aligns them: a
    # language model's logits at t against the label at t + 1); the OOD set's where its batches hold them
    ignoring = ignore_index is not None

    def members(batches: Iterable[Batch], labels: bool | None, name: str) -> tuple[Tensor, Tensor, object]:
        with evaluation_mode(model):
            return _collect_members(
                model, batches, m, device, transform, None, converted, output, labels=labels, label_key=label_key,
                padding_label=ignore_index, name=name,
            )  # fmt: skip

    reuse = outputs is not None and (not converted or samples > 1) and (ignore_index is None or targets is not None)
    inside, inside_targets, key = (outputs, targets, output) if reuse else members(data, ignoring, "the test set")
    outside, outside_targets, key = members(ood, None if ignoring else False, "the OOD set (ood=)")
    scored = leaf_task(task, key, model)
    u_in = _scored_positions(scored.uncertainty(inside), inside_targets, ignore_index, "the test set")
    u_out = _scored_positions(scored.uncertainty(outside), outside_targets, ignore_index, None)
    table = ood_metrics_per_score(u_in, u_out)
    scoring = {"components": k, "samples": m, "sampled": converted, "notes": score_notes(u_in, u_out, table, k * m)}
    return table, scoring


def _scored_positions(
    uncertainty: object, targets: Tensor | None, ignore_index: int | None, name: str | None
) -> dict[str, Tensor]:
    """The OOD scores of ``uncertainty`` (:func:`~bayesify.evaluation.ood.ood_scores`), at the positions whose
    target is not ``ignore_index`` (flattened) where there are an ``ignore_index`` and targets. Targets of another
    shape than the scores are refused for the set ``name``; for an OOD set (``name`` None) they are dummy labels
    (one per image of a segmentation set), which mark no position."""
    scores = ood_scores(uncertainty)
    if ignore_index is None or targets is None or targets.numel() == 0:
        return scores
    keep = targets != ignore_index
    shapes = sorted({tuple(v.shape) for v in scores.values()})
    if shapes != [tuple(keep.shape)] and name is None:
        return scores
    if shapes != [tuple(keep.shape)]:
        raise ValueError(
            f"ignore_index={ignore_index}: the targets of {name} have shape {tuple(keep.shape)}, but its scores "
            f"{shapes[0] if len(shapes) == 1 else shapes}: which positions to leave out cannot be told; give one "
            "target per scored position."
        )
    return {score: value[keep] for score, value in scores.items()}


def evaluate_corruptions(
    model: nn.Module,
    data: Dataset,
    *,
    corruptions: str | Sequence[str] | None = None,
    severities: Sequence[int] = SEVERITIES,
    samples: int = 1,
    device: torch.device | str = "cpu",
    transform: Transform | None = None,
    batch_size: int = 256,
    bins: int = 15,
    seed: int = 0,
    min_size: int = 32,
    progress: bool | None = None,
) -> dict[str, object]:
    """Metrics under every (corruption, severity), and their means: cNLL, cA, cECE.

    Args:
        data: the clean test set, images in [0, 1] (normalisation goes in ``transform``).
        corruptions: names, a comma-separated string, or None for the 15 ImageNet-C ones.
        severities: which of 1-5.
        seed: each corrupted image is a fixed function of (seed, corruption, severity, its index in ``data``),
            whatever the batch size.
        min_size: see :func:`~bayesify.evaluation.corruptions.corrupt_images`.
        progress: tqdm bar (None: only on a terminal).

    Returns:
        ``{"results": {corruption: {severity: {nll, accuracy, ece}}}, "by_severity": {severity:
        {nll, accuracy, ece}}, "mean": {"nll", "accuracy", "ece"}}``; ``mean`` is (cNLL, cA,
        cECE), the average over all corruptions and severities.
    """
    (result,) = compare_corruptions(
        [(model, samples)], data, corruptions=corruptions, severities=severities, device=device,
        transform=transform, batch_size=batch_size, bins=bins, seed=seed, min_size=min_size, progress=progress,
    )  # fmt: skip
    return result


def compare_corruptions(
    models: Sequence[tuple[nn.Module, int]],
    data: Dataset,
    *,
    corruptions: str | Sequence[str] | None = None,
    severities: Sequence[int] = SEVERITIES,
    device: torch.device | str = "cpu",
    transform: Transform | None = None,
    batch_size: int = 256,
    bins: int = 15,
    seed: int = 0,
    min_size: int = 32,
    progress: bool | None = None,
) -> list[dict[str, object]]:
    """:func:`evaluate_corruptions` for several models on the same corrupted images.

    Each test batch is corrupted once and given to every model (corrupting costs more than a
    small model's forward pass). Each model draws its posterior noise from its own stream, so
    its numbers are the ones :func:`evaluate_corruptions` gives it alone.

    Args:
        models: ``(model, samples)`` pairs; ``samples`` is M for a converted model.
        data, corruptions, severities, device, transform, batch_size, bins, seed, min_size,
            progress: as for :func:`evaluate_corruptions`.

    Returns:
        One :func:`evaluate_corruptions` result per model, in order.

    Example:
        >>> rank1, det = compare_corruptions([(model, 1), (baseline, 1)], bundle.test, corruptions="fog")
    """
    from tqdm.auto import tqdm

    _check_bins(bins)
    for model, _ in models:
        _check_classifier(model)
    names = parse_corruptions(corruptions)
    severities = parse_severities(severities)
    device = torch.device(device)
    loader = _loader(data, batch_size)
    with evaluation_mode(*(model for model, _ in models)):
        results: list[dict[str, dict[int, dict[str, float]]]] = [{name: {} for name in names} for _ in models]
        jobs = [(name, severity) for name in names for severity in severities]
        bar = tqdm(jobs, desc="corruptions", disable=None if progress is None else not progress, leave=False)
        for name, severity in bar:
            bar.set_postfix_str(f"{name} {severity}")
            # every model draws the noise it would draw alone: seed 0 for each set, then the loader's
            # iterator (a DataLoader takes its base seed from the generator), then its forward passes
            start = _RandomStream.seeded(0, device)
            with start.drawing():
                batches = iter(loader)
            streams = [start.copy() for _ in models]
            outputs: list[list[Tensor]] = [[] for _ in models]
            labels = []
            offset = 0  # each image seeded by its place in the set: the same corrupted set at any batch size
            for batch in batches:
                x, y = _image_batch(batch)
                seeds = [corruption_seed(seed, name, severity, offset + i) for i in range(len(x))]
                offset += len(x)
                x = corrupt_images(x, name, severity, seed=seeds, min_size=min_size)
                x = _prepare(x, device, transform)
                for (model, samples), stream, out in zip(models, streams, outputs):
                    with stream.drawing():
                        out.append(_member_log_probs(model, x, samples))
                labels.append(y.cpu())
            if not labels:
                raise ValueError("the test set is empty: nothing to evaluate.")
            targets = torch.cat(labels)
            for (model, _), out, result in zip(models, outputs, results):
                metrics = compute_metrics(
                    torch.cat(out, 1), targets, components=num_components(model), bins=bins, members=False
                )
                result[name][severity] = {key: float(metrics[key]) for key in _CORRUPTION_METRICS}
        return [_summarise(result, names, severities) for result in results]


_CORRUPTION_METRICS = ("nll", "accuracy", "ece")


def _image_batch(batch: object) -> tuple[Tensor, Tensor]:
    """An ``(images, labels)`` batch of the corruption benchmark; a mapping batch is refused naming the way round."""
    if not isinstance(batch, Mapping):
        return _read_batch(batch, None)
    raise ValueError(
        f"the corruption benchmark corrupts (images, labels) batches; got {described(batch)}. For a model that "
        "takes keyword inputs, corrupt the images with bayesify.evaluation.corrupt_images and score them with "
        "evaluate(), which takes mapping batches."
    )


def _check_ignore_index(ignore_index: object) -> None:
    """Before any work: the label that marks targets to leave out is a class label (an int)."""
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise ValueError(
            f"ignore_index={ignore_index!r} must be the integer label that marks targets to leave out (e.g. 255 in "
            "segmentation masks, -100 in Hugging Face labels), or None."
        )


def _check_bins(bins: object) -> None:
    """Before any work: the ECE's number of bins (an error after a whole evaluation would lose it)."""
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins={bins!r} must be the number of equal-width confidence bins of the ECE (an int >= 1).")


def _summarise(
    results: dict[str, dict[int, dict[str, float]]], names: Sequence[str], severities: Sequence[int]
) -> dict[str, object]:
    def mean(rows: list[dict[str, float]]) -> dict[str, float]:
        return {key: sum(r[key] for r in rows) / len(rows) for key in _CORRUPTION_METRICS}

    by_severity = {s: mean([results[n][s] for n in names]) for s in severities}
    overall = mean([results[n][s] for n in names for s in severities])
    return {"results": results, "by_severity": by_severity, "mean": overall}
