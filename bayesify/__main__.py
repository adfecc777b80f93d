"""``python -m bayesify``: the same as the ``bayesify`` command (see :mod:`bayesify.cli`)."""

import sys

from bayesify.cli import main

sys.exit(main())
