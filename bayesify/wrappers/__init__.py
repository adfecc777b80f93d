"""Deprecated: the layer classes moved to :mod:`bayesify.layers` (this alias stays for one release)."""

import warnings

from bayesify.layers import *  # noqa: F401,F403
from bayesify.layers import __all__  # noqa: F401

warnings.warn("bayesify.wrappers is deprecated; use bayesify.layers.", DeprecationWarning, stacklevel=2)
