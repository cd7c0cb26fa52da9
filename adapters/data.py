"""Moved: ``joinkit.adapters.data`` is now ``joinkit.adapters.torch.data`` (one room per library).

This path keeps working: it re-exports that module's public names and warns
once (a ``DeprecationWarning``) when first imported.
"""

from __future__ import annotations

import warnings

from .torch.data import *  # noqa: F403
from .torch.data import __all__  # noqa: F401

warnings.warn(
    "joinkit.adapters.data moved to joinkit.adapters.torch.data; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
