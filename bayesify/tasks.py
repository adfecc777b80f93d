"""What a model's output means: how its members reduce to the predictive distribution.

Evaluation of a converted model runs every example through its K components (x M samples) and
reduces the members of each output to one prediction. *How* depends on what the output is, and
only the model or the user knows that: class logits want the log of the mean softmax, independent
sigmoids the logit of the mean probability, a regression the mean, a Gaussian head the
moments of the mixture. A :class:`Task` says it:

* ``"classification"`` (:class:`Classification`): softmax over a class axis (``class_axis``; default
  -1 for ``[B, C]`` outputs and 1 for ``[B, C, H, W, ...]`` ones; a 3-d ``[B, ?, ?]`` output must say);
* ``"binary"`` / ``"multilabel"`` (:class:`Binary`): independent sigmoids, elementwise;
* ``"regression"`` (:class:`Regression`): the members' mean;
* ``"gaussian"`` (:class:`Gaussian`): a ``(mean, variance parameter)`` head, reduced to the mixture's
  mean and total variance in the head's own format;
* ``"members"`` (:class:`Members`): no reduction: evaluation returns ``[S, B, ...]``;
* any ``Task`` subclass or a plain function ``reduce(members) -> output`` (:class:`CustomTask`).

``"auto"`` (the default) asks the model: a timm / torchvision classifier, a torchvision
segmentation or detection model and a Hugging Face model say what their outputs are
(:func:`infer_task`). For any other model bayesify does not guess: evaluation raises an error that
names the option, because a wrong guess (softmax over a multi-label head or a ``(mean, log-variance)``
pair, over the width of a segmentation map) would be a silently wrong number.

Several outputs (a dict, a ``ModelOutput``, a tuple): a :class:`TaskMap` names the task of each
top-level key / index; with one task, it applies to the *primary* output (the tensor itself, a
tuple's first element, a Hugging Face ``logits``) and the other floating-point outputs of the
members (features, attention weights, hidden states) are averaged.

References:
    Dusenberry et al., ICML 2020, Eq. 2 (the mixture predictive); Lakshminarayanan et al.,
    NeurIPS 2017 (a mixture of Gaussian members, its mean and variance).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayesify.mixture import logmeanexp
from bayesify.options import StrOption
from bayesify.uncertainty import VarianceParameter, gaussian_head

__all__ = [
    "Binary",
    "Classification",
    "CustomTask",
    "Gaussian",
    "Members",
    "Regression",
    "Task",
    "TaskMap",
    "TaskName",
    "infer_task",
    "parse_task",
]


class TaskName(StrOption):
    """The tasks by name (``convert(model, task=...)``, ``bayesify train --task ...``)."""

    AUTO = "auto"
    """Ask the model (timm / torchvision / Hugging Face); any other model must say."""
    CLASSIFICATION = "classification"
    """Softmax class logits; the mixture is log(mean softmax)."""
    BINARY = "binary"
    """One sigmoid logit (per example, or per pixel); the mixture is logit(mean sigmoid)."""
    MULTILABEL = "multilabel"
    """Independent sigmoid logits, one per label; reduced as ``binary``, elementwise."""
    REGRESSION = "regression"
    """Point predictions; the mixture's mean."""
    GAUSSIAN = "gaussian"
    """A (mean, variance parameter) head; the mixture's mean and total variance in the same format."""
    MEMBERS = "members"
    """No reduction: evaluation returns the members, ``[S, B, ...]``."""


class Task:
    """What an output means. Subclasses implement :meth:`reduce` (and :meth:`log_likelihood` to be
    trained by bayesify's objective); see the module doc."""

    name: ClassVar[str] = "custom"

    def reduce(self, members: Tensor) -> Tensor:
        """The predictive output of ``members`` (``[S, ...]``, S members stacked), in the output's own format."""
        raise NotImplementedError

    def log_likelihood(self, output: Tensor, target: Tensor) -> Tensor:
        """``log p(target | output)`` per row (``[N]``; dense outputs averaged over their other axes), in float32
        (the training loss; a reduced-precision output is widened)."""
        raise NotImplementedError(
            f"task {self} has no likelihood to train with; use 'classification', 'binary', 'multilabel', "
            "'regression' or 'gaussian', or train with your own loss."
        )

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Classification(Task):
    """Class logits. The mixture: ``log mean_s softmax(z_s)`` over the class axis (usable as logits).

    Args:
        class_axis: the class axis of one member's output; None: -1 for ``[B, C]`` outputs and 1 for
            4-d and larger ``[B, C, H, W, ...]`` ones (PyTorch's channels-first layout). A 3-d output is
            ambiguous (``[B, C, L]`` from a Conv1d or ``[B, T, C]`` per-token logits) and must say.
    """

    class_axis: int | None = None
    name: ClassVar[str] = "classification"

    def axis(self, output: Tensor) -> int:
        """The class axis of one member's output ``output`` (non-negative)."""
        nd = output.dim()
        if self.class_axis is not None:
            if not -nd <= self.class_axis < nd:
                raise ValueError(f"class_axis={self.class_axis} is out of range for an output of shape {tuple(output.shape)}.")
            return self.class_axis % nd
        if nd <= 2:
            return nd - 1
        if nd >= 4:
            return 1
        raise ValueError(
            f"an output of shape {tuple(output.shape)} could hold classes at axis 1 ([B, C, L]: a Conv1d or "
            "segmentation net) or at axis -1 ([B, T, C]: per-token logits); pass class_axis=1 or class_axis=-1 to "
            "bayesify.convert (or bayesify.mode)."
        )

    def reduce(self, members: Tensor) -> Tensor:
        axis = self.axis(members[0]) + 1
        if members.shape[axis] == 1:
            raise ValueError(
                "task='classification' (log of the mean softmax) needs one output per class, but the model's output "
                "has a single class column; use task='binary' for a one-logit binary classifier or task='regression'."
            )
        return logmeanexp(torch.log_softmax(_wide(members), axis), 0).to(members.dtype)

    def log_likelihood(self, output: Tensor, target: Tensor) -> Tensor:
        axis = self.axis(output)
        ll = -F.cross_entropy(output.float().movedim(axis, 1), target.long(), reduction="none")
        return _per_row(ll)

    def __str__(self) -> str:
        return self.name if self.class_axis is None else f"{self.name} (class axis {self.class_axis})"


def _wide(t: Tensor) -> Tensor:
    """At least float32 for the maths (a float64 output stays float64)."""
    return t if t.dtype == torch.float64 else t.float()


def _per_row(values: Tensor) -> Tensor:
    """``[N, ...]`` -> ``[N]``: the mean over every axis but the first (a dense output's pixels, tokens)."""
    return values.reshape(values.shape[0], -1).mean(-1) if values.dim() > 1 else values


@dataclass(frozen=True)
class Binary(Task):
    """Independent sigmoid logits (one per example, per pixel or per label). The mixture, elementwise:
    ``logit(mean_s sigmoid(z_s))`` = ``log mean p - log mean (1 - p)``, computed in log space."""

    name: ClassVar[str] = "binary"

    def reduce(self, members: Tensor) -> Tensor:
        m = _wide(members)
        return (logmeanexp(F.logsigmoid(m), 0) - logmeanexp(F.logsigmoid(-m), 0)).to(members.dtype)

    def log_likelihood(self, output: Tensor, target: Tensor) -> Tensor:
        z = output.float()
        if z.dim() == target.dim() + 1 and z.shape[-1] == 1:  # [N, 1] logits for [N] labels
            z = z.squeeze(-1)
        return _per_row(-F.binary_cross_entropy_with_logits(z, target.to(z.dtype), reduction="none"))


@dataclass(frozen=True)
class MultiLabel(Binary):
    """``[B, L]`` logits of L independent labels (multi-label tagging): reduced as :class:`Binary`."""

    name: ClassVar[str] = "multilabel"


@dataclass(frozen=True)
class Regression(Task):
    """Point predictions: the mixture's mean (its spread is the epistemic uncertainty, see
    :func:`bayesify.uncertainty`)."""

    name: ClassVar[str] = "regression"

    def reduce(self, members: Tensor) -> Tensor:
        return members.mean(0)

    def log_likelihood(self, output: Tensor, target: Tensor) -> Tensor:
        """A unit-variance Gaussian: ``-(y - f(x))^2 / 2 - log(2 pi) / 2`` (training on it is training on MSE / 2)."""
        diff = output.float() - target.float().reshape(output.shape)
        return _per_row(-0.5 * diff.square() - 0.5 * math.log(2 * math.pi))


@dataclass(frozen=True)
class Gaussian(Task):
    """A Gaussian head ``[..., 2 * D]``: the first half means, the second half a variance parameter.

    The mixture of the members' Gaussians is reduced to its mean and total variance (law of total
    variance: the mean of the variances plus the variance of the means), written back in the
    head's own format, so code that reads the head keeps working.

    Args:
        variance: how the second half encodes the variance: ``"log"`` (log-variance), ``"softplus"``,
            ``"variance"`` or ``"std"``.
        axis: the axis holding ``[means, variance parameters]``.
    """

    variance: VarianceParameter | str = VarianceParameter.LOG
    axis: int = -1
    name: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(self, "variance", VarianceParameter.parse(self.variance, "variance"))

    def split(self, members: Tensor) -> tuple[Tensor, Tensor]:
        """``(means, variances)`` of ``[S, ..., 2 * D, ...]`` members."""
        axis = self.axis if self.axis < 0 else self.axis + 1
        return gaussian_head(members, variance=self.variance, axis=axis)

    def reduce(self, members: Tensor) -> Tensor:
        means, variances = self.split(members.double())
        mean = means.mean(0)
        total = variances.mean(0) + (means - mean).square().mean(0)  # (not var(): it warns on an empty batch)
        param = {
            VarianceParameter.LOG: lambda v: v.log(),
            VarianceParameter.SOFTPLUS: lambda v: v + torch.log(-torch.expm1(-v)),  # softplus^-1
            VarianceParameter.VARIANCE: lambda v: v,
            VarianceParameter.STD: lambda v: v.sqrt(),
        }[self.variance](total)
        return torch.cat([mean, param], dim=self.axis).to(members.dtype)

    def log_likelihood(self, output: Tensor, target: Tensor) -> Tensor:
        mean, variance = gaussian_head(output.float(), variance=self.variance, axis=self.axis)
        variance = variance.clamp_min(1e-12)
        diff = mean - target.to(mean.dtype).reshape(mean.shape)
        return _per_row(-0.5 * (torch.log(2 * math.pi * variance) + diff.square() / variance))


@dataclass(frozen=True)
class Members(Task):
    """No reduction: evaluation returns the members stacked in front, ``[S, B, ...]``."""

    name: ClassVar[str] = "members"

    def reduce(self, members: Tensor) -> Tensor:
        return members


@dataclass(frozen=True)
class CustomTask(Task):
    """A user's reduction: ``fn(members [S, ...]) -> output``."""

    fn: Callable[[Tensor], Tensor]
    name: ClassVar[str] = "custom"

    def reduce(self, members: Tensor) -> Tensor:
        return self.fn(members)

    def __str__(self) -> str:
        return f"custom ({getattr(self.fn, '__name__', 'function')})"


@dataclass(frozen=True)
class TaskMap(Task):
    """A task per top-level output: ``{key or index: task}`` (e.g. ``{"out": ..., "aux": ...}``).

    Floating-point outputs it does not name are averaged over the members only if ``rest`` says
    ``"mean"``; by default an unnamed tiled output is an error, never a guess.
    """

    tasks: tuple[tuple[Any, Task], ...] = ()
    rest: str = "error"
    name: ClassVar[str] = "per-output"

    def get(self, key: Any) -> Task | None:
        return dict(self.tasks).get(key)

    def reduce(self, members: Tensor) -> Tensor:  # a single tensor output: the one task there is
        if len(self.tasks) == 1:
            return self.tasks[0][1].reduce(members)
        raise ValueError(f"the model returned one tensor, but task names {len(self.tasks)} outputs: {self}.")

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {t}" for k, t in self.tasks) + "}"


@dataclass(frozen=True)
class Auto(Task):
    """Ask the model at conversion (:func:`infer_task`); see the module doc."""

    name: ClassVar[str] = "auto"

    def reduce(self, members: Tensor) -> Tensor:  # resolved by the router before any reduction
        raise AssertionError("Auto is resolved against the model before reducing")


_BY_NAME: dict[TaskName, Callable[[], Task]] = {
    TaskName.AUTO: Auto,
    TaskName.CLASSIFICATION: Classification,
    TaskName.BINARY: Binary,
    TaskName.MULTILABEL: MultiLabel,
    TaskName.REGRESSION: Regression,
    TaskName.GAUSSIAN: Gaussian,
    TaskName.MEMBERS: Members,
}


def parse_task(
    value: object, *, class_axis: int | None = None, gaussian_variance: str | None = None
) -> Task:
    """A :class:`Task` from a name, a Task, a function ``reduce(members)``, or a ``{key: task}`` mapping.

    ``class_axis`` and ``gaussian_variance`` fill in the named classification / gaussian tasks.
    """
    if isinstance(value, Task):
        return value
    if isinstance(value, Mapping):
        return TaskMap(tuple((k, parse_task(v, class_axis=class_axis, gaussian_variance=gaussian_variance)) for k, v in value.items()))
    if isinstance(value, (str, TaskName)):
        name = TaskName.parse(value, "task")
        if name is TaskName.CLASSIFICATION:
            return Classification(class_axis)
        if name is TaskName.GAUSSIAN:
            return Gaussian(gaussian_variance or VarianceParameter.LOG)
        return _BY_NAME[name]()
    if callable(value):
        return CustomTask(value)
    accepted = ", ".join(repr(m.value) for m in TaskName)
    raise ValueError(
        f"task={value!r} is not a task; pass one of {accepted}, a bayesify.tasks.Task, a function "
        "reduce(members) -> output, or a dict {output key: task}."
    )


# ---- asking the model ------------------------------------------------------------------------------


def _defined_in(model: nn.Module, *packages: str) -> bool:
    module = type(model).__module__ or ""
    return any(module == p or module.startswith(p + ".") for p in packages)


def _class_named(module_name: str, *names: str) -> tuple[type, ...]:
    module = sys.modules.get(module_name)
    return tuple(c for c in (getattr(module, n, None) for n in names) if isinstance(c, type))


# torch modules whose outputs are features or states, never logits: their mixture is the members' mean
_FEATURE_MODULES = (
    nn.RNNBase,
    nn.RNNCellBase,
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.Transformer,
)


def infer_task(model: nn.Module) -> Task | None:
    """The task a model states about its own output, or None when it states nothing.

    * Hugging Face ``PreTrainedModel``: :class:`HuggingFaceTask` (``logits`` by ``config.problem_type``
      and the head; the ``loss`` recomputed from the mixture).
    * torchvision segmentation (FCN, DeepLabV3, LRASPP): ``{"out", "aux"}`` class logits at axis 1.
    * torchvision detection (Faster / Mask / Keypoint R-CNN, RetinaNet, FCOS, SSD): :class:`Members`
      (boxes of different members cannot be averaged; see :func:`bayesify.detection.fuse_detections`).
    * a timm model with ``num_classes > 0`` or a torchvision classifier: :class:`Classification` (-1).
    * a torch recurrent, attention or transformer module used as the model: :class:`Regression` (its
      outputs are features and states; the mixture is their mean).
    """
    hf = _huggingface_task(model)
    if hf is not None:
        return hf
    segmentation = _class_named("torchvision.models.segmentation.fcn", "FCN") + _class_named(
        "torchvision.models.segmentation.deeplabv3", "DeepLabV3"
    ) + _class_named("torchvision.models.segmentation.lraspp", "LRASPP")
    if segmentation and isinstance(model, segmentation):
        return TaskMap((("out", Classification(1)), ("aux", Classification(1))))
    detection = (
        _class_named("torchvision.models.detection.generalized_rcnn", "GeneralizedRCNN")
        + _class_named("torchvision.models.detection.retinanet", "RetinaNet")
        + _class_named("torchvision.models.detection.fcos", "FCOS")
        + _class_named("torchvision.models.detection.ssd", "SSD")
    )
    if detection and isinstance(model, detection):
        return Members()
    if isinstance(model, _FEATURE_MODULES):
        return Regression()  # a recurrent / attention / transformer module used as the model: its features, averaged
    if _defined_in(model, "timm.models") and isinstance(getattr(model, "num_classes", None), int):
        return Classification(-1) if model.num_classes > 0 else None
    if _defined_in(model, "torchvision.models") and not _defined_in(
        model, "torchvision.models.detection", "torchvision.models.segmentation", "torchvision.models.optical_flow"
    ):
        return Classification(-1)
    return None


@dataclass(frozen=True)
class HuggingFaceTask(TaskMap):
    """A Hugging Face model's outputs: ``logits`` by the head and ``config.problem_type``; the ``loss``
    recomputed from the mixture's logits when labels are given (the predictive NLL, not the members'
    mean loss); other floating-point outputs (hidden states, attentions) averaged; the KV cache kept
    with its K * B rows (so ``generate`` continues every member)."""

    rest: str = "mean"
    recompute_loss: bool = True


def _huggingface_task(model: nn.Module) -> Task | None:
    module = sys.modules.get("transformers")
    base = getattr(module, "PreTrainedModel", None)
    if base is None or not isinstance(model, base):
        return None
    config = model.config
    kind = type(model).__name__
    problem = getattr(config, "problem_type", None)
    if problem == "multi_label_classification":
        logits: Task = MultiLabel()
    elif problem == "regression" or ("ForSequenceClassification" in kind and getattr(config, "num_labels", 2) == 1):
        logits = Regression()
    else:
        logits = Classification(-1)  # causal / masked LM, token and single-label sequence classification
    return HuggingFaceTask((("logits", logits),))
