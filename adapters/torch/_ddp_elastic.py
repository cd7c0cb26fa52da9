"""DistributedDataParallel in a Join with ``on_rank_loss="finish"`` (gloo, CPU).

Theory of operation
-------------------
The elastic TorchGroup (``backends._torch_elastic``) survives a dead rank
only for collectives that go through its methods: each is a *unit* that
detects the death, rebuilds the group over the survivors, agrees on the last
completed unit, hands it over and re-runs what nobody completed. DDP issues
its collectives on its own ``process_group``; while a finish-mode Join lasts,
:class:`ElasticDDP` routes every one of them through the Join's TorchGroup,
or refuses on entry what it cannot route:

- *Gradients.* joinkit's DDP comm hook (``adapters.torch._ddp_hook``,
  registered once per model by the first Join that needs it: DDP allows one
  hook, forever; this Join sets itself as the hook's route) collects the reducer's
  buckets and, on ``bucket.is_last()``, all-reduces their concatenation plus
  one element (1 from an active rank, 0 from a joined rank's shadow) as ONE
  unit, then completes every bucket's future. So an iteration's gradient is
  all-or-nothing for a rank that dies in it, and a joined rank's shadow
  (DDP's ``_match_all_reduce_for_bwd_pass`` runs the same hook on zero
  buckets) issues the same unit. The divisor: the world size at the Join's
  entry (``divide_by_initial_world_size=True``) or the extra element, the
  ranks that contributed (``False``). Outside finish-mode Joins the hook
  does what DDP does without a hook (``_ddp_hook``'s module doc).
- *One unit per iteration after the heartbeat.* DDP's gradient-sync check
  (``_check_global_requires_backward_grad_sync``, an all-reduce per forward
  telling joined ranks whether a gradient all-reduce follows) is replaced for
  the Join by one that sends nothing: a joined rank always shadows exactly one
  gradient unit, and an active rank whose forward will not all-reduce
  gradients (``torch.no_grad()``, ``no_sync()``) sends a zero unit (counted
  as no contribution) from its forward. So every iteration is a heartbeat and
  one gradient unit, and the elastic group's count of a dead rank's
  iterations holds: a rank that died after its heartbeat and before its
  gradient unit completed did not consume that input. A forward with
  gradients and no backward is found before this rank's next heartbeat: the
  zero unit is sent (the joined ranks are in it) and a ``LocalProtocolError``
  says what to do.
- *The bucket rebuild* (a broadcast on DDP's group, once, after the first
  backward) is put off while the Join lasts: ``ddp.reducer`` is a proxy
  whose ``_rebuild_buckets`` answers "not now"; on exit the real reducer is
  back and reset, so the rebuild happens at the next iteration outside.
- *Buffers* (``broadcast_buffers=True``, DDP's default, and a model with
  buffers: BatchNorm's running statistics). Inside torch's Join, DDP's
  forward copies the buffers of the highest active rank to every rank (a MAX
  all-reduce of the rank, then a broadcast), and a joined rank's hook takes
  part in both. Here both are one *transparent* unit
  (``TorchGroup.all_gather(..., settles=False)``): every rank gathers every
  rank's buffers (their bytes, so any dtype travels exactly) with two flags,
  whether it is active (it runs a forward) and whether it syncs (DDP's
  ``will_sync_module_buffers``: not after a forward without gradients), and
  takes those of the highest active rank: the rule of torch's Join, which
  after a loss picks the highest surviving active rank. Transparent: a rank
  that dies after it and before its gradient unit has not consumed the input.
  An active rank takes part even when it does not sync (it keeps its
  buffers), since joined ranks cannot know it without a collective.
- *The post hook* (torch syncs the final model from the last joiner with a
  raw all-reduce and broadcasts) is one unit: an all-reduce of every last
  joiner's parameters and a 1, divided by the count (they hold the same
  parameters). With ``broadcast_buffers=True`` a second unit gathers the
  buffers and every rank takes those of the highest surviving last joiner, as
  torch's post hook broadcasts them from the highest last joiner; otherwise
  each rank keeps its own buffers, as in torch.
- *After a loss* DDP's ``process_group`` is the dead one; on exit the model
  is moved onto the rebuilt group with ``DistributedDataParallel._update_process_group``
  (which also resets the reducer), so the next iteration and the next Join
  run on the survivors.
- *Refused on entry* (a ``ValueError`` on every rank, before any collective):
  a DDP that already has a comm hook, or a buffer comm hook
  (``_register_buffer_comm_hook``: its collectives run on DDP's group);
  ``find_unused_parameters=True`` and
  ``static_graph=True`` (their extra all-reduces and delayed reductions run
  on DDP's group); a model shadowed by replay (SyncBatchNorm); a CUDA model;
  parameters of more than one dtype.

Standard library, torch and joinkit; imported by ``adapters.torch`` only in
finish mode. No ``from __future__ import annotations`` here: DDP checks the
comm hook's annotations as objects.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import _compat, _ddp_hook

__all__ = ["ElasticDDP", "c10d_group", "has_hook", "refusal", "take_last_joiners"]


def refusal(ddp: Any, replays: bool) -> str | None:
    """Why ``ddp`` cannot be in a finish-mode Join, or ``None`` when it can.

    Args:
        ddp: the DistributedDataParallel model.
        replays: whether its joined ranks are shadowed by replay.

    Returns:
        The message (what is wrong and how to fix it), or ``None``.
    """
    head = "Join(on_rank_loss='finish') with DistributedDataParallel: "
    if _ddp_hook.foreign_hook(ddp) is not None:
        return (head + "the model already has a comm hook (register_comm_hook); joinkit "
                "needs its own to send each backward's buckets as one unit that survives "
                "a dead rank. Build the model without a comm hook, or use "
                "on_rank_loss='raise'")
    if hasattr(ddp, "buffer_hook"):
        return (head + "the model has a buffer comm hook (_register_buffer_comm_hook): its "
                "collectives run on DDP's own group, which cannot survive a dead rank. "
                "Build the model without one (joinkit syncs the buffers as DDP does by "
                "default), or use on_rank_loss='raise'")
    if ddp.find_unused_parameters:
        return (head + "find_unused_parameters=True sends an extra all-reduce on DDP's "
                "group in each backward, which cannot survive a dead rank: build the model "
                "with find_unused_parameters=False, or use on_rank_loss='raise'")
    if getattr(ddp, "static_graph", False):
        return (head + "static_graph=True is not in this version (its delayed reductions "
                "run on DDP's group): build the model with static_graph=False, or use "
                "on_rank_loss='raise'")
    if replays:
        return (head + "the model has modules with collectives in forward (SyncBatchNorm) "
                "or Join(..., replay=True): joined ranks would replay them on DDP's group. "
                "Not in this version: use on_rank_loss='raise'")
    if ddp.device_type != "cpu":
        return (head + "the model is on a CUDA device; finish mode is gloo on the CPU only "
                "(docs/elastic-torch.md). Use on_rank_loss='raise'")
    dtypes = {p.dtype for p in ddp.parameters() if p.requires_grad}
    if len(dtypes) > 1:
        return (head + f"the parameters have {len(dtypes)} dtypes "
                f"({', '.join(sorted(map(str, dtypes)))}): one unit per backward needs one "
                "dtype. Cast the model to one dtype, or use on_rank_loss='raise'")
    return None


def has_hook(ddp: Any) -> bool:
    """Whether ``ddp`` carries joinkit's comm hook (a Join registered it)."""
    return _ddp_hook.installed(ddp) is not None


class ElasticDDP:
    """One DDP model inside one finish-mode Join (module doc).

    Args:
        ddp: the model (already checked by :func:`refusal`).
        group: the Join's TorchGroup (elastic).
        divide_by_initial_world_size: the Join's argument.
        in_hook: whether the adapter is running a shadow round now.
    """

    def __init__(self, ddp: Any, group: Any, divide_by_initial_world_size: bool,
                 in_hook: Callable[[], bool]) -> None:
        self.ddp = ddp
        self.group = group
        # The group DDP runs on, and its size at the Join's entry: normally the
        # TorchGroup's own, but a survivor that saw a death in the Join's entry
        # agreement holds the rebuilt one already, and its peers may not yet.
        self.world = ddp.process_group.size()
        self.backend = ddp.process_group
        self.entry_process_group = ddp.process_group  # DDP's group at the Join's entry
        self._rebuilt: tuple[Any, Any] | None = None  # (backend, its c10d ProcessGroup)
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.in_hook = in_hook
        self.expecting = False  # a forward announced a backward that has not come yet
        # How many ranks contributed to the latest gradient unit (a joined rank's
        # ZeRO steps in its shadow round only if some did: adapters._zero_elastic).
        self.last_count = 0.0
        self.pending: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]] = []
        state = _ddp_hook.install(ddp)
        state.route = self
        self.state = state
        self.reducer = ddp.reducer
        self.deferred = not ddp._has_rebuilt_buckets
        ddp.reducer = _Reducer(self.reducer)
        ddp._check_global_requires_backward_grad_sync = self.check
        # broadcast_buffers=True with buffers: DDP's buffer sync as one unit.
        self.syncs_buffers = _compat.ddp_syncs_buffers_in_forward(ddp)
        if self.syncs_buffers:
            ddp._check_sync_bufs_pre_fwd = _always
            ddp._sync_buffers = self.sync_buffers
            ddp._check_and_sync_module_buffers = self.shadow_buffers

    def close(self) -> None:
        """The Join is over: give DDP back its reducer and check; follow a rebuilt group."""
        ddp = self.ddp
        if self.state.route is self:
            self.state.route = None
        self.pending = []
        if isinstance(ddp.__dict__.get("reducer"), _Reducer):
            ddp.reducer = self.reducer
        if ddp.__dict__.get("_check_global_requires_backward_grad_sync") == self.check:
            del ddp.__dict__["_check_global_requires_backward_grad_sync"]
        for name in _BUFFER_METHODS:
            ddp.__dict__.pop(name, None)
        pg = self.rebuilt_process_group()
        if pg is not None:
            ddp._update_process_group(pg)  # also resets the reducer
        elif self.deferred:
            self.reducer._reset_state()  # forget the parameters pushed meanwhile

    def rebuilt_process_group(self) -> Any:
        """The c10d ProcessGroup over the survivors after a loss (made once), else ``None``.

        DDP's reducer takes a c10d ProcessGroup: the rebuilt gloo backend, wrapped.
        It is registered with c10d (the global ranks of the survivors, in their
        new order), so ``dist.get_rank(group)`` and ``dist.broadcast(group=...)``
        work on it: ZeroRedundancyOptimizer moves onto the same object
        (``adapters._zero_elastic``), and a later Join over the model finds it live.
        """
        backend = self.group.process_group
        if backend is self.backend or not self.group.lost_ranks():
            return None
        if self._rebuilt is not None and self._rebuilt[0] is backend:
            return self._rebuilt[1]
        pg = c10d_group(self.group, self.entry_process_group)
        self._rebuilt = (backend, pg)
        return pg

    # -- the gradient unit -----------------------------------------------------------

    def hook(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """The comm hook's route: collect the backward's buckets; the last one sends the unit."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self.pending.append((bucket.buffer(), future))
        if bucket.is_last():
            pending, self.pending = self.pending, []
            self.reduce(pending)
        return future

    def reduce(self, pending: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]],
               ) -> None:
        """All-reduce every bucket of this backward as one unit; complete their futures."""
        contributes = not self.in_hook()
        if contributes:
            self.expecting = False
        flat = self._unit([b for b, _ in pending], contributes)
        start = 0
        for buffer, future in pending:
            n = buffer.numel()
            future.set_result(flat[start:start + n].view_as(buffer).to(buffer.dtype))
            start += n

    def _unit(self, buffers: list[torch.Tensor], contributes: bool) -> torch.Tensor:
        """The gradient unit: SUM of the buckets and a count, divided (module doc)."""
        dtype = buffers[0].dtype
        flat = torch.cat([b.reshape(-1).to(dtype) for b in buffers]
                         + [torch.full((1,), 1.0 if contributes else 0.0, dtype=dtype)])
        self.group.all_reduce(flat)
        self.last_count = float(flat[-1].item())
        divisor = float(self.world) if self.divide_by_initial_world_size else (
            max(self.last_count, 1.0))
        return flat[:-1].div_(divisor)

    def _zero_unit(self) -> None:
        """The unit a joined rank is in, sent by a rank that contributes nothing."""
        buckets = self.reducer._get_zeros_like_grad_buckets()
        self._unit([b.buffer() for b in buckets], False)

    # -- the gradient-sync check -----------------------------------------------------

    def check(self, is_joined_rank: bool) -> bool | None:
        """DDP's ``_check_global_requires_backward_grad_sync``: sends no collective.

        A joined rank always shadows one gradient unit (True); an active rank
        whose forward announces no backward all-reduce sends the zero unit now.
        """
        if is_joined_rank:
            return True
        if self.ddp.require_backward_grad_sync and torch.is_grad_enabled():
            self.expecting = True
        else:
            self._zero_unit()
        return None

    def settle(self) -> None:
        """Before this rank's next heartbeat: refuse a forward that got no backward.

        Raises:
            LocalProtocolError: the last forward had gradients enabled and no
                backward followed (the joined ranks' unit was matched first).
        """
        if not self.expecting:
            return
        self.expecting = False
        self._zero_unit()
        from joinkit import LocalProtocolError

        raise LocalProtocolError(
            "DistributedDataParallel ran a forward with gradients enabled and no backward "
            "after it inside Join(on_rank_loss='finish'): joined ranks shadow one gradient "
            "all-reduce per forward. Run forward-only iterations under `with "
            "torch.no_grad():` and follow every other forward by a backward. (joinkit "
            "matched the all-reduce the joined ranks were in.)")

    # -- the buffers -------------------------------------------------------------------

    def sync_buffers(self) -> None:
        """DDP's ``_sync_buffers`` in an active rank's forward: the buffer unit."""
        self._buffer_unit(candidate=True)

    def shadow_buffers(self) -> None:
        """DDP's ``_check_and_sync_module_buffers`` in a joined rank's hook: the same unit."""
        self._buffer_unit(candidate=False)

    def _buffer_unit(self, candidate: bool) -> None:
        """Take the buffers of the highest candidate rank that syncs (module doc).

        Args:
            candidate: this rank runs a forward (active); a joined rank shadows.
        """
        ddp = self.ddp
        syncs = bool(ddp.will_sync_module_buffers())
        take = _take_buffers(self.group, ddp, candidate, syncs, settles=False)
        if take and (syncs or not candidate):
            take()

    # -- the post hook -----------------------------------------------------------------

    def sync_final_model(self, is_last_joiner: bool) -> None:
        """DDP's ``_sync_final_model`` as units: the last joiners' model.

        Every rank that joined in the last round holds the same parameters (it
        was active in the last iteration); a SUM of theirs with a count gives
        them. With ``broadcast_buffers=True`` every rank takes the buffers of
        the highest last joiner (DDP broadcasts them from it), in a second
        unit; without, each keeps its own (as in DDP). If none of the last
        joiners survived, the survivors take the model of the lowest rank of
        the rebuilt group (limit: docs/elastic-torch.md).
        """
        ddp = self.ddp
        take_last_joiners(self.group, [p.data for p in ddp.module.parameters()],
                          is_last_joiner)
        if self.syncs_buffers:
            take = _take_buffers(self.group, ddp, is_last_joiner, True, settles=True)
            if take is None:  # no last joiner survived: the lowest rank's
                take = _take_buffers(self.group, ddp, self.group.rank == 0, True,
                                     settles=True)
            if take is not None:
                take()


#: DDP's methods the buffer unit replaces on the object while the Join lasts.
_BUFFER_METHODS = ("_check_sync_bufs_pre_fwd", "_sync_buffers",
                   "_check_and_sync_module_buffers")


def _always() -> bool:
    return True


def _take_buffers(group: Any, ddp: Any, candidate: bool, syncs: bool, settles: bool,
                  ) -> Callable[[], None] | None:
    """Gather every rank's buffers with its flags, as one unit on ``group``.

    Returns:
        A function that copies the buffers of the highest candidate rank into
        this rank's (``None`` when no rank is a candidate; nothing to copy when
        this rank is that one), if that rank syncs; else ``None``.
    """
    with torch.no_grad():
        ddp._assign_modules_buffers()
        buffers = list(ddp.modules_buffers)
        flags = torch.tensor([int(candidate), int(syncs)], dtype=torch.uint8)
        mine = torch.cat([flags] + [b.detach().reshape(-1).contiguous().view(torch.uint8)
                                    for b in buffers])
    parts = group.all_gather(mine, settles=settles)
    chosen = max((i for i, part in enumerate(parts) if int(part[0]) == 1), default=None)
    if chosen is None or int(parts[chosen][1]) != 1:
        return None
    source = parts[chosen]

    def copy() -> None:
        if chosen == group.rank:
            return
        start = 2
        with torch.no_grad(), _compat.preserve_version_counter(tuple(buffers)):
            for buffer in buffers:
                n = buffer.numel() * buffer.element_size()
                # A copy: a view at an odd byte offset cannot change its dtype.
                raw = source[start:start + n].clone()
                buffer.copy_(raw.view(buffer.dtype).view_as(buffer))
                start += n

    return copy


class _Reducer:
    """DDP's reducer with its bucket rebuild put off while the Join lasts (module doc)."""

    def __init__(self, reducer: Any) -> None:
        object.__setattr__(self, "_reducer", reducer)

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_reducer"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_reducer"), name, value)


def c10d_group(group: Any, entry_process_group: Any) -> Any:
    """A c10d ProcessGroup over ``group``'s rebuilt gloo backend, registered with c10d.

    Args:
        group: the Join's elastic TorchGroup, after a loss.
        entry_process_group: the c10d group it stood for at the Join's entry
            (its ranks map the survivors to global ranks).

    Returns:
        The new ProcessGroup: ``dist.get_rank(pg)``, ``dist.broadcast(group=pg)``
        and ``DeviceMesh.from_group(pg, "cpu")`` work on it.
    """
    backend = group.process_group
    pg: Any = dist.ProcessGroup(backend.rank(), backend.size())  # type: ignore[call-arg]
    gloo = dist.ProcessGroup.BackendType.GLOO
    pg._set_default_backend(gloo)
    pg._register_backend(torch.device("cpu"), gloo, backend)
    # A name every survivor derives alike, and no other group has: a later Join's
    # elastic group keeps its store keys under it (an unnamed group's were
    # "default", shared with the group of the next rebuild: a second loss in a
    # later Join then read the first one's keys).
    try:
        entry_name = str(entry_process_group.group_name)
    except RuntimeError:  # an unnamed group
        entry_name = "pg"
    pg._set_group_name(f"{entry_name}.r{len(group.lost_ranks())}")
    c10d: Any = dist.distributed_c10d
    survivors = group.lost_ranks()[-1].survivors  # entry ranks, in new order
    c10d._world.pg_group_ranks[pg] = {
        c10d.get_global_rank(entry_process_group, old): new
        for new, old in enumerate(survivors)}
    return pg


def take_last_joiners(group: Any, tensors: list[torch.Tensor], is_last_joiner: bool) -> None:
    """Give every survivor the last joiners' ``tensors``, as one unit on ``group``.

    The ranks that joined in the last round hold the same values (they were
    active in the last iteration); a float64 SUM of theirs with a count gives
    them exactly. If none of them survived, every rank takes the values of
    rank 0 of the (rebuilt) group.
    """
    if not tensors:
        return
    mine = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    weight = 1.0 if is_last_joiner else 0.0
    flat = torch.cat([mine * weight, torch.full((1,), weight, dtype=torch.float64)])
    group.all_reduce(flat)
    count = float(flat[-1].item())
    if count > 0:
        values = flat[:-1] / count
    else:
        values = mine.clone()
        group.broadcast(values, 0)
    start = 0
    with torch.no_grad():
        for tensor in tensors:
            n = tensor.numel()
            tensor.copy_(values[start:start + n].view_as(tensor).to(tensor.dtype))
            start += n
