"""``Rank1Config``: the one list of conversion options, validated once, shared by every converted layer.

Each option is declared here once, with its default and a one-line help. :func:`bayesify.convert`
takes them as keyword arguments (its signature and docstring are generated from these fields),
:class:`bayesify.training.TrainConfig` holds one ``Rank1Config``, and ``bayesify train`` has a flag
for each (``--prior-std``, ``--init``, ...). Adding an option is one edit: a field here (and the
code that uses it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, replace
from typing import Any

from bayesify.options import (
    Init,
    Perturbation,
    Posterior,
    Prior,
    Sampling,
    StrOption,
    VarianceParameter,
    check_pair,
    option,
)
from bayesify.predictive.tasks import Task, TaskName, resolve_task

__all__ = ["LayerOptions", "ModelOptions", "Rank1Config", "scoped"]


def _positive(name: str, value: float, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0; {fix}.")
    return float(value)


class Rank1Options(typing.TypedDict, total=False):
    """The conversion options as keyword arguments, for type checkers and IDEs: ``convert(model, **options)``.

    The fields of :class:`Rank1Config` (its field ``help`` says what each means), in its order; an option
    string is accepted where the field is an option enum. ``tests/test_config_fields.py`` holds the two equal.
    """

    components: int
    prior: Prior | str
    prior_mean: float | None
    prior_std: float | None
    posterior: Posterior | str
    perturbation: Perturbation | str
    init: Init | str
    init_sign_p: float
    init_mean_std: float
    init_dropout: float | None
    init_std: float | None
    init_jitter: float
    clip: float | None
    batch_dim: int
    eval_noise: bool
    sampling: Sampling | str
    unbatched_inputs: tuple[str | int, ...]
    task: TaskName | Task | str | Any
    class_axis: int | None
    gaussian_variance: VarianceParameter | str
    embeddings: bool
    embedding_prior_std: float


@dataclass(frozen=True)
class Rank1Config:
    """Options of :func:`bayesify.convert`; each field's ``help`` says what it means.

    Example:
        >>> config = Rank1Config(components=4, prior_std=0.05)
        >>> bayesify.convert(model, config)          # or bayesify.convert(model, components=4, prior_std=0.05)
    """

    components: int = option(4, "K, the number of mixture components (paper: 4)", scope="model")
    prior: Prior = option(Prior.NORMAL, "prior on each entry of r and s")
    prior_mean: float | None = option(None, "prior location; default 1 (multiplicative) or 0 (additive)")
    prior_std: float | None = option(
        None,
        "prior scale; None: 0.4 / sqrt(number of rank-1 layers), at most 0.3 (the same total noise at every depth; "
        "0.074 for WRN-28 and 0.054 for ResNet-50, where the paper chose 0.1 and 0.05)",
    )
    posterior: Posterior = option(Posterior.NORMAL, "variational family of each component ('delta': BatchEnsemble)")
    perturbation: Perturbation = option(Perturbation.MULTIPLICATIVE, "how r and s act: W o (r s^T), or added")
    init: Init = option(
        Init.PRESERVE,
        "posterior means: 'preserve' (the identity: keeps a pretrained network's function), 'random_sign' "
        "(reference random_sign_init, from scratch), 'normal' (spread init_mean_std around the identity)",
    )
    init_sign_p: float = option(0.5, "init='random_sign': probability of a +1 mean (paper: 0.5 CIFAR, 0.75 ImageNet)")
    init_mean_std: float = option(0.1, "init='normal': std of the means around the identity")
    init_dropout: float | None = option(
        None, "initial scale sqrt(p / (1 - p)) from a dropout rate p (the reference: 1e-3 Normal, 1e-6 Cauchy)"
    )
    init_std: float | None = option(
        None,
        "initial posterior scale directly (overrides init_dropout); None: the prior's scale (the posterior starts "
        "at the prior: a KL of 0 at conversion), or init_dropout's when given; a Cauchy posterior's: init_dropout "
        "1e-6's, 0.001 (as wide as the prior, it would draw its heavy tails from the start)",
    )
    init_jitter: float = option(0.0, "std of truncated-normal jitter on the raw scale (reference: 0.1)")
    clip: float | None = option(10.0, "samples of r and s clipped to [-clip, clip] (reference: 10; None: off)")
    batch_dim: int = option(0, "where the batch lies in the model's inputs (and Linear layers' inputs)", scope="model")
    eval_noise: bool = option(
        False,
        "evaluation samples r and s (the reference) instead of the K members' posterior means; measured "
        "better calibrated at the means (README: defaults)",
        scope="model",
    )
    sampling: Sampling = option(
        Sampling.AUTO,
        "'auto': per layer, one sample per component folded into the weight where that is cheaper (conv nets), "
        "else per example; 'example': per example everywhere (the reference); 'component': per component everywhere",
        scope="model",
    )
    unbatched_inputs: tuple[str | int, ...] = option(
        (),
        "the forward's inputs (names, or positions from 0) that hold no batch, never tiled for the members: a [T, T] "
        "mask, class prototypes [C, D], a table; without it, an input whose size at batch_dim equals the batch's is "
        "taken as batched",
        scope="model",
        cli=False,
    )
    task: TaskName | Task = option(
        TaskName.AUTO,
        "what the output means, i.e. how evaluation reduces the members: 'auto' (ask the model: timm, torchvision, "
        "Hugging Face), 'classification', 'binary', 'multilabel', 'regression', 'gaussian', 'members'; or a "
        "bayesify.predictive.Task, a function reduce(members), a dict {output key: task}",
        scope="conversion",
    )
    class_axis: int | None = option(None, "task='classification': the class axis (default -1, or 1 for 4-d+ outputs)", scope="conversion")
    gaussian_variance: VarianceParameter = option(
        VarianceParameter.LOG,
        "task='gaussian': how the head's second half encodes the variance (log, softplus, variance, std)",
        scope="conversion",
    )
    embeddings: bool = option(False, "make nn.Embedding / EmbeddingBag Gaussian variational embeddings (paper: MIMIC)", scope="conversion")
    embedding_prior_std: float = option(
        1.0,
        "std of the Normal(0, std) prior of Gaussian embeddings (their posterior starts at the factors' initial scale, "
        "not at this prior's: a KL above 0 at conversion)",
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once
        if isinstance(self.components, bool) or not isinstance(self.components, int) or self.components < 1:
            raise ValueError(
                f"components={self.components!r} must be an integer >= 1 (the number of mixture components; "
                "the paper uses 4)."
            )
        for name, kind in enum_fields(type(self)).items():
            set_(self, name, kind.parse(getattr(self, name), name))
        check_pair(self.posterior, self.prior)
        if self.prior_std is not None:
            fix = "the paper uses 0.1 (CIFAR) or 0.05 (ImageNet); None scales it to the depth"
            set_(self, "prior_std", _positive("prior_std", self.prior_std, fix))
        if self.prior_mean is None:
            set_(self, "prior_mean", self.identity)
        elif isinstance(self.prior_mean, bool) or not isinstance(self.prior_mean, (int, float)) or not math.isfinite(
            self.prior_mean
        ):
            raise ValueError(f"prior_mean={self.prior_mean!r} must be a finite number (default 1.0, or 0.0 additive).")
        if not 0.0 < self.init_sign_p <= 1.0:
            raise ValueError(f"init_sign_p={self.init_sign_p!r} must be in (0, 1]: the probability of a +1 mean.")
        _positive("init_mean_std", self.init_mean_std, "it is the spread of means with init='normal'")
        if self.init_dropout is not None and not 0.0 < self.init_dropout < 1.0:
            raise ValueError(
                f"init_dropout={self.init_dropout!r} must be in (0, 1): the dropout rate p giving "
                "std = sqrt(p / (1 - p)) (reference: 1e-3 Normal, 1e-6 Cauchy)."
            )
        if self.init_std is not None:
            _positive("init_std", self.init_std, "or leave it None to use init_dropout")
        if self.init_jitter < 0:
            raise ValueError(f"init_jitter={self.init_jitter!r} must be >= 0 (reference: 0.1 on the raw std).")
        if self.clip is not None:
            _positive("clip", self.clip, "or None to disable sample clipping (reference: 10)")
        if not isinstance(self.eval_noise, bool):
            raise TypeError(f"eval_noise={self.eval_noise!r} must be True or False.")
        if not isinstance(self.embeddings, bool):
            raise TypeError(f"embeddings={self.embeddings!r} must be True or False (Gaussian variational embeddings).")
        _positive("embedding_prior_std", self.embedding_prior_std, "it is the std of the Normal(0, std) prior on embeddings")
        if isinstance(self.batch_dim, bool) or not isinstance(self.batch_dim, int) or self.batch_dim < 0:
            raise ValueError(f"batch_dim={self.batch_dim!r} must be an integer >= 0 (where the batch lies in inputs).")
        names = (self.unbatched_inputs,) if isinstance(self.unbatched_inputs, (str, int)) else self.unbatched_inputs
        if not isinstance(names, (tuple, list)) or not all(
            isinstance(n, str) and n.isidentifier() or isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for n in names
        ):
            raise ValueError(
                f"unbatched_inputs={self.unbatched_inputs!r} must name the forward's inputs that hold no batch: "
                "argument names or positions (from 0), e.g. ('prototypes',) or (1,)."
            )
        set_(self, "unbatched_inputs", tuple(names))
        if self.class_axis is not None and (isinstance(self.class_axis, bool) or not isinstance(self.class_axis, int)):
            raise ValueError(f"class_axis={self.class_axis!r} must be an integer axis (e.g. -1 or 1) or None.")
        if isinstance(self.task, (str, TaskName)):
            set_(self, "task", TaskName.parse(self.task, "task"))
        else:  # a Task, a function or a {key: task} mapping, whose named entries take class_axis / gaussian_variance
            set_(self, "task", resolve_task(self.task, class_axis=self.class_axis, gaussian_variance=self.gaussian_variance))

    def resolved_task(self) -> Task:
        """:attr:`task` as a :class:`~bayesify.predictive.Task` (``"auto"`` stays :class:`~bayesify.predictive.Auto`)."""
        return resolve_task(self.task, class_axis=self.class_axis, gaussian_variance=self.gaussian_variance)

    @property
    def identity(self) -> float:
        """The factor value that leaves a layer unchanged: 1 multiplicative, 0 additive."""
        return 1.0 if self.perturbation is Perturbation.MULTIPLICATIVE else 0.0

    def resolved_prior_std(self, layers: int = 1) -> float:
        """``prior_std``, or for None the depth rule ``min(0.3, 0.4 / sqrt(layers))``.

        Each rank-1 layer scales its inputs and outputs by noise of this std, and the variances add up
        along the network: scaling the std with 1 / sqrt(depth) keeps the total noise on the output
        alike for a 4-layer CNN (0.2, where it was best on validation data) and a ResNet-50 (0.054;
        the paper chose 0.05 for ImageNet, 0.1 for a WRN-28, where the rule gives 0.074).
        """
        if self.prior_std is not None:
            return self.prior_std
        return min(0.3, 0.4 / math.sqrt(max(layers, 1)))

    def model_options(self) -> "ModelOptions":
        """The options every layer of a model shares (``scope="model"``): the model's one copy of them."""
        return ModelOptions(**{name: getattr(self, name) for name in scoped(Rank1Config, "model")})

    def layer_options(self, layers: int = 1) -> "LayerOptions":
        """What each layer's factors are made with (``scope="layer"``), the prior's scale resolved for a model of
        ``layers`` rank-1 layers (:meth:`resolved_prior_std`): every layer of a model shares one prior."""
        values = {name: getattr(self, name) for name in scoped(Rank1Config, "layer")}
        return LayerOptions(**{**values, "prior_std": self.resolved_prior_std(layers)})

    def replace(self, **changes: object) -> "Rank1Config":
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_options(cls, base: "Rank1Config | None" = None, **options: Any) -> "Rank1Config":
        """``base`` (default: the defaults) with ``options`` applied; unknown names raise a TypeError listing them all."""
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            raise TypeError(
                f"unknown conversion option(s) {unknown}; the options are: {', '.join(cls.option_names())} "
                "(see help(bayesify.Rank1Config))."
            )
        if base is None:
            return cls(**options)
        if not isinstance(base, Rank1Config):
            raise TypeError(f"config={base!r} must be a bayesify.Rank1Config (or None for the defaults).")
        base = base.rank1
        return base.replace(**options) if options else base

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The conversion options (the fields of ``Rank1Config`` itself, not of a subclass)."""
        return tuple(f.name for f in dataclasses.fields(Rank1Config))

    @property
    def rank1(self) -> "Rank1Config":
        """The conversion options alone (a subclass such as ``TrainConfig`` holds more)."""
        if type(self) is Rank1Config:
            return self
        return Rank1Config(**{name: getattr(self, name) for name in Rank1Config.option_names()})

    def to_dict(self) -> dict[str, Any]:
        """Plain values (enums as strings, tuples as lists), e.g. for a checkpoint or a report."""
        plain = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (StrOption, Task)):
                value = str(value)  # a custom Task is saved by name only
            plain[f.name] = list(value) if isinstance(value, tuple) else value
        return plain


@dataclass(frozen=True)
class ModelOptions:
    """The conversion options every layer of a model shares (``scope="model"`` in :class:`Rank1Config`), held once,
    on the model (``bayesify.ModelState.options``): the layers read them from there at run time, never a copy."""

    components: int
    batch_dim: int
    eval_noise: bool
    sampling: Sampling
    unbatched_inputs: tuple[str | int, ...] = ()


@dataclass(frozen=True)
class LayerOptions:
    """What one layer's factors are made with (``scope="layer"`` in :class:`Rank1Config`), ``prior_std`` resolved.

    Made by :meth:`Rank1Config.layer_options` (validated there); a layer holds it as ``layer.rank1_state.options``
    and its factors share it. The number of components is the model's (:class:`ModelOptions`), not a layer's.
    """

    prior: Prior
    prior_mean: float
    prior_std: float
    posterior: Posterior
    perturbation: Perturbation
    init: Init
    init_sign_p: float
    init_mean_std: float
    init_dropout: float | None
    init_std: float | None
    init_jitter: float
    clip: float | None
    embedding_prior_std: float

    @property
    def identity(self) -> float:
        """The factor value that leaves a layer unchanged: 1 multiplicative, 0 additive."""
        return 1.0 if self.perturbation is Perturbation.MULTIPLICATIVE else 0.0

    @property
    def meaning(self) -> dict[str, str]:
        """The options that say what the layer's saved rank-1 values mean (a location near 1 or 0; a Normal or a
        Cauchy scale, or none): saved in a state dict's metadata, checked when one loads."""
        return {"perturbation": self.perturbation.value, "posterior": self.posterior.value}

    @property
    def initial_std(self) -> float:
        """Initial posterior scale: ``init_std``; else from ``init_dropout``, sqrt(p / (1 - p)); else a Normal
        posterior starts at the prior's scale (the KL to the prior is 0 at conversion) and a Cauchy one at the
        reference's p = 1e-6 (a Cauchy as wide as the prior would draw its heavy tails from the start)."""
        if self.init_std is not None:
            return self.init_std
        p = self.init_dropout
        if p is None and self.posterior is Posterior.CAUCHY:
            p = 1e-6
        if p is None:
            return self.prior_std
        return math.sqrt(p / (1.0 - p))

    def replace(self, **changes: object) -> "LayerOptions":
        """A copy with ``changes`` applied (e.g. a recurrent kernel's unclipped samples)."""
        return replace(self, **changes)


def scoped(cls: type, scope: str) -> tuple[str, ...]:
    """The names of ``cls``'s options of one ``scope`` (``"model"``, ``"layer"``, ``"conversion"``; see ``option``)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("scope", "layer") == scope)


@functools.cache
def enum_fields(cls: type) -> dict[str, type[StrOption]]:
    """``{field name: option enum}`` for the fields of dataclass ``cls`` typed by a :class:`StrOption`."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    return {
        name: kind
        for name, kind in hints.items()
        if name in names and isinstance(kind, type) and issubclass(kind, StrOption)
    }


def options_doc(cls: type = Rank1Config, indent: str = "        ") -> str:
    """``name: help (default ...)`` lines for every option of ``cls``, for generated docstrings."""
    lines = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else "..."
        shown = f"'{default}'" if isinstance(default, StrOption) else repr(default)
        lines.append(f"{indent}{f.name}: {f.metadata.get('help', '')} (default {shown}).")
    return "\n".join(lines)
