"""Moved: ``joinkit.adapters.optim`` is now ``joinkit.adapters.torch.optim`` (one room per library).

This path keeps working: it re-exports that module's public names and warns
once (a ``DeprecationWarning``) when first imported.
"""

from __future__ import annotations

import warnings

from .torch.optim import *  # noqa: F403
from .torch.optim import __all__  # noqa: F401

warnings.warn(
    "joinkit.adapters.optim moved to joinkit.adapters.torch.optim; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
