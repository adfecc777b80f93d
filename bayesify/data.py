"""Deprecated: the demo data sets moved to :mod:`bayesify.zoo.data` (this alias stays for one release)."""

import warnings

from bayesify.zoo.data import *  # noqa: F401,F403
from bayesify.zoo.data import __all__  # noqa: F401

warnings.warn("bayesify.data is deprecated; use bayesify.zoo.data.", DeprecationWarning, stacklevel=2)
