"""The rest of a training step on a joined rank: optimizer, LR scheduler, GradScaler.

Theory of operation
-------------------
A rank that owns parameter shards (FSDP2) must step them in every shadow round
in which the active ranks step, with the same gradients, learning rate and
loss-scale decision; otherwise its shard falls behind. ``Join([model,
optimizer, scaler, scheduler])`` takes the objects of the user's loop as they
are; this module gives each a joinable whose shadow does that object's part:

- a plain ``torch.optim.Optimizer`` (:class:`OptimizerJoinable`): after a
  round in which a model's shadow *synced* gradients (it left the active
  ranks' reduced gradient in this rank's ``.grad``), ``optimizer.step()``, or
  ``scaler.step(optimizer)`` when a GradScaler is in the Join, or the Join's
  ``shadow_step`` callable (the loop's own step code, e.g. gradient clipping,
  whose norm all-reduce a joined rank must match, then the step);
- a ``torch.amp.GradScaler`` (:class:`ScalerJoinable`): ``scaler.update()``
  after a round in which its optimizers stepped. ``scaler.step`` unscales
  this rank's gradient shard; with DTensor gradients torch all-reduces the
  found-inf flag (MAX) inside that unscale, so every rank, joined ones
  included, takes the same skip-or-step decision and the same scale update;
- an LR scheduler (:class:`SchedulerJoinable`): ``scheduler.step()`` after
  every round in which its optimizer stepped (or a GradScaler skipped the
  step: the active ranks' loops step the scheduler either way), and in every
  round for a ``ZeroRedundancyOptimizer``, whose own shadow steps every round.

*Linking.* Which model fills an optimizer's gradients, which optimizers a
scaler steps and which optimizer a scheduler follows is settled once, when the
Join is built: :func:`check` sees the whole list, links the joinables and
refuses a combination it cannot shadow with a ``ValueError``: an optimizer
with parameters no earlier model's shadow fills (with DDP the optimizer needs
no shadow: DDP's post hook broadcasts the final model), a scaler or scheduler
without its optimizer listed before it, a scaler with a
ZeroRedundancyOptimizer, a ``ReduceLROnPlateau`` (it steps on a metric a
joined rank does not have). Their join process group and device are those of
what they are linked to. Hooks run in list order, so the order of the list is
the order of the loop: ``Join([model, optimizer, scaler, scheduler])``.

A model joinable that fills gradients offers ``shadow_parameters()`` and a
``shadow_synced`` flag set by its latest shadow round (``adapters.fsdp``). One
that closed a shared accumulation window in its post hook (``closed_window``,
``Join(..., shared_windows=True)``) is stepped in the post hooks the same way,
on every rank, and so are the scaler and the schedulers after it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.amp import GradScaler
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from joinkit import Joinable, JoinHook, LocalProtocolError
from joinkit.lowlevel import AdapterCache, AdapterJoinable

__all__ = ["adapt", "check", "OptimizerJoinable", "SchedulerJoinable", "ScalerJoinable",
           "gradients_set_aside"]

_ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


@contextlib.contextmanager
def gradients_set_aside(parameters: Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """Around one backward: the gradient accumulated so far set aside, then added back.

    DDP all-reduces a parameter's whole ``.grad``. When every backward must sync
    (gradient accumulation inside a Join, where ``no_sync`` windows of ranks with
    different numbers of batches would pair DDP's all-reduces wrongly), the
    gradient accumulated since the window began is taken off the parameters for
    the backward and added back after it: each step then gets the sum over its
    window of the averaged gradients, as with ``no_sync``. Used by the Accelerate
    and Hugging Face Trainer adapters.

    Args:
        parameters: the model's parameters (those without a gradient are left alone).
    """
    kept = [(p, p.grad) for p in parameters if p.grad is not None]
    for p, _ in kept:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in kept:
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)


def adapt(obj: Any) -> Joinable:
    """The joinable standing for an optimizer, LR scheduler or GradScaler.

    The same object always gets the same adapter.

    Raises:
        TypeError: ``obj`` is none of these.
    """
    kind: Callable[[Any], _StepJoinable]
    if isinstance(obj, Optimizer):
        kind = OptimizerJoinable
    elif isinstance(obj, LRScheduler):
        kind = SchedulerJoinable
    elif isinstance(obj, GradScaler):
        kind = ScalerJoinable
    else:
        raise TypeError(
            "joinkit.adapters.torch.optim.adapt expects an optimizer, an LR scheduler or a "
            f"GradScaler, got {type(obj).__qualname__}"
        )
    return _adapters.get(obj, kind)


_adapters: AdapterCache[_StepJoinable] = AdapterCache()


class _StepJoinable(AdapterJoinable):
    """A joinable for one object of the training step (``obj``); linked by :func:`check`."""

    def __init__(self, obj: Any) -> None:
        super().__init__(obj)
        self._link: Any = None  # whose process group and device this one shares

    @property
    def join_device(self) -> Any:
        return self._linked().join_device

    @property
    def join_process_group(self) -> Any:
        return self._linked().join_process_group

    def _linked(self) -> Any:
        if self._link is None:
            raise LocalProtocolError(f"{self!r} is not linked to a model: put it in a Join")
        return self._link


class OptimizerJoinable(_StepJoinable):
    """A plain optimizer: steps after a round whose model shadow synced gradients."""

    def __init__(self, obj: Any) -> None:
        super().__init__(obj)
        self.models: list[Any] = []
        self.scaler: ScalerJoinable | None = None
        self.step_fn: Callable[[], Any] | None = None  # Join(..., shadow_step=...)
        #: Whether this round's shadow stepped (or a GradScaler skipped the step).
        self.round_stepped = False
        #: Whether the post hooks stepped a shared window a model closed (module doc).
        self.closed_stepped = False

    def stepped_parameters(self) -> Iterable[torch.Tensor]:
        """The parameters this optimizer steps."""
        for group in self.obj.param_groups:
            yield from group["params"]

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The optimizer's shadow.

        Args:
            **kwargs: the Join's keyword arguments; ``shadow_step``, a callable,
                replaces ``optimizer.step()`` (or ``scaler.step(optimizer)``) on
                a joined rank: pass the loop's own step code when it does more
                than step, e.g. ``clip_grad_norm_`` (whose norm all-reduce the
                joined rank must match) then ``optimizer.step()``.
        """
        step_fn = kwargs.get("shadow_step")
        if step_fn is not None and not callable(step_fn):
            raise TypeError(f"shadow_step must be callable, not {type(step_fn).__qualname__}")
        self.step_fn = step_fn
        return _OptimizerShadow(self)

    def shadow_step(self) -> None:
        """One shadow round's step (module doc)."""
        self.round_stepped = any(model.shadow_synced for model in self.models)
        if self.round_stepped:
            self._step()

    def close_step(self) -> None:
        """In the post hooks, on every rank: the step of a shared window a model closed."""
        self.closed_stepped = any(getattr(model, "closed_window", False)
                                  for model in self.models)
        if self.closed_stepped:
            self._step()

    def _step(self) -> None:
        optimizer = self.obj
        if self.scaler is not None:
            # A rank that never ran the loop has no scale yet; scale() creates it.
            device = next(iter(self.stepped_parameters())).device
            self.scaler.obj.scale(torch.zeros((), device=device))
        if self.step_fn is not None:
            self.step_fn()
        elif self.scaler is not None:
            self.scaler.obj.step(optimizer)
        else:
            optimizer.step()


class _OptimizerShadow(JoinHook):
    def __init__(self, adapter: OptimizerJoinable) -> None:
        self.adapter = adapter

    def main_hook(self) -> None:
        self.adapter.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.adapter.close_step()


class ScalerJoinable(_StepJoinable):
    """A GradScaler: ``update()`` after a round in which its optimizers stepped."""

    def __init__(self, obj: Any) -> None:
        super().__init__(obj)
        self.optimizers: list[OptimizerJoinable] = []

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ScalerShadow(self)


class _ScalerShadow(JoinHook):
    def __init__(self, adapter: ScalerJoinable) -> None:
        self.adapter = adapter

    def main_hook(self) -> None:
        if any(optimizer.round_stepped for optimizer in self.adapter.optimizers):
            self.adapter.obj.update()

    def post_hook(self, is_last_joiner: bool) -> None:
        if any(optimizer.closed_stepped for optimizer in self.adapter.optimizers):
            self.adapter.obj.update()


class SchedulerJoinable(_StepJoinable):
    """An LR scheduler: steps after every round in which its optimizer stepped."""

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _SchedulerShadow(self)


class _SchedulerShadow(JoinHook):
    def __init__(self, adapter: SchedulerJoinable) -> None:
        self.adapter = adapter

    def main_hook(self) -> None:
        optimizer = self.adapter._linked()
        # ZeRO's own shadow steps in every round.
        if getattr(optimizer, "round_stepped", True):
            self.adapter.obj.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        if getattr(self.adapter._linked(), "closed_stepped", False):
            self.adapter.obj.step()


# -- linking ----------------------------------------------------------------------------


def check(joinables: Sequence[Joinable]) -> None:
    """Link a Join's optimizer, scaler and scheduler joinables; refuse what cannot work.

    Raises:
        ValueError: see the module doc; the message says what to change.
    """
    for joinable in joinables:
        if isinstance(joinable, OptimizerJoinable):
            joinable.models, joinable.scaler, joinable._link = [], None, None
    for index, joinable in enumerate(joinables):
        if isinstance(joinable, OptimizerJoinable):
            _link_optimizer(joinable, joinables, index)
    scalers = [(i, j) for i, j in enumerate(joinables) if isinstance(j, ScalerJoinable)]
    if len(scalers) > 1:
        raise ValueError("a Join can shadow one GradScaler; pass one")
    for index, joinable in scalers:
        _link_scaler(joinable, joinables, index)
    for index, joinable in enumerate(joinables):
        if isinstance(joinable, SchedulerJoinable):
            _link_scheduler(joinable, joinables, index)


def _link_optimizer(adapter: OptimizerJoinable, joinables: Sequence[Joinable],
                    index: int) -> None:
    name = type(adapter.obj).__qualname__
    owners: dict[int, Any] = {}
    for model in joinables[:index]:
        fills = getattr(model, "shadow_parameters", None)
        if callable(fills):
            for param in fills():
                owners.setdefault(id(param), model)
    missing = [p for p in adapter.stepped_parameters() if id(p) not in owners]
    if missing:
        if any(_is_ddp(j) for j in joinables):
            raise ValueError(
                f"Join got the optimizer {name} with a DistributedDataParallel model: "
                "a joined DDP rank does not step (DDP's post hook broadcasts the final "
                "model from the last joiner), so leave the optimizer out of Join, or use a "
                "ZeroRedundancyOptimizer"
            )
        later = any(callable(getattr(j, "shadow_parameters", None))
                    for j in joinables[index + 1:])
        raise ValueError(
            f"Join got the optimizer {name}, but {len(missing)} of its parameters belong "
            "to no model listed before it whose shadow fills their gradients on a joined "
            "rank (a fully_shard model). "
            + ("List the model first: Join([model, optimizer])." if later else
               "Pass the model too: Join([model, optimizer]).")
        )
    models: list[Any] = []
    for param in adapter.stepped_parameters():
        owner = owners[id(param)]
        if all(owner is not m for m in models):
            models.append(owner)
    adapter.models = models
    adapter._link = models[0]


def _link_scaler(adapter: ScalerJoinable, joinables: Sequence[Joinable], index: int) -> None:
    if any(_is_zero(getattr(j, "obj", None)) for j in joinables):
        raise ValueError(
            "Join does not shadow a GradScaler with a ZeroRedundancyOptimizer (a joined "
            "rank's ZeRO shadow steps without the scaler's skip decision); leave the "
            "scaler out only if it never skips, or use a fully_shard model"
        )
    optimizers = [j for j in joinables[:index] if isinstance(j, OptimizerJoinable)]
    if not optimizers:
        raise ValueError(
            "Join got a GradScaler but no optimizer listed before it: pass the optimizer "
            "it steps, in loop order: Join([model, optimizer, scaler])"
        )
    if any(isinstance(j, OptimizerJoinable) for j in joinables[index + 1:]):
        raise ValueError(
            "Join lists an optimizer after the GradScaler: list the optimizers first, "
            "Join([model, optimizer, scaler]), so the scaler updates after their steps"
        )
    adapter.optimizers = optimizers
    adapter._link = optimizers[0]
    for optimizer in optimizers:
        optimizer.scaler = adapter


def _link_scheduler(adapter: SchedulerJoinable, joinables: Sequence[Joinable],
                    index: int) -> None:
    scheduler = adapter.obj
    name = type(scheduler).__qualname__
    if isinstance(scheduler, ReduceLROnPlateau):
        raise ValueError(
            "Join cannot shadow ReduceLROnPlateau: it steps on a metric that a joined "
            "rank does not have; step it after the Join on every rank instead"
        )
    target = scheduler.optimizer
    position = next((i for i, j in enumerate(joinables) if getattr(j, "obj", None) is target),
                    None)
    if position is None:
        raise ValueError(
            f"Join got the LR scheduler {name} without its optimizer: pass the optimizer "
            "too, before the scheduler: Join([model, optimizer, scheduler])"
        )
    if position > index:
        raise ValueError(
            f"Join lists the LR scheduler {name} before its optimizer: list the optimizer "
            "first, Join([model, optimizer, scheduler])"
        )
    adapter._link = joinables[position]


def _is_ddp(joinable: Any) -> bool:
    parallel = sys.modules.get("torch.nn.parallel")
    obj = getattr(joinable, "obj", None)
    return parallel is not None and isinstance(obj, parallel.DistributedDataParallel)


def _is_zero(obj: Any) -> bool:
    module = sys.modules.get(_ZERO_MODULE)
    return module is not None and isinstance(obj, module.ZeroRedundancyOptimizer)
