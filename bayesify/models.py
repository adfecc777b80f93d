"""Deprecated: the demo models moved to :mod:`bayesify.zoo.models` (this alias stays for one release)."""

import warnings

from bayesify.zoo.models import *  # noqa: F401,F403
from bayesify.zoo.models import __all__  # noqa: F401

warnings.warn("bayesify.models is deprecated; use bayesify.zoo.models.", DeprecationWarning, stacklevel=2)
