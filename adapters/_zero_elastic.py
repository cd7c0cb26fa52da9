"""ZeroRedundancyOptimizer beside its DDP model in ``Join(..., on_rank_loss="finish")``.

Theory of operation
-------------------
ZeRO steps each rank's shard of the parameters and then broadcasts every
shard from its owner (``_sync_params``: one broadcast per parameter and rank,
on ``zero.process_group``); a joined rank's hook steps its shard and sends its
broadcasts. Those collectives do not go through the elastic TorchGroup's
units, so a death in them could not be recovered, and an owner that dies takes
its shard's next values with it. While a finish-mode Join lasts this module
removes them instead, exactly, for a *stateless* optimizer:

- *Every rank steps every parameter.* DDP's gradient unit
  (``adapters._ddp_elastic``) gives every active rank the same averaged
  gradient, bit for bit, and the parameters are the same on every active
  rank, so each can run the optimizer's step on all of them: the same
  operation on the same data gives the bits the owner would have computed and
  broadcast. ``zero.optim`` is, for the Join, an optimizer of the same class
  and arguments over every parameter (ZeRO's ``_local_step`` steps it and
  keeps the hyper-parameters in sync as it does with its shard), and
  ``zero._sync_params`` sends nothing. No collective: a death anywhere in the
  step is a death after the iteration's gradient unit, which DDP already
  counts.
- *A joined rank shadows nothing for ZeRO* (its hook returns at once; DDP's
  shadow still matches the gradient unit). Its parameters stay as they were
  when it joined; DDP's post hook gives every survivor the last joiners'
  model, as with DDP alone.
- *Stateless only.* A shard of optimizer state (momentum, Adam's moments)
  lives on its owner alone and dies with it, so only ``torch.optim.SGD`` with
  ``momentum=0`` in every parameter group (any ``lr``, ``weight_decay``,
  ``maximize``) is accepted; anything else is refused on entry, naming what
  works. ``overlap_with_ddp=True`` (ZeRO's steps ride in a DDP comm hook; ours
  is the gradient unit) and ``parameters_as_bucket_view=True`` are refused too.
- *After a loss* ZeRO moves onto the rebuilt group on exit: its
  ``process_group`` is the one DDP moves to (``ElasticDDP.rebuilt_process_group``,
  registered with c10d so that ``dist.broadcast(group=...)`` maps its ranks),
  ``rank``/``world_size``/``global_rank`` are the survivor's, the partition
  caches are cleared and the local optimizer is rebuilt over the new partition
  (it holds no state to lose). Steps after the Join are ZeRO again, over the
  survivors. Without a loss the shard optimizer simply comes back.

Standard library, torch and joinkit; imported by ``adapters.torch`` only in
finish mode.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ElasticZeRO", "refusal", "stateful", "stateful_message"]

_HEAD = "Join(on_rank_loss='finish') cannot hold ZeroRedundancyOptimizer: "


def stateful(zero: Any) -> str | None:
    """What makes ``zero``'s local optimizer keep state, or ``None`` if it keeps none.

    Args:
        zero: the ZeroRedundancyOptimizer.

    Returns:
        A short description (``"torch.optim.Adam"``, ``"SGD with momentum=0.9"``),
        or ``None`` for SGD with ``momentum=0`` in every parameter group.
    """
    optim = getattr(zero, "optim", None)
    if optim is None or type(optim) is not torch.optim.SGD:
        cls = zero._optim_constructor
        name = getattr(cls, "__qualname__", repr(cls))
        return f"{getattr(cls, '__module__', '')}.{name}".lstrip(".")
    for group in optim.param_groups:
        if group.get("momentum", 0) != 0:
            return f"SGD with momentum={group['momentum']}"
    return None


def stateful_message(what: str) -> str:
    """The refusal of a ZeRO whose optimizer keeps state (``what``: :func:`stateful`)."""
    return (_HEAD + f"its optimizer ({what}) keeps state, and ZeroRedundancyOptimizer "
            "keeps a shard of the optimizer state on each rank: a dead rank's shard is "
            "lost with it. What works: a stateless optimizer, torch.optim.SGD with "
            "momentum=0 (any lr and weight_decay), as Join([ddp_model, zero], "
            "on_rank_loss='finish'); or use on_rank_loss='raise' (the default) and "
            "restart from a checkpoint")


def refusal(zero: Any, ddp: Any) -> str | None:
    """Why ``[ddp, zero]`` cannot be in a finish-mode Join, or ``None`` when it can.

    The same on every rank (ZeRO's and DDP's settings agree across ranks).

    Args:
        zero: the ZeroRedundancyOptimizer.
        ddp: the DistributedDataParallel model listed before it.

    Returns:
        The message (what is wrong and how to fix it), or ``None``.
    """
    if zero._overlap_with_ddp:
        return (_HEAD + "overlap_with_ddp=True runs its steps in a DDP comm hook on "
                "ZeRO's own group, and finish mode needs DDP's comm hook for the gradient "
                "unit that survives a dead rank. Build it with overlap_with_ddp=False (the "
                "default), or use on_rank_loss='raise'")
    if zero.parameters_as_bucket_view:
        return (_HEAD + "parameters_as_bucket_view=True is not in this version. Build it "
                "with parameters_as_bucket_view=False (the default), or use "
                "on_rank_loss='raise'")
    what = stateful(zero)
    if what is not None:
        return stateful_message(what)
    mine = {id(p) for p in ddp.parameters()}
    if any(id(p) not in mine for group in zero.param_groups for p in group["params"]):
        return (_HEAD + "it steps parameters that the DistributedDataParallel model in the "
                "same Join does not hold, whose gradients no unit averages. Build it over "
                "the model's parameters, ZeroRedundancyOptimizer(model.parameters(), ...), "
                "or use on_rank_loss='raise'")
    return None


class ElasticZeRO:
    """One ZeroRedundancyOptimizer inside one finish-mode Join (module doc).

    Args:
        zero: the optimizer (already checked by :func:`refusal`).
        elastic_ddp: the ``ElasticDDP`` of the model listed before it.
    """

    def __init__(self, zero: Any, elastic_ddp: Any) -> None:
        self.zero = zero
        self.elastic_ddp = elastic_ddp
        self.shard = zero.optim
        # The same class and arguments over every parameter; the groups carry
        # the current hyper-parameters (ZeRO syncs them into it at each step).
        groups = [copy.copy(group) for group in zero.param_groups]
        self.full = zero._optim_constructor(groups, **zero._optim_defaults)
        zero.optim = self.full
        zero._sync_params = self.after_step

    def after_step(self) -> None:
        """ZeRO's ``_sync_params`` in finish mode: nothing to broadcast (module doc).

        Raises:
            LocalProtocolError: the step created optimizer state (momentum was
                set during the Join): a dead rank's shard of it could not be
                rebuilt.
        """
        if any(self.full.state.values()):
            from joinkit import LocalProtocolError

            raise LocalProtocolError(
                "ZeroRedundancyOptimizer in Join(on_rank_loss='finish'): a step created "
                "optimizer state (momentum set in a parameter group during the Join); "
                "only a stateless optimizer (SGD with momentum=0) can be rebuilt after a "
                "dead rank. Keep momentum=0 while the Join lasts")

    def close(self) -> None:
        """The Join is over: give ZeRO its shard back, or rebuild it on the survivors."""
        zero = self.zero
        if zero.__dict__.get("_sync_params") == self.after_step:
            del zero.__dict__["_sync_params"]
        if zero.optim is self.full:
            zero.optim = self.shard
        process_group = self.elastic_ddp.rebuilt_process_group()
        if process_group is not None:
            _rebuild(zero, process_group)


def _rebuild(zero: Any, process_group: Any) -> None:
    """Move ``zero`` onto ``process_group`` (the survivors): new partition, new local optimizer."""
    zero.process_group = process_group
    zero.world_size = process_group.size()
    zero.rank = process_group.rank()
    zero.global_rank = dist.distributed_c10d.get_global_rank(process_group, zero.rank)
    zero._all_state_dicts = []
    zero._clear_cache()
    zero._init_local_optimizer()  # SGD with momentum 0: no state to carry over
