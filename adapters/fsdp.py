"""Moved: ``joinkit.adapters.fsdp`` is now ``joinkit.adapters.torch.fsdp`` (one room per library).

This path keeps working: it re-exports that module's public names and warns
once (a ``DeprecationWarning``) when first imported.
"""

from __future__ import annotations

import warnings

from .torch.fsdp import *  # noqa: F403
from .torch.fsdp import __all__  # noqa: F401

warnings.warn(
    "joinkit.adapters.fsdp moved to joinkit.adapters.torch.fsdp; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
