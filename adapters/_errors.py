"""The errors every torch-bearing room raises when its framework changed: below the rooms.

The rooms (``torch/``, ``torchmetrics/``) take these classes from here, never
from the package's ``__init__``, which loads the rooms on demand and
re-exports the classes (the import graph stays a hierarchy). Standard library
only.
"""

from __future__ import annotations

__all__ = ["UnsupportedTorchError", "UnsupportedTorchmetricsError"]


class UnsupportedTorchError(RuntimeError):
    """This torch lacks or changed an internal that an adapter relies on.

    Raised when an adapter adapts an object (so when ``Join`` is built), once
    per kind of object and process; the message names the torch version, each
    member that changed and the torch versions this joinkit supports
    (``joinkit.adapters.torch._private``).
    """


class UnsupportedTorchmetricsError(RuntimeError):
    """This torchmetrics lacks or changed an internal that the metrics adapter relies on.

    Raised when ``Join`` adapts a torchmetrics object (once per process); the
    message names the torchmetrics version, each member that changed and the
    versions this joinkit supports (``joinkit.adapters.torchmetrics._private``).
    """
