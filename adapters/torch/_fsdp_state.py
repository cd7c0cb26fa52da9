"""FSDP2's state objects and parameter groups, as joinkit reads them.

Rules of this room: the members read here are FSDP internals, listed in
``_private``'s FSDP2 groups (checked when a model is adapted; their spellings
across torch releases are ``_compat``'s); the FSDP
adapter (``fsdp``) and its finish mode (``_fsdp_elastic``) both read them
through these two functions.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from . import _compat

__all__ = ["states", "param_groups"]


def states(model: nn.Module) -> list[Any]:
    """The distinct FSDP states of ``model``'s ``fully_shard`` modules, in module order."""
    seen: list[Any] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if all(state is not s for s in seen):
                seen.append(state)
    return seen


def param_groups(model: nn.Module) -> list[Any]:
    """Every FSDP parameter group of ``model``, in module order."""
    return [group for state in states(model) for group in _compat.fsdp_param_groups(state)]
