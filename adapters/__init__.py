"""Bridges from framework objects to joinkit's Join.

The adapters, each found by the core through the ``joinkit.adapters`` entry
point group (``pyproject.toml``); each imports its module only for an object
of a framework the program already imported, so importing joinkit never
imports torch:

- :data:`TORCH`: torch's own Joinables (DDP, ZeroRedundancyOptimizer, any
  ``torch.distributed.algorithms.join.Joinable``), ``joinkit.adapters.torch``;
- :data:`FSDP`: root ``torch.distributed.fsdp.fully_shard`` (FSDP2) modules,
  ``joinkit.adapters.torch.fsdp``, and root ``FullyShardedDataParallel`` (FSDP1)
  modules, ``joinkit.adapters.torch.fsdp1``;
- :data:`OPTIM`: plain ``torch.optim`` optimizers, LR schedulers and
  ``torch.amp.GradScaler`` (the rest of a training step on a joined rank),
  ``joinkit.adapters.torch.optim``;
- :data:`METRICS`: torchmetrics ``Metric`` and ``MetricCollection`` objects,
  ``joinkit.adapters.torchmetrics`` (the ``metrics`` extra);
- :data:`FABRIC`: what Lightning Fabric's ``fabric.setup`` returns (its model
  and optimizer wrappers), unwrapped for the adapters above,
  ``joinkit.adapters.lightning.fabric``.

*The house.* One sub-package per outside library, holding all of that
library's code, private helpers and guard table included: ``torch/``,
``lightning/`` (Trainer and Fabric), ``torchmetrics/``, ``ray/``,
``accelerate/``. What no library owns sits here: ``gather`` (exact gathering
inside a Join, any backend) and ``_guards`` (the guard-table checker every
room's ``_private`` uses).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from joinkit import Adapter, Joinable

from ._errors import UnsupportedTorchError, UnsupportedTorchmetricsError

__all__ = ["TORCH", "FSDP", "OPTIM", "METRICS", "FABRIC", "UnsupportedTorchError",
           "UnsupportedTorchmetricsError"]


_TORCH_JOIN = "torch.distributed.algorithms.join"
_TORCH_ADAPTER = "joinkit.adapters.torch._joinables"
_FSDP = "torch.distributed.fsdp"
_FSDP_ADAPTER = "joinkit.adapters.torch.fsdp"
_OPTIM_ADAPTER = "joinkit.adapters.torch.optim"
# module -> class: the objects OPTIM stands for.
_STEP_CLASSES = (
    ("torch.optim.optimizer", "Optimizer"),
    ("torch.optim.lr_scheduler", "LRScheduler"),
    ("torch.amp.grad_scaler", "GradScaler"),
)


def _is_torch_joinable(obj: Any) -> bool:
    join_module = sys.modules.get(_TORCH_JOIN)
    return join_module is not None and isinstance(obj, join_module.Joinable)


def _adapt_torch(obj: Any) -> Joinable:
    from . import torch as torch_adapter  # checks torch's internals first

    return torch_adapter.adapt(obj)


def _check_torch(joinables: Sequence[Joinable]) -> None:
    if _TORCH_ADAPTER in sys.modules:  # loaded once a torch joinable was adapted
        from . import torch as torch_adapter

        torch_adapter.check_order(joinables)


def _fsdp_classes() -> tuple[type, ...]:
    """FSDP2's ``FSDPModule`` and FSDP1's ``FullyShardedDataParallel``, once torch has them."""
    fsdp = sys.modules.get(_FSDP)
    return tuple(cls for cls in (getattr(fsdp, "FSDPModule", None),
                                 getattr(fsdp, "FullyShardedDataParallel", None))
                 if isinstance(cls, type))


def _is_fsdp_module(obj: Any) -> bool:
    classes = _fsdp_classes()
    return bool(classes) and isinstance(obj, classes)


def _adapt_fsdp(obj: Any) -> Joinable:
    fsdp2 = getattr(sys.modules.get(_FSDP), "FSDPModule", None)
    if isinstance(fsdp2, type) and isinstance(obj, fsdp2):
        from .torch import fsdp  # its adapt checks torch's FSDP internals

        return fsdp.adapt(obj)
    from .torch import fsdp1

    return fsdp1.adapt(obj)


def _check_fsdp(joinables: Sequence[Joinable]) -> None:
    adapter_module = sys.modules.get(_FSDP_ADAPTER)
    if adapter_module is not None:
        adapter_module.check(joinables)


def _is_step_object(obj: Any) -> bool:
    if _is_torch_joinable(obj) or _is_fabric_object(obj):  # ZeRO is TORCH's; Fabric's, FABRIC's
        return False
    for module_name, class_name in _STEP_CLASSES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and isinstance(obj, cls):
            return True
    return False


def _adapt_step(obj: Any) -> Joinable:
    from .torch import optim

    return optim.adapt(obj)


def _check_step(joinables: Sequence[Joinable]) -> None:
    adapter_module = sys.modules.get(_OPTIM_ADAPTER)
    if adapter_module is not None:
        adapter_module.check(joinables)


_METRICS_ADAPTER = "joinkit.adapters.torchmetrics"
# module -> class: the objects METRICS stands for.
_METRIC_CLASSES = (
    ("torchmetrics.metric", "Metric"),
    ("torchmetrics.collections", "MetricCollection"),
)


def _is_metric(obj: Any) -> bool:
    for module_name, class_name in _METRIC_CLASSES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and isinstance(obj, cls):
            return True
    return False


def _adapt_metric(obj: Any) -> Joinable:
    from . import torchmetrics as metrics_adapter

    return metrics_adapter.adapt(obj)


def _check_metric(joinables: Sequence[Joinable]) -> None:
    adapter_module = sys.modules.get(_METRICS_ADAPTER)
    if adapter_module is not None:
        adapter_module.check(joinables)


_FABRIC_WRAPPERS = "lightning_fabric.wrappers"


def _is_fabric_object(obj: Any) -> bool:
    wrappers = sys.modules.get(_FABRIC_WRAPPERS)
    if wrappers is None:
        return False
    classes = tuple(cls for cls in (getattr(wrappers, "_FabricModule", None),
                                    getattr(wrappers, "_FabricOptimizer", None))
                    if isinstance(cls, type))
    return bool(classes) and isinstance(obj, classes)


def _adapt_fabric(obj: Any) -> Joinable:
    from .lightning import fabric

    return fabric.adapt(obj)


#: torch's Joinables, through ``joinkit.adapters.torch`` (the entry point).
TORCH = Adapter(name="torch", matches=_is_torch_joinable, adapt=_adapt_torch, check=_check_torch)

#: Root FSDP2 modules, through ``joinkit.adapters.torch.fsdp``, and root FSDP1
#: modules, through ``joinkit.adapters.torch.fsdp1``.
FSDP = Adapter(name="fsdp", matches=_is_fsdp_module, adapt=_adapt_fsdp, check=_check_fsdp)

#: Optimizers, LR schedulers and GradScalers, through ``joinkit.adapters.torch.optim``.
OPTIM = Adapter(name="torch.optim", matches=_is_step_object, adapt=_adapt_step,
                check=_check_step)

#: torchmetrics ``Metric`` and ``MetricCollection``, through ``joinkit.adapters.torchmetrics``.
METRICS = Adapter(name="torchmetrics", matches=_is_metric, adapt=_adapt_metric,
                  check=_check_metric)

#: Lightning Fabric's model and optimizer wrappers, through
#: ``joinkit.adapters.lightning.fabric``.
FABRIC = Adapter(name="lightning_fabric", matches=_is_fabric_object, adapt=_adapt_fabric)
