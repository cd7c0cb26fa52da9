"""joinkit's one comm hook on a DistributedDataParallel model, and where it sends each bucket.

Theory of operation
-------------------
DDP takes one communication hook per model, for good: ``register_comm_hook``
refuses a second, and nothing removes one. Two of joinkit's ways of running
DDP need one: the heartbeat in the gradient all-reduce
(``adapters.torch._ddp_round``: each bucket's all-reduce carries one more
element) and finish mode (``adapters.torch._ddp_elastic``: each backward's
buckets as one unit that survives a dead rank). The first Join that needs it
registers this module's hook (:func:`install`), and from then on the hook
serves whichever Join holds the model:

- inside a Join that set a *route* (``HookState.route``: an object with
  ``hook(bucket) -> Future``), the route;
- anywhere else, what DDP does without a hook: each gradient multiplied by the
  inverse of the divisor (as the reducer does, so the numbers are the same
  bit for bit), then the bucket all-reduced on DDP's group. The divisor is the
  group's size, or, inside a Join on the one-collective path with
  ``divide_by_initial_world_size=False``, the number of active ranks that
  this iteration's heartbeat counted (``HookState.active``): the reducer
  reads it from the heartbeat's work only when the model has no hook.

A model that got a hook of its own from its user (``register_comm_hook`` or a
built-in one) before any of joinkit's is left alone (:func:`foreign_hook`);
the Join then uses the paths that need none.

No ``from __future__ import annotations`` here: DDP checks the comm hook's
annotations as objects.
"""

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HookState", "install", "installed", "foreign_hook", "complete"]


class HookState:
    """The comm hook's state: where buckets go now (module doc)."""

    def __init__(self, ddp: Any) -> None:
        self.ddp: Callable[[], Any] = weakref.ref(ddp)
        #: The Join's route for every bucket (``hook(bucket) -> Future``), or ``None``.
        self.route: Any = None
        #: Outside a route: the number of active ranks to divide by (``None``:
        #: the group's size).
        self.active: Callable[[], float] | None = None
        self.opts = dist.AllreduceOptions()
        self.opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        #: Outside a route, on the CPU: this backward's buckets so far (work,
        #: tensor, future), completed by its last (:func:`complete`).
        self.pending: list[tuple[Any, torch.Tensor, torch.futures.Future[torch.Tensor]]] = []


# id(ddp) -> its hook's state (a model gets the hook once: DDP allows one).
_states: dict[int, HookState] = {}


def installed(ddp: Any) -> HookState | None:
    """joinkit's hook state on ``ddp``, or ``None`` where it has none."""
    state = _states.get(id(ddp))
    return state if state is not None and state.ddp() is ddp else None


def install(ddp: Any) -> HookState:
    """Register joinkit's comm hook on ``ddp`` (once); return its state."""
    state = installed(ddp)
    if state is None:
        state = HookState(ddp)
        ddp.register_comm_hook(state, _hook)
        _states[id(ddp)] = state
        weakref.finalize(ddp, _states.pop, id(ddp), None)
    return state


def foreign_hook(ddp: Any) -> str | None:
    """The name of a comm hook on ``ddp`` that is not joinkit's, or ``None``."""
    if installed(ddp) is not None:
        return None
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks:
        return str(getattr(hooks[0][0], "__qualname__", hooks[0][0]))
    try:  # a built-in hook (register_builtin_comm_hook) is only in the logging data
        name = ddp._get_ddp_logging_data().get("comm_hook")
    except Exception:  # noqa: BLE001 - no logging data: no hook we can see
        return None
    return None if not name else str(name)


def _plain(state: HookState,
           bucket: dist.GradBucket,  # type: ignore[name-defined]
           ) -> torch.futures.Future[torch.Tensor]:
    """What DDP does without a hook (module doc)."""
    ddp = state.ddp()
    group = ddp.process_group
    tensor = bucket.buffer()
    divisor = float(group.size()) if state.active is None else max(state.active(), 1.0)
    tensor.mul_(1.0 / divisor)
    work = group.allreduce([tensor], state.opts)
    if tensor.device.type != "cpu":
        return work.get_future().then(  # type: ignore[no-any-return]
            lambda fut: fut.value()[0])
    # CPU: completed in the backward's last bucket's hook, not by a callback
    # on the communication thread (``_ddp_round.RoundHeartbeat._complete_round``).
    if bucket.index() == 0:
        state.pending.clear()  # a backward that never ended (it raised)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    state.pending.append((work, tensor, future))
    if bucket.is_last():
        complete(state.pending)
    return future


def complete(pending: list[tuple[Any, torch.Tensor, torch.futures.Future[torch.Tensor]]],
             finish: Callable[[torch.Tensor], None] | None = None) -> None:
    """Wait for every pending bucket's all-reduce, then complete each future with its tensor.

    Args:
        pending: (work, tensor, future) per bucket, in order; emptied.
        finish: called with each tensor whose all-reduce completed, once all
            did, before its future is completed (e.g. to divide it by a count
            that another bucket's all-reduce brought).

    An all-reduce's error reaches DDP through its bucket's future, as from a
    pending one.
    """
    errors: list[Exception | None] = []
    for work, _, _ in pending:
        try:
            work.wait()
        except Exception as error:  # noqa: BLE001 - DDP raises it, as from any future
            errors.append(error)
        else:
            errors.append(None)
    for (_, tensor, future), failed in zip(pending, errors, strict=True):
        if failed is not None:
            future.set_exception(failed)  # type: ignore[arg-type]  # torch types it as T
            continue
        if finish is not None:
            finish(tensor)
        future.set_result(tensor)
    pending.clear()


def _hook(state: HookState,
          bucket: dist.GradBucket,  # type: ignore[name-defined]
          ) -> torch.futures.Future[torch.Tensor]:
    """The comm hook: the Join's route if one is set, else DDP's own way."""
    route = state.route
    if route is None:
        return _plain(state, bucket)
    return route.hook(bucket)  # type: ignore[no-any-return]
