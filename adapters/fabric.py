"""Moved: ``joinkit.adapters.fabric`` is now ``joinkit.adapters.lightning.fabric``
(one room per library).

This path keeps working: it re-exports that module's public names and warns
once (a ``DeprecationWarning``) when first imported.
"""

from __future__ import annotations

import warnings

from .lightning.fabric import *  # noqa: F403
from .lightning.fabric import __all__  # noqa: F401

warnings.warn(
    "joinkit.adapters.fabric moved to joinkit.adapters.lightning.fabric; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
