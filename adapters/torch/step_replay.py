"""A joined rank replays a whole training step: forward, backward and step.

Theory of operation
-------------------
Some training steps keep their collectives inside their own code, where no
adapter can see them one by one: a DeepSpeed engine (ZeRO's bucketed gradient
reductions in backward, stage 3's parameter gathers in forward and backward,
the gradient norm's all-reduce, the partitioned optimizer step and the
all-gather after it), a Megatron-style tensor-parallel layer, a user's own
``all_reduce`` of gradients before ``optimizer.step()``. The one program that
issues exactly that sequence of collectives, in that order, is the step
itself. So a joined rank *replays* it (``adapters._replay`` does the same for a
model's forward and backward alone):

- ``zero_grad()``, if the loop clears gradients before its forward (given);
- forward on an **empty batch** (every input tensor with 0 rows along dim 0;
  the input spec comes from this rank's first input of the Join, or a peer's
  through the c10d store, or ``Join(..., shadow_input=...)``);
- ``backward(zero loss)``: ``sum(outputs) * 0`` over every output tensor that
  requires grad, through the loop's own backward (``loss.backward()``,
  ``engine.backward``), so every gradient this rank feeds into a reduction is
  zero and the active ranks' sums are unchanged;
- ``step()``: the loop's own post-backward code (``optimizer.step()``,
  clipping, ``engine.step()``), which on a joined rank applies this rank's
  share (an optimizer partition) with the active ranks' reduced gradient.

Buffers are saved before the replay and restored after it
(``_replay.kept_buffers``: a BatchNorm's running statistics over an empty batch
would become NaN), except those of modules that exchange statistics in
forward.

*The heartbeat.* While a Join holds the joinable, a forward pre-hook on the
module (before any hook the framework put there first: ``prepend``) sends the
rank's heartbeat before the iteration's first collective. So **one forward of
the module is one iteration**, and a joined rank replays one whole step per
heartbeat. A replay's own forward does not notify.

*What a step must be.* Every iteration runs, in this order, one forward of the
module with gradients enabled, one backward that reaches its outputs, and the
step; the collectives of an iteration do not depend on the data or its batch
size; every output tensor that requires grad feeds the loss; the module
accepts a batch of 0 samples (or pass ``shadow_input``). Two mistakes are
caught on the rank that makes them, without a mismatched collective:

- a forward with gradients disabled (an evaluation forward inside a training
  Join) is refused before its heartbeat (``LocalProtocolError``): a joined rank
  would replay a backward and a step after it. Evaluate in a Join of its own
  with ``backward=None``: the replay is then the forward alone, under
  ``torch.no_grad()``;
- a forward whose outputs no backward reached before the next forward (or
  before the rank leaves its loop) is completed as a joined rank's replay
  would (backward from a zero loss, then the step), and then refused.

A subclass may refuse more (``DeepSpeedJoinable``: a step it did not see).

*Gradients.* The replay does not touch a gradient the step would not: with
``zero_grad`` unset, the joined rank's ``.grad`` keeps what its own last
iterations left (a framework that accumulates over micro-steps, such as
DeepSpeed, still holds a partial window there, which belongs in the window's
reduction). A loop that clears gradients before its forward passes that call
as ``zero_grad``, or a joined rank's stale gradient would enter the next
reduction.

*A rank that dies* (``Join(..., on_rank_loss="finish")``) is refused on entry:
the framework's own groups cannot be rebuilt under it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from joinkit import Join, Joinable, JoinConfig, JoinHook, LocalProtocolError

from . import _replay

__all__ = ["StepReplay", "autograd_backward"]

_DISABLED = JoinConfig()


def autograd_backward(loss: torch.Tensor) -> None:
    """``loss.backward()``: :class:`StepReplay`'s default backward."""
    torch.autograd.backward(loss)


class StepReplay(Joinable):
    """A joinable for a training step whose collectives run inside its own code.

    A joined rank replays the step (module doc): ``zero_grad()`` if given,
    ``module(empty batch)``, ``backward(zero loss)``, ``step()``. Put it first
    in the Join, or after joinables whose collectives come before the module's
    forward.

    Example::

        def step():
            all_reduce_gradients(model)        # your own collectives
            optimizer.step()
            optimizer.zero_grad()

        with Join([StepReplay(model, step=step)]):
            for x, y in batches:               # uneven across ranks
                loss_fn(model(x), y).backward()
                step()

    Args:
        module: the ``torch.nn.Module`` the loop calls once per iteration (its
            forward starts the iteration).
        backward: what the loop does with its loss, ``backward(loss)``; default
            ``loss.backward()``. ``None``: the iterations have no backward (an
            evaluation loop); the replay is then the forward alone, under
            ``torch.no_grad()``, and ``step`` must be ``None`` too.
        step: the loop's code after backward (``optimizer.step()``, clipping,
            your gradient all-reduce, ``engine.step()``), called with no
            arguments; ``None`` for nothing.
        zero_grad: called at the start of a replay when the loop clears
            gradients before its forward (``optimizer.zero_grad``).
        process_group: the group of the Join's heartbeat (the data-parallel
            group of the step's collectives); default: the default group.
        device: the device of the heartbeat; default: the device of the
            module's first parameter (``cpu`` without one).

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``, or a callable
            argument is not callable.
        ValueError: ``step`` without ``backward``.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        backward: Callable[[torch.Tensor], Any] | None = autograd_backward,
        step: Callable[[], Any] | None = None,
        zero_grad: Callable[[], Any] | None = None,
        process_group: Any = None,
        device: Any = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"StepReplay expects the torch.nn.Module the loop calls, got "
                f"{type(module).__qualname__}"
            )
        for name, value in (("backward", backward), ("step", step), ("zero_grad", zero_grad)):
            if value is not None and not callable(value):
                raise TypeError(f"StepReplay: {name} must be callable or None, not "
                                f"{type(value).__qualname__}")
        if backward is None and step is not None:
            raise ValueError(
                "StepReplay: a step without a backward; for an evaluation loop pass "
                "backward=None and step=None"
            )
        self._config = _DISABLED
        super().__init__()
        self._module: Callable[[], nn.Module | None] = lambda: module
        self._backward = backward
        self._step = step
        self._zero_grad = zero_grad
        self._group = process_group
        self._device = device
        self._source: _replay.InputSource | None = None
        self._handles: list[Any] = []
        self._in_hook = False  # a replay (or a completion) is running
        # The outputs of this rank's last forward with gradients, and whether a
        # backward reached them yet (module doc).
        self._pending: tuple[list[torch.Tensor], list[bool], list[Any]] | None = None

    def __repr__(self) -> str:
        module = self._module()
        return f"{type(self).__name__}({type(module).__qualname__})"

    @property
    def module(self) -> nn.Module:
        """The module whose forward starts each iteration."""
        module = self._module()
        if module is None:
            raise LocalProtocolError(f"the module behind {type(self).__name__} was deleted")
        return module

    @property
    def trains(self) -> bool:
        """Whether the replayed iterations have a backward (``backward`` is not ``None``)."""
        return self._backward is not None

    # -- the config the shell sets ---------------------------------------------------

    @property
    def _join_config(self) -> Any:
        return self._config

    @_join_config.setter
    def _join_config(self, config: Any) -> None:
        was_active = self._config.enable and self._config.join is not None
        active = config.enable and config.join is not None
        if active and not was_active:
            self._refuse_on_entry(config.join)  # before this rank's loop: every rank alike
        self._config = config
        if active and not was_active:
            self._enter(config.join)
        elif was_active and not active:
            self._leave()

    def _refuse_on_entry(self, join: Join) -> None:
        """Raise for a Join this joinable cannot serve (the same on every rank).

        Raises:
            ValueError: ``on_rank_loss="finish"``.
        """
        if getattr(join, "on_rank_loss", "raise") == "finish":
            raise ValueError(
                f"{self!r} cannot finish after a rank dies (Join(..., "
                "on_rank_loss='finish')): the step's own collectives run on groups joinkit "
                "cannot rebuild. Use on_rank_loss='raise' (the default)"
            )

    def _enter(self, join: Join) -> None:
        module = self.module
        self._pending = None
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
            module.register_forward_hook(self._post_forward),
        ]

    def _leave(self) -> None:
        self._forget_pending()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._source is not None:
            self._source.close()
            self._source = None

    # -- Joinable ----------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The replay of one iteration (module doc).

        Args:
            **kwargs: the Join's keyword arguments; ``shadow_input`` (a tensor, a
                tuple of positional arguments, or ``(args, kwargs)``) is the
                replay's input, used as given, instead of an empty batch.
        """
        self._source = _replay.InputSource(self.join_process_group,
                                           kwargs.get(_replay.SHADOW_INPUT))
        return _StepReplayHook(self)

    @property
    def join_device(self) -> Any:
        if self._device is not None:
            return torch.device(self._device)
        for param in self.module.parameters():
            return param.device
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        if self._group is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise LocalProtocolError(
                    f"{self!r} has no process group: call "
                    "torch.distributed.init_process_group first, or pass process_group="
                )
            return dist.distributed_c10d._get_default_group()
        return self._group

    def join_leave_loop(self) -> None:
        """Called by the Join as this rank leaves its loop: settle the last iteration.

        Raises:
            LocalProtocolError: the last iteration was incomplete (module doc);
                it was completed first, so no collective mismatched.
        """
        if not self._in_hook:
            try:
                self._settle()
            except LocalProtocolError as error:
                self._refuse(error)

    # -- an active rank's iteration ------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._in_hook:
            return None  # the replay's own forward
        try:
            self._settle()  # the previous iteration, before anything goes out
            self._check_forward()
        except LocalProtocolError as error:
            self._refuse(error)
        source = self._source
        if source is not None and source.needs_record:
            source.record(tuple(args), dict(kwargs), self.join_device.type)
        handle = Join.notify_join_context(self)
        self._heartbeat_sent(handle)
        return None

    def _check_forward(self) -> None:
        """Refuse a forward a joined rank could not replay (before its heartbeat).

        Raises:
            LocalProtocolError: gradients are disabled in a training step.
        """
        if self.trains and not torch.is_grad_enabled():
            raise LocalProtocolError(
                f"{self!r}: a forward without gradients (torch.no_grad(), "
                "torch.inference_mode()) inside a Join whose joined ranks replay a "
                "training step (forward, backward, step). Evaluate in a Join of its own "
                "whose joined ranks replay the forward alone: "
                "Join([StepReplay(module, backward=None)]) (for a DeepSpeed engine: "
                "joinkit.adapters.deepspeed.evaluation(engine))"
            )

    def _refuse(self, error: LocalProtocolError) -> None:
        """Raise ``error`` at the one point the Join's failure protocol reads exactly.

        Called where this rank's iterations so far are complete (an open one
        was completed first). The Join tells a failure's place in an iteration
        from the collectives its backend counted since the rank's last
        heartbeat; a step whose iterations may issue none (a micro-step
        between accumulation boundaries) would make that count ambiguous. So
        the first joinable sends the next iteration's heartbeat first: with
        nothing after it, the Join runs one completion round (this rank
        replays that iteration, as its peers run it), then drains.

        Raises:
            LocalProtocolError: always, ``error``.
        """
        config = self._config
        if config.enable and config.join is not None and config.is_first_joinable:
            Join.notify_join_context(self)
        raise error

    def _heartbeat_sent(self, handle: Any) -> None:
        """After this rank's heartbeat, before the module's forward (subclasses)."""

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._in_hook or not self.trains:
            return None
        tensors = [t for t in pytree.tree_leaves(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return None  # nothing a backward could start from (the replay refuses it)
        seen = [False]

        def reached(grad: torch.Tensor) -> torch.Tensor:
            if not seen[0]:
                seen[0] = True
                tensors.clear()  # a backward ran: hold the outputs no longer
            return self._scale_gradient(grad)

        self._forget_pending()
        handles = [t.register_hook(reached) for t in tensors]  # type: ignore[no-untyped-call]
        self._pending = (tensors, seen, handles)
        return None

    def _scale_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient an active rank's backward sends into the module (subclasses)."""
        return grad

    def _forget_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            for handle in pending[2]:
                handle.remove()

    def _open_iteration(self) -> str | None:
        """What the last iteration still lacks (``"backward"``, ``"step"``), or ``None``."""
        pending = self._pending
        if pending is not None and not pending[1][0]:
            return "backward"
        return None

    def _settle(self) -> None:
        """Refuse an incomplete iteration, after completing it as a joined rank would.

        Raises:
            LocalProtocolError: the last forward had no backward (module doc).
        """
        missing = self._open_iteration()
        if missing is None:
            self._forget_pending()
            return
        self._complete(missing)
        raise LocalProtocolError(
            f"{self!r}: an iteration without its {missing}: the loop ran the module's "
            f"forward with gradients and no {missing} after it (e.g. a validation forward "
            "without torch.no_grad(), or a loop that skips a step). Inside a Join a joined "
            "rank replays forward, backward and step for every forward. Run each step "
            "completely, and evaluate under torch.no_grad() in a Join of its own. (joinkit "
            "completed that iteration with a zero loss, as joined ranks do, so no "
            "collective mismatched.)"
        )

    def _complete(self, missing: str) -> None:
        """Run what the open iteration lacks, contributing nothing (a joined rank's part)."""
        pending = self._pending
        self._forget_pending()
        self._in_hook = True
        try:
            if missing == "backward" and pending is not None:
                loss = _replay.zero_loss(pending[0])
                assert loss is not None and self._backward is not None
                with torch.enable_grad():
                    self._backward(loss)
            if self._step is not None:
                self._step()
        finally:
            self._in_hook = False

    # -- a joined rank's replay ------------------------------------------------------------

    def replay(self) -> None:
        """One joined rank's replay of an iteration (the main hook; module doc).

        Raises:
            LocalProtocolError: the module gave no output that requires grad
                (nothing to run a backward from), or a rank without inputs
                found no input spec (pass ``shadow_input``).
        """
        source = self._source
        if source is None:
            raise LocalProtocolError(f"{self!r} is not in a Join")
        module = self.module
        self._in_hook = True
        try:
            args, kwargs, autocast = source.inputs(self.join_device)
            amp = (torch.autocast(autocast[0], dtype=autocast[1]) if autocast is not None
                   else contextlib.nullcontext())
            with self._replay_context(), _replay.kept_buffers(module):
                if self._zero_grad is not None:
                    self._zero_grad()
                with torch.set_grad_enabled(self.trains), amp:
                    output = module(*args, **kwargs)
                if self._backward is not None:
                    loss = _replay.zero_loss(output)
                    if loss is None:
                        raise LocalProtocolError(
                            f"a joined rank's replay of {self!r} gave no output that requires "
                            "grad, so it cannot replay the backward pass"
                        )
                    self._backward(loss)
                if self._step is not None:
                    self._step()
        except Exception as error:
            if hasattr(error, "add_note"):
                error.add_note(_replay._HINT)
            raise
        finally:
            self._in_hook = False

    def _replay_context(self) -> contextlib.AbstractContextManager[Any]:
        """What a replay runs inside (subclasses: a framework's state for the replay)."""
        return contextlib.nullcontext()


class _StepReplayHook(JoinHook):
    def __init__(self, joinable: StepReplay) -> None:
        self.joinable = joinable

    def main_hook(self) -> None:
        self.joinable.replay()

    def post_hook(self, is_last_joiner: bool) -> None:
        # Every rank ran every step (its own or a replay): nothing to send. The
        # hooks and the published input spec go when the Join resets the config.
        pass
