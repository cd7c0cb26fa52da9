"""Moved: ``joinkit.adapters.collectives`` is now ``joinkit.adapters.torch.collectives``
(one room per library).

This path keeps working: it re-exports that module's public names and warns
once (a ``DeprecationWarning``) when first imported.
"""

from __future__ import annotations

import warnings

from .torch.collectives import *  # noqa: F403
from .torch.collectives import __all__  # noqa: F401

warnings.warn(
    "joinkit.adapters.collectives moved to joinkit.adapters.torch.collectives; import it "
    "from there",
    DeprecationWarning,
    stacklevel=2,
)
