"""Drive torch's own Joinables (DDP, ZeroRedundancyOptimizer, subclasses) with joinkit's Join.

Theory of operation
-------------------
``joinkit.Join`` calls :func:`adapt` for every instance of
``torch.distributed.algorithms.join.Joinable`` it is given; the result, a
:class:`TorchJoinable`, is an ordinary joinkit Joinable standing for the torch
object, so torch and joinkit joinables mix in any order in one ``Join``.

*Config.* A torch joinable reads ``self._join_config`` (torch's ``_JoinConfig``
namedtuple) in its forward or step. The shell sets the adapter's
``_join_config`` on entry and resets it on exit; the adapter mirrors each
change onto the torch object: ``enable`` and ``throw_on_early_termination`` as
given, ``is_first_joinable`` always ``False``, and torch's disabled config on
exit, so that after the block DDP sends no join collectives any more (torch's
own Join leaves the config enabled, and every later forward pays for a
heartbeat, a gradient-sync check and, with buffers, a rank agreement).

*Heartbeats are joinkit's.* A torch joinable announces an iteration by calling
``torch...Join.notify_join_context(self)``. While a joinkit Join holds torch
joinables, that static method is replaced by a router: for an object held by an
active adapter it calls joinkit's ``Join.notify_join_context(adapter)``, so the
heartbeat (and in throw mode the termination check) goes through joinkit's
machine, which must observe every ``Notified``; for any other object it calls
torch's original. ``is_first_joinable=False`` in the torch config makes sure
torch's original never sends a second heartbeat. The router is installed when
the first adapter is entered and removed when the last one leaves. DDP gets the
heartbeat's ``Work`` back, exactly as from torch, and hands it to its reducer,
so ``divide_by_initial_world_size=False`` divides by the number of active ranks.
A DDP after another joinable gets no heartbeat from its own notify; with
``divide_by_initial_world_size=False`` its reducer gets the Join's latest
heartbeat instead (``Join.heartbeat_handle``, sent by the first joinable in
the same iteration), and where the first joinable fuses its heartbeat into its
own collective (no torch Work carries the count) the Join is refused on entry.

*Iterations without a backward.* torch's DDP tells a joined rank "gradients
are all-reduced this iteration" whenever ``require_backward_grad_sync`` is set,
also under ``torch.no_grad()``, where no backward follows: the joined rank then
waits in bucket all-reduces nobody sends (gloo aborts the process). Here the
flag is ``torch.is_grad_enabled() and require_backward_grad_sync`` (fused, or
in :class:`_SyncCheck`, DDP's own check's replacement), which is also what
DDP's ``_post_forward`` sets ``require_forward_param_sync`` to, so buffer
broadcasts match too. A forward without gradients also runs DDP's one-time
bucket rebuild when due (a joined rank's hook always does; DDP's forward only
with gradients). A forward *with* gradients and no backward cannot be told at
the time: :class:`_BackwardWatch` finds it before this rank's next send and
refuses it after matching the joined ranks' all-reduces. A replayed model
(``_ddp_replay``) cannot replay a forward-only iteration: a forward
without gradients is refused before anything is sent.

*DDP carries the heartbeat in its gradient-sync check.* With join enabled,
torch's DDP sends two 1-element all-reduces per forward besides its gradients:
the heartbeat, and ``_check_global_requires_backward_grad_sync`` (whether this
rank syncs gradients this iteration, so a joined rank knows whether to shadow
the backward pass; under ``no_sync()`` it does not). When DDP is the first
joinable and the Join fuses heartbeats (it does unless throw mode or
``check_agreement=False``, which a group shared with torch's Join needs),
both travel in one 1-element float64 all-reduce sent from the routed notify:
a rank contributes its heartbeat value plus ``joinkit.HEARTBEAT_FLAG``
(2**28) if it syncs gradients, and ``joinkit.split_heartbeat_flags`` splits
the sum into the heartbeat sum and the number of syncing ranks, exactly for
every world joinkit accepts (up to 2**24 ranks), failed ranks included (the
core's wire values leave a float64 lane for the flags between the active
count and a failed rank's weight). One element, because gloo's ring needs
more steps for two elements than for one. The adapter is a fused joinable
whose ``fused_shadow`` is the joined rank's half of it (the count of
non-joined ranks and the sync flag at once), and DDP's own check is replaced,
while the Join lasts, by one that sends nothing and answers from that
all-reduce. So DDP pays one small asynchronous
collective per iteration instead of two, and nothing changes for
``no_sync()``. The reducer gets that all-reduce's ``Work``; with
``divide_by_initial_world_size=False`` it reads the number of active ranks from
the work's result, so it gets a work whose result is the heartbeat sum alone.
With buffers broadcast in forward (``broadcast_buffers=True`` and a module with
buffers), torch's DDP inside a Join first finds the rank that sources them (the
highest active one) with one more all-reduce per forward
(``_find_common_rank``). That rank changes only when a rank joins, which the
fused heartbeat shows to every rank in the same round: :meth:`_FusedCheck.common_rank`
asks again only when the round's heartbeat sum differs from the one it last
asked at, and answers from the last all-reduce otherwise (the same rank torch
finds, with one collective per forward instead of two).

*DDP carries the heartbeat in its gradients* (``adapters.torch._ddp_round``):
where DDP is the Join's first joinable and no other joinable has collectives
of its own, and the model allows it (``_ddp_round.refusal``: no comm hook of
the user's, no ``find_unused_parameters``, no ``static_graph``, no buffers
broadcast in forward, float32/float64 parameters, no replay, and not
``Join(..., heartbeat_in_gradients=False)``), the Join's
heartbeat rides in DDP's gradient all-reduce (``Join.heartbeat == "round"``):
every bucket's all-reduce carries one more element through joinkit's comm
hook (``_ddp_hook``), a forward sends nothing, and a joined rank's round is
one backward's bucket all-reduces from zeros. The fused check above is then
not used. Once a model has joinkit's hook (DDP keeps a hook for good), the
hook does what DDP does without one outside such Joins, and inside a Join on
another path with ``divide_by_initial_world_size=False`` it divides by the
active ranks of this iteration's heartbeat, as the reducer would.

*Shadow rounds are not heartbeats.* ZeroRedundancyOptimizer's main hook is a
plain ``step()``, which notifies. In torch's Join, with the optimizer first,
that joined rank's heartbeat contributes 1 to the count and the ranks deadlock.
The adapter marks the time its own hooks run and drops a notify made then.

*Gradients on a joined rank.* DDP's main hook all-reduces zero gradients to
match the active ranks' backward pass, and throws the result away; ZeRO's main
hook then steps the joined rank's shard with whatever ``.grad`` it still holds
from its last real iteration, so torch's DDP + ZeRO ends with a shard updated
by stale gradients. Here, when a ZeroRedundancyOptimizer is in the same Join,
DDP's shadow all-reduce keeps its result, the active ranks' averaged gradient
(the joined rank contributed zero), beside the parameters; ZeRO's shadow step
in that round puts it into ``.grad`` (zero where no all-reduce produced one)
for the step only, and then gives every parameter back its own ``.grad``.
Every rank's shard sees the gradient a single process would apply, and no
rank's ``.grad`` is ever touched by a shadow round: after the Join it is what
the user's last backward (or ``zero_grad``) left, exactly as after torch's
Join, so nothing leaks into the next iteration or epoch. DDP alone runs
torch's hook unchanged. On exit DDP's reducer also forgets the last
heartbeat's ``Work``: left in place, a later backward outside the Join would
divide by that stale count of active ranks.

*A rank that dies* (``Join(..., on_rank_loss="finish")``). DDP alone: its
``join_hook`` tells the torch backend that DDP's raw group may be rebuilt
(``torch_dist.elastic_raw_groups``, with the Join's ``store_outlives_ranks``
keyword), and on entry ``adapters._ddp_elastic`` routes every collective DDP
sends through the Join's elastic TorchGroup (one gradient unit per backward
through a comm hook, no sync-check collective, the post hook as a unit) or
refuses what it cannot route; the fused check and the backward watch are off.
DDP with its ZeroRedundancyOptimizer right after it, ``[model, zero]``, any
optimizer class: ``adapters._zero_elastic`` gives every rank the full
optimizer state on entry and has every rank step every parameter (no
broadcasts; a joined rank with the averaged gradient of DDP's shadow unit, as
above, when some rank contributed to it), and on exit ZeRO gets its shard's
state back or follows DDP onto the rebuilt group with its new partition's
state (ZeRO's join_hook leaves DDP's vouch in place). Every other combination
with a torch joinable is refused on entry (:func:`_finish_refusal`).

*torch's internals.* Most of the above uses members torch does not promise to
keep (DDP's join-hook methods, reducer methods, ``_JoinConfig``...). Each is
listed in ``adapters._torch_private``, and :func:`adapt` checks them once per
process before the first object of a kind is adapted, so a torch that renamed
one fails loudly instead of training on stale gradients.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.algorithms.join as torch_join
from torch.nn.parallel import DistributedDataParallel

from joinkit import (
    HEARTBEAT_FLAG,
    Join,
    Joinable,
    JoinConfig,
    JoinHook,
    LocalProtocolError,
    split_heartbeat_flags,
)
from joinkit.lowlevel import AdapterCache, AdapterJoinable

from .._errors import UnsupportedTorchError
from . import _ddp_hook, _ddp_round, _private

__all__ = ["adapt", "TorchJoinable"]

_c10d: Any = torch._C._distributed_c10d
_SUM: Any = dist.ReduceOp.SUM
# A rank's weight in the fused DDP check when it syncs gradients (module doc).
_SYNCS = HEARTBEAT_FLAG
_TorchJoinConfig = torch_join._JoinConfig
_TORCH_DISABLED = _TorchJoinConfig(
    enable=False, throw_on_early_termination=False, is_first_joinable=False
)
_ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


def adapt(obj: Any) -> TorchJoinable:
    """Return the joinkit Joinable that stands for a torch Joinable.

    The same object always gets the same adapter (when it is hashable), so the
    shell notices a torch object entered in two nested Joins.

    Args:
        obj: an instance of ``torch.distributed.algorithms.join.Joinable``.

    Returns:
        Its :class:`TorchJoinable`.

    Raises:
        TypeError: ``obj`` is not a torch Joinable.
        UnsupportedTorchError: this torch lacks or changed an internal the
            adapter relies on (``adapters._torch_private``).
        LocalProtocolError: ``obj``'s constructor did not call
            ``Joinable.__init__`` (it has no ``_join_config``).
    """
    if not isinstance(obj, torch_join.Joinable):
        raise TypeError(
            f"joinkit.adapters.torch.adapt expects a torch Joinable, got {type(obj).__qualname__}"
        )
    _private.check(obj)  # once per kind of object and process
    if not hasattr(obj, "_join_config"):
        raise LocalProtocolError(
            f"{type(obj).__qualname__} has no join config: its constructor must call "
            "torch.distributed.algorithms.join.Joinable.__init__(self) (e.g. "
            "super().__init__())"
        )
    return _adapters.get(obj, TorchJoinable)


def check_order(joinables: Sequence[Joinable]) -> None:
    """Refuse a ZeroRedundancyOptimizer listed before a DDP model it steps.

    A joined rank shadows the joinables' collectives in list order, and in
    every iteration DDP's gradient all-reduce (in the backward pass) comes
    before the optimizer's step, so ``Join([optim, model])`` would issue the
    shadow collectives in the wrong order (torch's Join mismatches the same way,
    silently).

    Args:
        joinables: a Join's joinables, adapters included.

    Raises:
        ValueError: a ZeRO adapter comes before a DDP adapter.
    """
    zero: TorchJoinable | None = None
    for index, joinable in enumerate(joinables):
        if not isinstance(joinable, TorchJoinable):
            continue
        if zero is None and _is_zero(joinable.obj):
            zero = joinable
            zero_index = index
        elif zero is not None and joinable._is_ddp:
            raise ValueError(
                f"Join lists the ZeroRedundancyOptimizer (joinable {zero_index}) before "
                f"the DistributedDataParallel model (joinable {index}): list the model "
                "first, Join([model, optimizer]). A joined rank shadows the joinables' "
                "collectives in list order, and in each iteration DDP's gradient "
                "all-reduce comes before the optimizer step"
            )


class TorchJoinable(AdapterJoinable):
    """A joinkit Joinable standing for one torch Joinable (see the module doc).

    Args:
        obj: the torch Joinable.
    """

    describes = "torch Joinable"

    def __init__(self, obj: Any) -> None:
        # AdapterJoinable.__init__ does not assign _join_config (which would
        # write a disabled config onto ``obj``, maybe inside a torch Join right
        # now); it holds ``obj`` weakly: while a Join runs, the torch hook it
        # holds keeps the object alive.
        super().__init__(obj)
        self.key = id(obj)  # how the router finds this adapter
        self._in_hook = False
        self._is_ddp = isinstance(obj, DistributedDataParallel)
        self._is_zero = _is_zero(obj)
        # A DDP may carry the heartbeat (module doc); the Join reads this flag.
        self.join_fuses_heartbeat = self._is_ddp
        self._fused: _FusedCheck | None = None
        # DDP whose gradient all-reduce carries the heartbeat (_ddp_round), and
        # why it cannot where it cannot (read by the Join: join_heartbeat_in_round).
        self._round: _ddp_round.RoundHeartbeat | None = None
        self.round_refusal: str | None = "not a DistributedDataParallel model"
        self.join_heartbeat_in_round = False
        # A Join on another path, with joinkit's comm hook on the model and
        # divide_by_initial_world_size=False: this iteration's heartbeat, whose
        # count the hook divides by (module doc).
        self._count_handle: Any = None
        self._sync_check: _SyncCheck | None = None
        self._watch: _BackwardWatch | None = None
        # DDP after the first joinable with divide_by_initial_world_size=False:
        # the Join whose heartbeat Work DDP's reducer reads (module doc).
        self._heartbeat_work: Any = None
        self._replays = False  # DDP shadowed by replay (adapters._ddp_replay)
        # DDP in a Join with on_rank_loss="finish" (adapters._ddp_elastic).
        self._elastic_ddp: Any = None
        # ZeRO beside that DDP (adapters._zero_elastic).
        self._elastic_zero: Any = None
        self._divide_by_initial_world_size = True  # DDP's join_hook default

    # -- the config the shell sets -------------------------------------------------

    def join_entering(self, config: JoinConfig) -> None:
        join = config.join
        assert join is not None
        if rank_loss_finish(join):
            # The same answer on every rank (the settings and torch agree), before
            # any collective: a refused combination, or a torch without what finish
            # mode needs (that feature alone is refused).
            message = _finish_refusal(self, join)
            refusal: Exception | None = None if message is None else ValueError(message)
            if refusal is None:
                try:
                    _private.check(self.obj, _private.FINISH)
                except UnsupportedTorchError as error:
                    refusal = error
            if refusal is not None:
                # The Join leaves as if never entered: DDP's vouch goes too.
                for joinable in join.joinables:
                    if isinstance(joinable, TorchJoinable):
                        _elastic_vouch(joinable, None)
                raise refusal

    def join_config_set(self, config: JoinConfig) -> None:
        if config.enable and config.join is not None:
            self.obj._join_config = _TorchJoinConfig(
                enable=True,
                throw_on_early_termination=config.throw_on_early_termination,
                is_first_joinable=False,  # joinkit sends the heartbeat (module doc)
            )
        else:
            self.obj._join_config = _TORCH_DISABLED

    def join_entered(self, join: Join) -> None:
        if self._is_ddp:
            self._enter_ddp(self._config)
        elif self._is_zero and rank_loss_finish(join):
            self._enter_elastic_zero(join)
        _route(self)

    def join_left(self) -> None:
        _unroute(self)
        if self._round is not None:
            self._round.close()
            self._round = None
        hook_state = _ddp_hook.installed(self.obj) if self._is_ddp else None
        if hook_state is not None:
            hook_state.active = None
        self._count_handle = None
        if self._fused is not None:
            self._fused.close()
            self._fused = None
        if self._sync_check is not None:
            self._sync_check.close()
            self._sync_check = None
        if self._is_ddp:
            _forget_join(self)
        if self._elastic_ddp is not None:
            elastic, self._elastic_ddp = self._elastic_ddp, None
            elastic.close()
        if self._elastic_zero is not None:
            elastic_zero, self._elastic_zero = self._elastic_zero, None
            elastic_zero.close()
        _elastic_vouch(self, None)

    def _enter_ddp(self, config: Any) -> None:
        """Install DDP's gradient-sync check for this Join (module doc)."""
        join = config.join
        backend = join.backend
        if join.on_rank_loss == "finish":
            self._enter_elastic_ddp(join)
            return
        if config.is_first_joinable and join.heartbeat == "round":
            # The heartbeat rides in the gradient all-reduce (_ddp_round).
            self._watch = None
            self._heartbeat_work = None
            self._round = _ddp_round.RoundHeartbeat(
                self, self._divide_by_initial_world_size, getattr(backend, "wait", None))
            return
        hook_state = _ddp_hook.installed(self.obj)
        if hook_state is not None and not self._divide_by_initial_world_size:
            # joinkit's comm hook (from an earlier Join) divides instead of the
            # reducer: by this iteration's heartbeat count (module doc).
            hook_state.active = self._active_count
        counter: Callable[[], int | None] | None = None
        if hasattr(backend, "collectives_issued"):
            def counter() -> int | None:
                return backend.collectives_issued  # type: ignore[no-any-return]
        self._watch = _BackwardWatch(self.obj, counter)
        if not config.is_first_joinable:
            # The first joinable's notify sends the next heartbeat, before
            # DDP's next forward: settle the last forward there.
            self._watch.before_heartbeat = join.before_next_heartbeat
        self._heartbeat_work = None
        if config.is_first_joinable and join.fuses_heartbeat:
            # The Join's backend (a TorchGroup) waits so that a peer's
            # abort ends a blocked shadow, as it ends the Join's counts.
            self._fused = _FusedCheck(self.obj, self._divide_by_initial_world_size,
                                      getattr(backend, "wait", None), self._watch)
        else:
            self._sync_check = _SyncCheck(self.obj, self._watch)
            if not config.is_first_joinable and not self._divide_by_initial_world_size:
                if join.fuses_heartbeat:
                    # The heartbeat rides in another joinable's collective: no
                    # torch Work carries the number of active ranks.
                    raise LocalProtocolError(
                        "Join(..., divide_by_initial_world_size=False) with "
                        "DistributedDataParallel after a first joinable that carries the "
                        "heartbeat in its own collective: DDP cannot learn the number "
                        "of active ranks. List the model first, Join([model, ...]), or "
                        "keep divide_by_initial_world_size=True"
                    )
                self._heartbeat_work = join

    def _enter_elastic_ddp(self, join: Any) -> None:
        """DDP in a finish-mode Join: route its collectives through the group's units.

        Raises:
            ValueError: what cannot be routed (``adapters._ddp_elastic.refusal``),
                or another kind of torch joinable in the same Join.
        """
        from . import _ddp_elastic

        ddp = self.obj
        message = _ddp_elastic.refusal(ddp, self._replays)
        if message is not None:
            raise ValueError(message)
        self._watch = None
        self._heartbeat_work = None
        self._elastic_ddp = _ddp_elastic.ElasticDDP(
            ddp, join.backend, self._divide_by_initial_world_size,
            lambda: self._in_hook)

    def _enter_elastic_zero(self, join: Any) -> None:
        """ZeRO beside its DDP model in a finish-mode Join (``adapters._zero_elastic``).

        :func:`_finish_refusal` let it in: the Join is ``[ddp, zero]``, and the
        DDP adapter (entered first) routes the gradients.
        """
        from . import _zero_elastic

        ddp_adapter = join.joinables[0]
        elastic_ddp = ddp_adapter._elastic_ddp
        if elastic_ddp is None:  # pragma: no cover - _finish_refusal guarantees it
            raise LocalProtocolError("ZeroRedundancyOptimizer entered before its DDP model")
        self._elastic_zero = _zero_elastic.ElasticZeRO(self.obj, elastic_ddp)

    def _active_count(self) -> float:
        """The active ranks of this iteration's heartbeat (its work's result), or
        the world size where this rank sent none (a joined rank's zeros)."""
        handle = self._count_handle
        if handle is None:
            return float(self.obj.process_group.size())
        handle.wait()
        total = float(handle.get_future().value()[0].reshape(-1)[0])
        return total if total >= 0.5 else 1.0

    # -- Joinable ------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Return the torch object's hook, wrapped (see the module doc).

        Args:
            **kwargs: the Join's keyword arguments, passed on unchanged (e.g.
                DDP's ``divide_by_initial_world_size``).
        """
        hook = self.obj.join_hook(**kwargs)
        self._divide_by_initial_world_size = bool(
            kwargs.get("divide_by_initial_world_size", True)
        )
        if not (callable(getattr(hook, "main_hook", None))
                and callable(getattr(hook, "post_hook", None))):
            raise TypeError(
                f"{type(self.obj).__qualname__}.join_hook() returned "
                f"{type(hook).__qualname__}, not a JoinHook"
            )
        if not self._is_zero:
            # A ZeRO leaves the vouch as it is: after its DDP model (the only
            # order check_order accepts) it follows that model's rebuilt group.
            _elastic_vouch(self, self._is_ddp, kwargs.get("store_outlives_ranks"))
        if self._is_ddp:
            # A model with collectives in forward is shadowed by replaying it.
            from ._ddp_replay import replay_for

            shadow = _DDPShadow(self, hook)
            shadow.replay = replay_for(self, kwargs)
            self._replays = shadow.replay is not None
            self.round_refusal = (
                "Join(..., heartbeat_in_gradients=False)"
                if not kwargs.get("heartbeat_in_gradients", True)
                else _ddp_round.refusal(self.obj, self._replays))
            # The Join reads it next: the heartbeat rides in the gradients.
            self.join_heartbeat_in_round = self.round_refusal is None
            return shadow
        if _is_zero(self.obj):
            return _ZeROShadow(self, hook)
        return _Shadow(self, hook)

    @property
    def join_device(self) -> Any:
        return self.obj.join_device

    @property
    def join_process_group(self) -> Any:
        group = self.obj.join_process_group
        if group is None and dist.is_available() and dist.is_initialized():
            # torch's spelling of the default group (ZeRO built before init
            # stores None); compare equal to DDP's default group.
            return dist.distributed_c10d._get_default_group()
        return group

    def join_round_open(self) -> bool | None:
        """Whether this rank is midway through a gradient round (``_ddp_round``)."""
        return None if self._round is None else self._round.round_open()

    # -- the heartbeat -------------------------------------------------------------

    def notify(self) -> Any:
        """What torch's ``notify_join_context(self.obj)`` does, wherever the object is.

        Inside a joinkit Join that holds the object, the heartbeat goes through
        that Join (the module doc); anywhere else this is torch's own notify,
        which inside torch's Join notifies that Join and outside any Join does
        nothing. Called by the router that replaces torch's static method, and
        by joinkit's ``Join.notify_join_context(obj)`` when code written for
        torch's Join passes the torch object itself (as DDP's forward does once
        ``torch.nn.parallel.distributed.Join`` is joinkit's).

        Returns:
            The heartbeat's work (or handle) if this object sends it, else ``None``.
        """
        if _routes.get(self.key) is not self:
            return _torch_notify.__func__(self.obj)
        if self._in_hook:
            return None  # a shadow round's own notify (ZeRO's step), not an input
        if not self._is_ddp:
            return Join.notify_join_context(self)
        if self._replays and not torch.is_grad_enabled():
            raise _replay_eval_error()  # before anything goes out
        fused = self._fused
        if self._round is not None:
            self._round.notify()  # counts the input; nothing is sent
            handle = None
        elif self._elastic_ddp is not None:
            self._elastic_ddp.settle()
            handle = Join.notify_join_context(self)
            if not isinstance(handle, dist.Work):
                handle = None
        elif fused is not None:
            handle = fused.notify(self)
        else:
            if self._watch is not None:
                self._watch.settle()
            handle = Join.notify_join_context(self)
            if self._heartbeat_work is not None:
                # Not first: the first joinable sent this iteration's heartbeat.
                handle = self._heartbeat_work.heartbeat_handle
            if not isinstance(handle, dist.Work):
                handle = None  # DDP's reducer accepts nothing but a torch Work
        self._count_handle = handle  # for joinkit's comm hook, where it divides (module doc)
        if not torch.is_grad_enabled():
            # A joined rank's hook rebuilds DDP's buckets whenever a rebuild is
            # due; DDP's forward does only with gradients on: here it does too.
            ddp = self.obj
            if ddp.reducer._rebuild_buckets():
                ddp._has_rebuilt_buckets = True
        return handle

    def join_leave_loop(self) -> None:
        """Called by the Join as this rank leaves its loop: settle the last forward.

        Raises:
            LocalProtocolError: the last forward told joined ranks to shadow a
                gradient all-reduce and no backward ran (module doc).
        """
        if self._watch is not None and _routes.get(self.key) is self:
            self._watch.settle()
        if self._round is not None and _routes.get(self.key) is self:
            self._round.settle()
        if self._elastic_ddp is not None and _routes.get(self.key) is self:
            self._elastic_ddp.settle()


# -- hooks ------------------------------------------------------------------------


def rank_loss_finish(join: Any) -> bool:
    """Whether ``join`` was built with ``on_rank_loss="finish"``."""
    return getattr(join, "on_rank_loss", "raise") == "finish"


def _finish_refusal(adapter: TorchJoinable, join: Any) -> str | None:
    """Why a finish-mode Join cannot hold ``adapter``'s object here, or ``None``.

    Accepted: a DDP model alone (``adapters._ddp_elastic`` refuses what it
    cannot route), or exactly ``[ddp, zero]`` with a ZeroRedundancyOptimizer
    that ``adapters._zero_elastic.refusal`` accepts. Every other combination
    with a torch joinable is refused: two adapters would wrap one group twice.
    Asked by each torch adapter of the Join as it is entered, so the first one
    refuses, before DDP registers anything.
    """
    joinables = list(join.joinables)
    pair = (len(joinables) == 2
            and all(isinstance(j, TorchJoinable) for j in joinables)
            and joinables[0]._is_ddp and joinables[1]._is_zero)
    if pair:
        from . import _zero_elastic

        return _zero_elastic.refusal(joinables[1].obj, joinables[0].obj)
    if adapter._is_ddp:
        if len(joinables) == 1:
            return None
        return ("Join(on_rank_loss='finish') holds a DistributedDataParallel model "
                "only alone, or with its ZeroRedundancyOptimizer right after it, in this "
                "version: pass Join([model], on_rank_loss='finish') or Join([model, zero], "
                "on_rank_loss='finish'), or use on_rank_loss='raise' (the default) with "
                "other joinables")
    return str(rank_loss_refusal(adapter.obj))


def rank_loss_refusal(obj: Any) -> ValueError:
    """Why ``Join(..., on_rank_loss="finish")`` cannot hold ``obj`` (a framework object).

    Raised by the adapter as the Join hands it its config, on every rank alike
    and before the loop (the Join then leaves as if never entered); it covers a
    framework object that shares its process group with a joinable whose group
    can be rebuilt (a Counter on a ``TorchGroup``), where the group alone would
    not refuse.
    """
    name = type(obj).__name__
    if _is_zero(obj):
        why = ("ZeroRedundancyOptimizer follows a rebuilt group only listed right after "
               "the DistributedDataParallel model whose parameters it steps, and alone "
               "with it: Join([ddp_model, zero], on_rank_loss='finish'); alone or beside "
               "other joinables it is not in this version")
    else:
        why = f"{name} keeps its own reference to the process group"
    return ValueError(
        f"Join(on_rank_loss='finish') cannot hold {name}: {why}. Use on_rank_loss='raise' "
        "(the default) and restart from a checkpoint")


class _Shadow(JoinHook):
    """A torch join hook, run with its adapter marked as inside a hook."""

    def __init__(self, adapter: TorchJoinable, hook: Any) -> None:
        self.adapter = adapter
        self.hook = hook

    def main_hook(self) -> None:
        self.adapter._in_hook = True
        try:
            self.hook.main_hook()
        finally:
            self.adapter._in_hook = False

    def post_hook(self, is_last_joiner: bool) -> None:
        self.adapter._in_hook = True
        try:
            self.hook.post_hook(is_last_joiner)
        finally:
            self.adapter._in_hook = False


# The averaged gradients of a DDP's latest shadow round, by adapter key: per
# bucket, its parameters and their gradients (views of the all-reduce's
# result). Kept only when a ZeroRedundancyOptimizer shares the Join; its shadow
# step in the same round steps with them. Nothing else ever sees them.
_averaged: dict[int, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}


class _DDPShadow(_Shadow):
    """DDP's hook; with a ZeRO in the Join, its shadow all-reduce keeps the average.

    A model with collectives in forward is shadowed by replay instead
    (``replay``, a ``_ddp_replay.DDPReplay``); the fused check stays this one's.
    """

    #: The replay that stands for torch's main hook, if the model is replayed.
    replay: Any = None

    def forget_average(self) -> None:
        """Drop the average kept from the previous round."""
        _averaged.pop(self.adapter.key, None)

    def steps_shards(self) -> bool:
        """Whether a ZeroRedundancyOptimizer in this Join steps with the average."""
        return _steps_shards_with(self.adapter)

    def keep_average(self, averaged: list[tuple[list[Any], list[Any]]]) -> None:
        """Keep this round's average (per bucket: parameters, gradients) for ZeRO."""
        _averaged[self.adapter.key] = averaged

    def post_hook(self, is_last_joiner: bool) -> None:
        if self.replay is not None:
            self.replay.close()
        elastic = self.adapter._elastic_ddp
        if elastic is None:
            heartbeat_round = self.adapter._round
            if heartbeat_round is not None:
                # torch's final model comes from its last joiners, the ranks with
                # the most inputs; a round heartbeat knows only who left after
                # the last round (a rank that stepped alone under no_sync()
                # since may differ): ask, with one small all-reduce.
                is_last_joiner = heartbeat_round.most_inputs()
            if self.adapter._fused is not None:
                # torch's final-model sync asks by is_last_joiner, not activity.
                self.adapter._fused.release_common_rank()
            super().post_hook(is_last_joiner)
            return
        # on_rank_loss="finish": torch's final-model sync as one unit of the group.
        self.adapter._in_hook = True
        try:
            elastic.sync_final_model(is_last_joiner)
        finally:
            self.adapter._in_hook = False

    def fused_shadow(self, heartbeat: float) -> float:
        """The joined rank's half of ``[heartbeat, requires sync]`` (module doc).

        Without a fused heartbeat (DDP not first, throw mode, or
        ``check_agreement=False``) DDP's own check runs in the main hook as in
        torch, and this sends nothing.
        """
        heartbeat_round = self.adapter._round
        if heartbeat_round is not None:
            return heartbeat_round.shadow_first(heartbeat)
        fused = self.adapter._fused
        if fused is None:
            return 0.0
        return fused.shadow(heartbeat)

    def main_hook(self) -> None:
        adapter = self.adapter
        heartbeat_round = adapter._round
        if heartbeat_round is not None:
            # The rest of the gradient round (after the count, or the failing
            # rank's own open round).
            adapter._in_hook = True
            try:
                heartbeat_round.shadow_rest()
            finally:
                adapter._in_hook = False
            return
        if self.replay is not None:
            adapter._in_hook = True
            try:
                self.replay.run(self)
            finally:
                adapter._in_hook = False
            return
        # This round's average, if the active ranks sync gradients in it.
        _averaged.pop(adapter.key, None)
        if not _steps_shards_with(adapter):
            # DDP alone: torch's hook as it is. The joined rank's .grad stays
            # what its last backward left, as in torch's Join.
            super().main_hook()
            return
        ddp = adapter.obj
        # torch's main hook calls ddp._match_all_reduce_for_bwd_pass() when the
        # active ranks sync gradients this round; an instance attribute puts our
        # variant in its place for this call only.
        ddp._match_all_reduce_for_bwd_pass = self._match_all_reduce_keeping_average
        try:
            super().main_hook()
        finally:
            del ddp._match_all_reduce_for_bwd_pass

    def _match_all_reduce_keeping_average(self) -> None:
        reducer = self.adapter.obj.reducer
        # Same collectives, same order as torch's _match_all_reduce_for_bwd_pass:
        # one comm-hook all-reduce per bucket, zeros in the reducer's layout.
        buckets = reducer._get_zeros_like_grad_buckets()
        futures = [reducer._run_comm_hook(bucket) for bucket in buckets]
        averaged = []
        for bucket, future in zip(buckets, futures, strict=True):
            result = future.wait()
            if isinstance(result, (list, tuple)):
                result = result[0]
            bucket.set_buffer(result)  # gradients() are views of the buffer
            averaged.append((bucket.parameters(), bucket.gradients()))
        _averaged[self.adapter.key] = averaged


class _FusedCheck:
    """One DDP's heartbeat fused with its gradient-sync check (module doc).

    Active rank, per forward: ``notify`` sends ``heartbeat + HEARTBEAT_FLAG * syncs``
    asynchronously; DDP's ``_check_global_requires_backward_grad_sync`` is
    replaced by :meth:`check`, which sends nothing. Joined rank, per shadow
    round: the Join's count is :meth:`shadow` (contributing the heartbeat
    value alone), and the main hook's check answers whether the active ranks
    sync gradients in this round. A rank that failed right after its own fused all-reduce runs one
    main hook without a count first; its check then reads that all-reduce.

    The buffers alternate, and each send first waits for the all-reduce that
    last used its buffer, which finished long ago (every rank has since passed
    a later collective of the group).
    """

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool,
                 wait: Callable[[Any], Any] | None = None,
                 watch: _BackwardWatch | None = None) -> None:
        self.ddp = ddp
        self.watch = watch or _BackwardWatch(ddp, None)
        self.flagged = False  # this rank's latest send said "gradients are all-reduced"
        self.wait: Callable[[Any], Any] = wait or _plain_wait
        device = torch.device(ddp.join_device)
        self.on_cpu = device.type == "cpu"
        self.allreduce = ddp.process_group.allreduce
        self.opts = dist.AllreduceOptions()
        self.opts.reduceOp = _SUM
        self.buffers = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(3)]
        # NumPy views of the CPU buffers: element writes and reads without torch's
        # indexing machinery (on CUDA, values go through fill_ and item()).
        self.views: list[Any] = [b.numpy() if self.on_cpu else None for b in self.buffers]
        self.works: list[Any] = [None, None]
        self.current = 1  # the buffer of the latest send
        # divide_by_initial_world_size=False: the reducer reads the number of
        # active ranks from the work's result, so it needs the heartbeat sum alone.
        self.count_only = not divide_by_initial_world_size
        self.sync = True  # the latest round's answer (joined rank)
        self.own_latest: int | None = None  # a send of ours not yet read (joined rank)
        self.heartbeat = 0.0  # the latest round's heartbeat sum (joined rank)
        # (heartbeat sum, DDP's common rank) of the last all-reduce that found it.
        self.common: tuple[float, int] | None = None
        self.find_common_rank = ddp._find_common_rank
        ddp._check_global_requires_backward_grad_sync = self.check
        ddp._find_common_rank = self.common_rank

    def close(self) -> None:
        """Give DDP its own check back; release completed work."""
        self.ddp.__dict__.pop("_check_global_requires_backward_grad_sync", None)
        self.release_common_rank()
        for work in self.works:
            if work is not None and work.is_completed():
                work.wait()
        self.works = [None, None]

    def notify(self, adapter: TorchJoinable) -> Any:
        """An active rank's forward: send ``heartbeat + HEARTBEAT_FLAG * syncs``."""
        index = 1 - self.current
        latest = self.works[self.current]
        if latest is not None and self.on_cpu:
            # Long complete: a peer's failure shows in the heartbeat sum.
            latest.wait()
            heartbeat, _ = split_heartbeat_flags(float(self.views[self.current][0]))
            Join.record_heartbeat_total(adapter, heartbeat)
        previous = self.works[index]
        if previous is not None:
            previous.wait()  # this buffer's last all-reduce
        self.watch.settle()  # the last flagged forward, before anything goes out
        value = Join.fused_heartbeat(adapter)  # may raise PeerAborted
        self.flagged = self.ddp.require_backward_grad_sync and torch.is_grad_enabled()
        if self.flagged:
            value += _SYNCS
        buf = self.buffers[index]
        view = self.views[index]
        if view is not None:
            view[0] = value
        else:
            buf.fill_(value)
        work = self.allreduce([buf], self.opts)
        self.works[index] = work
        self.current = index
        self.own_latest = index
        if self.count_only:
            future = work.get_future().then(
                lambda _: [buf.new_full((1,), split_heartbeat_flags(buf.item())[0])]
            )
            return _c10d._create_work_from_future(future)
        return work

    def shadow(self, heartbeat: float) -> float:
        """A joined rank's count (it does not sync); return the heartbeat sum."""
        buf = self.buffers[2]
        view = self.views[2]
        if view is not None:
            view[0] = heartbeat
        else:
            buf.fill_(heartbeat)
        self.wait(self.allreduce([buf], self.opts))
        return self._read(2)

    def _read(self, index: int) -> float:
        """Split a completed sum: remember the sync flag, return the heartbeat sum."""
        heartbeat, syncs = split_heartbeat_flags(self.buffers[index].item())
        self.sync = syncs > 0
        self.own_latest = None
        self.heartbeat = heartbeat
        return heartbeat

    def common_rank(self, input_rank: int, rank_cond: bool) -> int:
        """DDP's ``_find_common_rank`` for its buffer broadcast (module doc).

        The rank that sources the buffers is the highest active one, which
        torch finds with an all-reduce before every broadcast. Active ranks
        only leave within a Join, so while this round's heartbeat sum equals
        the one of the round that last asked, the answer is the same: it is
        asked again only when the sum changed. Every rank decides from the
        same sum (this round's fused all-reduce), so all of them ask or none.
        """
        if rank_cond:
            # An active rank's forward: its own send of this round (just out).
            index = self.current
            self.wait(self.works[index])
            heartbeat, _ = split_heartbeat_flags(self.buffers[index].item())
        elif self.own_latest is not None:
            # A completion round's hook: the round of this rank's own last send.
            self.wait(self.works[self.own_latest])
            heartbeat, _ = split_heartbeat_flags(self.buffers[self.own_latest].item())
        else:
            heartbeat = self.heartbeat  # this shadow round's count
        common = self.common
        if common is not None and common[0] == heartbeat:
            return common[1]
        rank = int(self.find_common_rank(input_rank, rank_cond))
        self.common = (heartbeat, rank)
        return rank

    def release_common_rank(self) -> None:
        """Give DDP its own ``_find_common_rank`` back (its final-model sync asks it)."""
        if self.ddp.__dict__.get("_find_common_rank") == self.common_rank:
            del self.ddp.__dict__["_find_common_rank"]

    def check(self, is_joined_rank: bool) -> bool | None:
        """DDP's ``_check_global_requires_backward_grad_sync``, already sent."""
        if not is_joined_rank:
            # The sync flag went out with the heartbeat; DDP's pre-forward
            # collectives (buffer broadcast) are behind us.
            self.watch.forwarded(self.flagged)
            return None
        if self.own_latest is not None:
            # A completion round: the round of this rank's own last send.
            self.wait(self.works[self.own_latest])
            self._read(self.own_latest)
        return self.sync


class _BackwardWatch:
    """Whether a forward that announced a gradient all-reduce got its backward.

    An active rank's forward tells the joined ranks whether a gradient
    all-reduce follows (grad mode on and ``require_backward_grad_sync``); they
    then shadow one all-reduce per bucket. A forward with gradients enabled and
    no backward (``model.eval()`` without ``torch.no_grad()``, a validation
    loss) would leave them in those all-reduces while this rank sends its next
    heartbeat or count: a mismatch (gloo aborts the process). So after such a
    forward's own collectives the watch notes the group's collective counter
    (the Join backend's ``collectives_issued``, which counts DDP's C++
    collectives); before this rank's next send (its next forward, or leaving
    the loop) :meth:`settle` looks again. Unchanged means no bucket all-reduce
    went out: the watch then sends the all-reduces the joined ranks are in
    (zeros, as a joined rank does) and raises, and the Join's failure protocol
    gives every rank a clear error. One counter read per forward; nothing
    without a counter (a backend that keeps none).
    """

    def __init__(self, ddp: Any, counter: Callable[[], int | None] | None) -> None:
        self.ddp = ddp
        self.counter = counter
        self.mark: int | None = None  # the counter after a flagged forward
        # DDP after another joinable: Join.before_next_heartbeat.
        self.before_heartbeat: Callable[[Callable[[], None]], bool] | None = None

    def forwarded(self, flagged: bool) -> None:
        """An active rank's forward sent its collectives; ``flagged``: it announced a backward."""
        counter = self.counter
        self.mark = counter() if flagged and counter is not None else None
        if self.mark is not None and self.before_heartbeat is not None:
            self.before_heartbeat(self.settle)

    def settle(self) -> None:
        """Before this rank's next send: refuse a flagged forward that had no backward.

        Raises:
            LocalProtocolError: it had none (the joined ranks' all-reduces were
                matched first).
        """
        mark = self.mark
        if mark is None:
            return
        self.mark = None
        assert self.counter is not None
        if self.counter() != mark:
            return  # the backward's bucket all-reduces went out
        ddp = self.ddp
        # What a joined rank's hook does after "syncs" (torch's _DDPJoinHook).
        ddp._match_all_reduce_for_bwd_pass()
        if ddp.find_unused_parameters:
            ddp._match_unused_params_allreduce()
        if not ddp._has_rebuilt_buckets:
            # A bucket rebuild is still due: this rank's drain rebuilds, as the
            # joined ranks' next round does, once the reducer no longer waits
            # for the backward that never came.
            ddp.reducer._reset_state()
        ddp.reducer._push_all_rebuilt_params()
        raise LocalProtocolError(
            "DistributedDataParallel ran a forward with gradients enabled and no backward "
            "after it (e.g. evaluation in model.eval() without torch.no_grad()): inside a "
            "Join, such a forward tells joined ranks to shadow its gradient all-reduce. "
            "Run forward-only iterations under `with torch.no_grad():` (or "
            "torch.inference_mode(), or model.no_sync()), and follow every other forward "
            "by a backward. (joinkit matched the all-reduce the joined ranks were in, so "
            "no collective mismatched.)"
        )


class _SyncCheck:
    """DDP's own gradient-sync check, where the heartbeat is not fused (module doc).

    torch's active side says "syncs" whenever ``require_backward_grad_sync``,
    also under ``torch.no_grad()``, where no backward follows: its joined rank
    then shadows a gradient all-reduce nobody sends. This one says "syncs"
    only when grad mode is on as well (the same all-reduce, the same value
    otherwise), and tells the :class:`_BackwardWatch`.
    """

    def __init__(self, ddp: Any, watch: _BackwardWatch) -> None:
        self.ddp = ddp
        self.watch = watch
        self.original = type(ddp)._check_global_requires_backward_grad_sync.__get__(ddp)
        ddp._check_global_requires_backward_grad_sync = self

    def __call__(self, is_joined_rank: bool) -> bool | None:
        ddp = self.ddp
        if is_joined_rank:
            return self.original(True)  # type: ignore[no-any-return]
        requires = ddp.require_backward_grad_sync
        flagged = requires and torch.is_grad_enabled()
        if requires and not flagged:
            ddp.require_backward_grad_sync = False
            try:
                self.original(False)
            finally:
                ddp.require_backward_grad_sync = requires
        else:
            self.original(False)
        self.watch.forwarded(flagged)
        return None

    def close(self) -> None:
        """Give DDP its own check back."""
        if self.ddp.__dict__.get("_check_global_requires_backward_grad_sync") is self:
            del self.ddp.__dict__["_check_global_requires_backward_grad_sync"]


def _replay_eval_error() -> LocalProtocolError:
    return LocalProtocolError(
        "a forward without gradients (torch.no_grad() / torch.inference_mode()) of a "
        "DistributedDataParallel model that joined ranks shadow by replaying it (it has "
        "SyncBatchNorm or another module with collectives in forward, or Join(..., "
        "replay=True)): a replay cannot tell a forward-only iteration from one with a "
        "backward. Evaluate in a Join of its own with the model in eval mode (SyncBatchNorm "
        "then sends nothing in forward): `model.eval()` then `with Join([model], "
        "replay=False), torch.no_grad(): ...`"
    )


def _plain_wait(work: Any) -> Any:
    return work.wait()


class _ZeROShadow(_Shadow):
    """ZeRO's hook (one step) with this round's averaged gradients (module doc).

    For the step only, each parameter's ``.grad`` is the average a DDP shadow
    all-reduce of this round produced, or zero where none did (a joined rank
    has no gradient of its own: it contributes zero, as it does to DDP's
    average); a parameter without a gradient keeps none. Afterwards every
    parameter gets back the very ``.grad`` it had, so nothing of the shadow
    step reaches the user's next iteration. In finish mode the same step runs
    over every parameter (``adapters._zero_elastic``), and only in a round whose
    gradient unit some rank contributed to.
    """

    def main_hook(self) -> None:
        elastic = self.adapter._elastic_zero
        if elastic is not None and not elastic.elastic_ddp.last_count:
            # Finish mode (adapters._zero_elastic): no rank contributed to this
            # round's gradient unit, so no active rank steps; neither does this one.
            return
        average: dict[int, torch.Tensor] = {}
        for buckets in _averaged.values():
            for params, grads in buckets:
                for param, averaged in zip(params, grads, strict=True):
                    average[id(param)] = averaged
        saved: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        try:
            for param in _parameters(self.adapter.obj):
                own = param.grad
                grad: torch.Tensor | None = average.get(id(param))
                if grad is None:
                    if own is None:
                        continue
                    grad = torch.zeros_like(own)
                saved.append((param, own))
                param.grad = grad
            super().main_hook()
        finally:
            for param, own in saved:
                param.grad = own


def _parameters(optimizer: Any) -> Iterable[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _is_zero(obj: Any) -> bool:
    module = sys.modules.get(_ZERO_MODULE)
    return module is not None and isinstance(obj, module.ZeroRedundancyOptimizer)


_completed_work: Any = None


def _steps_shards_with(adapter: TorchJoinable) -> bool:
    """Whether a ZeroRedundancyOptimizer is in the same (active) Join as ``adapter``."""
    join = adapter._config.join
    return any(
        other._is_zero and other._config.join is join for other in list(_routes.values())
    )


def _elastic_vouch(adapter: TorchJoinable, ddp: bool | None,
                   store_outlives_ranks: bool | None = None) -> None:
    """Tell the torch backend whether this joinable's raw group may be rebuilt.

    ``ddp`` True (a DDP's join_hook): its group may recover with
    ``on_rank_loss="finish"`` (``adapters._ddp_elastic`` routes DDP's
    collectives); False (any other torch joinable but ZeroRedundancyOptimizer,
    which follows its DDP model and leaves the vouch as it is): it may not;
    ``None`` (the Join is over, or refused): forget it. ``store_outlives_ranks``:
    the Join's keyword of that name (``Join(..., store_outlives_ranks=True)``),
    which the raw group's TorchGroup then uses instead of its guess.
    """
    from joinkit.backends import torch_dist

    try:
        key = id(adapter.join_process_group)
    except Exception:  # noqa: BLE001 - no live group: nothing to vouch for
        return
    groups: dict[int, bool | None] = torch_dist.elastic_raw_groups
    if ddp:
        groups[key] = None if store_outlives_ranks is None else bool(store_outlives_ranks)
    else:
        groups.pop(key, None)


def _forget_join(adapter: TorchJoinable) -> None:
    """Undo what a Join leaves in a DDP's reducer; drop its kept average."""
    global _completed_work
    _averaged.pop(adapter.key, None)
    ddp = adapter.obj
    reducer = getattr(ddp, "reducer", None)
    if reducer is None:
        return
    if _completed_work is None:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result([torch.zeros(1)])
        c10d: Any = torch._C._distributed_c10d
        _completed_work = c10d._create_work_from_future(future)
    # "Use the static world size": the reducer never reads this work.
    reducer._set_forward_pass_work_handle(_completed_work, True)


# -- routing torch's notify_join_context ------------------------------------------

_adapters: AdapterCache[TorchJoinable] = AdapterCache()
# id(torch object) -> its active adapter (the adapter keeps the object alive).
_routes: dict[int, TorchJoinable] = {}
_routes_lock = threading.Lock()
_torch_notify = torch_join.Join.__dict__["notify_join_context"]


def _routed_notify_join_context(joinable: Any) -> Any:
    adapter = _routes.get(id(joinable))
    if adapter is None:
        return _torch_notify.__func__(joinable)
    return adapter.notify()


_routed_notify_join_context.__doc__ = (
    "torch's Join.notify_join_context, routed to joinkit's Join for torch "
    "joinables inside a joinkit Join (installed by joinkit.adapters.torch)."
)
_router = staticmethod(_routed_notify_join_context)


def _route(adapter: TorchJoinable) -> None:
    with _routes_lock:
        if not _routes:
            torch_join.Join.notify_join_context = _router  # type: ignore[method-assign]
        _routes[adapter.key] = adapter


def _unroute(adapter: TorchJoinable) -> None:
    with _routes_lock:
        if _routes.get(adapter.key) is adapter:
            del _routes[adapter.key]
        if not _routes and torch_join.Join.__dict__.get("notify_join_context") is _router:
            torch_join.Join.notify_join_context = _torch_notify  # type: ignore[method-assign]
