"""ZeroRedundancyOptimizer beside its DDP model in ``Join(..., on_rank_loss="finish")``.

Theory of operation
-------------------
ZeRO steps each rank's shard of the parameters and then broadcasts every
shard from its owner (``_sync_params``: one broadcast per parameter and rank,
on ``zero.process_group``); a joined rank's hook steps its shard and sends its
broadcasts. Those collectives do not go through the elastic TorchGroup's
units, so a death in them could not be recovered, and an owner that dies takes
its shard's next values, and its shard of the optimizer state (Adam's moments,
SGD's momentum), with it. While a finish-mode Join lasts this module replaces
them by *replicated state*, exactly, for any optimizer class:

- *The full state on every rank, at entry.* Each rank hands its shard's
  optimizer state (keyed by the parameter's index in ``zero.param_groups``)
  to every other rank in ONE unit of the Join's elastic TorchGroup
  (``all_gather_object``). A rank that dies during it either completed it on
  some survivor (the hand-over gives its shard to everyone) or on none: then
  its shard is missing, every survivor sees the same gap and the Join is left
  with a ``LocalProtocolError`` before its loop, on every survivor alike.
- *Every rank steps every parameter.* ``zero.optim`` is, for the Join, an
  optimizer of the same class and arguments over every parameter, holding
  that full state (ZeRO's ``_local_step`` steps it and keeps the
  hyper-parameters in sync as it does with its shard: lr schedulers keep
  working), and ``zero._sync_params`` sends nothing. DDP's gradient unit
  (``adapters._ddp_elastic``) gives every rank the same averaged gradient,
  bit for bit, so every rank computes the bits the owner would have computed
  (on the CPU torch's optimizers run their per-parameter loop, whatever the
  grouping). No collective: a death anywhere in the step is a death after the
  iteration's gradient unit, which DDP already counts.
- *A joined rank steps too.* Its ZeRO hook (``adapters.torch._ZeROShadow``)
  steps every parameter with the round's averaged gradient that DDP's shadow
  unit produced, when that unit had a contributor (an iteration some rank
  consumed); a round whose unit nobody contributed to (``no_sync``, or the
  only active rank died before its backward) steps nothing, as no active rank
  steps. So parameters and the full state are the same on every rank after
  every round, and stay right when the last joiner dies.
- *On exit* the state goes back to ZeRO's shards. Without a loss each rank's
  shard optimizer gets its parameters' state from the full copy (as the steps
  of the Join left it). After a loss ZeRO moves onto the rebuilt group: its
  ``process_group`` is the one DDP moves to
  (``ElasticDDP.rebuilt_process_group``, registered with c10d so that
  ``dist.broadcast(group=...)`` maps its ranks), ``rank``/``world_size``/
  ``global_rank`` are the survivor's, the partition caches are cleared, the
  local optimizer is rebuilt over the new partition, and it gets that
  partition's state from the full copy. Steps after the Join are ZeRO again,
  over the survivors, with the state they would have had.
- *Cost:* while the Join lasts every rank holds the whole optimizer state
  (ZeRO's memory saving is suspended), and at entry each rank's shard state
  crosses the group once (pickled).
- *Refused on entry:* ``overlap_with_ddp=True`` (ZeRO's steps ride in a DDP
  comm hook; ours is the gradient unit), ``parameters_as_bucket_view=True``,
  and parameters the DDP model does not hold.

Standard library, torch and joinkit; imported by ``adapters.torch`` only in
finish mode.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ElasticZeRO", "refusal"]

_HEAD = "Join(on_rank_loss='finish') cannot hold ZeroRedundancyOptimizer: "


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
    mine = {id(p) for p in ddp.parameters()}
    if any(id(p) not in mine for group in zero.param_groups for p in group["params"]):
        return (_HEAD + "it steps parameters that the DistributedDataParallel model in the "
                "same Join does not hold, whose gradients no unit averages. Build it over "
                "the model's parameters, ZeroRedundancyOptimizer(model.parameters(), ...), "
                "or use on_rank_loss='raise'")
    return None


def _params(zero: Any) -> list[torch.Tensor]:
    """Every parameter ZeRO steps, in ``zero.param_groups``' order (the same on every rank)."""
    return [p for group in zero.param_groups for p in group["params"]]


class ElasticZeRO:
    """One ZeroRedundancyOptimizer inside one finish-mode Join (module doc).

    Args:
        zero: the optimizer (already checked by :func:`refusal`).
        elastic_ddp: the ``ElasticDDP`` of the model listed before it.

    Raises:
        LocalProtocolError: a rank died while the shards' state was gathered
            and no survivor received its shard (every survivor alike, before
            the Join's loop).
    """

    def __init__(self, zero: Any, elastic_ddp: Any) -> None:
        self.zero = zero
        self.elastic_ddp = elastic_ddp
        self.shard = zero.optim
        params = _params(zero)
        state = self._gather(params)
        # The same class and arguments over every parameter; the groups carry
        # the current hyper-parameters (ZeRO syncs them into it at each step).
        groups = [copy.copy(group) for group in zero.param_groups]
        self.full = zero._optim_constructor(groups, **zero._optim_defaults)
        for index, values in state.items():
            self.full.state[params[index]] = values
        zero.optim = self.full
        zero._sync_params = self.after_step

    def _gather(self, params: list[torch.Tensor]) -> dict[int, dict[str, Any]]:
        """Every shard's optimizer state, on every rank: one unit (module doc)."""
        zero = self.zero
        index = {id(p): i for i, p in enumerate(params)}
        mine = {index[id(p)]: dict(self.shard.state[p])
                for group in self.shard.param_groups for p in group["params"]
                if p in self.shard.state and self.shard.state[p]}
        world = zero.world_size
        parts = self.elastic_ddp.group.all_gather_object((zero.rank, mine))
        ranks = sorted(rank for rank, _ in parts)
        if ranks != list(range(world)):
            from joinkit import LocalProtocolError

            missing = sorted(set(range(world)) - set(ranks))
            raise LocalProtocolError(
                "ZeroRedundancyOptimizer in Join(on_rank_loss='finish'): rank(s) "
                f"{missing} died while every rank's shard of the optimizer state was "
                "gathered at the Join's entry, before any survivor received it: that "
                "state is lost. Restart from a checkpoint")
        state: dict[int, dict[str, Any]] = {}
        for _, shard in parts:
            state.update(shard)
        return state

    def after_step(self) -> None:
        """ZeRO's ``_sync_params`` in finish mode: nothing to broadcast (module doc)."""

    def close(self) -> None:
        """The Join is over: ZeRO's shard back with its state, or rebuilt on the survivors."""
        zero = self.zero
        if zero.__dict__.get("_sync_params") == self.after_step:
            del zero.__dict__["_sync_params"]
        if zero.optim is self.full:
            zero.optim = self.shard
        process_group = self.elastic_ddp.rebuilt_process_group()
        if process_group is not None:
            _rebuild(zero, process_group)
        # The shard's state: its parameters' slice of the full state, as the
        # steps of the Join left it.
        optim = zero.optim
        optim.state.clear()
        for group in optim.param_groups:
            for p in group["params"]:
                if p in self.full.state and self.full.state[p]:
                    optim.state[p] = self.full.state[p]
        self.full.state.clear()


def _rebuild(zero: Any, process_group: Any) -> None:
    """Move ``zero`` onto ``process_group`` (the survivors): new partition, new local optimizer."""
    zero.process_group = process_group
    zero.world_size = process_group.size()
    zero.rank = process_group.rank()
    zero.global_rank = dist.distributed_c10d.get_global_rank(process_group, zero.rank)
    zero._all_state_dicts = []
    zero._clear_cache()
    zero._init_local_optimizer()  # its state comes from the full copy (ElasticZeRO.close)
