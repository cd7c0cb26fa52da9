"""Bridges from framework objects to joinkit's Join.

``joinkit.adapters.torch`` drives torch's own Joinables (DDP,
ZeroRedundancyOptimizer, any ``torch.distributed.algorithms.join.Joinable``).
The core finds it through the ``joinkit.adapters`` entry point :data:`TORCH`,
which imports the adapter module only for an object that is a torch Joinable,
so importing joinkit never imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from joinkit import Adapter, Joinable

__all__ = ["TORCH"]

_TORCH_JOIN = "torch.distributed.algorithms.join"
_TORCH_ADAPTER = "joinkit.adapters.torch"


def _is_torch_joinable(obj: Any) -> bool:
    join_module = sys.modules.get(_TORCH_JOIN)
    return join_module is not None and isinstance(obj, join_module.Joinable)


def _adapt_torch(obj: Any) -> Joinable:
    from . import torch as torch_adapter

    return torch_adapter.adapt(obj)


def _check_torch(joinables: Sequence[Joinable]) -> None:
    adapter_module = sys.modules.get(_TORCH_ADAPTER)
    if adapter_module is not None:  # loaded once a torch joinable was adapted
        adapter_module.check_order(joinables)


#: torch's Joinables, through ``joinkit.adapters.torch`` (the entry point).
TORCH = Adapter(name="torch", matches=_is_torch_joinable, adapt=_adapt_torch, check=_check_torch)
