"""Deprecated: distributions and KLs moved to :mod:`bayesify.variational` (this alias stays for one release)."""

import warnings

from bayesify.variational import *  # noqa: F401,F403
from bayesify.variational import __all__  # noqa: F401
from bayesify.variational import distributions, kl  # noqa: F401

warnings.warn("bayesify.priors is deprecated; use bayesify.variational.", DeprecationWarning, stacklevel=2)
