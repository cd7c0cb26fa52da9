"""Hugging Face Accelerate: ``join_uneven_inputs`` that works where Accelerate's does nothing.

Theory of operation
-------------------
``Accelerator.join_uneven_inputs`` wraps torch's Join only for DDP on several
accelerators (``Accelerator.multi_device``); under FSDP, DeepSpeed or on CPU
processes (``MULTI_CPU``) it does nothing but warn, and ranks with uneven data
hang in their next collective. Accelerate instead evens the data out by
default: its prepared data loaders (``even_batches=True``) give the shorter
ranks extra batches from the start of the dataset, so every rank runs as many
steps, and the duplicated samples count twice in training and evaluation.

:func:`join_uneven_inputs` is the same context manager on joinkit's Join, for
every distributed type whose model joinkit adapts: it takes the objects
``Accelerator.prepare`` returned and hands joinkit what they wrap:

- ``AcceleratedOptimizer`` -> its torch optimizer, ``AcceleratedScheduler`` ->
  its LR scheduler (joinkit's optimizer adapter steps them on a joined rank);
- the model: DDP (``MULTI_CPU``, ``MULTI_GPU``), a root FSDP2 module
  (``fully_shard``; Accelerate's FSDP plugin with ``fsdp_version=2``) and an
  FSDP1 module (``FullyShardedDataParallel``, the plugin's default version) are
  joinkit joinables as they are;
- with a DDP model the optimizer and scheduler are left out of the Join: a
  joined DDP rank does not step (DDP's post hook broadcasts the last joiner's
  model, as torch's Join does), so ``[model, optimizer]`` is one line for DDP
  and FSDP2 alike;
- anything else (a ``joinkit.SideCollective`` for ``accelerator.gather`` or a
  logging reduce in the loop) is passed through.

*Gradient accumulation* (``accelerator.accumulate(model)``, DDP): a rank's last
window ends at its own last batch while the others still accumulate, so while
the Join lasts every backward syncs its gradient (``no_sync`` does nothing; the
gradient accumulated since the window began is set aside around each backward
and added back): each step gets its window's summed gradient, and the last
joiner's model, which DDP's post hook gives every rank, is exact.

*Gradient accumulation under FSDP* (FSDP1 or FSDP2): FSDP's own ``no_sync``
windows stay, counted as under DeepSpeed (:func:`_counted_windows`: not cut by
a process's own end of data), and the Join's windows are shared
(``Join(..., shared_windows=True)``, ``joinkit.adapters.torch.fsdp``): a
process that runs out inside a window keeps its part of it for the window's
step, which a joined process replays with the others, and a window still open
when every process has run out is closed in the Join's post hooks (one more
synced replay and optimizer step on every process, ``shadow_step`` if given).

``even_batches`` overrides the setting of the accelerator's prepared map-style
data loaders for the block, as Accelerate's does: pass ``False`` (or build the
``Accelerator`` with ``DataLoaderConfiguration(even_batches=False)``) so that
each rank sees its own share of the data exactly once, and the Join takes the
unevenness; with ``True`` the data is padded and the Join has nothing to do.

*DeepSpeed* (Accelerate's DeepSpeed plugin): the engine joins as a
``joinkit.adapters.deepspeed.DeepSpeedJoinable`` on Accelerate's windows
(:func:`_deepspeed_items`): ``accumulate()`` sets the engine's boundary itself and
``accelerator.backward`` steps the engine at a window's end only, so a joined
process must know where the windows end. They end every
``gradient_accumulation_steps`` micro-steps from ``Accelerator.step`` at the
block's start, and not at a process's own end of data while the Join lasts
(:func:`_counted_windows`); the last one closes when every process has run out.

A world of one Accelerate process does nothing (as Accelerate); one whose
launcher started more processes (``WORLD_SIZE``) while Accelerate sees one
(on a machine without GPUs ``Accelerator()`` without ``cpu=True`` is
``DistributedType.NO``: every process trains alone) is an error. The members
of Accelerate read that it does not document (the list of data loaders
``Accelerator._dataloaders``; under DeepSpeed its micro-step count and gradient
state) are listed in :data:`_PRIVATE`; a missing one raises
:class:`UnsupportedAccelerateError`.

Tested with accelerate 1.12.0 (the oldest supported) and 1.15 (constraints.txt); ``pip install
'joinkit[accelerate]'``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from joinkit import Join

from .._guards import supported_spec

__all__ = ["join_uneven_inputs", "unwrap", "SUPPORTED_ACCELERATE", "TESTED_ACCELERATE",
           "UnsupportedAccelerateError"]

#: The Accelerate releases this module's tests ran on: the oldest supported (the
#: release current a year before this joinkit; docs/compat.md) and the dev pin.
TESTED_ACCELERATE = ("1.12.0", "1.15.0")
#: The ``accelerate`` extra's range: no upper bound; :data:`_PRIVATE`, asked of the
#: objects when used, decides what runs.
SUPPORTED_ACCELERATE = supported_spec(TESTED_ACCELERATE)

#: The private members of Accelerate this module reads: (class, attribute, what for).
_PRIVATE = (
    ("Accelerator", "_dataloaders", "the prepared data loaders whose even_batches to override"),
    ("Accelerator", "step", "DeepSpeed, FSDP: the micro-step count accumulate() starts "
                            "its windows from, reset at the end of the data"),
    ("GradientState", "plugin_kwargs", "DeepSpeed, FSDP: sync_with_dataloader, off in the Join"),
    ("GradientState", "_set_sync_gradients", "DeepSpeed, FSDP: a joined process's scheduler "
                                             "step sees its step's boundary"),
)


class UnsupportedAccelerateError(RuntimeError):
    """This Accelerate lacks a member :func:`join_uneven_inputs` relies on."""


def _accelerate() -> Any:
    try:
        import accelerate  # type: ignore[import-untyped]
    except ModuleNotFoundError as error:
        if error.name is not None and error.name.split(".")[0] != "accelerate":
            raise
        raise ModuleNotFoundError(
            "joinkit.adapters.accelerate needs Hugging Face Accelerate, which could not be "
            f"imported: pip install 'joinkit[accelerate]' (accelerate {SUPPORTED_ACCELERATE})",
            name="accelerate",
        ) from error
    return accelerate


def unwrap(obj: Any) -> Any:
    """What joinkit's Join takes for one object ``Accelerator.prepare`` returned.

    Args:
        obj: a prepared model, optimizer or scheduler, or any joinable.

    Returns:
        The torch optimizer of an ``AcceleratedOptimizer``, the scheduler of an
        ``AcceleratedScheduler``, else ``obj`` itself.
    """
    accelerate = _accelerate()
    if isinstance(obj, accelerate.optimizer.AcceleratedOptimizer):
        return obj.optimizer
    if isinstance(obj, accelerate.scheduler.AcceleratedScheduler):
        return obj.scheduler
    return obj


def _is_ddp(obj: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(obj, DistributedDataParallel)


def _is_fsdp(obj: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(obj, FSDPModule | FullyShardedDataParallel)


def _is_step_object(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.optim.Optimizer | torch.optim.lr_scheduler.LRScheduler)


def _deepspeed_items(accelerator: Any, joinables: list[Any],
                     items: list[Any]) -> tuple[list[Any], bool]:
    """With a DeepSpeed engine: what the Join takes instead of ``items``, and ``True``.

    The engine's step (``accelerator.backward`` calls it at a window's end)
    steps its optimizer and a DeepSpeed LR scheduler, and a joined process
    replays that step, so they are left out (``joinkit.adapters.deepspeed``).
    The engine joins as a ``DeepSpeedJoinable`` on Accelerate's windows:
    ``accelerator.accumulate()`` ends one every ``gradient_accumulation_steps``
    micro-steps, counted from ``Accelerator.step`` at the Join's start
    (:func:`_counted_windows` keeps a process's own end of data from ending
    one early). A torch LR scheduler Accelerate wrapped itself (an
    ``AcceleratedScheduler``, which the loop's ``scheduler.step()`` steps,
    ``num_processes`` times per optimizer step) is stepped by a joined process
    after each micro-step it replays, with that micro-step's boundary as
    Accelerate's ``sync_gradients``, as the loop's call steps it.
    """
    from .. import deepspeed

    if not any(deepspeed.is_engine(obj) for obj in items):
        return items, False
    parts = [part for obj in items if deepspeed.is_engine(obj)
             for part in deepspeed.engine_parts(obj)]
    scheduler_class = _accelerate().scheduler.AcceleratedScheduler
    schedulers = [given for given, item in zip(joinables, items, strict=True)
                  if isinstance(given, scheduler_class) and all(item is not p for p in parts)]
    every = int(accelerator.gradient_accumulation_steps)
    start = int(_private(accelerator, "step"))
    state = accelerator.gradient_state

    def boundaries(micro_step: int) -> bool:
        return (start + micro_step + 1) % every == 0

    def after_step(window_end: bool) -> None:
        _private(state, "_set_sync_gradients")(window_end)
        for scheduler in schedulers:
            scheduler.step()

    kept: list[Any] = []
    for given, item in zip(joinables, items, strict=True):
        if deepspeed.is_engine(item):
            kept.append(deepspeed.DeepSpeedJoinable(item, boundaries=boundaries,
                                                    after_step=after_step))
        elif not (any(item is part for part in parts) or isinstance(given, scheduler_class)):
            kept.append(item)
    return kept, True


@contextlib.contextmanager
def _counted_windows(accelerator: Any, on: bool) -> Iterator[None]:
    """Accelerate's windows under a DeepSpeed or FSDP Join: counted, never cut by a
    process's data.

    ``accelerator.accumulate()`` ends a window at the end of the process's own
    data (``sync_with_dataloader``), where the others are still inside theirs,
    and the engine's step (FSDP's reduce-scatter) at that boundary would meet no
    peer. So while the Join lasts that is off: every window ends after
    ``gradient_accumulation_steps`` micro-steps, a process that ran out replays the
    rest of its windows with zeros, and a window still open when every process
    has run out is closed by the Join (``DeepSpeedJoinable``'s post hook, or
    FSDP's shared windows: one more step on every process, as Accelerate steps at
    the end of the data).
    Then the window count starts again, as at the end of Accelerate's data.
    """
    if not on:
        yield
        return
    state = accelerator.gradient_state
    kwargs = _private(state, "plugin_kwargs")
    before = kwargs.get("sync_with_dataloader", _UNSET)
    kwargs["sync_with_dataloader"] = False
    try:
        yield
        accelerator.step = 0
        _private(state, "_set_sync_gradients")(True)
    finally:
        if before is _UNSET:
            kwargs.pop("sync_with_dataloader", None)
        else:
            kwargs["sync_with_dataloader"] = before


_UNSET = object()


def _private(obj: Any, name: str, advice: str = "") -> Any:
    """A member of :data:`_PRIVATE`, or :class:`UnsupportedAccelerateError` saying why
    joinkit reads it."""
    try:
        return getattr(obj, name)
    except AttributeError:
        owner = type(obj).__name__
        why = next(what for cls, attr, what in _PRIVATE if (cls, attr) == (owner, name))
        version = getattr(_accelerate(), "__version__", "?")
        raise UnsupportedAccelerateError(
            f"found accelerate {version}; joinkit needs {owner}.{name}, which this release "
            f"lacks ({why}; tested with accelerate {' and '.join(TESTED_ACCELERATE)}){advice}"
        ) from None


def _override_even_batches(accelerator: Any, even_batches: bool) -> list[tuple[Any, bool]]:
    """Set ``even_batches`` on the accelerator's map-style loaders; return what to restore."""
    restore = []
    advice = (". Build the Accelerator with DataLoaderConfiguration(even_batches=False) and "
              "leave join_uneven_inputs(even_batches=None)")
    for loader in _private(accelerator, "_dataloaders", advice):
        sampler = getattr(loader, "batch_sampler", None)
        if sampler is None or not hasattr(sampler, "even_batches"):
            continue  # iterable-style: Accelerate cannot override it either
        restore.append((sampler, bool(sampler.even_batches)))
        sampler.even_batches = even_batches
    return restore


def _launched_processes() -> int | None:
    try:
        return int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


@contextlib.contextmanager
def join_uneven_inputs(
    accelerator: Any,
    joinables: Sequence[Any],
    even_batches: bool | None = None,
    **join_kwargs: Any,
) -> Iterator[Join | None]:
    """``Accelerator.join_uneven_inputs`` on joinkit's Join, for DDP and FSDP2, CPU and GPU.

    Example::

        accelerator = Accelerator(cpu=True)          # or FSDP2, or GPUs
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        with join_uneven_inputs(accelerator, [model, optimizer], even_batches=False):
            for x, y in loader:
                optimizer.zero_grad()
                accelerator.backward(loss_fn(model(x), y))
                optimizer.step()

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared the objects.
        joinables: what ``prepare`` returned (model, optimizer, scheduler) and
            any other joinables, in the order of one iteration's collectives.
        even_batches: ``False`` to give each rank its own share of the data
            exactly once for the block (what the Join is for), ``True`` to pad;
            ``None`` keeps the accelerator's setting. Overrides map-style
            loaders only, as Accelerate's method does.
        **join_kwargs: passed to :class:`joinkit.Join` (``timeout``,
            ``throw_on_early_termination``, ``divide_by_initial_world_size``...).

    Yields:
        The :class:`joinkit.Join`, or ``None`` for a world of one process.

    Raises:
        ModuleNotFoundError: Accelerate is not installed.
        RuntimeError: Accelerate sees one process while the launcher started
            several (``Accelerator(cpu=True)`` is needed without GPUs).
        UnsupportedAccelerateError: ``even_batches`` was given and this
            Accelerate lacks ``Accelerator._dataloaders``.
        TypeError, ValueError: from :class:`joinkit.Join` (an object joinkit
            cannot join, such as a DeepSpeed engine).
    """
    _accelerate()
    if isinstance(joinables, str) or not isinstance(joinables, Sequence):
        raise TypeError(
            "join_uneven_inputs(accelerator, joinables): joinables must be a list, e.g. "
            f"[model, optimizer], not {type(joinables).__qualname__}"
        )
    launched = _launched_processes()
    if accelerator.num_processes == 1:
        if launched is not None and launched > 1:
            raise RuntimeError(
                f"Accelerate sees a world of 1 process ({accelerator.distributed_type}), but "
                f"the launcher started {launched} (WORLD_SIZE={launched}): every process "
                "would train alone. On a machine without GPUs build the Accelerator with "
                "Accelerator(cpu=True) (DistributedType.MULTI_CPU)"
            )
        yield None  # nothing to join, as Accelerate's own method
        return
    items, windows = _deepspeed_items(accelerator, list(joinables),
                                      [unwrap(obj) for obj in joinables])
    if any(_is_ddp(obj) for obj in items):
        items = [obj for obj in items if not _is_step_object(obj)]
    restore = [] if even_batches is None else _override_even_batches(accelerator,
                                                                     bool(even_batches))
    accumulating = accelerator.gradient_accumulation_steps > 1
    fsdp_windows = accumulating and any(_is_fsdp(obj) for obj in items)
    if fsdp_windows:
        join_kwargs = {"shared_windows": True, **join_kwargs}
    if any(_is_fsdp(obj) for obj in items):
        items, join_kwargs = _fsdp_schedulers(accelerator, list(joinables), items,
                                              join_kwargs)
    try:
        with _sync_every_backward(accelerator, items,
                                  accumulating and any(_is_ddp(obj) for obj in items)), \
                _counted_windows(accelerator, windows or fsdp_windows), \
                Join(items, **join_kwargs) as join:
            yield join
    finally:
        for sampler, value in restore:
            sampler.even_batches = value


def _fsdp_schedulers(accelerator: Any, joinables: list[Any], items: list[Any],
                     join_kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Under FSDP, a scheduler Accelerate wrapped steps as the loop's call steps it.

    ``AcceleratedScheduler.step()`` steps its scheduler ``num_processes`` times
    per optimizer step (without ``split_batches``); joinkit's scheduler joinable
    would step it once. So such a scheduler is left out of the Join, and a joined
    process's step (the Join's ``shadow_step``, or the optimizer's ``step()``)
    is followed by the wrapper's own ``step()``, with Accelerate's
    ``sync_gradients`` on, as after the loop's optimizer step.

    Raises:
        ValueError: a wrapped scheduler with several optimizers in the Join (the
            Join's one step runs once per optimizer).
    """
    scheduler_class = _accelerate().scheduler.AcceleratedScheduler
    schedulers = [obj for obj in joinables if isinstance(obj, scheduler_class)]
    if not schedulers:
        return items, join_kwargs
    optimizers = [obj for obj in items if _is_step_object(obj)
                  and not isinstance(obj, _torch_scheduler())]
    if len(optimizers) != 1:
        raise ValueError(
            "join_uneven_inputs under FSDP steps an Accelerate-wrapped scheduler after a "
            f"joined process's optimizer step, and takes one optimizer; got {len(optimizers)}"
        )
    inner = [scheduler.scheduler for scheduler in schedulers]
    kept = [obj for obj in items if all(obj is not s for s in inner)]
    given = join_kwargs.get("shadow_step")
    optimizer = optimizers[0]
    state = accelerator.gradient_state

    def step() -> None:
        if given is not None:
            given()
        else:
            optimizer.step()
        _private(state, "_set_sync_gradients")(True)
        for scheduler in schedulers:
            scheduler.step()

    return kept, {**join_kwargs, "shadow_step": step}


def _torch_scheduler() -> type:
    import torch

    return torch.optim.lr_scheduler.LRScheduler


@contextlib.contextmanager
def _sync_every_backward(accelerator: Any, items: Sequence[Any], on: bool) -> Iterator[None]:
    """``accelerator.accumulate`` under the Join: every backward syncs its gradient.

    A rank's last window of gradient accumulation ends at its own last batch
    (``end_of_dataloader``), where the others are still in ``no_sync``: DDP's
    all-reduces would pair wrongly. So while the Join lasts ``no_sync`` does
    nothing, and around each backward the gradient accumulated since the window
    began is set aside (DDP all-reduces a parameter's whole ``.grad``) and added
    back: each optimizer step gets the sum over its window of the averaged
    gradients, and the last joiner's model (DDP's post hook) is exact. The
    ``no_sync`` and ``backward`` replacements are instance attributes, removed
    on exit.
    """
    if not on:
        yield
        return
    from joinkit.adapters.torch.optim import gradients_set_aside

    model = next(obj for obj in items if _is_ddp(obj))
    original = accelerator.backward

    def no_sync(model: Any) -> Any:
        return contextlib.nullcontext()

    def backward(loss: Any, **kwargs: Any) -> Any:
        with gradients_set_aside(model.parameters()):
            return original(loss, **kwargs)

    accelerator.no_sync, accelerator.backward = no_sync, backward
    try:
        yield
    finally:
        del accelerator.no_sync, accelerator.backward
