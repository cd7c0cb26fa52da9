"""Lightning Fabric: ``Join([model, optimizer])`` with what ``fabric.setup`` returns.

Theory of operation
-------------------
``fabric.setup(model, optimizer)`` returns wrappers: a ``_FabricModule`` whose
``_forward_module`` is the module the strategy built (a
``DistributedDataParallel`` under ``strategy="ddp"``, the ``fully_shard``
(FSDP2) root module under ``ModelParallelStrategy``), and a
``_FabricOptimizer`` around the optimizer (``.optimizer``). :func:`adapt` hands
the inner objects to the adapters that already know them (``adapters.torch``
for DDP, ``adapters.fsdp`` for FSDP2, ``adapters.optim`` for an optimizer of
sharded parameters), so the forward's heartbeat, the shadow rounds and the post
hooks are theirs; ``fabric.backward(loss)`` is ``loss.backward()`` for these
strategies and needs nothing.

*An optimizer beside DDP.* A joined DDP rank does not step: DDP's post hook
broadcasts the last joiner's parameters. Its optimizer *state* (momentum, Adam's
moments and step count) would stay behind, and the next epoch's steps would
differ across ranks. So the optimizer of plain (not sharded) parameters
becomes an :class:`OptimizerStateSync`: no shadow, and a post hook that
broadcasts the last joiner's ``optimizer.state_dict()`` to every rank, so the
replicas stay identical, as after a single process's epoch.

*Refused.* Lightning's ``strategy="fsdp"`` builds FSDP1
(``FullyShardedDataParallel``), which joinkit cannot shadow: a clear
``TypeError`` says to use ``ModelParallelStrategy`` with ``fully_shard``.
Fabric's private members are checked by ``adapters._lightning_private``.
"""

from __future__ import annotations

from typing import Any

try:
    import torch
    import torch.distributed as dist
    from lightning_fabric import wrappers
except ImportError as error:  # pragma: no cover - the lightning extra is missing
    raise ImportError(
        "Could not find lightning_fabric: joinkit's Fabric adapter needs it. Please run "
        "`pip install 'joinkit[lightning]'`"
    ) from error

from joinkit import Joinable, JoinHook
from joinkit import lowlevel as ports
from joinkit.lowlevel import AdapterCache, AdapterJoinable

from . import _private

__all__ = ["adapt", "is_fabric_object", "OptimizerStateSync"]


def is_fabric_object(obj: Any) -> bool:
    """Whether ``obj`` is a Fabric model or optimizer wrapper."""
    return isinstance(obj, (wrappers._FabricModule, wrappers._FabricOptimizer))


def adapt(obj: Any) -> Joinable:
    """The joinable for a ``_FabricModule`` or ``_FabricOptimizer`` (module doc).

    Raises:
        UnsupportedLightningError: Fabric's wrappers changed.
        TypeError: the model is not one joinkit can shadow (FSDP1, no DDP or
            ``fully_shard`` module inside: a single-device strategy).
    """
    _private.check("Fabric")
    if isinstance(obj, wrappers._FabricModule):
        inner = obj._forward_module
        if _is_fsdp1(inner):
            # Before the torch adapter takes it: this module's optimizer adapter would
            # sync a DDP optimizer's state, and an FSDP1 rank's state is its own shard.
            raise TypeError(
                "Join got a Fabric model set up by Lightning's FSDPStrategy (FSDP1, "
                "FullyShardedDataParallel): pass what Fabric wraps, "
                "Join([model._forward_module, optimizer.optimizer]) (joinkit's FSDP1 "
                "adapter replays the model and steps a joined rank's shards), or use "
                "Fabric(strategy=ModelParallelStrategy(parallelize_fn=...)) (FSDP2)"
            )
        joinable = ports.adapt(inner)
        if joinable is not None:
            return joinable
        raise TypeError(
            f"Join got a Fabric model whose strategy built a {type(inner).__qualname__}, not a "
            "DistributedDataParallel or fully_shard module: joinkit supports Fabric's 'ddp' "
            "strategies and ModelParallelStrategy (FSDP2). On one device there is nothing "
            "to join: Join(..., enable=False)"
        )
    optimizer = obj.optimizer
    if any(_is_dtensor(p) for group in optimizer.param_groups for p in group["params"]):
        found = ports.adapt(optimizer)  # adapters.optim: steps the joined rank's shards
        assert found is not None
        return found
    return _state_syncs.get(optimizer, OptimizerStateSync)


class OptimizerStateSync(AdapterJoinable):
    """The optimizer of a DDP model: its post hook gives every rank the last joiner's state."""

    join_follows_group = True
    describes = "optimizer"

    @property
    def optimizer(self) -> Any:
        """The optimizer (``obj``)."""
        return self.obj

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _StateSyncHook(self)

    @property
    def join_device(self) -> Any:
        join = self._join_config.join
        return None if join is None else join.device

    @property
    def join_process_group(self) -> Any:
        join = self._join_config.join
        return None if join is None else join.process_group

    def sync_state(self, is_last_joiner: bool) -> None:
        """Broadcast the optimizer state of one last joiner to every rank (a collective)."""
        group = self.join_process_group
        candidate = torch.tensor([dist.get_rank(group) if is_last_joiner else -1])
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=group)
        source = dist.get_global_rank(group, int(candidate[0])) if group is not None else int(
            candidate[0])
        optimizer = self.optimizer
        box = [optimizer.state_dict() if source == dist.get_rank() else None]
        dist.broadcast_object_list(box, src=source, group=group)
        if source != dist.get_rank():
            optimizer.load_state_dict(box[0])


class _StateSyncHook(JoinHook):
    def __init__(self, adapter: OptimizerStateSync) -> None:
        self.adapter = adapter

    def post_hook(self, is_last_joiner: bool) -> None:
        self.adapter.sync_state(is_last_joiner)


#: One OptimizerStateSync per optimizer.
_state_syncs: AdapterCache[OptimizerStateSync] = AdapterCache()


def _is_fsdp1(module: Any) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
