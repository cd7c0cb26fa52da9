"""DeepSpeed engines under Join: a joined rank replays the engine's step.

Theory of operation
-------------------
A DeepSpeed engine runs its collectives inside its own ``forward`` (ZeRO-3's
parameter gathers), ``backward`` (ZeRO-2/3's bucketed reductions in gradient
hooks; stage 0's and ZeRO-1's reduction at the accumulation boundary) and
``step`` (the gradient norm for clipping, the overflow check, the partitioned
optimizer step, the all-gather of the updated partitions). Which of them run
in a micro-step depends only on the configuration and the micro-step counter,
so :class:`DeepSpeedJoinable` is a :class:`~joinkit.adapters.torch.step_replay.StepReplay`
over the engine: an active rank's heartbeat goes out in a forward pre-hook on
the engine (before the first gather), and a joined rank replays the whole
micro-step through the engine, ``engine(empty batch)``,
``engine.backward(zero loss)``, ``engine.step()``. Its micro-step counter
advances with the active ranks', so it reaches every accumulation boundary
with them; its reductions contribute zeros; at a boundary it steps its own
optimizer partition with the active ranks' reduced gradient (clipped by the
global norm it helped compute), and the all-gather after the step gives it
the new parameters: after the Join every rank holds the same model, and no
post hook has anything to send.

*The divisor.* DeepSpeed divides each micro-batch's loss by
``gradient_accumulation_steps`` (``engine.backward``) and averages the reduced
gradient over the data-parallel world size ``W`` (``engine.dp_world_size``,
``gradient_predivide_factor`` included). A joined rank's zeros leave that as
it is, so by default each optimizer step applies

    sum over the micro-steps t of the window, over the ranks r active at t, of
    grad(loss[r, t]) / (gradient_accumulation_steps * W)

which is DDP's ``divide_by_initial_world_size=True``: exactly what DeepSpeed
computes when the missing micro-batches contribute nothing, with no rescale.
``Join([engine], divide_by_initial_world_size=False)`` divides each
micro-step's gradient by the number ``A[t]`` of ranks active at ``t`` instead
(``W`` replaced by ``A[t]`` above, as DDP does per iteration): each active
rank multiplies the gradient its backward sends into the engine's outputs by
``W / A[t]`` (a tensor hook on the outputs, so ``engine.backward`` and a
torch-style ``loss.backward()`` alike), where ``A[t]`` is the sum of this
micro-step's heartbeat (read after its forward, long complete). ``W / A`` is
exact when it is a power of two (2 ranks, 1 active) and within one rounding
of the product otherwise. With ``"gradient_allreduce_op": "sum"`` DeepSpeed
does not average, and ``divide_by_initial_world_size=False`` is refused.

*The boundary.* A joined rank replays with the micro-step counter's boundary
(``(micro_steps + 1) % gradient_accumulation_steps == 0``; the flag
``set_gradient_accumulation_boundary`` sets is set aside for the replay). An
active rank must run the same boundary: while the Join lasts,
``engine.set_gradient_accumulation_boundary(b)`` with ``b`` not the counter's
(Accelerate's ``accumulate()`` under DeepSpeed) completes the open micro-step
as a joined rank would and raises ``LocalProtocolError``; so does a forward
after a stale flag. Each micro-step must call ``engine.step()`` (DeepSpeed's
documented loop; Accelerate's ``accelerator.backward`` does with
``gradient_accumulation_steps=1``): ``engine.step`` is replaced on the engine
object for the Join's length to see it, and a forward (or the rank leaving
its loop) after a micro-step without its backward or step completes that
micro-step, then raises. ``engine.no_sync()`` and ``coalesce_grad_reduction()``
are refused at the forward, before the heartbeat.

*The loop's windows.* The Hugging Face Trainer and Accelerate's
``accumulate()`` do not let the engine count: before each backward they set
the boundary themselves (``set_gradient_accumulation_boundary``) and call
``engine.step()`` at a window's end only, so the engine's counter advances once
per window. Such a loop's joinable is ``DeepSpeedJoinable(engine,
boundaries=...)``, where ``boundaries(i)`` says whether the Join's micro-step
``i`` (counted from 0 on every rank: its own forwards and its replays) ends a
window; the integration knows (the Trainer pads every rank's windows alike;
Accelerate ends one every ``gradient_accumulation_steps`` micro-steps). A
joined rank replays micro-step ``i`` with that boundary set and steps the engine
only where it is true; an active rank must set the same boundary (else the
micro-step is completed as a joined rank would and ``LocalProtocolError``
raised) and step there only. ``engine.no_sync()`` is allowed inside a window
(Accelerate's ``accumulate()`` under ZeRO 0 and 1, where such a micro-step
reduces nothing anyway). When every rank has run out and the last micro-step
did not end a window, the post hook closes it on every rank at once (one more
replayed micro-step, boundary set, engine stepped: Accelerate steps at the end
of its data). ``after_step(window_end)`` runs after each replayed micro-step:
the shadow of what the loop does after the engine's step (its LR scheduler's).

*ZeRO-Offload* (``offload_optimizer`` / ``offload_param`` to ``cpu``) changes
where the partitions live, not which collectives a micro-step runs: a joined
rank's replay copies its zero gradients to its CPU partition, steps its CPU
optimizer partition (a torch optimizer or ``DeepSpeedCPUAdam``) and takes part
in the all-gather as an active rank does.

*Refused on entry* (``ValueError`` from ``Join(...)``, on every rank alike,
before any collective: it depends on the configuration only): pipeline
parallelism (``PipelineEngine.train_batch`` runs its own schedule of
point-to-point sends), MoE layers (expert routing), ZeRO-Infinity
(``offload_optimizer`` / ``offload_param`` to ``nvme``: DeepSpeed's async I/O op
does not build on the test machines, so no replay with it was run), ZenFlow,
DeepCompile, ZeRO++ (hpZ, quantized weights or gradients),
``managed_gradient_accumulation: false``, tensor, sequence or model
parallelism (AutoTP, Ulysses, an ``mpu``), an engine without an optimizer (use
:func:`evaluation`), and the engine's own optimizer or LR scheduler listed in
the Join beside it (the engine steps them).
A training Join (the engine's own, Accelerate's, the Trainer's: every
:class:`DeepSpeedJoinable`) also refuses, when it is entered, ZeRO-2 with gradient
accumulation (no optimizer offload) on a DeepSpeed that steps on a window's last
micro-step alone (0.18.2: ``_private.zero2_keeps_last_micro_step``), ZeRO-2 with
optimizer offload and more than 2 accumulation steps on a DeepSpeed that drops a
window's middle micro-steps there (0.18.2 to 0.18.9:
``_private.zero2_offload_drops_middle_micro_steps``), ZeRO-3 on the CPU on a
DeepSpeed that reads its gathered parameters before the gathers end (0.18.2 to
0.19.7: ``_private.zero3_gather_races_on_cpu``), ZeRO-1 or 2 on the CPU, 2 ranks or
more, on a DeepSpeed whose first optimizer step raises there, its flat parameters left
in autograd (0.18.7 to 0.18.9: ``_private.zero12_step_raises_on_cpu``), and a joinable
on the loop's windows on ZeRO 0 or 1 with accumulation on a DeepSpeed whose
``engine.no_sync()`` leaves a micro-step undivided by the accumulation steps (0.18.2:
``_private.no_sync_skips_accumulation_scaling``), which would train wrongly with or
without a Join; evaluation does not accumulate.

*Evaluation.* :func:`evaluation` gives the joinable of a forward-only loop
(``StepReplay(engine, backward=None)``): a joined rank replays the forward
alone under ``torch.no_grad()`` (ZeRO-3's gathers).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from joinkit import Join, Joinable, JoinHook, LocalProtocolError
from joinkit.lowlevel import AdapterCache

from .._guards import version
from ..torch.step_replay import StepReplay
from . import _private
from ._private import is_engine

__all__ = ["DeepSpeedJoinable", "adapt", "check", "evaluation", "engine_parts",
           "owned_by_an_engine", "collectives_group"]

_MISSING = object()
# The engine methods replaced on the object while a Join lasts (module doc).
_WATCHED = ("step", "set_gradient_accumulation_boundary")


def adapt(obj: Any) -> DeepSpeedJoinable:
    """The joinable standing for a DeepSpeed engine (the same one for the same engine).

    Args:
        obj: what ``deepspeed.initialize`` returned first.

    Raises:
        UnsupportedDeepSpeedError: an unsupported DeepSpeed (``_private``).
        ValueError: an engine whose step cannot be replayed (module doc), or an
            engine's optimizer or scheduler passed instead of the engine.
        TypeError: ``obj`` is neither.
    """
    if is_engine(obj):
        _private.check()
        message = _refusal(obj, training=True)
        if message is not None:
            raise ValueError(message)
        _engines.add(obj)
        return _adapters.get(obj, DeepSpeedJoinable)
    if owned_by_an_engine(obj) or _is_deepspeed_optimizer(obj):
        raise ValueError(_part_message(obj))
    raise TypeError(
        "joinkit.adapters.deepspeed.adapt expects a DeepSpeed engine, got "
        f"{type(obj).__qualname__}"
    )


def evaluation(engine: Any) -> StepReplay:
    """The joinable of an evaluation loop over ``engine``: joined ranks replay its forward.

    Example::

        engine.eval()
        with Join([evaluation(engine)]), torch.no_grad():
            for x, y in batches:
                total += loss_fn(engine(x), y)

    Args:
        engine: what ``deepspeed.initialize`` returned first.

    Returns:
        A ``StepReplay(engine, backward=None)`` on the engine's data-parallel group.

    Raises:
        UnsupportedDeepSpeedError, ValueError: as :func:`adapt`.
    """
    if not is_engine(engine):
        raise TypeError(
            f"evaluation expects a DeepSpeed engine, got {type(engine).__qualname__}"
        )
    _private.check()
    message = _refusal(engine, training=False)
    if message is not None:
        raise ValueError(message)
    return StepReplay(engine, backward=None, process_group=collectives_group(engine),
                      device=engine.device)


def collectives_group(engine: Any) -> Any:
    """The process group the engine's step runs its collectives on: the Join's group.

    ZeRO's optimizer keeps its own (``dp_process_group``: for stage 3 the group
    the parameters were partitioned over, the world by default; for stages 1
    and 2 the engine's data-parallel group); stage 0 reduces on the engine's
    data-parallel group. The Join's heartbeat goes on the same group, so the
    backend's collective counter (the group's sequence number) sees the step's
    collectives, which the Join's failure protocol reads.
    """
    group = getattr(engine.optimizer, "dp_process_group", None)
    return group if group is not None else engine.data_parallel_group


def engine_parts(engine: Any) -> list[Any]:
    """The optimizers and LR schedulers ``engine`` steps itself (none of them is a joinable)."""
    parts: list[Any] = []
    for name in ("optimizer", "basic_optimizer", "client_optimizer", "lr_scheduler",
                 "client_lr_scheduler"):
        part = getattr(engine, name, None)
        if part is not None and all(part is not p for p in parts):
            parts.append(part)
        inner = getattr(part, "optimizer", None)  # a ZeRO optimizer's torch optimizer
        if inner is not None and all(inner is not p for p in parts):
            parts.append(inner)
    return parts


def owned_by_an_engine(obj: Any) -> bool:
    """Whether ``obj`` is an optimizer or scheduler of an engine adapted in this process."""
    return any(obj is part for engine in list(_engines) for part in engine_parts(engine))


def check(joinables: Sequence[Joinable]) -> None:
    """Refuse an engine's optimizer or scheduler listed beside the engine.

    Raises:
        ValueError: the message says to pass the engine alone.
    """
    engines = [j.module for j in joinables if isinstance(j, DeepSpeedJoinable)]
    if not engines:
        return
    parts = [part for engine in engines for part in engine_parts(engine)]
    for joinable in joinables:
        obj = getattr(joinable, "obj", None)
        if obj is not None and any(obj is part for part in parts):
            raise ValueError(_part_message(obj))


_adapters: AdapterCache[DeepSpeedJoinable] = AdapterCache()
_engines: weakref.WeakSet[Any] = weakref.WeakSet()


class DeepSpeedJoinable(StepReplay):
    """A DeepSpeed engine in a Join: a joined rank replays its micro-steps (module doc).

    ``Join([engine])`` makes one with the engine alone: the engine's micro-step
    counter decides the accumulation boundary and the loop calls
    ``engine.step()`` after every backward. A loop that decides the boundary
    itself (the Hugging Face Trainer's, Accelerate's ``accumulate()``) passes
    ``boundaries`` (module doc, *The loop's windows*).

    Args:
        engine: what ``deepspeed.initialize`` returned first.
        boundaries: ``None``: the micro-step counter's boundaries. Else
            ``boundaries(i)`` says whether the Join's micro-step ``i`` (``0``
            for its first) ends an accumulation window, the same on every rank;
            the loop sets that boundary on the engine
            (``set_gradient_accumulation_boundary``) before each backward and
            calls ``engine.step()`` at the micro-steps that end a window only.
        after_step: called on a joined rank after each micro-step it replays
            (and after the one that closes the last window) with whether that
            micro-step ended a window: the shadow of what the loop does after
            the engine's step (its own LR scheduler's step).

    Raises:
        TypeError: ``boundaries`` or ``after_step`` is not callable.
    """

    def __init__(self, engine: Any, *, boundaries: Callable[[int], bool] | None = None,
                 after_step: Callable[[bool], Any] | None = None) -> None:
        for name, value in (("boundaries", boundaries), ("after_step", after_step)):
            if value is not None and not callable(value):
                raise TypeError(f"DeepSpeedJoinable: {name} must be callable or None, not "
                                f"{type(value).__qualname__}")
        super().__init__(engine, backward=self._engine_backward, step=self._engine_step,
                         process_group=collectives_group(engine), device=engine.device)
        _engines.add(engine)
        # Weak: the adapter cache must not keep the engine alive.
        self._module = weakref.ref(engine)
        self._boundaries = boundaries
        self._after_step = after_step
        self._index = -1  # the Join's current micro-step (own or replayed)
        self._boundary = False  # whether it ends a window
        self._closing = False  # the post hook's replay closing the last window
        self._world = int(engine.dp_world_size)
        self._average = bool(engine.gradient_average)
        self._divide_by_initial_world_size = True
        self._originals: dict[str, Any] = {}  # the engine's own methods, while in a Join
        self._saved: dict[str, Any] = {}  # what the instance held under those names
        self._forwarded = False  # this rank's micro-step announced and not yet settled
        self._stepped = False
        self._heartbeat: Any = None
        self._scale: float | None = None

    @property
    def engine(self) -> Any:
        """The DeepSpeed engine."""
        return self.module

    # -- Join ------------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The replay of one micro-step (module doc).

        Args:
            **kwargs: the Join's keyword arguments: ``divide_by_initial_world_size``
                (default ``True``: DeepSpeed's own average over the world size)
                and ``shadow_input`` (``StepReplay``).

        Raises:
            ValueError: ``divide_by_initial_world_size=False`` with an engine that
                sums gradients instead of averaging them.
        """
        divide = bool(kwargs.get("divide_by_initial_world_size", True))
        if not divide and not self._average:
            raise ValueError(
                "Join(..., divide_by_initial_world_size=False) with a DeepSpeed engine that "
                "sums gradients (\"gradient_allreduce_op\": \"sum\"): there is no world size "
                "to replace by the number of active ranks. Leave the keyword out, or let the "
                "engine average"
            )
        self._divide_by_initial_world_size = divide
        super().join_hook(**kwargs)  # the replay's input source
        return _EngineHook(self)

    def _refuse_on_entry(self, join: Join) -> None:
        super()._refuse_on_entry(join)
        message = _training_refusal(self.engine, windows=self._boundaries is not None)
        if message is not None:
            raise ValueError(message)
        if not self._divide_by_initial_world_size and join.fuses_heartbeat:
            raise ValueError(
                "Join(..., divide_by_initial_world_size=False) needs the number of active "
                "ranks from the heartbeat, and this Join's first joinable carries it in its "
                "own collective: list the DeepSpeed engine first, Join([engine, ...])"
            )

    def _enter(self, join: Join) -> None:
        super()._enter(join)
        engine = self.engine
        self._forwarded = self._stepped = False
        self._heartbeat, self._scale = None, None
        self._index, self._boundary = -1, False
        replacements = {"step": self._watched_step,
                        "set_gradient_accumulation_boundary": self._watched_boundary}
        for name in _WATCHED:
            self._originals[name] = getattr(engine, name)
            self._saved[name] = engine.__dict__.get(name, _MISSING)
            engine.__dict__[name] = replacements[name]

    def _leave(self) -> None:
        engine = self._module()
        if engine is not None:
            for name, value in self._saved.items():
                if value is _MISSING:
                    engine.__dict__.pop(name, None)
                else:
                    engine.__dict__[name] = value
        self._saved, self._originals = {}, {}
        self._heartbeat = None
        super()._leave()

    # -- what the replay calls ---------------------------------------------------------------

    def _engine_backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def _engine_step(self) -> None:
        if self._boundaries is not None and not self._boundary:
            return  # the loop steps at a window's end only
        step = self._originals.get("step")
        (step if step is not None else self.engine.step)()

    def _set_boundary(self, is_boundary: bool) -> None:
        """The engine's own ``set_gradient_accumulation_boundary`` (not the watched one)."""
        original = self._originals.get("set_gradient_accumulation_boundary")
        (original if original is not None
         else self.engine.set_gradient_accumulation_boundary)(is_boundary)

    def _replay_context(self) -> contextlib.AbstractContextManager[Any]:
        self._index += 1
        if self._boundaries is None:
            self._boundary = self._counted_boundary()
            return self._counted_boundary_set()
        self._boundary = self._closing or bool(self._boundaries(self._index))
        self._set_boundary(self._boundary)  # as the loop sets it, and leaves it
        return contextlib.nullcontext()

    def replay(self) -> None:
        """A joined rank's replay of one micro-step, then ``after_step`` (class doc)."""
        super().replay()
        if self._after_step is not None:
            self._after_step(self._boundary)

    def _close_window(self) -> None:
        """At the Join's end, close a window the loop's boundaries left open (module doc).

        Every rank calls it at the same point (the post hook), so the micro-step it
        replays, with the boundary set, is a collective of every rank.
        """
        if self._boundaries is None or self._index < 0 or self._boundary:
            return
        self._closing = True
        try:
            self.replay()
        finally:
            self._closing = False

    @contextlib.contextmanager
    def _counted_boundary_set(self) -> Iterator[None]:
        """The replay runs the micro-step counter's boundary (module doc)."""
        engine = self.engine
        flag = engine._is_gradient_accumulation_boundary
        engine._is_gradient_accumulation_boundary = None
        try:
            yield
        finally:
            engine._is_gradient_accumulation_boundary = flag

    # -- an active rank's micro-step -------------------------------------------------------------

    def _active(self) -> bool:
        config = self._config
        return bool(config.enable and config.join is not None and not self._in_hook)

    def _counted_boundary(self) -> bool:
        engine = self.engine
        return bool((engine.micro_steps + 1) % engine.gradient_accumulation_steps() == 0)

    def _window_end(self) -> bool:
        """Whether this rank's open micro-step ends a window (the next one's, if none is open)."""
        if self._boundaries is None:
            return self._counted_boundary()
        if self._forwarded:
            return self._boundary
        return bool(self._boundaries(self._index + 1))

    def _check_forward(self) -> None:
        super()._check_forward()
        engine = self.engine
        if self._boundaries is not None:
            # The loop sets the boundary after this forward. engine.no_sync() (Accelerate's
            # accumulate() under ZeRO 0/1) skips only a reduction that a micro-step inside
            # a window does not run: allowed there.
            if engine.inside_no_sync_ctxt and self._boundaries(self._index + 1):
                raise LocalProtocolError(
                    "a forward of the DeepSpeed engine inside engine.no_sync() at a micro-step "
                    "that ends an accumulation window inside a Join: the window's reduction "
                    "would be skipped on this rank and run on the others. Leave no_sync() "
                    "out of the micro-step that ends a window"
                )
            return
        if engine.inside_no_sync_ctxt:
            raise LocalProtocolError(
                "a forward of the DeepSpeed engine inside engine.no_sync() or "
                "engine.coalesce_grad_reduction() inside a Join: a joined rank cannot tell "
                "such a micro-step from one that reduces. Let DeepSpeed accumulate with "
                "\"gradient_accumulation_steps\" in its config instead"
            )
        flag = engine._is_gradient_accumulation_boundary
        if flag is not None and bool(flag) != self._counted_boundary():
            raise LocalProtocolError(_boundary_message(bool(flag), self._counted_boundary()))

    def _heartbeat_sent(self, handle: Any) -> None:
        self._index += 1
        self._boundary = (self._counted_boundary() if self._boundaries is None
                          else bool(self._boundaries(self._index)))
        self._forwarded, self._stepped = True, False
        self._scale = None
        join = self._config.join
        if not self._divide_by_initial_world_size and join is not None:
            self._heartbeat = handle if handle is not None else join.heartbeat_handle

    def _open_iteration(self) -> str | None:
        missing = super()._open_iteration()
        if (missing is None and self._forwarded and not self._stepped
                and (self._boundaries is None or self._boundary)):
            missing = "step"
        return missing

    def _settle(self) -> None:
        try:
            super()._settle()
        finally:
            self._forwarded = False

    def _complete(self, missing: str) -> None:
        try:
            if self._boundaries is None:
                with self._counted_boundary_set():
                    super()._complete(missing)
            else:
                self._set_boundary(self._boundary)
                super()._complete(missing)
        finally:
            self._forwarded, self._stepped = False, True

    def _watched_step(self, *args: Any, **kwargs: Any) -> Any:
        step = self._originals["step"]
        if not self._active():
            return step(*args, **kwargs)
        if not self._forwarded or self._stepped:
            self._refuse(LocalProtocolError(
                "engine.step() inside a Join without a forward of the engine since the last "
                "step: joined ranks replay one forward, backward and step per forward. Call "
                "engine(batch), engine.backward(loss), engine.step() once each per micro-batch"
            ))
        if self._boundaries is not None and not self._boundary:
            missing = self._open_iteration()  # a joined rank steps nothing here
            if missing is not None:
                self._complete(missing)
            self._forget_pending()
            self._forwarded = False
            self._refuse(LocalProtocolError(
                f"engine.step() at the Join's micro-step {self._index}, which does not end an "
                "accumulation window by the loop's boundaries: joined ranks step the engine "
                "at a window's end only. Call engine.step() after the backward of the "
                "micro-step that ends a window (Accelerate's accelerator.backward does it "
                "inside accelerator.accumulate(model))"
            ))
        result = step(*args, **kwargs)
        self._stepped = True
        return result

    def _watched_boundary(self, is_boundary: bool) -> Any:
        original = self._originals["set_gradient_accumulation_boundary"]
        if self._active():
            expected = self._window_end()
            if bool(is_boundary) != expected:
                missing = self._open_iteration()
                if missing is not None:
                    self._complete(missing)  # as the joined ranks replay it
                message = (_boundary_message(bool(is_boundary), expected)
                           if self._boundaries is None
                           else _window_message(bool(is_boundary), expected, self._index))
                self._refuse(LocalProtocolError(message))
        return original(is_boundary)

    def _scale_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        if self._divide_by_initial_world_size or self._in_hook:
            return grad
        scale = self._scale
        if scale is None:
            scale = self._scale = self._world / self._active_ranks()
        return grad if scale == 1.0 else grad * scale

    def _active_ranks(self) -> float:
        """The number of ranks active in this micro-step: its heartbeat's sum."""
        handle = self._heartbeat
        join = self._config.join
        if handle is None or join is None:
            raise LocalProtocolError(
                "divide_by_initial_world_size=False: no heartbeat of this micro-step to count "
                "the active ranks from"
            )
        total = 0.0
        reader = getattr(join.backend, "heartbeat_total", None)
        if reader is not None:
            total = float(reader(handle))
        if not total:
            # The backend does not read it (a CUDA group): the torch Work's result.
            handle.wait()
            total = float(handle.result()[0].sum().item())
        if not 1.0 <= total <= self._world:
            return float(self._world)  # a peer failed: the Join raises at the next notify
        return total


def _boundary_message(given: bool, counted: bool) -> str:
    return (
        f"the DeepSpeed engine's gradient accumulation boundary was set to {given} inside a "
        f"Join, where its micro-step counter says {counted}: Join([engine]) replays each "
        "micro-step with the counter's boundary. Either let the engine count (call "
        "engine.step() after every backward and leave the boundary alone), or, for a loop "
        "that sets the boundary itself and steps at a window's end only, join "
        "DeepSpeedJoinable(engine, boundaries=...) saying where its windows end (Accelerate's "
        "accumulate(): joinkit.adapters.accelerate.join_uneven_inputs does). (joinkit "
        "completed the open micro-step as joined ranks do, so no collective mismatched.)"
    )


def _nvme_message(what: str) -> str:
    return (
        f"Join does not replay a DeepSpeed engine with zero_optimization.{what} to 'nvme' "
        "(ZeRO-Infinity): joinkit's tests have no NVMe device with DeepSpeed's async I/O "
        "op to run a joined rank's replay on, so nothing vouches that it matches. Offload "
        "to 'cpu' (ZeRO-Offload, supported) or leave offloading out inside a Join"
    )


def _window_message(given: bool, expected: bool, index: int) -> str:
    return (
        f"the DeepSpeed engine's gradient accumulation boundary was set to {given} at the "
        f"Join's micro-step {index}, where the loop's windows say {expected}: joined ranks "
        "replay each micro-step with those windows' boundaries. With Accelerate, accumulate "
        "inside accelerator.accumulate(model) on every micro-batch (gradient_accumulation_steps "
        "micro-batches per window, counted from the Join's start). (joinkit completed the "
        "open micro-step as joined ranks do, so no collective mismatched.)"
    )


def _offload_device(offload: Any) -> str:
    """Where a ZeRO offload config puts its part: ``none``, ``cpu`` or ``nvme``."""
    if offload is None:
        return "none"
    device = getattr(offload, "device", "none")
    return str(getattr(device, "value", device))


def _training_refusal(engine: Any, windows: bool = False) -> str | None:
    """Why this DeepSpeed would train ``engine`` wrongly, with or without a Join, or
    ``None``: ZeRO-2 accumulation on a release that steps on a window's last micro-step
    alone (``_private.zero2_keeps_last_micro_step``) or with optimizer offload drops a
    window's middle micro-steps (``_private.zero2_offload_drops_middle_micro_steps``),
    ZeRO-3 on the CPU where it reads gathered parameters early
    (``_private.zero3_gather_races_on_cpu``), ZeRO-1/2 on the CPU where the first
    optimizer step raises (``_private.zero12_step_raises_on_cpu``), and the loop's windows
    (``windows``: Accelerate's ``accumulate()``, whose micro-steps inside a window run
    under ``engine.no_sync()`` on ZeRO 0 and 1) on a release that leaves such a
    micro-step undivided (``_private.no_sync_skips_accumulation_scaling``). Every
    training path's Join (the engine's own, Accelerate's, the Trainer's) checks it on
    entry; evaluation does not accumulate."""
    gas = int(engine.gradient_accumulation_steps())
    stage = engine.zero_optimization_stage()
    if (stage == 3 and torch.device(engine.device).type == "cpu"
            and _private.zero3_gather_races_on_cpu()):
        # Where ZeRO-1/2's first CPU step raises too (below), ZeRO-0 is the CPU's stage.
        other = "ZeRO-0" if _private.zero12_step_raises_on_cpu() else "ZeRO-1 or ZeRO-2"
        return (
            f"found deepspeed {version('deepspeed')}, whose ZeRO-3 on the CPU (gloo) reads "
            "the parameters it gathers several at once (after each optimizer step, the "
            "persistent ones) before every gather has ended, so now and then the model "
            "trains on stale values, with or without a Join; DeepSpeed fixed it in "
            "0.19.8), so Join refuses to train on it. Upgrade DeepSpeed (pip install "
            f"'deepspeed>=0.19.8'), or use {other}, or a GPU"
        )
    if (torch.device(engine.device).type == "cpu" and _private.zero12_step_raises_on_cpu()
            and _zero12_optimizer(engine.optimizer) and int(engine.dp_world_size) > 1):
        return (
            f"found deepspeed {version('deepspeed')}, whose ZeRO-{stage} keeps its "
            "flattened parameters in autograd (flattened on the accelerator without "
            ".detach()), so on the CPU (gloo) the first optimizer step's all-gather into "
            "them raises \"RuntimeError: Output 0 of Split is a view and is being modified "
            "inplace\" on every rank, with or without a Join (0.18.7 to 0.18.9; DeepSpeed "
            "fixed it in 0.19.0), so Join refuses to train on it. Upgrade DeepSpeed (pip "
            "install 'deepspeed>=0.19.0'), or use 0.18.6 or older, or ZeRO stage 0"
        )
    if gas == 1:
        return None
    offload = _offload_device(engine.zero_offload_optimizer())
    if stage == 2 and offload == "none" and _private.zero2_keeps_last_micro_step():
        return _last_micro_step_message(gas)
    if (stage == 2 and offload != "none" and gas > 2
            and _private.zero2_offload_drops_middle_micro_steps()):
        return (
            f"found deepspeed {version('deepspeed')}, whose ZeRO-2 with offload_optimizer "
            "keeps each accumulation window's gradient on the CPU from its first micro-step "
            f"only: with gradient_accumulation_steps={gas} the optimizer steps on the first "
            f"and the last micro-step's gradients, and the other {gas - 2} are dropped, with "
            "or without a Join; DeepSpeed fixed it in 0.19.0), so Join refuses to train on "
            "it. Upgrade DeepSpeed (pip install 'deepspeed>=0.19.0'), or use ZeRO-1 or "
            "ZeRO-3 with the offload, no offload, or gradient_accumulation_steps of 2 at most"
        )
    if windows and stage < 2 and _private.no_sync_skips_accumulation_scaling():
        return (
            f"found deepspeed {version('deepspeed')}, whose engine.no_sync() leaves a "
            "micro-step's loss undivided by gradient_accumulation_steps: with the loop's "
            f"accumulation windows on ZeRO-{stage} (Accelerate's accumulate() runs a "
            f"window's first micro-steps under engine.no_sync(); gradient_accumulation_steps"
            f"={gas}) each of them would count {gas} times, with or without a Join; "
            "DeepSpeed fixed it in 0.18.3), so Join refuses to train on it. Upgrade "
            "DeepSpeed (pip install 'deepspeed>=0.18.3'), or use ZeRO-3, or "
            "gradient_accumulation_steps=1"
        )
    return None


def _zero12_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is ZeRO-1/2's (not bf16's ``BF16_Optimizer`` at stage 1)."""
    cls = _private_class("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer")
    return cls is not None and isinstance(optimizer, cls)


def _last_micro_step_message(gas: int) -> str:
    return (
        f"found deepspeed {version('deepspeed')}, whose ZeRO-2 steps on the last micro-step's "
        f"gradient of each accumulation window alone (gradient_accumulation_steps={gas}: "
        f"the other {gas - 1} are dropped, with or without a Join; DeepSpeed fixed it in "
        "0.18.3), so Join refuses to train on it. Upgrade DeepSpeed (pip install "
        "'deepspeed>=0.18.3'), or use ZeRO-1 or ZeRO-3, offload_optimizer to 'cpu', or "
        "gradient_accumulation_steps=1"
    )


def _is_deepspeed_optimizer(obj: Any) -> bool:
    import sys

    base = getattr(sys.modules.get("deepspeed.runtime.base_optimizer"), "DeepSpeedOptimizer",
                   None)
    return isinstance(base, type) and isinstance(obj, base)


def _part_message(obj: Any) -> str:
    return (
        f"Join got {type(obj).__qualname__}, which a DeepSpeed engine steps itself "
        "(engine.step() steps its optimizer and LR scheduler): pass the engine alone, "
        "Join([engine]); a joined rank's replay of engine.step() steps them"
    )


def _refusal(engine: Any, *, training: bool) -> str | None:
    """Why the engine's step cannot be replayed, or ``None`` (module doc)."""
    name = type(engine).__qualname__
    pipe = _private_class("deepspeed.runtime.pipe.engine", "PipelineEngine")
    if engine.pipeline_parallelism or (pipe is not None and isinstance(engine, pipe)):
        return (
            f"Join cannot replay a {name} with pipeline parallelism: train_batch() runs its "
            "own schedule of sends and receives between stages, which a rank without data "
            "cannot replay. Give every rank the same number of batches (or use "
            "ZeRO data parallelism without a PipelineModule)"
        )
    if engine.has_moe_layers:
        return (
            f"Join cannot replay a {name} with MoE layers: expert routing sends tokens "
            "between ranks by their data (all-to-all), which an empty batch does not "
            "reproduce. Give every rank the same number of batches"
        )
    for what, offload in (("offload_optimizer", engine.zero_offload_optimizer()),
                          ("offload_param", engine.zero_offload_param())):
        if _offload_device(offload) == "nvme":
            return _nvme_message(what)
    if getattr(engine, "zenflow", False):
        return "Join does not replay a DeepSpeed engine with ZenFlow (its own update schedule)"
    if engine.is_deepcompile_enabled():
        return ("Join does not replay a DeepSpeed engine with DeepCompile (compiled "
                "collectives): turn compile.deepcompile off inside a Join")
    if not _private.managed_accumulation(engine):
        return (
            "Join needs DeepSpeed's managed gradient accumulation (the engine counts "
            "micro-steps and step() is called after each backward): remove "
            "\"managed_gradient_accumulation\": false from the config"
        )
    parallel = [(label, size) for label, size in (
        ("AutoTP tensor parallelism", engine.autotp_size()),
        ("sequence parallelism", engine.sequence_parallel_size),
        ("model parallelism (mpu)", engine.mp_world_size)) if size and int(size) > 1]
    if parallel:
        label, size = parallel[0]
        return (
            f"Join does not replay a DeepSpeed engine with {label} of size {size}: joinkit "
            "has tested data parallelism only (ZeRO stages 0-3). For your own "
            "tensor-parallel step use joinkit.adapters.torch.step_replay.StepReplay"
        )
    if (engine.zero_hpz_partition_size() > 1 or engine.zero_quantized_weights()
            or engine.zero_quantized_gradients()):
        return ("Join does not replay a DeepSpeed engine with ZeRO++ (hpZ partitions, "
                "quantized weights or gradients): joinkit has not run it. Leave "
                "zero_hpz_partition_size, zero_quantized_weights and "
                "zero_quantized_gradients out of the config inside a Join")
    if engine.seq_data_parallel_group is not engine.data_parallel_group:
        return ("Join does not replay a DeepSpeed engine whose ZeRO group is not its "
                "data-parallel group")
    if training and engine.optimizer is None:
        return (
            f"Join got a {name} without an optimizer, which has no step to replay: for "
            "an evaluation loop use Join([joinkit.adapters.deepspeed.evaluation(engine)])"
        )
    return None


class _EngineHook(JoinHook):
    """A joined rank replays each micro-step; at the Join's end an open window closes."""

    def __init__(self, joinable: DeepSpeedJoinable) -> None:
        self.joinable = joinable

    def main_hook(self) -> None:
        self.joinable.replay()

    def post_hook(self, is_last_joiner: bool) -> None:
        # Every rank ran every micro-step (its own or a replay) and holds the same model:
        # nothing to send. Every rank is here at once: a window the loop's boundaries
        # left open closes now, on all of them.
        self.joinable._close_window()


def _private_class(module: str, name: str) -> Any:
    import sys

    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None
