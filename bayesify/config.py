"""The options of a rank-1 conversion, validated once, shared by every converted layer."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from bayesify.options import Init, Perturbation, Posterior, Prior, Reduction, parse_option
from bayesify.priors.kl import check_pair

__all__ = ["Rank1Config"]


def _positive(name: str, value: float, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0; {fix}.")
    return float(value)


@dataclass(frozen=True)
class Rank1Config:
    """Options of :func:`bayesify.convert`; see its docstring for what each one means."""

    components: int = 4
    prior: Prior = Prior.NORMAL
    prior_mean: float | None = None
    prior_std: float = 0.1
    posterior: Posterior = Posterior.NORMAL
    perturbation: Perturbation = Perturbation.MULTIPLICATIVE
    init: Init = Init.PRESERVE
    init_sign_p: float = 0.5
    init_mean_std: float = 0.1
    init_dropout: float | None = None
    init_std: float | None = None
    init_jitter: float = 0.0
    clip: float | None = 10.0
    batch_dim: int = 0
    reduction: Reduction = Reduction.LOGITS
    embeddings: bool = False
    embedding_prior_std: float = 1.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once
        if isinstance(self.components, bool) or not isinstance(self.components, int) or self.components < 1:
            raise ValueError(
                f"components={self.components!r} must be an integer >= 1 (the number of mixture components; "
                "the paper uses 4)."
            )
        set_(self, "prior", parse_option(self.prior, Prior, "prior"))
        set_(self, "posterior", parse_option(self.posterior, Posterior, "posterior"))
        set_(self, "perturbation", parse_option(self.perturbation, Perturbation, "perturbation"))
        set_(self, "init", parse_option(self.init, Init, "init"))
        set_(self, "reduction", parse_option(self.reduction, Reduction, "reduction"))
        check_pair(self.posterior, self.prior)
        set_(self, "prior_std", _positive("prior_std", self.prior_std, "the paper uses 0.1 (CIFAR) or 0.05 (ImageNet)"))
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
        if not isinstance(self.embeddings, bool):
            raise TypeError(f"embeddings={self.embeddings!r} must be True or False (Gaussian variational embeddings).")
        _positive("embedding_prior_std", self.embedding_prior_std, "it is the std of the Normal(0, std) prior on embeddings")
        if isinstance(self.batch_dim, bool) or not isinstance(self.batch_dim, int) or self.batch_dim < 0:
            raise ValueError(f"batch_dim={self.batch_dim!r} must be an integer >= 0 (where the batch lies in inputs).")

    @property
    def identity(self) -> float:
        """The factor value that leaves a layer unchanged: 1 multiplicative, 0 additive."""
        return 1.0 if self.perturbation is Perturbation.MULTIPLICATIVE else 0.0

    @property
    def initial_std(self) -> float:
        """Initial posterior scale: ``init_std``, else the dropout parameterisation sqrt(p / (1 - p))."""
        if self.init_std is not None:
            return self.init_std
        p = self.init_dropout
        if p is None:
            p = 1e-6 if self.posterior is Posterior.CAUCHY else 1e-3
        return math.sqrt(p / (1.0 - p))

    def replace(self, **changes: object) -> "Rank1Config":
        return replace(self, **changes)
