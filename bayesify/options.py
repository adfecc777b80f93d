"""String options of bayesify, as ``str`` enums.

Every option accepts either the enum member or its string value
(``posterior="cauchy"`` and ``posterior=Posterior.CAUCHY`` are the same). Unknown values
raise a ``ValueError`` that lists what is accepted.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any, TypeVar

__all__ = [
    "Init",
    "Perturbation",
    "Posterior",
    "Prior",
    "Route",
    "Sampling",
    "StrOption",
    "VarianceParameter",
    "check_pair",
    "option",
    "parse_option",
]


class StrOption(str, Enum):
    """Base of every string option: a ``str`` enum whose members print as their value.

    Subclasses get :meth:`parse` (a string, any case, or a member; unknown values raise a
    ValueError listing what is accepted) and document each member with a docstring.
    """

    def __str__(self) -> str:  # "normal", not "Prior.NORMAL", in messages and reprs
        return self.value

    @classmethod
    def parse(cls, value: object, name: str | None = None) -> "StrOption":
        """``value`` as a member of this option, or a ValueError naming ``name`` and the accepted values."""
        return parse_option(value, cls, name or _snake(cls.__name__))


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))




class Prior(StrOption):
    """Prior over each entry of the rank-1 factors r and s."""

    NORMAL = "normal"
    """Normal(prior_mean, prior_std); analytic KL to a Normal posterior."""
    CAUCHY = "cauchy"
    """Cauchy(prior_mean, prior_std); closed-form KL to a Cauchy posterior."""


class Posterior(StrOption):
    """Variational family of each mixture component of r and s."""

    NORMAL = "normal"
    """Normal(loc, softplus(rho) + 1e-7), reparameterised samples."""
    CAUCHY = "cauchy"
    """Cauchy(loc, softplus(rho) + 1e-7); heavy-tailed, samples clipped like the reference."""
    DELTA = "delta"
    """A point mass at loc: the deterministic BatchEnsemble special case (no KL)."""


class Perturbation(StrOption):
    """How the factors act on the layer: ``W o (r s^T)`` or an additive shift."""

    MULTIPLICATIVE = "multiplicative"
    """y = ((x o s) W^T) o r + b: the paper's rank-1 weight perturbation (means start at 1)."""
    ADDITIVE = "additive"
    """y = (x + s) W^T + r + b: the reference's additive variant (means start at 0)."""


class Init(StrOption):
    """How the posterior means are initialised."""

    PRESERVE = "preserve"
    """Means exactly at the identity (1, or 0 for additive): a pretrained model's function is kept."""
    RANDOM_SIGN = "random_sign"
    """The reference's ``random_sign_init``: +-1 (+1 with probability ``init_sign_p``), for training from scratch."""
    NORMAL = "normal"
    """Normal(identity, ``init_mean_std``): small random spread around the identity."""


class Route(StrOption):
    """Which mixture component each example of a forward pass goes through."""

    SAMPLE = "sample"
    """One component per example, drawn uniformly at random (training default; cost ~1x)."""
    TILE = "tile"
    """Every example through all K components; output is the raw members, member-major ([K*B, ...])."""
    MIXTURE = "mixture"
    """Every example through all K components; output reduced to the mixture predictive (evaluation default)."""
    COMPONENT = "component"
    """Every example through one chosen component (``mode(component=k)``)."""


class Sampling(StrOption):
    """How often the factors are sampled, and so how a layer may compute: per example, or per component."""

    AUTO = "auto"
    """Per layer, whichever costs less: layers whose weight is small next to their activations (conv nets,
    large batches) fold one sample per component into their weight and run each component's rows as one
    block; the others (large weights at small batches) sample per example. A symbolic batch size
    (``torch.export`` with a dynamic batch, ``torch.compile(dynamic=True)``) takes the per-example path
    unless folding pays for every batch size, so that one graph serves them all."""
    EXAMPLE = "example"
    """One sample per example in every layer (the reference); the per-example path everywhere."""
    COMPONENT = "component"
    """One sample per component (per member when tiled) and forward pass in every layer: every layer that can
    folds its weights."""


class VarianceParameter(StrOption):
    """How the second half of a Gaussian head's output parametrises the variance."""

    LOG = "log"
    """The log-variance: ``variance = exp(v)`` (the usual Gaussian NLL head)."""
    SOFTPLUS = "softplus"
    """``variance = softplus(v)`` (Lakshminarayanan et al. 2017 add a small minimum to it)."""
    VARIANCE = "variance"
    """The variance itself (the head already ends in a positive activation); must be >= 0."""
    STD = "std"
    """The standard deviation: ``variance = v ** 2``; must be >= 0."""


_E = TypeVar("_E", bound=StrOption)


def parse_option(value: object, kind: type[_E], name: str) -> _E:
    """Turn a string or enum member into ``kind``, or raise a ValueError naming ``name``."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind(value.lower())
        except ValueError:
            pass
    accepted = ", ".join(repr(m.value) for m in kind)
    raise ValueError(f"{name}={value!r} is not a valid {kind.__name__} option; accepted: {accepted}.")


def option(
    default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING, cli: bool = True, scope: str = "layer"
) -> Any:
    """A dataclass field that documents itself: its one-line ``help`` feeds docstrings and CLI flags.

    The configuration dataclasses (:class:`~bayesify.config.Rank1Config`,
    :class:`~bayesify.training.TrainConfig`) declare every option once with this; ``convert``'s
    signature and docstring and the command line's flags are generated from those fields.
    ``cli=False`` keeps a field off the command line (e.g. a Python-only mapping). ``scope`` says who reads a
    conversion option: ``"layer"`` (each layer's factors: :class:`~bayesify.config.LayerOptions`), ``"model"`` (the
    same for every layer, read at run time from the model's one copy: :class:`~bayesify.config.ModelOptions`), or
    ``"conversion"`` (what ``convert()`` itself does: which layers, the task).
    """
    metadata = {"help": help, "cli": cli, "scope": scope}
    return dataclasses.field(default=default, default_factory=factory, metadata=metadata)


def check_pair(posterior: Posterior, prior: Prior) -> None:
    """Raise a ValueError for a posterior/prior pair whose KL is infinite."""
    if posterior is Posterior.CAUCHY and prior is Prior.NORMAL:
        raise ValueError(
            "posterior='cauchy' with prior='normal' has an infinite KL divergence (a Cauchy has no "
            "finite second moment); use prior='cauchy' with a Cauchy posterior."
        )
