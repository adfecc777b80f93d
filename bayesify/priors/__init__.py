"""Distributions over the rank-1 factors and their KL divergences.

* :mod:`bayesify.priors.distributions`: sampling and log-densities of Normal and Cauchy.
* :mod:`bayesify.priors.kl`: KL(posterior || prior) for every supported pair.
"""

from bayesify.priors.distributions import log_prob, rsample, softplus_inverse
from bayesify.priors.kl import kl_cauchy_cauchy, kl_divergence, kl_normal_cauchy, kl_normal_normal

__all__ = [
    "kl_cauchy_cauchy",
    "kl_divergence",
    "kl_normal_cauchy",
    "kl_normal_normal",
    "log_prob",
    "rsample",
    "softplus_inverse",
]
