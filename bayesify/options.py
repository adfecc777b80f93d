"""String options of bayesify, as ``str`` enums.

Every option accepts either the enum member or its string value
(``posterior="cauchy"`` and ``posterior=Posterior.CAUCHY`` are the same). Unknown values
raise a ``ValueError`` that lists what is accepted.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = ["Prior", "Posterior", "Perturbation", "Init", "Route", "Reduction", "parse_option"]


class _Option(str, Enum):
    def __str__(self) -> str:  # "normal", not "Prior.NORMAL", in messages and reprs
        return self.value


class Prior(_Option):
    """Prior over each entry of the rank-1 factors r and s."""

    NORMAL = "normal"
    """Normal(prior_mean, prior_std); analytic KL to a Normal posterior."""
    CAUCHY = "cauchy"
    """Cauchy(prior_mean, prior_std); closed-form KL to a Cauchy posterior."""


class Posterior(_Option):
    """Variational family of each mixture component of r and s."""

    NORMAL = "normal"
    """Normal(loc, softplus(rho) + 1e-7), reparameterised samples."""
    CAUCHY = "cauchy"
    """Cauchy(loc, softplus(rho) + 1e-7); heavy-tailed, samples clipped like the reference."""
    DELTA = "delta"
    """A point mass at loc: the deterministic BatchEnsemble special case (no KL)."""


class Perturbation(_Option):
    """How the factors act on the layer: ``W o (r s^T)`` or an additive shift."""

    MULTIPLICATIVE = "multiplicative"
    """y = ((x o s) W^T) o r + b: the paper's rank-1 weight perturbation (means start at 1)."""
    ADDITIVE = "additive"
    """y = (x + s) W^T + r + b: the reference's additive variant (means start at 0)."""


class Init(_Option):
    """How the posterior means are initialised."""

    PRESERVE = "preserve"
    """Means exactly at the identity (1, or 0 for additive): a pretrained model's function is kept."""
    RANDOM_SIGN = "random_sign"
    """The reference's ``random_sign_init``: +-1 (+1 with probability ``init_sign_p``), for training from scratch."""
    NORMAL = "normal"
    """Normal(identity, ``init_mean_std``): small random spread around the identity."""


class Route(_Option):
    """Which mixture component each example of a forward pass goes through."""

    SAMPLE = "sample"
    """One component per example, drawn uniformly at random (training default; cost ~1x)."""
    TILE = "tile"
    """Every example through all K components; output is the raw members, member-major ([K*B, ...])."""
    MIXTURE = "mixture"
    """Every example through all K components; output reduced to the mixture predictive (evaluation default)."""
    COMPONENT = "component"
    """Every example through one chosen component (``mode(component=k)``)."""


class Reduction(_Option):
    """How the ``mixture`` route reduces the members' outputs to one output per example."""

    LOGITS = "logits"
    """log(mean_k softmax(z_k)): the mixture's log-probabilities, usable as logits."""
    BINARY_LOGITS = "binary_logits"
    """logit(mean_k sigmoid(z_k)): for binary classifiers with one output unit."""
    MEAN = "mean"
    """mean_k z_k: for regression or features."""


_E = TypeVar("_E", bound=_Option)


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
