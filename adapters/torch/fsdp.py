"""Drive FSDP2 models (``torch.distributed.fsdp.fully_shard``) with joinkit's Join.

Theory of operation
-------------------
``Join([model, optimizer])`` with ``model`` the root ``fully_shard`` module
(any nesting) gets an :class:`FSDPJoinable` for the model from this module and
an ``adapters.optim`` joinable for the optimizer; the user's loop is unchanged.

*Active rank, per iteration.* While the Join lasts, a forward pre-hook on the
root (run before FSDP's own, so before any all-gather) sends one asynchronous
1-element float64 SUM all-reduce on the model's process group, the *step
check*. A rank contributes ``slot + 2**24 * (1 + 4096 * flags)`` where
``slot`` is :meth:`Join.fused_heartbeat`'s value (the heartbeat rides here
when the model is the Join's first joinable; otherwise the slot is 0 and the
first joinable sends it) and ``flags`` says what the rest of this iteration
does: bit 0, FSDP reduces gradients (``set_requires_gradient_sync``); bit 1,
HSDP all-reduces them (``set_requires_all_reduce``); bit 2, gradients are
enabled, so a backward follows; bit 3, ``torch.inference_mode()`` (a joined
rank replays the forward in inference mode too: FSDP's unsharded parameters
are then inference tensors on every rank alike, and an evaluation loop under
``inference_mode`` shadows without a graph). ``joinkit.split_heartbeat_flags(total, 2**24)``
splits off the heartbeat sum (below ``2**24`` in the worlds of fewer than 4096
ranks this check counts; a failed rank's first weight lies above these lanes),
so the sum splits exactly into the heartbeat sum, the number of active ranks
``A`` and ``F = A * flags`` (ranks that disagree on the flags
give an ``F`` that ``A`` does not divide: an ``AgreementError``). The joinable
is a fused joinable, so in every Join mode the shell pairs this all-reduce with
the joined ranks' :meth:`_FSDPShadow.fused_shadow`; in throw mode or with
``check_agreement=False`` the shell sends the classic heartbeat first.

*Joined rank, per shadow round.* ``fused_shadow`` is the joined rank's half of
the step check (it contributes only its heartbeat value) and learns ``A`` and
the flags; ``main_hook`` then *replays* the iteration (``adapters._replay``):
the model's own forward on an empty batch and backward from a zero loss, with
gradient sync set as the active ranks set it. That issues FSDP's exact
collective sequence (all-gathers in forward, prefetched all-gathers in
backward, reduce-scatters, HSDP all-reduces) with zero contributions, and
leaves in this rank's sharded ``.grad`` the reduced gradient of the active
ranks, which the optimizer's shadow then steps with (``adapters.optim``).

*Gradients on a joined rank.* A shadow round's gradients exist only for the
shadow step. Before its first shadow round the joined rank takes its own
gradients out of the model (each sharded ``.grad``, and FSDP's unsharded
accumulation of a ``set_requires_gradient_sync(False)`` window it ran out
in), and when the Join ends it drops the last round's gradients and gives its
own back, the very objects its loop left: so after the Join every ``.grad``
is what the user's last backward or ``zero_grad`` left (as with DDP,
``adapters.torch``), and nothing of a shadow round reaches the next epoch (in
a ``backward, step, zero_grad`` loop FSDP would accumulate it into the next
backward's gradient). Meanwhile the rank holds both its own gradients and a
round's: one more set of gradient shards (and a partial window's unsharded
gradients, if it ran out mid-window). A partial window given back enters
this rank's next syncing backward, as it would without the Join
(``optimizer.zero_grad()`` does not clear FSDP's accumulation); in the Join's
own steps only the ranks active at a step contribute, as with DDP. HSDP's partial reduction
(``set_requires_all_reduce(False)``) is not this rank's own: it already holds
its shard group's sum, so the shadow continues it as the active ranks do.

*Gradient windows.* A joined rank starts every accumulation window with no
gradients: at its first shadow round (above) and after every round that
synced. So with ``set_requires_gradient_sync`` accumulation the joined rank's
shard is stepped with the active ranks' accumulated window, and it steps only
in rounds that sync.

*Shared windows* (``Join(..., shared_windows=True)``, for loops whose
accumulation windows are counted from the Join's start on every rank, as
Accelerate's ``accumulate()`` and Lightning's ``accumulate_grad_batches`` under
joinkit's helpers). Accumulation is then one window of the whole world, not
of each rank: a rank that runs out in the middle of a window keeps its partial
window (FSDP's unsharded accumulation) in the model instead of setting it
aside, so the replayed backward that syncs reduces it with the active ranks'
(its own part counts in that step, as one process stepping once per window of
batch positions would count it); and a window still open when every rank has
run out (the last rank's count was not a multiple of the window) is closed in
the post hooks: every rank replays one syncing backward from a zero loss
(FSDP reduces what each accumulated) and the optimizer's joinable steps
(``closed_window``). After the Join every gradient of the model is dropped
(every window was stepped). Refused with ``divide_by_initial_world_size=False``
(a shared window mixes rounds of different active counts).

*Divisor.* FSDP divides reduced gradients by the data-parallel world size; a
joined rank contributes zero, so the default is DDP's
``divide_by_initial_world_size=True``. With ``Join(...,
divide_by_initial_world_size=False)`` every rank sets FSDP's gradient divide
factor to ``A`` before each backward (active ranks wait for the step check in
a forward post-hook; joined ranks know ``A`` from their shadow), with sum
reductions (gloo has no pre-multiplied sum), and the settings are restored on
exit.

*A forward with gradients and no backward.* The step check says "a
backward follows" whenever gradients are enabled, so a joined rank replays a
backward; an active rank that runs none (``model.eval()`` without
``torch.no_grad()``, a validation loss never backpropagated) would leave it
in that backward's collectives. So after such a forward a forward hook puts
an autograd pre-hook on its outputs' ``grad_fn`` nodes (the output tensors
are held until a backward reaches one of them); before this rank's next step
check (its next forward), before the first joinable's next heartbeat where
the model is not first (``Join.before_next_heartbeat``), or when it leaves the loop
(``join_leave_loop``), :meth:`FSDPJoinable._settle` looks: no backward
reached them means the rank runs that backward itself from zero output
gradients (FSDP's own collectives, the ones the joined ranks replay; the
reduced gradient it adds is zero) and raises ``LocalProtocolError``; the
Join's failure protocol gives its peers ``PeerFailure``. Limit: a backward
that does not reach the root's outputs counts as none.

*Forwards that are no round* (:meth:`FSDPJoinable.paused`). A framework that
runs an evaluation on every rank, active and joined, in one of the Join's
rounds (a side collective's call and shadow: Lightning's mid-epoch validation)
pauses the adapter while it lasts: no step check, backward watch or divisor in
those forwards, whose collectives pair among themselves; uneven evaluation
batches go in a Join of their own over a second ``FSDPJoinable`` of the same
model (the cached adapter is in the training Join).

*A rank that dies* (``Join([model, optimizer], on_rank_loss="finish")``): none
of the above runs. The model's ``join_hook`` vouches for FSDP's group
(``torch_dist.elastic_raw_groups``), and on entry ``adapters._fsdp_elastic``
unshards the model for the length of the Join (no FSDP collective in forward
or backward; one gradient unit per backward through the Join's elastic
TorchGroup; every active rank steps the full parameters with the full
optimizer state, gathered from its shards at entry) and shards both again on
exit, over the survivors after a loss; it refuses on entry what it cannot do.
A joined rank's shadow is that module's zero unit, and its post hook syncs the
last joiners' model and optimizer state.

*Failures.* A rank whose loop raised shadows like a joined rank. If it raised
right after its step check (before FSDP issued anything), the shell runs one
completion round first, which reads the flags from that rank's own send;
before its first replay a rank whose FSDP state is mid-iteration calls
``reset_iter_state()``. A rank that failed in the middle of FSDP's collectives
leaves them unmatched, as with DDP: the watchdog reports the stall.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from joinkit import (
    AgreementError,
    Join,
    Joinable,
    JoinConfig,
    JoinHook,
    LocalProtocolError,
    split_heartbeat_flags,
)
from joinkit.lowlevel import AdapterCache, AdapterJoinable, JoinContext

from .._errors import UnsupportedTorchError
from . import _compat, _private, _replay
from ._fsdp_state import param_groups as _param_groups
from ._fsdp_state import states as _states

__all__ = ["adapt", "check", "FSDPJoinable"]

_SUM: Any = dist.ReduceOp.SUM
# Step check encoding (module doc).
_SLOT = float(2**24)
_RANKS = 4096
SYNC, ALL_REDUCE, GRAD, INFERENCE = 1, 2, 4, 8


def adapt(model: Any) -> FSDPJoinable:
    """Return the joinkit Joinable that stands for a root ``fully_shard`` module.

    The same model always gets the same adapter, so the shell notices a model
    entered in two nested Joins.

    Args:
        model: an ``FSDPModule``.

    Raises:
        TypeError: ``model`` is not an ``FSDPModule``.
        UnsupportedTorchError: this torch lacks or changed an FSDP internal the
            adapter relies on (``adapters._torch_private``).
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"joinkit.adapters.torch.fsdp.adapt expects a fully_shard module, got "
            f"{type(model).__qualname__}"
        )
    _private.check(model)  # once per process
    device = model._get_fsdp_state()._device
    refusal = _private.fsdp_cpu_refusal() if torch.device(device).type == "cpu" else None
    if refusal is not None:
        # FSDP's own forward fails on every rank alike; refused before any collective.
        raise UnsupportedTorchError(refusal)
    return _adapters.get(model, FSDPJoinable)


_adapters: AdapterCache[FSDPJoinable] = AdapterCache()


class FSDPJoinable(AdapterJoinable):
    """A joinkit Joinable standing for one root FSDP2 module (see the module doc).

    Args:
        model: the root ``fully_shard`` module (the one the loop calls).
    """

    # Its step check is the iteration's first collective (module doc).
    join_fuses_heartbeat = True

    describes = "FSDP module"

    #: What the model is, in messages.
    unit = "fully_shard module"

    #: Whether a ``Join(on_rank_loss="finish")`` can take the model (FSDP2 can:
    #: ``_fsdp_elastic``).
    finishes = True

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._group: Any = None
        self._divide_by_initial_world_size = True
        self._source: _replay.InputSource | None = None
        self._check: _StepCheck | None = None
        self._handles: list[Any] = []
        self._groups: list[Any] = []  # FSDP's parameter groups, while in a Join
        self._checked_root = False
        self._saved: list[tuple[Any, float | None, bool]] = []
        self._replaying = False
        self._paused = False  # paused(): forwards that are not the Join's iterations
        self._first_round = True
        self._window_open = False
        # This rank's own gradients while it shadows (module doc).
        self._own_gradients: list[tuple[Any, str, Any]] | None = None
        self._divisor: int | None = None
        # A forward with gradients whose backward has not been seen yet: its
        # output tensors, whether a backward reached them, the pre-hook handles.
        self._pending: tuple[list[torch.Tensor], list[bool], list[Any]] | None = None
        #: Whether this rank's latest shadow round synced gradients: the
        #: optimizer's shadow steps after such a round (``adapters.optim``).
        self.shadow_synced = False
        # Join(..., shared_windows=True) (module doc), and the flags of the
        # iteration this rank last ran or shadowed.
        self._shared_windows = False
        self._last_flags = 0
        #: Whether the post hooks closed an open shared window: the optimizer's
        #: joinable steps after it (``adapters.optim``).
        self.closed_window = False
        # Join(..., on_rank_loss="finish"): adapters._fsdp_elastic, while one lasts.
        self._elastic: Any = None

    @property
    def model(self) -> Any:
        """The FSDP module this adapter stands for (``obj``)."""
        return self.obj

    def shadow_parameters(self) -> Iterable[torch.Tensor]:
        """The parameters whose ``.grad`` a shadow round fills (``adapters.optim``)."""
        params: Iterable[torch.Tensor] = self.model.parameters()
        return params

    # -- the config the shell sets -------------------------------------------------

    def join_entering(self, config: JoinConfig) -> None:
        assert config.join is not None
        finish = config.join.on_rank_loss == "finish"
        # Before any collective, the same on every rank: a feature of this Join
        # that this torch lacks what it needs for is refused (``_private``).
        # Finish mode divides by itself (``_fsdp_elastic``), never through FSDP.
        sums = not self._divide_by_initial_world_size
        features = [_private.FINISH] if finish else ([_private.SUM_REDUCTIONS] if sums else [])
        try:
            refusal = _private.fsdp_gloo_refusal() if self._on_gloo() else None
            if refusal is not None:
                # FSDP2 itself, in either mode: the model trains wrong before and
                # after any Join, and a finish-mode Join hands it back over gloo.
                raise UnsupportedTorchError(refusal)
            _private.check(self.model, *features)
        except UnsupportedTorchError:
            _vouch(self, False)
            raise
        if finish:
            self._enter_elastic(config.join)  # may refuse: before any collective

    def join_entered(self, join: Join) -> None:
        if self._elastic is None:  # finish mode entered in join_entering
            self._enter(join)

    def join_left(self) -> None:
        if self._elastic is not None:
            elastic, self._elastic = self._elastic, None
            try:
                elastic.close()
            finally:
                _vouch(self, False)
        else:
            self._leave()
            _vouch(self, False)

    def _enter_elastic(self, join: JoinContext) -> None:
        """``Join(..., on_rank_loss="finish")``: unsharded while it lasts (``_fsdp_elastic``).

        Raises:
            ValueError: a refused configuration (``_fsdp_elastic.refusal``), the
                same on every rank; the Join leaves as if never entered.
        """
        from . import _fsdp_elastic
        from .optim import OptimizerJoinable

        joinables = list(join.joinables)
        message = _fsdp_elastic.refusal(self.model, joinables, self)
        if message is not None:
            _vouch(self, False)
            raise ValueError(message)
        optimizer = next((j.obj for j in joinables if isinstance(j, OptimizerJoinable)),
                         None)
        try:
            self._elastic = _fsdp_elastic.ElasticFSDP(
                self, join, optimizer, self._divide_by_initial_world_size,
                lambda: self._replaying)
        except BaseException:
            _vouch(self, False)
            raise

    def _enter(self, join: Join) -> None:
        model = self.model
        self._check = _StepCheck(self.join_process_group, self.join_device,
                                 getattr(join.backend, "wait", None))
        self._first_round = True
        self._window_open = False
        self._own_gradients = None
        self.shadow_synced = False
        self._last_flags = 0
        self.closed_window = False
        self._divisor = None
        self._checked_root = False
        # Before FSDP's own pre-forward (it prepends too, at fully_shard time).
        self._pending = None
        self._handles = [model.register_forward_pre_hook(
            self._pre_forward, prepend=True, with_kwargs=True),
            model.register_forward_hook(self._watch_backward)]
        if not self._divide_by_initial_world_size:
            self._handles.append(model.register_forward_hook(self._post_forward))
        self._enter_units()

    # -- what FSDP2 and FSDP1 do differently (``fsdp1.FSDP1Joinable`` overrides these) --

    def _enter_units(self) -> None:
        """On entry, after the hooks: read (and set) the units' state for the Join."""
        self._groups = _param_groups(self.model)  # made by fully_shard; read per iteration
        if not self._divide_by_initial_world_size:
            # Sums, then FSDP's own division: gloo has no PREMUL_SUM. (gloo's
            # averaging before torch 2.9 is refused at entry: ``_private``.)
            self._saved = [(g, g.gradient_divide_factor, g.force_sum_reduction_for_comms)
                           for g in self._groups]
            for group, _, _ in self._saved:
                group.force_sum_reduction_for_comms = True

    def _on_gloo(self) -> bool:
        """Whether the Join's group is gloo's (whose averaging before torch 2.9 is refused)."""
        # The group's own name: a raw group (store_outlives_ranks) is not in the
        # map dist.get_backend reads.
        return bool(self.join_process_group.name() == "gloo")

    def _leave_units(self) -> None:
        """On exit: put back what :meth:`_enter_units` set."""
        self._groups = []
        for group, factor, force_sum in self._saved:
            group.gradient_divide_factor = factor
            group.force_sum_reduction_for_comms = force_sum
        self._saved = []

    def _is_root(self, module: Any) -> bool | None:
        """Whether ``module`` is its FSDP tree's root (``None``: not known yet)."""
        root: bool | None = module._get_fsdp_state()._is_root
        return root

    def _iteration_flags(self) -> int:
        """This rank's flags for the step check (module doc)."""
        return _flags(self._groups)

    def _apply_divisor(self, active: int) -> None:
        """Make the next reductions divide by ``active`` ranks (the summing divisor)."""
        for group, _, _ in self._saved:
            group.gradient_divide_factor = float(active)

    def _before_first_replay(self) -> None:
        """Reset FSDP's iteration if this rank's loop left it mid-flight (module doc)."""
        _reset_if_mid_iteration(self.model)

    def _take(self) -> list[tuple[Any, str, Any]]:
        """Take every gradient out of the model (:func:`_take_gradients`)."""
        return _take_gradients(self.model)

    def _give(self, taken: list[tuple[Any, str, Any]]) -> None:
        """Put back gradients :meth:`_take` took."""
        _give_back(taken)

    @contextlib.contextmanager
    def _replay_settings(self, flags: int) -> Iterator[None]:
        """Gradient sync set for a replay as the active ranks set it (the step check's flags)."""
        groups = self._groups
        saved = [(g, g.reduce_grads, g.all_reduce_grads) for g in groups]
        for group in groups:
            group.reduce_grads = bool(flags & SYNC)
            group.all_reduce_grads = bool(flags & ALL_REDUCE)
        try:
            yield
        finally:
            for group, reduce_grads, all_reduce_grads in saved:
                group.reduce_grads = reduce_grads
                group.all_reduce_grads = all_reduce_grads

    # -- leaving -------------------------------------------------------------------

    def _leave(self) -> None:
        self._forget_pending()
        if self._own_gradients is not None and self._obj() is not None:
            # After the hooks of every round: the shadow's gradients go, the
            # rank's own come back (module doc).
            self._take()
            self._give(self._own_gradients)
        self._own_gradients = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._leave_units()
        if self._check is not None:
            self._check.close()
            self._check = None
        if self._source is not None:
            self._source.close()
            self._source = None

    # -- Joinable ------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The shadow of one iteration (module doc).

        Args:
            **kwargs: the Join's keyword arguments: ``divide_by_initial_world_size``
                (default ``True``) and ``shadow_input`` (``adapters._replay``).
        """
        self._divide_by_initial_world_size = bool(
            kwargs.get("divide_by_initial_world_size", True))
        self._shared_windows = bool(kwargs.get("shared_windows", False))
        if self._shared_windows and not self._divide_by_initial_world_size:
            raise ValueError(
                f"Join(..., shared_windows=True) with an {self.describes} takes "
                "divide_by_initial_world_size=True only: a shared accumulation window "
                "mixes rounds with different numbers of active ranks, which no one "
                "divisor fits"
            )
        self._source = _replay.InputSource(self.join_process_group,
                                           kwargs.get(_replay.SHADOW_INPUT))
        if self.finishes:
            # Its group may be rebuilt in a finish-mode Join (adapters._fsdp_elastic).
            _vouch(self, True, kwargs.get("store_outlives_ranks"))
        return _FSDPShadow(self)

    @property
    def join_device(self) -> Any:
        return self.model._get_fsdp_state()._device

    @property
    def join_process_group(self) -> Any:
        if self._group is None:
            # FSDP's own mesh info: a DTensor parameter's device_mesh may be an
            # equal mesh of an earlier group (DTensor caches specs by value).
            info = self._mesh_info()
            mesh = info.mesh
            if mesh.ndim == 1:
                self._group = info.shard_process_group
            elif mesh.size() == dist.get_world_size():
                # HSDP over the whole world: the Join's collectives need every rank.
                self._group = dist.distributed_c10d._get_default_group()
            else:
                self._group = mesh._flatten().get_group()
        return self._group

    def _mesh_info(self) -> Any:
        groups = _param_groups(self.model)
        if not groups:
            raise LocalProtocolError(
                f"{type(self.model).__qualname__} has no sharded parameters: pass the root "
                "fully_shard module to Join"
            )
        return groups[0].mesh_info

    # -- an active rank's iteration ------------------------------------------------

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """While it lasts, the model's forwards are not iterations of this adapter's Join.

        For forwards that every rank of the group runs alike inside the Join, active
        and joined (an evaluation that a framework runs on every rank in one of the
        Join's rounds, itself in a Join of its own over another adapter of the same
        model): no step check, no backward watch, no divisor. Those forwards'
        collectives pair among themselves, not with a shadow round.
        """
        paused, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = paused

    def _pre_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        if self._replaying or self._paused:
            return None
        assert self._source is not None and self._check is not None
        if not self._checked_root:
            if self._is_root(module) is False:
                raise LocalProtocolError(
                    f"{type(module).__qualname__} is not the root {self.unit}; pass "
                    "the module the training loop calls to Join"
                )
            self._checked_root = True
        if self._source.needs_record:
            self._source.record(tuple(args), dict(kwargs), self.join_device.type)
        if self._pending is not None:
            self._settle()  # the last forward's backward, before this step check
        flags = self._iteration_flags()
        self._check.send(self, flags)
        self._last_flags = flags
        return None

    def _watch_backward(self, module: nn.Module, args: Any, output: Any) -> None:
        """After an active rank's forward with gradients: watch for its backward."""
        if self._replaying or self._paused or not torch.is_grad_enabled() or \
                torch.is_inference_mode_enabled():
            return None
        tensors = [t for t in _tensors(output) if t.grad_fn is not None]
        if not tensors:
            return None  # nothing a backward could start from: not checked
        seen = [False]

        def reached(grad_outputs: Any) -> None:
            seen[0] = True
            tensors.clear()  # a backward ran: hold the outputs no longer

        nodes: list[Any] = []
        for tensor in tensors:
            if all(tensor.grad_fn is not node for node in nodes):
                nodes.append(tensor.grad_fn)
        self._forget_pending()
        self._pending = (tensors, seen, [node.register_prehook(reached) for node in nodes])
        join = self._config.join
        if not self._config.is_first_joinable and join is not None:
            # The first joinable's next notify comes before this model's next step check.
            join.before_next_heartbeat(self._settle)
        return None

    def _forget_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            for handle in pending[2]:
                handle.remove()

    def _settle(self) -> None:
        """Before this rank's next send: refuse a forward with gradients and no backward.

        Raises:
            LocalProtocolError: it had none (the backward the joined ranks
                replay was run first, from zero gradients: module doc).
        """
        pending = self._pending
        if pending is None:
            return
        self._forget_pending()
        tensors, seen, _ = pending
        if seen[0]:
            return
        with torch.inference_mode(False), torch.enable_grad():
            torch.autograd.backward(tensors, [torch.zeros_like(t) for t in tensors])
        raise LocalProtocolError(
            f"the FSDP model {type(self.model).__qualname__} ran a forward with gradients "
            "enabled and no backward after it (e.g. evaluation in model.eval() without "
            "torch.no_grad()): inside a Join, such a forward tells joined ranks to replay "
            "its backward. Run forward-only iterations under `with torch.no_grad():` (or "
            "torch.inference_mode()), and follow every other forward by a backward. "
            "(joinkit ran that backward with zero gradients, so no collective mismatched.)"
        )

    def join_leave_loop(self) -> None:
        """Called by the Join as this rank leaves its loop: settle the last forward.

        Raises:
            LocalProtocolError: the last forward had gradients enabled and no
                backward (module doc).
        """
        if self._elastic is not None:
            self._elastic.settle()
            return
        self._settle()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._replaying or self._paused:
            return None
        assert self._check is not None
        self._set_divisor(self._check.active_count())
        return None

    def _set_divisor(self, active: int) -> None:
        if active != self._divisor and active > 0:
            self._apply_divisor(active)
            self._divisor = active

    # -- a joined rank's shadow round ----------------------------------------------

    def _shadow_round(self) -> None:
        assert self._check is not None and self._source is not None
        active, flags = self._check.round()
        if self._first_round:
            self._begin_shadowing()
        if not self._window_open:
            self._take()  # the previous window's, already stepped
            self._window_open = True
        if not self._divide_by_initial_world_size:
            self._set_divisor(active)
        backward = bool(flags & GRAD)
        args, kwargs, autocast = self._source.inputs(self.join_device)
        self._replaying = True
        try:
            with self._replay_settings(flags):
                _replay.replay(self.model, args, kwargs, backward=backward,
                               autocast=autocast, inference=bool(flags & INFERENCE))
        finally:
            self._replaying = False
        self.shadow_synced = backward and bool(flags & SYNC)
        self._last_flags = flags
        if self.shadow_synced:
            self._window_open = False  # the optimizer steps; the next window starts empty

    def _begin_shadowing(self) -> None:
        """Before this rank's first replay: set its own gradients aside (module doc),
        or, in a shared window it ran out inside, keep them for the window's step."""
        self._first_round = False
        self._before_first_replay()
        if self._shared_windows and self._mid_window():
            self._own_gradients = []  # its window is stepped with the others': none back
        else:
            self._own_gradients = self._take()  # given back by _leave
        self._window_open = True

    def _mid_window(self) -> bool:
        """Whether the last iteration run or shadowed had a backward that did not sync."""
        return bool(self._last_flags & GRAD) and not self._last_flags & SYNC

    def _close_window(self) -> None:
        """In the post hooks, on every rank: close a shared window still open (module doc)."""
        if not (self._shared_windows and self._mid_window()):
            return
        assert self._source is not None
        if self._first_round:  # ran to the end without shadowing: drop all on leaving
            self._begin_shadowing()
        args, kwargs, autocast = self._source.inputs(self.join_device)
        self._replaying = True
        try:
            with self._replay_settings(GRAD | SYNC | ALL_REDUCE):
                _replay.replay(self.model, args, kwargs, backward=True, autocast=autocast,
                               inference=False)
        finally:
            self._replaying = False
        self._last_flags = GRAD | SYNC
        self.closed_window = True


class _FSDPShadow(JoinHook):
    """A joined rank's shadow of one FSDP iteration (module doc)."""

    def __init__(self, adapter: FSDPJoinable) -> None:
        self.adapter = adapter

    def fused_shadow(self, heartbeat: float) -> float:
        """The joined rank's half of the step check; returns the heartbeat sum."""
        if self.adapter._elastic is not None:
            return 0.0  # finish mode never fuses: the Join sent the classic heartbeat
        check = self.adapter._check
        assert check is not None
        return check.shadow(heartbeat)

    def main_hook(self) -> None:
        elastic = self.adapter._elastic
        if elastic is not None:
            elastic.shadow()  # finish mode: the zero gradient unit, no replay
            return
        self.adapter._shadow_round()

    def post_hook(self, is_last_joiner: bool) -> None:
        elastic = self.adapter._elastic
        if elastic is not None:
            elastic.sync_final_model(is_last_joiner)
        else:
            self.adapter._close_window()


# -- the step check ---------------------------------------------------------------------


class _StepCheck:
    """The per-iteration step check all-reduce (module doc).

    Active rank: :meth:`send` starts it asynchronously (two buffers alternate;
    each send first waits for the all-reduce that last used its buffer, long
    finished). Joined rank: :meth:`shadow` is the blocking counterpart, and
    :meth:`round` gives the round's active count and flags (from this rank's
    own last send in a completion round).
    """

    def __init__(self, group: Any, device: torch.device,
                 wait: Callable[[Any], Any] | None = None) -> None:
        self.allreduce = group.allreduce
        self.opts = dist.AllreduceOptions()
        self.opts.reduceOp = _SUM
        self.wait: Callable[[Any], Any] = wait or _plain_wait
        self.on_cpu = device.type == "cpu"
        self.buffers = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(3)]
        self.views: list[Any] = [b.numpy() if self.on_cpu else None for b in self.buffers]
        self.works: list[Any] = [None, None]
        self.current = 1
        self.own_latest: int | None = None
        self.latest: tuple[int, int] | None = None  # (active ranks, flags) just read

    def close(self) -> None:
        for work in self.works:
            if work is not None and work.is_completed():
                work.wait()
        self.works = [None, None]

    def send(self, adapter: FSDPJoinable, flags: int) -> None:
        """An active rank's step check: heartbeat slot, one active rank, its flags."""
        index = 1 - self.current
        latest = self.works[self.current]
        if latest is not None and self.on_cpu:
            latest.wait()  # long complete; a failed peer shows in the slot's sum
            heartbeat, _ = split_heartbeat_flags(float(self.views[self.current][0]), _SLOT)
            Join.record_heartbeat_total(adapter, heartbeat)
        previous = self.works[index]
        if previous is not None:
            previous.wait()
        value = Join.fused_heartbeat(adapter) + _SLOT * (1 + _RANKS * flags)  # may raise
        self._fill(index, value)
        self.works[index] = self.allreduce([self.buffers[index]], self.opts)
        self.current = index
        self.own_latest = index

    def active_count(self) -> int:
        """An active rank: the number of active ranks in its latest step check."""
        work = self.works[self.current]
        self.wait(work)
        return self._decode(self._value(self.current))[1]

    def shadow(self, heartbeat: float) -> float:
        """A joined rank's step check; returns the heartbeat slot's sum."""
        self._fill(2, heartbeat)
        self.wait(self.allreduce([self.buffers[2]], self.opts))
        return self._read(2)

    def round(self) -> tuple[int, int]:
        """(active ranks, flags) of the round being shadowed."""
        if self.own_latest is not None:
            # A completion round: the step check was this rank's own last send.
            self.wait(self.works[self.own_latest])
            self._read(self.own_latest)
        assert self.latest is not None
        return self.latest

    def _fill(self, index: int, value: float) -> None:
        view = self.views[index]
        if view is not None:
            view[0] = value
        else:
            self.buffers[index].fill_(value)

    def _value(self, index: int) -> float:
        view = self.views[index]
        return float(view[0]) if view is not None else float(self.buffers[index].item())

    def _read(self, index: int) -> float:
        slot, active, flags = self._decode(self._value(index))
        self.latest = (active, flags)
        self.own_latest = None
        return slot

    @staticmethod
    def _decode(total: float) -> tuple[float, int, int]:
        slot, ranks = split_heartbeat_flags(total, _SLOT)
        active, summed = ranks % _RANKS, ranks // _RANKS
        if active and summed % active:
            raise AgreementError(
                "the active ranks of an FSDP model in a Join disagree on what this "
                "iteration does (gradient sync, HSDP all-reduce or grad mode): set "
                "set_requires_gradient_sync / set_requires_all_reduce / torch.no_grad "
                "the same way on every rank"
            )
        return slot, active, summed // active if active else 0


def _vouch(adapter: FSDPJoinable, on: bool, store_outlives_ranks: bool | None = None) -> None:
    """Tell the torch backend whether the model's raw group may be rebuilt (finish mode).

    ``on`` (the model's join_hook): a finish-mode Join over it may rebuild the
    group (``adapters._fsdp_elastic`` moves FSDP onto the survivors); off (the
    Join is over, or refused): forget it.
    """
    from joinkit.backends import torch_dist

    try:
        key = id(adapter.join_process_group)
    except Exception:  # noqa: BLE001 - no live group: nothing to vouch for
        return
    if on:
        torch_dist.elastic_raw_groups[key] = (
            None if store_outlives_ranks is None else bool(store_outlives_ranks))
    else:
        torch_dist.elastic_raw_groups.pop(key, None)


def _plain_wait(work: Any) -> Any:
    return work.wait()


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    """The tensors in a forward's output (tensors, tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


# -- FSDP's state (private attributes of torch's fully_shard, read in one place; each
# -- is listed and checked at adapt time in adapters._torch_private) ---------------------


def _flags(groups: list[Any]) -> int:
    """This rank's flags for the step check (module doc)."""
    reduce = {g.reduce_grads for g in groups}
    all_reduce = {g.all_reduce_grads for g in groups}
    if len(reduce) > 1 or len(all_reduce) > 1:
        raise LocalProtocolError(
            "inside a Join, an FSDP model's gradient sync must be the same for all its "
            "fully_shard units: call set_requires_gradient_sync(...) on the root "
            "(recurse=True, the default)"
        )
    flags = GRAD if torch.is_grad_enabled() else 0
    if torch.is_inference_mode_enabled():
        flags |= INFERENCE  # FSDP's all-gathers then make inference tensors
    if reduce != {False}:
        flags |= SYNC
    if all_reduce != {False}:
        flags |= ALL_REDUCE
    return flags


def _take_gradients(model: nn.Module) -> list[tuple[Any, str, Any]]:
    """Take every gradient out of ``model``: sharded, unsharded and accumulated.

    Returns:
        ``(owner, attribute, value)`` for each, for :func:`_give_back`; the
        model is left with none, so the next backward starts a window.
    """
    taken: list[tuple[Any, str, Any]] = []
    for param in model.parameters():
        taken.append((param, "grad", param.grad))
        param.grad = None
    accumulated = _compat.fsdp_accumulated_grad()  # None: it is the unsharded .grad
    for group in _param_groups(model):
        for fsdp_param in group.fsdp_params:
            if accumulated is not None:
                taken.append((fsdp_param, accumulated, getattr(fsdp_param, accumulated)))
                setattr(fsdp_param, accumulated, None)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                taken.append((unsharded, "grad", unsharded.grad))
                unsharded.grad = None
    return taken


def _give_back(taken: list[tuple[Any, str, Any]]) -> None:
    """Put gradients taken by :func:`_take_gradients` back where they were."""
    for owner, attribute, value in taken:
        setattr(owner, attribute, value)


def _reset_if_mid_iteration(model: Any) -> None:
    """Reset FSDP's iteration when the loop body left FSDP inside one (``_compat``)."""
    idle = "IDLE"
    states = _states(model)
    if any(state._training_state.name != idle for state in states) or any(
        group._training_state.name != idle
        for state in states for group in _compat.fsdp_param_groups(state)
    ):
        if not _compat.fsdp_reset(model, states):
            raise UnsupportedTorchError(
                f"joinkit cannot shadow this rank: its loop raised inside an FSDP2 forward "
                f"or backward after FSDP issued collectives, and torch {torch.__version__} "
                "has no FSDPModule.reset_iter_state to reset FSDP's iteration before the "
                "shadow (torch 2.13 and later have it). Every other use of FSDP2 under Join "
                "works on this torch; this rank's own exception is chained below")


def check(joinables: Iterable[Joinable]) -> None:
    """Warn about an FSDP model in training whose optimizer is not in the Join.

    Every rank owns shards of an FSDP model, so a joined rank must step its own:
    without the optimizer in the Join, its shards would stop at the value they
    had when it joined (fine for evaluation, where the model is not training).
    """
    listed = list(joinables)
    stepped: set[int] = set()
    for joinable in listed:
        parameters = getattr(joinable, "stepped_parameters", None)
        if callable(parameters):
            stepped.update(id(param) for param in parameters())
    for joinable in listed:
        if not isinstance(joinable, FSDPJoinable) or not joinable.model.training:
            continue
        if any(p.requires_grad and id(p) not in stepped for p in joinable.model.parameters()):
            warnings.warn(
                f"Join got the training fully_shard model {type(joinable.model).__qualname__} "
                "without the optimizer that steps its parameters: a joined rank would not "
                "step its shards. Pass it: Join([model, optimizer])",
                UserWarning,
                stacklevel=5,
            )
