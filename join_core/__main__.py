"""``python -m joinkit``: see :mod:`joinkit._cli`."""

import sys

from ._cli import main

sys.exit(main())
