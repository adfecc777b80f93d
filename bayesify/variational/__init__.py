"""The variational side of a rank-1 layer: factor posteriors, their distributions, priors and KLs.

* :mod:`bayesify.variational.factor`: :class:`Rank1Factor`, the K-component posterior table of one factor.
* :mod:`bayesify.variational.distributions`: sampling, log-densities and the positive-scale parameterisation.
* :mod:`bayesify.variational.divergence`: KL(posterior || prior) for every supported pair, and the grouped model KL.
* :mod:`bayesify.variational.store`: the flat store of a model's factors and bias offsets, drawn in one go per group.
"""

from bayesify.variational.distributions import MIN_SCALE, log_prob, rsample, softplus_inverse
from bayesify.variational.factor import Rank1Factor
from bayesify.variational.divergence import (
    KLTerm,
    kl_cauchy_cauchy,
    kl_divergence,
    kl_normal_cauchy,
    kl_normal_normal,
    total_kl,
)

__all__ = [
    "MIN_SCALE",
    "KLTerm",
    "Rank1Factor",
    "kl_cauchy_cauchy",
    "kl_divergence",
    "kl_normal_cauchy",
    "kl_normal_normal",
    "log_prob",
    "rsample",
    "softplus_inverse",
    "total_kl",
]
