"""DeepSpeed under Join: a joined rank replays the engine's whole step.

``Join([engine])`` takes the engine ``deepspeed.initialize`` returns (ZeRO
stages 0 to 3) and gives it a :class:`DeepSpeedJoinable`: while some rank still
has data, a rank that ran out replays each of its peers' iterations through
the engine itself (forward on an empty batch, ``engine.backward`` of a zero
loss, ``engine.step``), so ZeRO's reductions, stage 3's gathers, gradient
clipping's norm and the partitioned optimizer step run on every rank as they
should, and the joined rank keeps stepping its own optimizer partition with
the active ranks' gradient (docs/deepspeed.md).

This module imports neither torch nor DeepSpeed: the adapter (:data:`DEEPSPEED`,
the ``joinkit.adapters`` entry point ``deepspeed``) recognises an engine only
once the program imported DeepSpeed, and the names below that need torch load
their module on first use.

Public names:

- :class:`DeepSpeedJoinable`, :func:`adapt` (what ``Join`` does with an engine);
- :func:`evaluation`: the joinable of an evaluation loop (forward only);
- :func:`is_engine`, :func:`engine_parts`: for integrations that take the objects
  a framework prepared (joinkit's Accelerate path); :func:`collectives_group`: the
  group an engine's step (and its Join) runs its collectives on, for integrations
  that run more of the engine's collectives beside the Join (the Trainer's
  checkpoints);
- :data:`SUPPORTED_DEEPSPEED`, :class:`UnsupportedDeepSpeedError`.

``pip install 'joinkit[deepspeed]'`` (deepspeed 0.18.3 and later).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from joinkit import Adapter, Joinable

# Defined beside the guard table, which _engine imports without this package
# (the package loads _engine, never the reverse).
from ._private import SUPPORTED_DEEPSPEED, UnsupportedDeepSpeedError, is_engine

if TYPE_CHECKING:
    from ._engine import DeepSpeedJoinable, adapt, collectives_group, engine_parts, evaluation

__all__ = ["DEEPSPEED", "DeepSpeedJoinable", "adapt", "evaluation", "is_engine",
           "engine_parts", "collectives_group", "SUPPORTED_DEEPSPEED",
           "UnsupportedDeepSpeedError"]

_OPTIMIZER_MODULE = "deepspeed.runtime.base_optimizer"
_ADAPTER_MODULE = "joinkit.adapters.deepspeed._engine"


def _is_engine_part(obj: Any) -> bool:
    """A DeepSpeed optimizer, or an optimizer or scheduler of an engine adapted before."""
    base = getattr(sys.modules.get(_OPTIMIZER_MODULE), "DeepSpeedOptimizer", None)
    if isinstance(base, type) and isinstance(obj, base):
        return True
    adapter_module = sys.modules.get(_ADAPTER_MODULE)
    return adapter_module is not None and adapter_module.owned_by_an_engine(obj)


def _matches(obj: Any) -> bool:
    return is_engine(obj) or _is_engine_part(obj)


def _adapt(obj: Any) -> Joinable:
    from . import _engine

    return _engine.adapt(obj)


def _check(joinables: Sequence[Joinable]) -> None:
    adapter_module = sys.modules.get(_ADAPTER_MODULE)
    if adapter_module is not None:  # loaded once an engine was adapted
        adapter_module.check(joinables)


def __getattr__(name: str) -> Any:
    if name in ("DeepSpeedJoinable", "adapt", "evaluation", "engine_parts", "collectives_group"):
        from . import _engine

        return getattr(_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: DeepSpeed engines (and, to refuse them with a message, the optimizers and
#: schedulers they step), through ``joinkit.adapters.deepspeed._engine``.
DEEPSPEED = Adapter(name="deepspeed", matches=_matches, adapt=_adapt, check=_check)
