"""torch's own objects under joinkit's Join: one room for everything torch.

What is here (each module's doc says more):

- torch's Joinables (DistributedDataParallel, ZeroRedundancyOptimizer, any
  ``torch.distributed.algorithms.join.Joinable``): :func:`adapt` gives the
  joinkit Joinable standing for one (``_joinables``; DDP models with
  collectives in forward are replayed, ``_ddp_replay``; finish mode:
  ``_ddp_elastic``, ``_zero_elastic``);
- :mod:`joinkit.adapters.torch.fsdp`: root ``fully_shard`` (FSDP2) modules
  (finish mode: ``_fsdp_elastic``; FSDP's state as read: ``_fsdp_state``);
- :mod:`joinkit.adapters.torch.fsdp1`: root ``FullyShardedDataParallel`` (FSDP1)
  modules, the FSDP2 joinable with FSDP1's state where the two differ;
- :mod:`joinkit.adapters.torch.optim`: optimizers, LR schedulers and
  GradScalers, the rest of a joined rank's training step;
- :mod:`joinkit.adapters.torch.data`: exact shards (``ShardSampler``,
  ``ShardedIterable``);
- :mod:`joinkit.adapters.torch.collectives`: ``SideCollective`` wrappers of
  torch.distributed calls;
- ``_replay``: a joined rank's replay of a model's forward and backward;
- ``_private``: the guard table of every torch internal the adapters use.
- ``_compat``: the torch internals that differ between the releases joinkit
  supports (2.6 and later), each resolved once; the rest of the room uses its answers.

Importing this package imports nothing of torch: the core reaches these
adapters through ``joinkit.adapters``' entry points once the program imported
torch, and :func:`adapt` checks the torch internals (``_private``) before the
module that uses them is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from joinkit import Joinable

    from ._joinables import TorchJoinable

__all__ = ["adapt", "check_order", "TorchJoinable"]


def adapt(obj: Any) -> TorchJoinable:
    """Return the joinkit Joinable that stands for a torch Joinable.

    The same object always gets the same adapter, so the shell notices a torch
    object entered in two nested Joins.

    Args:
        obj: an instance of ``torch.distributed.algorithms.join.Joinable``.

    Returns:
        Its ``TorchJoinable``.

    Raises:
        TypeError: ``obj`` is not a torch Joinable.
        UnsupportedTorchError: this torch lacks or changed an internal the
            adapter relies on (``_private``).
        LocalProtocolError: ``obj``'s constructor did not call
            ``Joinable.__init__``.
    """
    from . import _private

    _private.check(obj)  # before _joinables reads torch internals at import
    from . import _joinables

    return _joinables.adapt(obj)


def check_order(joinables: Sequence[Joinable]) -> None:
    """Refuse a ZeroRedundancyOptimizer listed before a DDP model it steps.

    Raises:
        ValueError: the order cannot be shadowed (the message says which to swap).
    """
    from . import _joinables

    _joinables.check_order(joinables)


def __getattr__(name: str) -> Any:
    if name == "TorchJoinable":
        from ._joinables import TorchJoinable

        return TorchJoinable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
