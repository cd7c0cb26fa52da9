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
(``adapters._replay``): ``ddp(empty batch)`` then backward from a zero loss.
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
(``adapters.torch``); then every parameter gets back the ``.grad`` it had
before the round, object and value (the value too: with
``gradient_as_bucket_view`` the replay wrote into the user's own gradient), so
after the Join ``.grad`` is what the user's last backward left.

*When.* Enabled by ``Join(..., replay=True)``, or automatically when the DDP
module contains a module with collectives in forward (``SyncBatchNorm``, or
any module with ``join_forward_collectives = True``); ``replay=False`` keeps
torch's hook. The model must meet ``adapters._replay``'s requirements, and
every iteration must run backward (under ``no_sync()`` too).

*The input.* A forward pre-hook on the DDP module records (and publishes) the
rank's first input of the Join (``_replay.InputSource``). It is installed when
the hook is built and removed, with the published spec, by the post hook, or
at the first forward after a Join that ended without post hooks (a failure).
"""

from __future__ import annotations

from typing import Any

import torch

from . import _replay
from . import torch as torch_adapter

__all__ = ["REPLAY", "replay_shadow", "DDPReplayShadow"]

#: ``Join(..., replay=...)``: ``True``/``False`` forces the replay on or off;
#: absent or ``None`` decides from the model.
REPLAY = "replay"


def replay_shadow(adapter: Any, hook: Any, kwargs: dict[str, Any]) -> DDPReplayShadow | None:
    """The replaying shadow for a DDP adapter, or ``None`` to keep torch's hook."""
    ddp = adapter.obj
    wanted = kwargs.get(REPLAY)
    if wanted is None:
        wanted = _replay.has_forward_collectives(ddp.module)
    if not wanted:
        return None
    return DDPReplayShadow(adapter, hook, kwargs.get(_replay.SHADOW_INPUT))


class DDPReplayShadow(torch_adapter._DDPShadow):
    """DDP's shadow by replay (module doc); the fused check stays the parent's."""

    def __init__(self, adapter: Any, hook: Any, shadow_input: Any) -> None:
        super().__init__(adapter, hook)
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
            self._remove()  # the first forward after this hook's Join
            return None
        if not self.adapter._in_hook and self.source.needs_record:
            self.source.record(tuple(args), dict(kwargs), module.device_type)
        return None

    def _remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.source.close()

    def main_hook(self) -> None:
        self.adapter._in_hook = True
        try:
            self._replay()
        finally:
            self.adapter._in_hook = False

    def post_hook(self, is_last_joiner: bool) -> None:
        self._remove()
        super().post_hook(is_last_joiner)

    def _replay(self) -> None:
        ddp = self.adapter.obj
        torch_adapter._averaged.pop(self.adapter.key, None)  # this round's, if it syncs
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
            if synced and torch_adapter._steps_shards_with(self.adapter):
                with_grad = [p for p in params if p.grad is not None]
                torch_adapter._averaged[self.adapter.key] = [
                    (with_grad, [p.grad.detach().clone() for p in with_grad])
                ]
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
