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
(:func:`bayesify.predictive.libraries.infer_task`). For any other model bayesify does not guess: evaluation raises an error that
names the option, because a wrong guess (softmax over a multi-label head or a ``(mean, log-variance)``
pair, over the width of a segmentation map) would be a silently wrong number.

Several outputs (a dict, a ``ModelOutput``, a tuple): one task reduces *every* floating-point output
that has the members' rows, not only the primary one (the tensor itself, a tuple's first element, a
Hugging Face ``logits``: what :func:`bayesify.uncertainty` decomposes). With ``task="classification"``,
``{"logits": z, "feat": f}`` comes back with ``feat`` as ``log mean softmax(f)`` too, and a warning names
the tensors reduced as logits. A dict task (:class:`TaskMap`) names the task of each top-level key /
index instead, e.g. ``{"logits": "classification", "feat": "regression"}`` (``feat``: the members'
mean); a tiled output it does not name is refused. A Hugging Face model's inferred task names its
``logits`` and averages the other floating-point outputs (hidden states, attentions). An output without
the members' rows (a scalar loss) passes as it is.

A task is decided in one place, :func:`resolve_task`; what a task means for a reduction, a
likelihood, an uncertainty decomposition, the metrics and a head's width are its methods.

References:
    Dusenberry et al., ICML 2020, Eq. 2 (the mixture predictive); Lakshminarayanan et al.,
    NeurIPS 2017 (a mixture of Gaussian members, its mean and variance).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayesify.mixture import logmeanexp
from bayesify.options import StrOption, VarianceParameter
from bayesify.predictive import decompositions
from bayesify.predictive.heads import gaussian_head

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
    "parse_task",
    "resolve_task",
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


_NAMED = "'classification', 'binary', 'multilabel', 'regression' or 'gaussian'"


class Task:
    """What an output means. Subclasses implement :meth:`reduce` (and :meth:`log_likelihood` to be
    trained by bayesify's objective); see the module doc. The other methods say what the task
    means elsewhere (an uncertainty decomposition, metrics, a head's width); a task without one
    refuses in one line."""

    name: ClassVar[str] = "custom"

    def reduce(self, members: Tensor) -> Tensor:
        """The predictive output of ``members`` (``[S, ...]``, S members stacked), in the output's own format."""
        raise NotImplementedError

    def log_likelihood(self, output: Tensor, target: Tensor) -> Tensor:
        """``log p(target | output)`` per row (``[N]``; dense outputs averaged over their other axes), in float32
        (the training loss; a reduced-precision output is widened)."""
        raise NotImplementedError(f"task {self} has no likelihood to train with; use {_NAMED}, or train with your own loss.")

    def uncertainty(self, members: Tensor) -> object:
        """The uncertainty decomposition of ``[S, ...]`` members (:mod:`bayesify.predictive.decompositions`)."""
        raise ValueError(f"task {self} has no uncertainty decomposition; pass task={_NAMED}.")

    def member_log_probs(self, members: Tensor) -> Tensor | None:
        """``[S, N, C]`` member log-probabilities of a categorical output (every pixel / token / label a row),
        or None for an output that is not categorical."""
        return None

    def member_moments(self, members: Tensor) -> tuple[Tensor, Tensor | None] | None:
        """``(means, variances or None)`` of a real-valued output's ``[S, ...]`` members, or None."""
        return None

    def output_size(self, targets: int) -> int:
        """How many outputs a head of this task needs for ``targets`` classes or regression targets."""
        return targets

    def for_output(self, key: Any) -> Task | None:
        """The task of the model's output leaf at top-level ``key`` (None: the task names none)."""
        return self

    def recomputes(self, key: Any) -> bool:
        """Whether the output at ``key`` is not reduced but made again from the reduced outputs (:meth:`finish`)."""
        return False

    def finish(self, model: Any, reduced: list[tuple[Any, object]], inputs: dict) -> list[object]:
        """The output leaves after the reduction (``reduced``: ``(top-level key, value)`` per leaf; ``inputs``: the
        call's keyword arguments), with what :meth:`recomputes` made again from them."""
        return [value for _, value in reduced]

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Classification(Task):
    """Class logits. The mixture: ``log mean_s softmax(z_s)`` over the class axis (usable as logits).

    Args:
        class_axis: the class axis of one member's output; None: -1 for ``[B, C]`` outputs and 1 for
            4-d and larger ``[B, C, H, W, ...]`` ones (PyTorch's channels-first layout). A 3-d output is
            ambiguous (``[B, C, L]`` from a Conv1d or ``[B, T, C]`` per-token logits) and must say.
        classes: the number of classes the model stated when the task was inferred from it (timm's
            ``num_classes``, a Hugging Face classifier's ``config.num_labels``); None: said by the user, or no
            number stated. An output whose class axis has another width is refused (its head was replaced
            after ``convert``: features, not logits; see :func:`bayesify.predictive.outputs.check_leaf`).
            Where the task came from, not what it means: left out of equality.
    """

    class_axis: int | None = None
    classes: int | None = field(default=None, compare=False)
    name: ClassVar[str] = "classification"

    def axis(self, output: Tensor | torch.Size) -> int:
        """The class axis of one member's output ``output`` (or of an output of that shape; non-negative)."""
        shape = tuple(output.shape if isinstance(output, Tensor) else output)
        nd = len(shape)
        if self.class_axis is not None:
            if not -nd <= self.class_axis < nd:
                raise ValueError(f"class_axis={self.class_axis} is out of range for an output of shape {shape}.")
            return self.class_axis % nd
        if nd <= 2:
            return nd - 1
        if nd >= 4:
            return 1
        raise ValueError(
            f"an output of shape {shape} could hold classes at axis 1 ([B, C, L]: a Conv1d or "
            "segmentation net) or at axis -1 ([B, T, C]: per-token logits); pass class_axis=1 or class_axis=-1 to "
            "bayesify.convert (or bayesify.mode); a time-major [T, B, C] output (batch_dim=1): class_axis=-1."
        )

    def reduce(self, members: Tensor) -> Tensor:
        axis = self.axis(members.shape[1:]) + 1
        if members.shape[axis] == 1:
            raise ValueError(
                "task='classification' (log of the mean softmax) needs one output per class, but the model's output "
                "has a single class column; use task='binary' for a one-logit binary classifier or task='regression'."
            )
        return logmeanexp(torch.log_softmax(_wide(members), axis), 0).to(members.dtype)

    def log_likelihood(self, output: Tensor, target: Tensor) -> Tensor:
        axis = self.axis(output)
        if output.shape[axis] == 1:  # a softmax over one class: a loss of 0 whatever the label
            raise ValueError(
                f"task='classification' needs one output per class, but an output of shape {tuple(output.shape)} has "
                f"a single class column at axis {axis}; use task='binary' for a one-logit binary classifier."
            )
        ll = -F.cross_entropy(output.float().movedim(axis, 1), target.long(), reduction="none")
        return _per_row(ll)

    def uncertainty(self, members: Tensor) -> decompositions.ClassificationUncertainty:
        refuse_probabilities(members, self.axis(members.shape[1:]) + 1)
        return decompositions.classification_uncertainty(members, class_axis=self.axis(members.shape[1:]))

    def member_log_probs(self, members: Tensor) -> Tensor:
        axis = self.axis(members.shape[1:]) + 1
        if members.shape[axis] == 1:  # a softmax over one class: NLL 0, accuracy 1 whatever the labels
            raise ValueError(
                f"task='classification' needs one output per class, but the members' outputs {tuple(members.shape)} "
                f"have a single class column at axis {axis - 1}; use task='binary' for a one-logit binary classifier."
            )
        refuse_probabilities(members, axis)
        logits = members.movedim(axis, -1)
        return logits.reshape(logits.shape[0], -1, logits.shape[-1]).log_softmax(-1)

    def __str__(self) -> str:
        return self.name if self.class_axis is None else f"{self.name} (class axis {self.class_axis})"


def refuse_probabilities(members: Tensor, axis: int) -> None:
    """Class outputs that are probabilities already (a model ending in a softmax) would go through a softmax again:
    the mixture, its NLL and its uncertainty all wrong, silently. Refused in one line where every value is
    non-negative and every row along the class ``axis`` sums to 1 (log-probabilities pass: a softmax leaves them as
    they are). It reads values (one sync): not in a traced graph, and the forward pass looks once per model."""
    if (
        torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()  # (a batched tensor's values are not read)
        or isinstance(members, torch._subclasses.FakeTensor)
        or members.device.type == "meta"
        or not members.is_floating_point()
        or members.numel() == 0
        or members.shape[axis] < 2
    ):
        return
    tolerance = 1e-3 if members.dtype in (torch.float32, torch.float64) else 2e-2  # (a half-precision row's sum)
    rows = members.detach().sum(axis, dtype=torch.float32)
    if bool((members.detach().min() >= 0) & ((rows - 1).abs().max() <= tolerance)):
        raise ValueError(
            "the model's class outputs are probabilities (every value non-negative, every row summing to 1: a final "
            "softmax), but task='classification' takes logits and takes their softmax; return the logits (leave the "
            "softmax out) or their log (torch.log(probs): log-probabilities are logits), or say task='members' to "
            "stack the members as they are."
        )


def refuse_sigmoid_outputs(members: Tensor, model: nn.Module) -> None:
    """Binary outputs that are probabilities already (a model ending in ``nn.Sigmoid``) would go through a sigmoid
    again (every prediction near 0.5 or above, the NLL and accuracy wrong, silently). Refused in one line where the
    model's last module is a sigmoid and every value lies in [0, 1]; logits alone cannot tell (a head whose bias is
    set to the class prior starts with every logit in [0, 1]). Reads values: not in a traced graph."""
    last = next(reversed(list(model.modules())), None)
    if (
        not isinstance(last, nn.Sigmoid)
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or isinstance(members, torch._subclasses.FakeTensor)
        or members.device.type == "meta"
        or not members.is_floating_point()
        or members.numel() == 0
    ):
        return
    values = members.detach()
    if bool((values.min() >= 0) & (values.max() <= 1)):
        raise ValueError(
            f"the binary outputs of {type(model).__name__} are probabilities (it ends in a sigmoid, every value in "
            "[0, 1]), but task='binary' / 'multilabel' takes logits and takes their sigmoid; return the logits (leave "
            "the sigmoid out, train with BCEWithLogitsLoss), or say task='members' to stack the members as they are."
        )


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

    def uncertainty(self, members: Tensor) -> decompositions.BinaryUncertainty:
        return decompositions.binary_uncertainty(members)

    def member_log_probs(self, members: Tensor) -> Tensor:
        """Every (example, label) a two-class problem: ``[S, N * labels, 2]`` (log(1 - p), log p)."""
        logits = members.reshape(members.shape[0], -1).float()
        return torch.stack([F.logsigmoid(-logits), F.logsigmoid(logits)], -1)


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
        if target.numel() != output.numel():
            raise ValueError(
                f"task='regression' scores an output of shape {tuple(output.shape)} against targets of its shape, but "
                f"the targets have shape {tuple(target.shape)}"
                + (" (class labels?): use task='classification'." if output.dim() == 2 and target.dim() == 1 else ".")
            )
        diff = output.float() - target.float().reshape(output.shape)
        return _per_row(-0.5 * diff.square() - 0.5 * math.log(2 * math.pi))

    def uncertainty(self, members: Tensor) -> decompositions.RegressionUncertainty:
        return decompositions.regression_uncertainty(members)

    def member_moments(self, members: Tensor) -> tuple[Tensor, None]:
        return members, None


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
        self.check_width(members.shape[1:])
        axis = self.axis if self.axis < 0 else self.axis + 1
        return gaussian_head(members, variance=self.variance, axis=axis)

    def check_width(self, shape: torch.Size) -> None:
        """Refuse in one line one output of ``shape`` with no ``2 * D`` values on :attr:`axis`, naming what a model
        can do (gaussian_head's own error names its arguments, which a task's caller does not pass)."""
        size = shape[self.axis] if -len(shape) <= self.axis < len(shape) else None
        if size is not None and size and size % 2 == 0:
            return
        param = {VarianceParameter.LOG: "log_var", VarianceParameter.SOFTPLUS: "raw_var"}.get(
            self.variance, self.variance.value
        )
        got = "no such axis" if size is None else f"{size} value{'s' * (size != 1)} there"
        raise ValueError(
            f"task='gaussian' reads one tensor with D means then D variance parameters on axis {self.axis}, but an "
            f"output of shape {tuple(shape)} has {got}; return torch.cat([mean, {param}], {self.axis}) (a "
            f"(mean, {param}) tuple is two outputs), name another axis with "
            "task=bayesify.predictive.Gaussian(axis=...), or use task='regression' for a mean-only head."
        )

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
        self.check_width(output.shape)
        mean, variance = gaussian_head(output.float(), variance=self.variance, axis=self.axis)
        variance = variance.clamp_min(1e-12)
        diff = mean - target.to(mean.dtype).reshape(mean.shape)
        return _per_row(-0.5 * (torch.log(2 * math.pi * variance) + diff.square() / variance))

    def uncertainty(self, members: Tensor) -> decompositions.RegressionUncertainty:
        return decompositions.regression_uncertainty(*self.split(members))

    def member_moments(self, members: Tensor) -> tuple[Tensor, Tensor]:
        return self.split(members)

    def output_size(self, targets: int) -> int:
        return 2 * targets  # the means, then the variance parameters


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

    def for_output(self, key: Any) -> Task | None:
        found = self.get(key)
        if found is None and self.rest == "mean":
            return Regression()  # an output it does not name, averaged (features, hidden states)
        return found

    def reduce(self, members: Tensor) -> Tensor:  # a single tensor output: the one task there is
        if len(self.tasks) == 1:
            return self.tasks[0][1].reduce(members)
        raise ValueError(f"the model returned one tensor, but task names {len(self.tasks)} outputs: {self}.")

    def __str__(self) -> str:
        named = "{" + ", ".join(f"{k!r}: {t}" for k, t in self.tasks) + "}"
        return f"{named}, other outputs averaged" if self.rest == "mean" else named  # (a headless model's: features)


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
        f"task={value!r} is not a task; pass one of {accepted}, a bayesify.predictive.Task, a function "
        "reduce(members) -> output, or a dict {output key: task}."
    )


def check_class_axis(task: object, class_axis: int | None) -> None:
    """Refuse ``class_axis`` with a task named otherwise than ``"classification"`` (it would be ignored, silently)."""
    if class_axis is None or not isinstance(task, (str, TaskName)):
        return
    name = TaskName.parse(task, "task")
    if name not in (TaskName.CLASSIFICATION, TaskName.AUTO):
        raise ValueError(
            f"class_axis={class_axis!r} goes with task='classification' (the axis of its softmax), and "
            f"task={name.value!r} has none: drop class_axis (or say task='classification')."
        )


def _with_class_axis(stated: Task, class_axis: int) -> Task:
    """The task a model states with ``class_axis`` for its classes (each classified output's, in a mapping); refused
    where it states no classification (the axis would be ignored, silently)."""
    if isinstance(stated, Classification):
        return dataclasses.replace(stated, class_axis=class_axis)
    if isinstance(stated, TaskMap) and any(isinstance(t, Classification) for _, t in stated.tasks):
        tasks = tuple((k, dataclasses.replace(t, class_axis=class_axis) if isinstance(t, Classification) else t) for k, t in stated.tasks)
        return dataclasses.replace(stated, tasks=tasks)
    raise ValueError(
        f"class_axis={class_axis!r} sets the class axis of a classifier's output, and the model states {stated}, "
        "which has none: drop class_axis, or say the task (task='classification', class_axis=...)."
    )


def resolve_task(
    task: object = None,
    *,
    stated: Task | None = None,
    class_axis: int | None = None,
    gaussian_variance: str | None = None,
    needed_by: str | None = None,
) -> Task:
    """What an output means: the one place bayesify decides it.

    Args:
        task: what the caller says (a name, a :class:`Task`, a function ``reduce(members)``, a
            ``{output key: task}`` mapping); None or ``"auto"``: nothing said.
        stated: what the model says of its own output when the caller said nothing (a converted
            model's task, or :func:`bayesify.predictive.libraries.infer_task` of a plain one).
        class_axis, gaussian_variance: fill in a named ``"classification"`` / ``"gaussian"`` task (and
            ``class_axis`` the class axis of a stated classifier).
        needed_by: the call that needs a definite task: with it, a task nobody stated raises a one-line
            error naming ``task=`` of that call; without it, :class:`Auto` is returned (decided later).
    """
    said = parse_task("auto" if task is None else task, class_axis=class_axis, gaussian_variance=gaussian_variance)
    if isinstance(said, Auto) and stated is not None and not isinstance(stated, Auto):
        if class_axis is not None:  # the caller's axis, the model's classes
            stated = _with_class_axis(stated, class_axis)
        said = stated
    if isinstance(said, Auto) and needed_by is not None:
        raise ValueError(
            f"{needed_by} does not know what the model's output means; pass task= to it (or to bayesify.convert): "
            f"{_NAMED}."
        )
    return said
