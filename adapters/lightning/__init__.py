"""Lightning under joinkit's Join: the Trainer's callback and Fabric's objects.

- :class:`UnevenInputs` (``_trainer``): ``Trainer(callbacks=[UnevenInputs()])``
  runs every training epoch with per-rank uneven dataloaders inside a Join;
- :mod:`joinkit.adapters.lightning.fabric`: what ``fabric.setup`` returns,
  unwrapped for the torch adapters (``Join([model, optimizer])``);
- ``_private``: the guard table of the Lightning internals both rely on
  (:class:`UnsupportedLightningError`).

Importing this package imports no Lightning: ``UnevenInputs`` loads the
Trainer's module (``pytorch_lightning``) when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._private import UnsupportedLightningError

if TYPE_CHECKING:
    from ._trainer import UnevenInputs

__all__ = ["UnevenInputs", "UnsupportedLightningError"]


def __getattr__(name: str) -> Any:
    if name == "UnevenInputs":
        from ._trainer import UnevenInputs

        return UnevenInputs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
