"""Deprecated: the model-level helpers moved to :mod:`bayesify.inspection` and :mod:`bayesify.kl`."""

import warnings

from bayesify.inspection import is_converted, num_components, rank1_layers, rank1_parameters
from bayesify.kl import kl_divergence

__all__ = ["is_converted", "kl_divergence", "num_components", "rank1_layers", "rank1_parameters"]

warnings.warn(
    "bayesify.modules is deprecated; import from bayesify (or bayesify.inspection / bayesify.kl).",
    DeprecationWarning,
    stacklevel=2,
)
