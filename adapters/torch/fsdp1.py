"""Drive FSDP1 models (``torch.distributed.fsdp.FullyShardedDataParallel``) with joinkit's Join.

Theory of operation
-------------------
FSDP1, the ``FullyShardedDataParallel`` wrapper, is still what the Hugging Face
Trainer, Accelerate's FSDP plugin and Lightning's ``strategy="fsdp"`` build by
default. Like FSDP2 it keeps its collectives inside the model: parameter
all-gathers in forward (and again in backward, prefetched), gradient
reduce-scatters in backward (an all-reduce for ``NO_SHARD``). So
``Join([model, optimizer])`` with the root FSDP1 module takes the FSDP2
adapter's way (:mod:`joinkit.adapters.torch.fsdp`, whose module doc this one
follows): a forward pre-hook on the root (before FSDP1's own forward, so before
any all-gather) sends the *step check* (the heartbeat, the number of active
ranks, and whether this iteration syncs gradients, runs a backward, runs in
inference mode); a joined rank *replays* the iteration through the model (its
forward on an empty batch, its backward from a zero loss, gradient sync set as
the active ranks set it), which issues FSDP1's exact collectives with zero
contributions and leaves the active ranks' reduced gradient in this rank's
shards; the optimizer's joinable then steps them (``adapters.optim``).
:class:`FSDP1Joinable` is the FSDP2 joinable with FSDP1's state in the places
where the two differ:

- *Gradient sync.* ``model.no_sync()`` sets ``_sync_gradients`` on every FSDP1
  module of the tree; the step check carries it, and a replay sets it as the
  active ranks had it (and puts it back).
- *Gradients.* FSDP1 keeps a unit's gradient in its flat parameter's ``.grad``:
  the shard after a syncing backward, the whole unsharded gradient inside
  ``no_sync()``; with ``use_orig_params=True`` the original parameters'
  ``.grad`` are views into it (of another shape than the parameter inside
  ``no_sync()``). A joined rank takes all of them aside before its first
  shadow round and at the start of every window (its own partial window must
  not enter the active ranks' reduction; the shard of the window just stepped
  must not be added to the next), and the Join gives its own back when it ends,
  the very objects.
- *Divisor.* FSDP1 divides by hand around a SUM reduction (a pre- and a
  post-divide factor whose product is the world size), so a joined rank's zero
  gives DDP's ``divide_by_initial_world_size=True``; with ``False`` every rank
  sets the factors to 1 and the number of active ranks before each backward,
  and puts them back on exit.
- *Mixed precision* (``MixedPrecision``: parameters, inputs, reductions and
  buffers cast) and ``use_orig_params`` need nothing: the replay runs through
  the same module with the same casts.
- *Gradient clipping*: FSDP1's ``model.clip_grad_norm_`` all-reduces the norm
  over the model's group, so a joined rank must run it too: pass the loop's
  step as ``Join(..., shadow_step=...)`` (``adapters.optim``), e.g.
  ``lambda: (model.clip_grad_norm_(1.0), optimizer.step())``.

Refused on entry, on every rank before any collective (``ValueError``, with
the reason): ``Join(on_rank_loss="finish")`` (FSDP1's groups cannot be rebuilt
under it), ``HYBRID_SHARD`` over part of the world (the step check needs a
group of every rank that FSDP1's collectives span), parameter CPU offload
(``CPUOffload(offload_params=True)``: FSDP1 keeps the sharded gradient in a
buffer of its own, ``_cpu_grad``, that a shadow round's reduction overwrites in
place, so a rank's own gradient cannot be set aside), and a communication hook
(``register_comm_hook``) with ``divide_by_initial_world_size=False`` (the hook
divides, not FSDP1's factors). A rank whose loop raised inside FSDP1's forward
or backward (FSDP1 not idle at its first shadow round) cannot be shadowed:
FSDP1 has no way to reset an iteration mid-flight (``LocalProtocolError``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel

from joinkit import JoinConfig, JoinHook, LocalProtocolError
from joinkit.lowlevel import AdapterCache

from . import _private
from .fsdp import GRAD, INFERENCE, SYNC, FSDPJoinable

__all__ = ["adapt", "FSDP1Joinable"]

_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def adapt(model: Any) -> FSDP1Joinable:
    """Return the joinkit Joinable that stands for a root FSDP1 module.

    The same model always gets the same adapter, so the shell notices a model
    entered in two nested Joins.

    Args:
        model: a ``FullyShardedDataParallel`` module.

    Raises:
        TypeError: ``model`` is not a ``FullyShardedDataParallel`` module.
        UnsupportedTorchError: this torch lacks or changed an FSDP1 internal the
            adapter relies on (``_private``).
    """
    if not isinstance(model, FullyShardedDataParallel):
        raise TypeError(
            f"joinkit.adapters.torch.fsdp1.adapt expects a FullyShardedDataParallel module, "
            f"got {type(model).__qualname__}"
        )
    _private.check(model)  # once per process
    _refuse(model)
    return _adapters.get(model, FSDP1Joinable)


def _refuse(model: Any) -> None:
    """Raise for an FSDP1 model the Join cannot shadow (module doc), at ``Join(...)``.

    Raises:
        ValueError: hybrid sharding over part of the world, parameter CPU offload.
    """
    if str(model.sharding_strategy.name) in _HYBRID and not _spans_world(model):
        raise ValueError(
            f"joinkit shadows {model.sharding_strategy.name} only over the whole world "
            "(a joined rank's step check runs on a group of every rank FSDP1's "
            "collectives span); this model's shard and replicate groups cover part of it"
        )
    if model.cpu_offload.offload_params:
        raise ValueError(
            "joinkit cannot shadow an FSDP1 model with CPUOffload(offload_params=True): "
            "FSDP1 keeps each sharded gradient in a CPU buffer of its own (_cpu_grad) that "
            "a joined rank's replayed reduction overwrites in place, so the rank's own "
            "gradient cannot be set aside. Leave parameter offload out, or use FSDP2 "
            "(fully_shard with CPUOffloadPolicy)"
        )


_adapters: AdapterCache[FSDP1Joinable] = AdapterCache()


class FSDP1Joinable(FSDPJoinable):
    """A joinkit Joinable standing for one root FSDP1 module (see the module doc).

    Args:
        model: the root ``FullyShardedDataParallel`` module (the one the loop calls).
    """

    unit = "FullyShardedDataParallel module"
    finishes = False

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._states: list[Any] = []  # the tree's FSDP1 modules, while in a Join
        self._factors: list[tuple[Any, float, float]] = []

    def join_entering(self, config: JoinConfig) -> None:
        assert config.join is not None
        if config.join.on_rank_loss == "finish":
            raise ValueError(
                "joinkit cannot finish after a rank dies with an FSDP1 model (Join(..., "
                "on_rank_loss='finish')): FSDP1's process groups cannot be rebuilt over the "
                "survivors. Use on_rank_loss='raise' (the default), or FSDP2 (fully_shard), "
                "which finish mode supports"
            )
        sums = not self._divide_by_initial_world_size
        _private.check(self.model, *([_private.SUM_REDUCTIONS] if sums else []))

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The shadow of one iteration (``fsdp.FSDPJoinable.join_hook``).

        Raises:
            ValueError: ``divide_by_initial_world_size=False`` with a
                communication hook (module doc), at ``Join(...)``.
        """
        if not kwargs.get("divide_by_initial_world_size", True) and any(
                state._comm_hook is not None for state in _units(self.model)):
            raise ValueError(
                "Join(..., divide_by_initial_world_size=False) with an FSDP1 model that has "
                "a communication hook (register_comm_hook): the hook divides, not FSDP1's "
                "factors joinkit sets. Leave divide_by_initial_world_size=True (the default)"
            )
        return super().join_hook(**kwargs)

    # -- what FSDP1 does differently ---------------------------------------------------

    @property
    def join_device(self) -> Any:
        return self.model.compute_device

    @property
    def join_process_group(self) -> Any:
        if self._group is None:
            model = self.model
            hybrid = str(model.sharding_strategy.name) in _HYBRID
            self._group = (dist.distributed_c10d._get_default_group() if hybrid
                           else model.process_group)
        return self._group

    def _enter_units(self) -> None:
        self._states = _units(self.model)
        if not self._divide_by_initial_world_size:
            self._factors = [(state, state._gradient_predivide_factor,
                              state._gradient_postdivide_factor) for state in self._states]

    def _leave_units(self) -> None:
        self._states = []
        for state, pre, post in self._factors:
            state._gradient_predivide_factor = pre
            state._gradient_postdivide_factor = post
        self._factors = []

    def _is_root(self, module: Any) -> bool | None:
        root: bool | None = module._is_root  # None until FSDP1's lazy init
        return root

    def _iteration_flags(self) -> int:
        syncs = {bool(state._sync_gradients) for state in self._states}
        if len(syncs) > 1:
            raise LocalProtocolError(
                "inside a Join, an FSDP1 model's gradient sync must be the same for all its "
                "FullyShardedDataParallel modules: call no_sync() on the root"
            )
        flags = GRAD if torch.is_grad_enabled() else 0
        if torch.is_inference_mode_enabled():
            flags |= INFERENCE
        if syncs != {False}:
            flags |= SYNC
        return flags

    def _apply_divisor(self, active: int) -> None:
        for state, _, _ in self._factors:
            state._gradient_predivide_factor = 1.0
            state._gradient_postdivide_factor = float(active)

    def _before_first_replay(self) -> None:
        idle = "IDLE"
        busy = [state for state in self._states if state.training_state.name != idle or (
            state._handle is not None and state._handle._training_state.name != idle)]
        if busy:
            raise LocalProtocolError(
                "joinkit cannot shadow this rank: its loop raised inside an FSDP1 forward or "
                "backward, after FSDP1 began the iteration's collectives, and FSDP1 has no way "
                "to reset an iteration mid-flight. (FSDP2, fully_shard, has: "
                "reset_iter_state.) This rank's own exception comes first"
            )

    def _take(self) -> list[tuple[Any, str, Any]]:
        return _take_gradients(self.model, self._states)

    @contextlib.contextmanager
    def _replay_settings(self, flags: int) -> Iterator[None]:
        saved = [(state, state._sync_gradients) for state in self._states]
        for state, _ in saved:
            state._sync_gradients = bool(flags & SYNC)
        try:
            yield
        finally:
            for state, sync in saved:
                state._sync_gradients = sync

    def _give(self, taken: list[tuple[Any, str, Any]]) -> None:
        _give_back(taken)


# -- FSDP1's state (private attributes, each listed in ``_private``'s FSDP1 groups) --------


def _units(model: Any) -> list[Any]:
    """Every FSDP1 module of ``model``'s tree, the root first."""
    units: list[Any] = FullyShardedDataParallel.fsdp_modules(model)
    return units


def _spans_world(model: Any) -> bool:
    """Whether a hybrid model's shard group times its replicate group is the whole world."""
    inter = getattr(model, "_inter_node_pg", None)
    if inter is None:
        return False
    return bool(dist.get_world_size(model.process_group) * dist.get_world_size(inter)
                == dist.get_world_size())


def _take_gradients(model: Any, states: list[Any]) -> list[tuple[Any, str, Any]]:
    """Take every gradient out of ``model``: each flat parameter's, each original parameter's.

    Returns:
        ``(owner, "grad", value)`` for each, flat parameters first, for
        :func:`_give_back`; the model is left with none.
    """
    owners: list[Any] = []
    for state in states or _units(model):
        handle = state._handle
        if handle is not None and all(handle.flat_param is not o for o in owners):
            owners.append(handle.flat_param)
    for param in model.parameters():  # the original ones with use_orig_params=True
        if all(param is not o for o in owners):
            owners.append(param)
    taken = [(owner, "grad", owner.grad) for owner in owners]
    for owner in owners:
        owner.grad = None
    return taken


def _give_back(taken: list[tuple[Any, str, Any]]) -> None:
    """Put gradients taken by :func:`_take_gradients` back, the very objects.

    Inside ``no_sync()`` with ``use_orig_params=True`` an original parameter's
    gradient is an unsharded view while the parameter is its shard: assigned as
    FSDP1 assigns it, through a parameter of the gradient's shape.
    """
    for owner, _, grad in taken:
        if grad is None or (grad.shape == owner.shape and grad.dtype == owner.dtype
                            and grad.device == owner.device):
            owner.grad = grad
            continue
        data = owner.data
        owner.data = torch.empty_like(grad)
        owner.grad = grad
        owner.data = data

