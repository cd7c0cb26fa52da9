"""DDP models with collectives in forward: a joined rank replays the iteration.

Theory of operation
-------------------
torch's DDP join hook shadows DDP's own collectives only (buffer broadcast,
gradient-sync check, one all-reduce per bucket): a model whose forward runs
collectives of its own (``torch.nn.SyncBatchNorm``, a tensor-parallel layer, a
user's all-reduce) leaves those unmatched, and the backward's bucket
all-reduces interleave with the layer's backward collectives in an order only
autograd knows. So for such a model the joined rank's main hook, instead of
torch's, *replays* the iteration through the DDP module itself
(``_replay``): ``ddp(empty batch)`` then backward from a zero loss.
DDP's forward and backward then issue, in their own order, exactly what an
active rank's do, with three changes that make the joined rank a joined rank:

- the notify inside DDP's forward is a shadow round's, so it sends nothing
  (the adapter drops notifies made inside its hooks);
- the gradient-sync check is the joined side's (it contributes "does not
  sync" and learns whether the active ranks do; with a fused heartbeat that
  answer already came with the count), and DDP's ``require_backward_grad_sync``
  is set to it for this replay, so a ``no_sync()`` iteration replays without
  bucket all-reduces but with the layers' own backward collectives;
- in the buffer broadcast's agreement on an authoritative rank the joined rank
  is never a candidate (torch's own hook does the same).

Before the replay the joined rank's gradients are zeroed (a stale ``.grad``
would otherwise enter the bucket sums); after it, ``.grad`` holds the active
ranks' averaged gradient. When a ZeroRedundancyOptimizer is in the Join that
average is kept for its shadow step, as joinkit's usual DDP shadow keeps it
(``_joinables``); then every parameter gets back the ``.grad`` it had
before the round, object and value (the value too: with
``gradient_as_bucket_view`` the replay wrote into the user's own gradient), so
after the Join ``.grad`` is what the user's last backward left.

*When.* Enabled by ``Join(..., replay=True)``, or automatically when the DDP
module contains a module with collectives in forward (``SyncBatchNorm``, or
any module with ``join_forward_collectives = True``); ``replay=False`` keeps
torch's hook. The model must meet ``_replay``'s requirements, and
every iteration must run backward (under ``no_sync()`` too).

*The input.* A forward pre-hook on the DDP module records (and publishes) the
rank's first input of the Join (``_replay.InputSource``). It is installed when
the hook is built and removed, with the published spec, by the post hook, or
at the first forward after a Join that ended without post hooks (a failure).

*Where it plugs in.* DDP's shadow (``_joinables._DDPShadow``) holds a
:class:`DDPReplay` when the model is replayed and runs it as its main hook; the
replay keeps or drops the round's average through that shadow
(``forget_average``, ``steps_shards``, ``keep_average``), so this module
needs nothing of the DDP adapter's.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from . import _replay

__all__ = ["REPLAY", "replay_for", "DDPReplay"]

#: ``Join(..., replay=...)``: ``True``/``False`` forces the replay on or off;
#: absent or ``None`` decides from the model.
REPLAY = "replay"


class _Shadow(Protocol):
    """What the replay needs of DDP's shadow (``_joinables._DDPShadow``)."""

    adapter: Any

    def forget_average(self) -> None: ...

    def steps_shards(self) -> bool: ...

    def keep_average(self, averaged: list[tuple[list[Any], list[Any]]]) -> None: ...


def replay_for(adapter: Any, kwargs: dict[str, Any]) -> DDPReplay | None:
    """The replay for a DDP adapter's shadow, or ``None`` to keep torch's hook."""
    ddp = adapter.obj
    wanted = kwargs.get(REPLAY)
    if wanted is None:
        wanted = _replay.has_forward_collectives(ddp.module)
    if not wanted:
        return None
    return DDPReplay(adapter, kwargs.get(_replay.SHADOW_INPUT))


class DDPReplay:
    """A DDP model's shadow round by replay (module doc)."""

    def __init__(self, adapter: Any, shadow_input: Any) -> None:
        self.adapter = adapter
        ddp = adapter.obj
        self.source = _replay.InputSource(ddp.process_group, shadow_input)
        self._join: Any = None
        self._handle: Any = ddp.register_forward_pre_hook(
            self._record, prepend=True, with_kwargs=True)

    def _record(self, module: Any, args: Any, kwargs: Any) -> None:
        config = self.adapter._join_config
        join = config.join if config.enable else None
        if self._join is None and join is not None:
            self._join = join
        if join is None or join is not self._join:
            self.close()  # the first forward after this hook's Join
            return None
        if not self.adapter._in_hook and self.source.needs_record:
            self.source.record(tuple(args), dict(kwargs), module.device_type)
        return None

    def close(self) -> None:
        """Remove the input's hook and its published spec (the post hook, or later)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.source.close()

    def run(self, shadow: _Shadow) -> None:
        """One shadow round: replay the iteration, keep the average for a ZeRO."""
        ddp = self.adapter.obj
        shadow.forget_average()  # this round's, if it syncs
        args, kwargs, autocast = self.source.inputs(torch.device(ddp.join_device))
        params = [p for p in ddp.parameters() if p.requires_grad]
        # Each parameter's own gradient, given back after the round (module doc).
        own = [(p, p.grad, None if p.grad is None else p.grad.detach().clone())
               for p in params]
        with torch.no_grad():
            for param in params:
                if param.grad is not None:
                    param.grad.zero_()
        try:
            synced = self._replay_zero_loss(ddp, args, kwargs, autocast)
            if synced and shadow.steps_shards():
                with_grad = [p for p in params if p.grad is not None]
                shadow.keep_average([(with_grad, [p.grad.detach().clone() for p in with_grad])])
        finally:
            with torch.no_grad():
                for param, grad, value in own:
                    if grad is not None:
                        grad.copy_(value)
                    param.grad = grad

    def _replay_zero_loss(self, ddp: Any, args: Any, kwargs: Any, autocast: Any) -> bool:
        """The replay itself; whether the active ranks synced gradients in it."""
        check = ddp._check_global_requires_backward_grad_sync  # the fused one, if fused
        find_common_rank = ddp._find_common_rank
        synced = [False]

        def joined_check(is_joined_rank: bool) -> Any:
            sync = bool(check(True))
            ddp.require_backward_grad_sync = sync
            synced[0] = sync
            return sync

        def never_candidate(rank: int, condition: bool) -> Any:
            return find_common_rank(rank, False)

        patched = {"_check_global_requires_backward_grad_sync": joined_check,
                   "_find_common_rank": never_candidate}
        before = {name: ddp.__dict__[name] for name in patched if name in ddp.__dict__}
        requires_sync = ddp.require_backward_grad_sync
        ddp.__dict__.update(patched)
        ddp.require_backward_grad_sync = True  # as an active rank enters its forward
        try:
            _replay.replay(ddp, args, kwargs, backward=True, autocast=autocast)
        finally:
            for name in patched:
                if name in before:
                    ddp.__dict__[name] = before[name]
                else:
                    del ddp.__dict__[name]
            ddp.require_backward_grad_sync = requires_sync
        return synced[0]
