"""The torch.distributed backend: joinkit's collectives over a torch ProcessGroup.

Theory of operation
-------------------
:class:`TorchGroup` wraps one ``ProcessGroup`` (the default group unless told
otherwise) and one device: the CPU for gloo, ``cuda:LOCAL_RANK`` for nccl. It
is both a :class:`backends.CollectiveGroup` and its own join backend. Importing
this module registers three kinds of ``join_process_group`` with the registry:
a ``TorchGroup`` resolves to itself, a raw ``ProcessGroup`` (what DDP and
ZeroRedundancyOptimizer return, and ``dist.group.WORLD``) to a new
``TorchGroup`` over it on the joinable's device, and ``None`` (torch's spelling
of "the default group", and what ``dist.group.WORLD`` is before
``init_process_group``) to the default group, or a clear error when there is
none. ``backends`` imports this module by itself once ``torch.distributed`` is
loaded.

*Wire-compatible with torch's Join.* A heartbeat is what
``torch.distributed.algorithms.join.Join.notify_join_context`` sends: a
1-element float32 SUM all-reduce on the joinable's device, issued with
``async_op`` so the active rank does not wait for it; a count is the same
all-reduce, blocking. So a torch rank and a joinkit rank can share one group
(pass ``check_agreement=False`` to joinkit's Join: torch does no agreement
check). The heartbeat returns the raw ``torch.distributed.Work``: DDP hands it
to its reducer, which with ``divide_by_initial_world_size=False`` reads the
number of active ranks from it.

*The per-iteration path allocates nothing.* The 1-element tensors are made
once, and the collectives go to the ``ProcessGroup`` directly with options built
once (``dist.all_reduce`` re-checks its arguments on every call). An async
all-reduce's buffer must not be touched before its work completes, and a
heartbeat's buffer is read after it was sent (by DDP's reducer in the backward
pass, by the Join's failure check at the next notify), so heartbeats rotate
over two buffers and each waits for the work that last used its buffer, which
finished long ago: every rank has since passed a later collective on the same
group, and a group completes its collectives in order. On CUDA that wait only
orders the device streams. An elastic rebuild (``_adopt``) gives the group new
buffers, and in finish mode every collective runs on a copy of the caller's
buffer (``_stage``): a collective that a recovery abandoned (its work is
dropped, not waited) keeps the memory it had, and a member left out of the
rebuild but still alive could complete it late. Reading a heartbeat's sum
(``heartbeat_total``) on CUDA would need a device synchronisation per
iteration, so there it reports no failure and a failed peer is seen at the next
count instead.

*Failure handling extras.* ``collectives_issued`` is the group's own sequence
number (which counts every collective on the group, DDP's from C++ included)
minus the heartbeats and counts, so the Join knows whether a rank failed right
after its heartbeat. ``post_status``/``peer_status`` and ``abort`` go
through the default group's store, which every rank reaches without the
(possibly stuck) process group: ``post_status`` only records what the Join is
doing, and a daemon thread publishes it at most twice a second (so the
per-round path pays no store round trip); ``peer_status`` reads every rank's
entry for a stall diagnostic. ``post_beat`` (the Join's watchdog thread, every
tenth of its timeout) takes a new number that the same thread publishes with
the status, and ``peer_board`` reads the entries of a few ranks (the
watchdog's ring neighbour, or every rank while it waits) and any posted
abort, which ``aborted`` then reports. What an entry is (its JSON, its age,
its text) and this rank's record of its own come from ``backends._status``;
this module only carries entries through the store. With its first entry a
rank posts, once per group, which process it is (pid, host, start time); after a
collective failed, ``gone_peers`` reads them and names the peers on this host
whose process is gone (a SIGKILL leaves gloo's survivors with a "Connection
closed by peer" that names no rank). ``abort`` posts the reason (first aborter wins)
and calls ``ProcessGroup.abort()``. That is enough on nccl, but gloo's abort
wakes nobody, neither this rank's pending collective nor its peers'. So on a
CPU group every blocking wait of this class waits in slices of
``_WAIT_SLICE`` seconds, and between slices it looks at the group's abort
flag; when the collective fails (e.g. because the aborting process exited)
it reads the store's abort key itself. The flag is set by this rank's
``abort`` or by the process's one *abort watcher*, a daemon thread that reads
the abort key of every group with a wait past its first slice, every
``max(_WAIT_SLICE, world size / _ABORT_POLLS_PER_SECOND)`` seconds: one store
request per poll per group, however many waits, and the whole world's polls
of the store stay near ``_ABORT_POLLS_PER_SECOND`` at any size (a wait used
to start a thread and a store request every second). A wait then raises
:class:`GroupAborted` naming the aborting rank and its reason. A collective
that completes within a slice never pays for this; collectives issued by
other code (DDP's, from C++) still wait for the group's own timeout or for
the aborting process to exit.

*Leaving the interpreter.* gloo runs every collective on a worker thread of
the process group, and that thread holds the collective's ``Work`` (and through
it the tensors) a moment after the collective completes. If Python has let go
of a tensor by then, torch hands the tensor's Python object to C++, and the
worker thread, dropping the last reference, must take the GIL to free it; once
the interpreter is finalizing, taking the GIL ends the thread, which inside a
C++ destructor means ``std::terminate``: "terminate called without an active
exception", SIGABRT, after a job that succeeded. So this class keeps a Python
reference to every tensor it hands to torch until torch holds none
(``Tensor._use_count() == 1``): its one-element buffers live as long as the
group, staged tensors in ``_held``. An exit guard (``atexit``, so before
finalization) settles the rest: it stops the status thread and the store
helpers, keeps every tensor still held alive through exit, and waits (the GIL
released) until gloo's worker threads are idle, which also settles collectives
that others issued in this process (torch's own Join, the caller's ``dist``
calls). If a collective is still pending (a frozen peer never joined it), or
a worker stays busy, it keeps every process group alive through exit as well,
so that no group destructor joins a blocked thread. The torch launcher
(``backends.init``/``init_torch``) runs the guard before it destroys the group.

*Buffers.* Collectives take torch tensors and NumPy arrays; what they accept
(dtypes, devices, reduce ops, roots, scatter chunks) is decided by
``backends._checks``, the same for every backend. A contiguous tensor
already on the group's device is used in place; anything else (a NumPy array, a
CPU tensor on an nccl group, a non-contiguous tensor) is copied to a staging
tensor and the result copied back into it in place. A writable C-contiguous
NumPy array on a CPU group is shared with torch without a copy. Bool buffers
reduce with logical ops like the other backends: ``sum``/``max``/``bor`` are
OR, ``prod``/``min``/``band`` are AND, ``bxor`` is XOR. ``async_op=True``
returns a handle whose ``wait()`` returns what the blocking call returns.

*Where the parts live* (the package ``joinkit.backends.torch_dist``): this
module holds ``TorchGroup`` (the collectives, the waits in slices, the board's
and abort's methods) and the registry's factories. The threads that work
beside it over the store (the status publisher, the abort watcher, bounded
store access) are ``_board``, the exit guard (``_hold``, ``settle_at_exit``)
``_exit``, the recovery from a lost rank ``_elastic``, and what the launcher
and the doctor need of torch ``_launcher``.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from joinkit import LocalProtocolError, PeerFailure
from joinkit.lowlevel import register_backend

from .. import _objects, _status
from .._checks import Checks
from .._status import Post
from . import _board, _elastic
from ._board import (
    _GONE_PATIENCE,
    _STORE_PATIENCE,
    _WAIT_SLICE,
    _abort_posted,
    _publish_statuses,
    _publishing,
    _watch_aborts,
)
from ._exit import (
    _groups,
    _hold,
)

__all__ = ["TorchGroup", "GroupAborted", "elastic_raw_groups"]



class GroupAborted(PeerFailure):
    """A rank aborted the process group, so this rank's collective was abandoned.

    Raised by a :class:`TorchGroup` wait once a rank (this one or a peer)
    called :meth:`TorchGroup.abort`, e.g. because a join hook raised or the
    Join's watchdog found a stall.

    Attributes:
        rank: the rank that aborted first.
        exc_type: ``"abort"``.
        exc_message: its reason.
    """

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(rank, "abort", reason)
        self.args = (f"rank {rank} aborted the process group: {reason}",)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.exc_message))

_ARITHMETIC: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}
_BITWISE = {
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}
_INTEGER = {**_ARITHMETIC, **_BITWISE}
# Bool buffers travel as uint8; these ops give the logical meaning on 0/1.
_LOGICAL = {
    "sum": dist.ReduceOp.MAX,
    "max": dist.ReduceOp.MAX,
    "bor": dist.ReduceOp.MAX,
    "prod": dist.ReduceOp.MIN,
    "min": dist.ReduceOp.MIN,
    "band": dist.ReduceOp.MIN,
    "bxor": dist.ReduceOp.BXOR,
}


def _reduce_op(dtype: np.dtype[Any], op: str) -> Any:
    """The ReduceOp of ``op`` (checked by ``_checks``) on a ``dtype`` buffer."""
    if dtype.kind == "b":
        return _LOGICAL[op]
    return _INTEGER[op]


class _Staged:
    """A buffer as a tensor on the group's device, and how to give the result back.

    ``tensor`` is what the collective reads and writes. ``finish()`` copies it
    back into the caller's buffer when it is a copy (it is a no-op when the
    buffer was used in place).
    """

    __slots__ = ("buf", "tensor", "in_place")

    def __init__(self, buf: Any, tensor: torch.Tensor, in_place: bool) -> None:
        self.buf = buf
        self.tensor = tensor
        self.in_place = in_place

    def finish(self) -> None:
        if self.in_place:
            return
        result = self.tensor
        if isinstance(self.buf, torch.Tensor):
            with torch.no_grad():
                self.buf.copy_(result.to(self.buf.dtype))
        else:
            np.copyto(self.buf, result.cpu().numpy().astype(self.buf.dtype, copy=False))


class _Pending:
    """A collective in flight; ``wait()`` returns what the blocking call returns."""

    __slots__ = ("_work", "_finish", "_done", "_result", "_wait")

    def __init__(self, work: Any, finish: Callable[[], Any],
                 wait: Callable[[Any], Any]) -> None:
        self._work = work
        self._finish = finish
        self._done = False
        self._result: Any = None
        self._wait = wait

    def wait(self) -> Any:
        """Block until the collective completes; return its result."""
        if not self._done:
            self._wait(self._work)
            self._result = self._finish()
            self._done = True
            self._finish = _nothing
        return self._result

    def is_completed(self) -> bool:
        """Whether the collective has completed (never blocks)."""
        return self._done or bool(self._work.is_completed())


def _nothing() -> None:
    return None


class _DeviceBuffers:
    """The object collectives' buffers (``backends._objects``): tensors on the group's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def read_ints(self, buf: torch.Tensor) -> list[int]:
        return [int(value) for value in buf.tolist()]

    def data(self, raw: bytes | bytearray) -> torch.Tensor:
        host = torch.from_numpy(np.frombuffer(bytes(raw), dtype=np.uint8).copy())
        return host.to(self.device)

    def read_data(self, buf: torch.Tensor) -> bytes:
        return bytes(buf.cpu().numpy().tobytes())


class TorchGroup:
    """joinkit's collectives over a torch.distributed ProcessGroup.

    Every method is collective: all ranks of the group call it in the same
    order with matching arguments (same shapes and dtypes, same root). Ranks
    (``src``, ``dst``, ``rank``) are ranks *within this group*.

    Args:
        process_group: a ProcessGroup (``dist.new_group(...)``,
            ``dist.group.WORLD``); ``None`` means the default group.
        device: where the group's collectives run; default: the CPU, or for an
            nccl group the group's bound device, else ``cuda:LOCAL_RANK``, else
            the current CUDA device.
        store_outlives_ranks: for ``Join(..., on_rank_loss="finish")``: whether
            the default group's store lives outside the ranks (a launcher's or
            your own ``TCPStore`` server, a ``FileStore``), so that any rank's
            death can be recovered. ``None``: guessed (a ``TCPStore`` is taken
            to live in rank 0 unless torchrun's agent hosts it);
            docs/elastic-torch.md.

    Raises:
        LocalProtocolError: torch.distributed is not initialised, or the group
            is not a live group of this process (destroyed, or this rank is not
            a member).
    """

    def __init__(self, process_group: Any = None, device: Any = None, *,
                 store_outlives_ranks: bool | None = None) -> None:
        group = _live_group(process_group)
        self.process_group = group
        self.device = _usable_device(device) if device is not None else _default_device(group)
        self._buffers = _DeviceBuffers(self.device)
        self.rank: int = group.rank()
        self.world_size: int = group.size()
        self._checks = Checks(self.rank, self.world_size, self.device)
        self._on_cuda = self.device.type == "cuda"
        # The per-iteration path: options and buffers made once (module doc).
        self._allreduce = group.allreduce
        self._sum = dist.AllreduceOptions()
        self._sum.reduceOp = _ARITHMETIC["sum"]
        self._beats: tuple[torch.Tensor, torch.Tensor]
        self._beat_views: tuple[Any, ...] | None
        self._tally: torch.Tensor
        self._barrier_buf: torch.Tensor
        self._new_buffers()
        self._beat_works: list[Any] = [None, None]
        self._next_beat = 0
        # The latest count's and barrier's work, for the exit guard (module doc).
        self._count_work: Any = None
        self._barrier_work: Any = None
        # collectives_issued: the group's sequence number counts every
        # collective on it (DDP's from C++ too); ours are subtracted.
        self._join_collectives = 0
        try:
            self._sequence: Callable[[], int] | None = group._get_sequence_number_for_group
            self._sequence()
        except (AttributeError, RuntimeError):
            self._sequence = None
        # The failure path (module doc): the abort seen so far, the slice a CPU
        # wait waits before looking for one, and the store for statuses.
        self._abort: tuple[int, str] | None = None
        self._slice = (
            None if self._on_cuda else datetime.timedelta(seconds=_WAIT_SLICE)
        )
        self._store_prefix = f"joinkit/{getattr(group, 'group_name', '')}/"
        # This rank's board entry; peers compute its age, so wall-clock time.
        self._post = Post(time.time)
        # on_rank_loss="finish" (_elastic): the recovery state,
        # set on Join entry; whether the registry made this group for a raw
        # ProcessGroup (DDP's, ZeRO's, FSDP2's: they keep their own reference).
        self._elastic: _elastic.Elastic | None = None
        self._store_outlives_ranks = store_outlives_ranks
        # all_gather_into's tensors for its latest buffers (buf, out, wire, rows).
        self._into: tuple[Any, ...] | None = None
        self._for_raw_group = False
        self._initial_rank = self.rank
        _groups.add(self)

    def __repr__(self) -> str:
        return (
            f"TorchGroup(rank={self.rank}, world_size={self.world_size}, "
            f"device={self.device}, backend={_backend_name(self.process_group)!r})"
        )

    # A TorchGroup stands for its ProcessGroup: DDP (whose join_process_group is
    # the raw group) and a joinkit joinable holding a TorchGroup over the same
    # group may share one Join, which compares the groups with ``!=``.
    def __eq__(self, other: object) -> bool:
        if isinstance(other, TorchGroup):
            return other.process_group is self.process_group
        return other is self.process_group

    def __hash__(self) -> int:
        return hash(self.process_group)

    # -- join backend ------------------------------------------------------------

    @property
    def initial_rank(self) -> int:
        """This rank in the group as it was built (before any rank was lost)."""
        return int(self._initial_rank)

    def lost_ranks(self) -> tuple[Any, ...]:
        """Every rank lost so far in this group's life, in order of loss.

        Returns:
            ``joinkit.LostRank`` values (original ranks); ``()`` unless a
            ``Join(..., on_rank_loss="finish")`` over this group lost one.
        """
        elastic = self._elastic
        return () if elastic is None else tuple(elastic.lost)

    def start_rank_loss_recovery(self, config: Any) -> None:
        """Turn on recovery from dead ranks (``Join(..., on_rank_loss="finish")``).

        Called by the Join on entry, before any collective. From then on every
        collective of this group is a unit that survives a dead rank: the
        group is rebuilt over the survivors (``_elastic``).

        Args:
            config: the Join's ``RankLossConfig`` (its ``progress`` callback).

        Raises:
            ValueError: recovery cannot work here: an nccl group or a CUDA
                device, a group the registry made for a raw ProcessGroup
                (DistributedDataParallel, ZeroRedundancyOptimizer, FSDP2), or
                no store. The message says why and what works.
        """
        elastic = self._elastic
        if elastic is not None:  # a later Join over the same group
            elastic.progress = config.progress
            elastic.reset_counts()
            return
        backend = _backend_name(self.process_group)
        if self._on_cuda or "nccl" in backend:
            raise _elastic.ElasticUnavailable(
                "Join(on_rank_loss='finish') is not available on nccl in this version: "
                "gloo's trick (leave the broken group and build a new one over the "
                "store) would need every CUDA stream and communicator of the dead "
                "generation aborted first, and torch's in-place shrink_group (nccl "
                "only) does not hand the survivors the last completed collective. "
                "What works: a gloo group (backend='gloo', tensors on the CPU), or "
                "on_rank_loss='raise'. docs/elastic-torch.md says what it would take")
        if self._for_raw_group and id(self.process_group) not in elastic_raw_groups:
            raise _elastic.ElasticUnavailable(
                "Join(on_rank_loss='finish') works with joinables whose "
                "join_process_group is a joinkit TorchGroup (your own joinable, such "
                "as a Counter): the group is rebuilt in place. This Join's group is a "
                "raw ProcessGroup, as DistributedDataParallel, ZeroRedundancyOptimizer "
                "and FSDP2 return, and those keep their own reference to it. DDP alone "
                "works (adapters.torch follows the rebuilt group), and so do DDP with "
                "its ZeroRedundancyOptimizer (any optimizer), Join([model, zero]), and an "
                "FSDP2 model with SGD (momentum=0), Join([model, optimizer]); refused (not "
                "built): FSDP2 with a stateful optimizer (a dead rank's shard of the "
                "optimizer state is lost). Use "
                "on_rank_loss='raise' and restart from a checkpoint")
        try:
            store = _board._store()
        except Exception as exc:  # noqa: BLE001
            raise _elastic.ElasticUnavailable(
                f"Join(on_rank_loss='finish') needs the default group's store: {exc}"
            ) from exc
        outlives = self._store_outlives_ranks
        if outlives is None and self._for_raw_group:
            outlives = elastic_raw_groups.get(id(self.process_group))
        if outlives is None:
            outlives = _elastic.store_outlives_ranks_guess(store)
        host = None if outlives else 0
        if host is not None and self.rank == 0:
            warnings.warn(
                "joinkit: Join(on_rank_loss='finish'): the store seems to live in rank 0 "
                "(a TCPStore from init_process_group): if rank 0 dies the survivors cannot "
                "rebuild and fail naming it; host the store outside the ranks and pass "
                "TorchGroup(..., store_outlives_ranks=True) (docs/elastic-torch.md)",
                UserWarning, stacklevel=4)
        if self.rank == 0:
            _elastic.warn_torchrun()
        self._elastic = _elastic.Elastic(self, config.progress, store, host)

    def _adopt(self, process_group: Any, rank: int, world_size: int) -> None:
        """Go on over a rebuilt group (``_elastic``): same object, new group."""
        self.process_group = process_group
        self.rank, self.world_size = rank, world_size
        self._checks = Checks(rank, world_size, self.device)
        self._allreduce = process_group.allreduce
        # A collective of the old group may still be pending (a member left out
        # of the rebuild, alive, may yet complete it): it keeps its buffers, so
        # it can never write into the ones the new group uses (module doc).
        self._new_buffers()
        self._beat_works = [None, None]
        self._count_work = self._barrier_work = None
        assert self._elastic is not None
        self._store_prefix = self._elastic.key(self._elastic.generation, "board/")

    def heartbeat(self, value: float) -> Any:
        """Start the 1-element float32 SUM all-reduce contributing ``value``.

        Args:
            value: this rank's contribution.

        Returns:
            The ``torch.distributed.Work`` of the all-reduce (DDP's reducer
            reads the number of active ranks from it); in elastic mode a
            handle that has completed (module doc of ``_elastic``).
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            total = elastic.unit("heartbeat", lambda: self.heartbeat_total(self.heartbeat(value)),
                                 beat=value)
            return _elastic._Done(None, total)
        index = self._next_beat
        self._next_beat = 1 - index
        previous = self._beat_works[index]
        if previous is not None:
            self.wait(previous)  # this buffer's last all-reduce (module doc)
        buf = self._beats[index]
        views = self._beat_views
        if views is not None:
            views[index][0] = value
        else:
            buf.fill_(value)
        work = self._allreduce([buf], self._sum)
        self._join_collectives += 1
        self._beat_works[index] = work
        return work

    @property
    def collectives_issued(self) -> int | None:
        """How many collectives the group issued besides heartbeats and counts.

        It counts what other code (DDP's reducer, a joinable) sends on the
        group, so the Join can tell whether a rank failed right after its
        heartbeat, before that iteration's collectives. ``None`` when the
        group's backend keeps no sequence number.
        """
        elastic = self._elastic
        if elastic is not None:  # units: the group's own count survives rebuilds
            return elastic.issued_other
        if self._sequence is None:
            return None
        return self._sequence() - self._join_collectives

    def heartbeat_total(self, handle: Any) -> float:
        """The sum of a heartbeat this group sent (waits for it).

        Args:
            handle: what :meth:`heartbeat` returned.

        Returns:
            The sum over all ranks; ``0.0`` ("nothing known") on CUDA, where
            reading it would synchronise the device every iteration, or when the
            heartbeat's buffer has been reused since.
        """
        if isinstance(handle, _elastic._Done):
            return handle.total
        views = self._beat_views
        if views is None:  # CUDA
            return 0.0
        for index in (1 - self._next_beat, self._next_beat):
            if self._beat_works[index] is handle:
                self.wait(handle)
                return float(views[index].item(0))
        return 0.0

    def count(self, value: float) -> float:
        """1-element float32 SUM all-reduce contributing ``value`` (blocking).

        Args:
            value: this rank's contribution.

        Returns:
            The sum over all ranks.
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            return elastic.unit("count", lambda: self.count(value), beat=value)  # type: ignore[no-any-return]
        buf = self._tally
        buf.fill_(value)
        work = self._count_work = self._allreduce([buf], self._sum)
        self._join_collectives += 1
        self.wait(work)
        return float(buf.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every rank, on every rank.

        Args:
            obj: this rank's object.

        Returns:
            The objects in rank order.
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            return elastic.unit("all_gather_object", lambda: self.all_gather_object(obj))  # type: ignore[no-any-return]
        return _objects.all_gather_object(self, obj, self._buffers)

    def all_agree(self, value: int) -> bool:
        """Whether every rank passed the same ``value``: one 2-element int64
        MAX all-reduce of ``value`` and its negation.

        Args:
            value: an int in ``[0, 2**63)`` (the Join passes a settings digest).

        Returns:
            The same answer on every rank.
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            return bool(elastic.unit("all_agree", lambda: self.all_agree(value)))
        return _objects.all_agree(self, value, self._buffers)

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None:
        """Gather one picklable object from every rank on rank ``dst``.

        A MAX all-reduce of the pickles' lengths, then a gather of
        length-prefixed pickles padded to the longest: a rank other than
        ``dst`` sends its own object and receives one number (torch's
        ``gather_object`` all-gathers every rank's length to every rank).

        Args:
            obj: this rank's object.
            dst: the rank that receives them.

        Returns:
            The objects in rank order on ``dst``, ``None`` elsewhere.

        Raises:
            ValueError: ``dst`` is not a rank of the group.
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            return elastic.unit("gather_object",  # type: ignore[no-any-return]
                                lambda: self.gather_object(obj, dst))
        dst = self._checks.root(dst, "dst", "gather_object")
        return _objects.gather_object(self, obj, dst, self._buffers)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank: a broadcast of its
        pickle's length, then of the pickle.

        Args:
            obj: the object on ``src``; ignored elsewhere.
            src: the rank that sends.

        Returns:
            A copy of ``src``'s object (``src`` gets ``obj`` itself).

        Raises:
            ValueError: ``src`` is not a rank of the group.
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            return elastic.unit("broadcast_object", lambda: self.broadcast_object(obj, src))
        src = self._checks.root(src, "src", "broadcast_object")
        return _objects.broadcast_object(self, obj, src, self._buffers)

    def abort(self, message: str) -> None:
        """Abort the process group so peers blocked in a collective fail too.

        Posts ``message`` in the store for the peers (the first aborter's
        reason wins), makes this rank's pending and later waits raise
        :class:`GroupAborted`, and calls ``ProcessGroup.abort()`` (which on
        nccl also fails the peers' collectives; see the module doc for gloo).

        Args:
            message: why.
        """
        reason = json.dumps({"rank": self.rank, "reason": message})
        _board._bounded(lambda store: store.compare_set(self._store_prefix + "abort", "", reason))
        if self._abort is None:
            self._abort = (self.rank, message)
        abort = getattr(self.process_group, "abort", None)  # none in torch 2.6
        try:
            if abort is not None:
                abort()
        except (RuntimeError, NotImplementedError):
            pass  # gloo: peers learn of it from the store (module doc)

    def side_wire(self) -> Any:
        """The side channel's wire: a second process group over this group's ranks.

        Made once per process group (``dist.new_group``, which every rank of the
        group calls: a ``joinkit.SideChannel`` asks on Join entry) and kept; its
        waits end when a rank aborts this group (they read this group's abort).

        Returns:
            A ``backends._side_wire.ArrayWire`` over a ``TorchGroup`` of the new group.
        """
        group = self.process_group
        known = _side_wires.get(id(group))
        if known is not None and known[0] is group:
            return known[1]
        from .._side_wire import ArrayWire

        ranks = dist.get_process_group_ranks(group)
        whole = len(ranks) == dist.get_world_size()
        # A subgroup's ranks alone can make it (local synchronization); the whole
        # world's is made by every rank, under a name of its own.
        side_pg = dist.new_group(ranks=None if whole else ranks,
                                 backend=dist.get_backend(group),
                                 use_local_synchronization=not whole,
                                 group_desc="joinkit side channel")
        side = TorchGroup(side_pg, self.device)
        side._store_prefix = self._store_prefix  # an abort of this group ends its waits
        wire = ArrayWire(side)
        _side_wires[id(group)] = (group, wire)
        return wire

    def post_status(self, what: str) -> None:
        """Record what this rank's Join is doing, for its peers' stall diagnostics.

        Costs no store round trip: a daemon thread publishes the latest status
        at most every ``_STATUS_INTERVAL`` seconds (module doc).

        Args:
            what: e.g. ``"counting non-joined ranks (shadow round 3)"``.
        """
        self._post.status(what)
        if self not in _publishing:
            _publish_statuses(self)

    def post_beat(self) -> None:
        """Show the peers that this rank is alive (called by the watchdog thread).

        A new number from this process's sequence, published with the status
        by the status thread (no store round trip here).
        """
        self._post.beat()
        if self not in _publishing:
            _publish_statuses(self)

    def peer_board(self, ranks: Sequence[int]) -> dict[int, tuple[str, float, int | None]]:
        """The status board entries of ``ranks``, for the watchdog's policy.

        Args:
            ranks: the ranks to read.

        Returns:
            rank -> (its last posted status, seconds since (by this host's
            clock), its latest beat), for the ranks that posted one.

        Raises:
            TimeoutError: the store did not answer within ``_STORE_PATIENCE`` s.
        """
        keys = {rank: f"{self._store_prefix}status/{rank}" for rank in ranks}
        abort_key = self._store_prefix + "abort"

        def read(store: Any) -> dict[int, bytes]:
            found = {rank: store.get(key) for rank, key in keys.items() if store.check([key])}
            if self._abort is None and store.check([abort_key]):
                found[-1] = store.get(abort_key)
            return found

        found = _board._bounded(read)
        if found is None:
            raise TimeoutError(
                f"the rendezvous store did not answer within {_STORE_PATIENCE:g} s"
            )
        aborted = found.pop(-1, None)
        if aborted and self._abort is None:  # seen on the way: waits give up at once
            posted = json.loads(aborted)
            self._abort = (int(posted["rank"]), str(posted["reason"]))
        now = time.time()
        return {rank: _status.board_entry(_status.decode(value), now)
                for rank, value in found.items()}

    def gone_peers(self) -> dict[int, str]:
        """The peers whose process no longer runs, for the note on a failure.

        One store read of the processes the peers posted with their first
        status (``_GONE_PATIENCE`` s at most), then a look at each on this
        host (``/proc``). Never raises: what cannot be read is not reported.

        Returns:
            rank -> ``"pid 4242 on node0"``, for the peers on this host whose
            process is gone (killed, out of memory).
        """
        keys = {rank: f"{self._store_prefix}process/{rank}"
                for rank in range(self.world_size) if rank != self.rank}

        if not keys:
            return {}

        def read(store: Any) -> dict[int, bytes]:
            if store.check(list(keys.values())):  # the usual case: one round trip
                return dict(zip(keys, store.multi_get(list(keys.values())), strict=True))
            return {rank: store.get(key) for rank, key in keys.items() if store.check([key])}

        gone = {}
        for rank, value in (_board._bounded(read, _GONE_PATIENCE) or {}).items():
            try:
                text = _status.gone_text(json.loads(value))
            except (ValueError, AttributeError):
                continue
            if text is not None:
                gone[rank] = text
        return gone

    @property
    def aborted(self) -> tuple[int, str] | None:
        """``(rank, reason)`` of the abort this rank knows of, or ``None``.

        Known from this rank's own :meth:`abort`, a wait that found a posted
        one, or a :meth:`peer_board` read (no store access here). The Join's
        watchdog does not report a peer silent once it knows the group was
        aborted: the aborting rank may have left, and the abort is the news.
        """
        return self._abort

    def peer_status(self) -> dict[int, str]:
        """What every rank's Join last posted, and whether a rank aborted.

        Returns:
            rank -> its last posted status and how long ago (``"no status
            posted"`` for a rank whose Join has posted none).

        Raises:
            TimeoutError: the store did not answer within ``_STORE_PATIENCE`` s.
        """
        keys = [f"{self._store_prefix}status/{rank}" for rank in range(self.world_size)]
        abort_key = self._store_prefix + "abort"

        def read(store: Any) -> tuple[list[bytes | None], bytes | None]:
            # A get waits for a missing key, so look first: one check of all
            # the keys and one multi_get when every rank posted (the usual
            # case: a Join posts on entry), else a check per key.
            if store.check(keys):
                values: list[bytes | None] = list(store.multi_get(keys))
            else:
                present = [key for key in keys if store.check([key])]
                found = dict(zip(present, store.multi_get(present) if present else [],
                                 strict=True))
                values = [found.get(key) for key in keys]
            aborted = store.get(abort_key) if store.check([abort_key]) else None
            return values, aborted

        found = _board._bounded(read)
        if found is None:
            raise TimeoutError(
                f"the rendezvous store did not answer within {_STORE_PATIENCE:g} s"
            )
        values, aborted = found
        now = time.time()
        out = {}
        for rank, value in enumerate(values):
            out[rank] = _status.status_text(None if value is None else _status.decode(value), now)
        if aborted:
            first = json.loads(aborted)
            reason = str(first["reason"]).partition("\n")[0]
            out[first["rank"]] += f"; aborted the group: {reason}"
        return out

    def wait(self, work: Any) -> Any:
        """``work.wait()``, but on a CPU group give up once a rank aborted (module doc).

        The join backend's optional ``wait``: adapters wait on the framework
        work they issue through it, so a peer's abort ends their waits too.

        Raises:
            GroupAborted: a rank aborted the group.
        """
        elastic = self._elastic
        if elastic is not None:
            if isinstance(work, _elastic._Done):
                return work.wait()
            if elastic.inside:
                return elastic.wait(work)
        if self._abort is not None:
            raise GroupAborted(*self._abort)
        if self._slice is None:
            return work.wait()
        watched = False
        try:
            while True:
                try:
                    return work.wait(self._slice)
                except RuntimeError as slice_error:
                    exc = slice_error
                    aborted = self._abort
                    if aborted is None and work.is_completed():
                        # The slice may have ended as the work completed: a
                        # second wait returns at once, or raises its failure.
                        try:
                            return work.wait()
                        except RuntimeError as failed:
                            exc = failed
                        # It failed: did a rank abort (and its process exit)?
                        aborted = self._posted_abort()
                        if aborted is None:
                            raise exc from None  # a real failure, not the end of a slice
                    if aborted is not None:
                        self._abort = aborted
                        raise GroupAborted(*aborted) from exc
                    if not watched:  # a long wait: the watcher looks for aborts
                        watched = _watch_aborts(self, +1)
        finally:
            if watched:
                _watch_aborts(self, -1)

    def _aborted_error(self) -> GroupAborted:
        assert self._abort is not None
        return GroupAborted(*self._abort)

    def _posted_abort(self) -> tuple[int, str] | None:
        return _board._bounded(lambda store: _abort_posted(store, self._store_prefix))  # type: ignore[no-any-return]

    # -- collectives ---------------------------------------------------------------

    def all_reduce(self, buf: Any, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce ``buf`` over all ranks, in place; every rank gets the result.

        Args:
            buf: a torch tensor or NumPy array.
            op: one of :data:`backends.REDUCE_OPS`.
            async_op: return a handle instead of waiting.

        Returns:
            ``buf`` (or a handle whose ``wait()`` returns it).

        Raises:
            TypeError: unsupported buffer type, or ``op`` undefined for its dtype.
            ValueError: unknown ``op``.
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            done = elastic.unit("all_reduce", lambda: self.all_reduce(buf, op), buf=buf)
            return _elastic._Done(done) if async_op else done
        dtype = self._checks.all_reduce(buf, op)
        staged = self._stage(buf)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _reduce_op(dtype, op)
        wire = _wire(staged.tensor)
        work = _hold(self.process_group.allreduce([wire], opts), wire)
        return self._finish(work, async_op, staged, lambda: buf)

    def broadcast(self, buf: Any, src: int, async_op: bool = False) -> Any:
        """Copy ``buf`` of rank ``src`` into ``buf`` of every rank.

        Args:
            buf: a torch tensor or NumPy array.
            src: the rank whose buffer is sent.
            async_op: return a handle instead of waiting.

        Returns:
            ``buf`` (or a handle whose ``wait()`` returns it).

        Raises:
            TypeError: unsupported buffer type.
            ValueError: ``src`` is not a rank of the group.
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            done = elastic.unit("broadcast", lambda: self.broadcast(buf, src), buf=buf)
            return _elastic._Done(done) if async_op else done
        opts = dist.BroadcastOptions()
        opts.rootRank = self._checks.broadcast(buf, src)
        staged = self._stage(buf)
        wire = _wire(staged.tensor)
        work = _hold(self.process_group.broadcast([wire], opts), wire)
        return self._finish(work, async_op, staged, lambda: buf)

    def all_gather(self, buf: Any, async_op: bool = False, *, settles: bool = True) -> Any:
        """Gather every rank's ``buf`` on every rank.

        Args:
            buf: a torch tensor or NumPy array; same shape and dtype on every rank.
            async_op: return a handle instead of waiting.
            settles: in ``Join(..., on_rank_loss="finish")``, ``False`` for a
                gather that comes between an iteration's heartbeat and the
                collective of its contribution (DDP's buffer broadcast before
                its forward): a rank lost after it and before that collective
                counts as not having consumed the iteration's input. Ignored
                outside finish mode.

        Returns:
            A list of ``world_size`` new buffers of ``buf``'s kind (and device),
            in rank order, or a handle whose ``wait()`` returns it.

        Raises:
            TypeError: unsupported buffer type.
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            done = elastic.unit("all_gather", lambda: self.all_gather(buf), buf=None,
                                settles=settles)
            return _elastic._Done(done) if async_op else done
        self._checks.all_gather(buf)
        staged = self._stage(buf)
        parts = [torch.empty_like(staged.tensor) for _ in range(self.world_size)]
        outputs, wire = [_wire(p) for p in parts], _wire(staged.tensor)
        work = _hold(self.process_group.allgather([outputs], [wire], AllgatherOptions()),
                     wire, *outputs)
        return self._finish(work, async_op, None, lambda: [_like(buf, p) for p in parts])

    def all_gather_into(self, buf: np.ndarray, out: np.ndarray) -> Any:
        """Gather every rank's ``buf`` into row ``rank`` of ``out``, on every rank.

        The optional per-call path of ``Gather``, which calls it with the same
        two buffers until it needs larger ones: they are not checked, and on a
        CPU group no buffer is made. A rank may call :meth:`all_gather` with a
        buffer of ``buf``'s size instead: the collective is the same.

        Args:
            buf: a 1-D contiguous, writeable uint8 NumPy array of the same size
                on every rank.
            out: a contiguous, writeable uint8 NumPy array of shape
                ``(world_size, buf.size)``.

        Returns:
            ``out``; or, where the group does not gather into it (a CUDA group,
            or a recovery unit of a Join with ``on_rank_loss="finish"``, after
            which the group may have fewer ranks), what :meth:`all_gather`
            returns.
        """
        elastic = self._elastic
        if self._on_cuda or (elastic is not None and not elastic.inside):
            return self.all_gather(buf)
        into = self._into
        if into is None or into[0] is not buf or into[1] is not out:
            rows = [torch.from_numpy(row) for row in out]
            self._into = into = (buf, out, torch.from_numpy(buf), rows)
        wire, rows = into[2], into[3]
        self.wait(_hold(self.process_group.allgather([rows], [wire], AllgatherOptions()),
                        wire, *rows))
        return out

    def reduce(self, buf: Any, dst: int, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce ``buf`` over all ranks into ``buf`` of rank ``dst``.

        Other ranks' buffers are left as they were.

        Args:
            buf: a torch tensor or NumPy array.
            dst: the rank that receives the result.
            op: one of :data:`backends.REDUCE_OPS`.
            async_op: return a handle instead of waiting.

        Returns:
            ``buf`` (or a handle whose ``wait()`` returns it).

        Raises:
            TypeError: unsupported buffer type, or ``op`` undefined for its dtype.
            ValueError: unknown ``op``, or ``dst`` is not a rank of the group.
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            done = elastic.unit("reduce", lambda: self.reduce(buf, dst, op), buf=buf)
            return _elastic._Done(done) if async_op else done
        opts = dist.ReduceOptions()
        dst, dtype = self._checks.reduce(buf, dst, op)
        opts.rootRank = dst
        opts.reduceOp = _reduce_op(dtype, op)
        receives = self.rank == dst
        staged = self._stage(buf)
        # A backend may use a non-root rank's input as scratch space; send a copy.
        tensor = staged.tensor if receives or not staged.in_place else staged.tensor.clone()
        wire = _wire(tensor)
        work = _hold(self.process_group.reduce([wire], opts), wire)
        return self._finish(work, async_op, staged if receives else None, lambda: buf)

    def gather(self, buf: Any, dst: int, async_op: bool = False) -> Any:
        """Gather every rank's ``buf`` on rank ``dst``.

        Args:
            buf: a torch tensor or NumPy array; same shape and dtype on every rank.
            dst: the rank that receives the list.
            async_op: return a handle instead of waiting.

        Returns:
            On ``dst`` a list of ``world_size`` new buffers in rank order, on the
            other ranks ``None`` (or a handle whose ``wait()`` returns it).

        Raises:
            TypeError: unsupported buffer type.
            ValueError: ``dst`` is not a rank of the group.
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            done = elastic.unit("gather", lambda: self.gather(buf, dst), buf=None)
            return _elastic._Done(done) if async_op else done
        opts = dist.GatherOptions()
        opts.rootRank = dst = self._checks.gather(buf, dst)
        staged = self._stage(buf)
        wire = _wire(staged.tensor)
        if self.rank != dst:
            work = _hold(self.process_group.gather([], [wire], opts), wire)
            return self._finish(work, async_op, None, _nothing)
        parts = [torch.empty_like(staged.tensor) for _ in range(self.world_size)]
        outputs = [_wire(p) for p in parts]
        work = _hold(self.process_group.gather([outputs], [wire], opts), wire, *outputs)
        return self._finish(work, async_op, None, lambda: [_like(buf, p) for p in parts])

    def scatter(
        self, buf: Any, src: int, chunks: Any = None, async_op: bool = False
    ) -> Any:
        """Fill every rank's ``buf`` with ``chunks[rank]`` of rank ``src``.

        Args:
            buf: a torch tensor or NumPy array that receives.
            src: the rank that sends.
            chunks: on ``src`` only: ``world_size`` buffers shaped like ``buf``,
                or one buffer of shape ``(world_size, *buf.shape)``.
            async_op: return a handle instead of waiting.

        Returns:
            ``buf`` (or a handle whose ``wait()`` returns it).

        Raises:
            TypeError: unsupported buffer type, or chunks of another dtype.
            ValueError: ``src`` is not a rank, or ``chunks`` missing on ``src``
                or of the wrong number or shape.
        """
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            done = elastic.unit("scatter", lambda: self.scatter(buf, src, chunks), buf=buf)
            return _elastic._Done(done) if async_op else done
        opts = dist.ScatterOptions()
        opts.rootRank, parts = self._checks.scatter(buf, src, chunks)
        staged = self._stage(buf)
        sources = [] if parts is None else [
            _wire(self._stage(part).tensor)
            for part in parts
        ]
        wire = _wire(staged.tensor)
        work = _hold(self.process_group.scatter([wire], [sources] if sources else [], opts),
                     wire, *sources)
        return self._finish(work, async_op, staged, lambda: buf)

    def barrier(self) -> None:
        """Return once every rank of the group has called ``barrier``."""
        elastic = self._elastic
        if elastic is not None and not elastic.inside:
            return elastic.unit("barrier", self.barrier)  # type: ignore[no-any-return]
        # An all-reduce is a barrier on every backend (nccl's barrier() guesses a
        # device); reading the result blocks the host on CUDA too.
        self._barrier_buf.zero_()
        work = self._barrier_work = self._allreduce([self._barrier_buf], self._sum)
        self.wait(work)
        self._barrier_buf.item()

    # -- helpers -------------------------------------------------------------------

    def _new_buffers(self) -> None:
        """Fresh heartbeat, count and barrier buffers (at start, and on a rebuild)."""
        self._beats = (self._scalar(), self._scalar())
        # On the CPU, NumPy views write and read the heartbeats' one element
        # without torch's dispatch (fill_ and item() cost ~1.5 us per beat).
        self._beat_views = None if self._on_cuda else tuple(b.numpy() for b in self._beats)
        self._tally = self._scalar()
        self._barrier_buf = self._scalar()

    def _scalar(self) -> torch.Tensor:
        # float32 on the wire, like torch's Join (and every joinkit backend).
        return torch.zeros(1, dtype=torch.float32, device=self.device)

    def _stage(self, buf: Any) -> _Staged:
        """``buf`` (checked) as a contiguous tensor on the group's device (module doc).

        In finish mode always a copy: a collective that a recovery abandoned may
        still be pending in gloo, and must not write into the caller's buffer
        while the unit runs again over the rebuilt group.
        """
        private = self._elastic is not None
        if isinstance(buf, torch.Tensor):
            tensor = buf.detach()
            if tensor.dtype == torch.bool:
                return _Staged(buf, tensor.to(self.device, torch.uint8), False)
            if tensor.is_conj() or tensor.is_neg():  # lazy views: no wire format
                resolved = tensor.resolve_conj().resolve_neg()
                return _Staged(buf, resolved.to(self.device).contiguous(), False)
            if tensor.device == self.device and tensor.is_contiguous():
                return _Staged(buf, tensor.clone() if private else tensor, not private)
            return _Staged(buf, tensor.to(self.device).contiguous(), False)
        if isinstance(buf, np.ndarray):
            if buf.dtype == np.bool_:
                host = torch.from_numpy(buf.astype(np.uint8))
                return _Staged(buf, host.to(self.device), False)
            shareable = (not private and self.device.type == "cpu"
                         and buf.flags.c_contiguous and buf.flags.writeable)
            host = torch.from_numpy(buf if shareable else np.ascontiguousarray(buf).copy())
            return _Staged(buf, host if shareable else host.to(self.device), shareable)
        raise AssertionError(f"unchecked buffer {type(buf)}")  # pragma: no cover

    def _finish(
        self, work: Any, async_op: bool, staged: _Staged | None, result: Callable[[], Any]
    ) -> Any:
        def finish() -> Any:
            if staged is not None:
                staged.finish()
            return result()

        if async_op:
            return _Pending(work, finish, self.wait)
        self.wait(work)
        return finish()


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    # Complex numbers travel as pairs of reals (as in dist.all_reduce); a view,
    # so results still land in the tensor.
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _like(buf: Any, tensor: torch.Tensor) -> Any:
    """A new buffer of ``buf``'s kind, dtype and device holding ``tensor``."""
    if isinstance(buf, torch.Tensor):
        return tensor.to(buf.device, buf.dtype)
    return tensor.cpu().numpy().astype(buf.dtype, copy=False)


def _usable_device(device: Any) -> torch.device:
    """``device`` as a torch.device this process can use, or a clear error."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise TypeError(
            f"join_device {device!r} is not a torch device: {exc}"
        ) from exc
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise TypeError(
            f"join_device {device!r} is a CUDA device, but torch.cuda.is_available() "
            "is False here: return torch.device('cpu') from join_device for a gloo "
            "group"
        )
    if parsed.type not in ("cpu", "cuda"):
        raise TypeError(
            f"join_device {device!r} is not supported: joinkit's torch backend runs "
            "its collectives on the CPU (gloo) or on CUDA (nccl)"
        )
    return parsed


def _backend_name(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError, TypeError):  # 2.6: TypeError for a group it does not map
        return "?"


def _default_device(group: Any) -> torch.device:
    if "nccl" not in _backend_name(group) or "gloo" in _backend_name(group):
        return torch.device("cpu")
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None:
        return torch.device("cuda", int(local_rank))
    return torch.device("cuda", torch.cuda.current_device())


def _live_group(process_group: Any) -> Any:
    """``process_group`` (``None``: the default group), checked to be usable here."""
    if not dist.is_available() or not dist.is_initialized():
        raise LocalProtocolError(
            "torch.distributed is not initialized: call "
            "torch.distributed.init_process_group(...) before building the joinable "
            "or entering Join (a group taken as dist.group.WORLD before that is None)"
        )
    group = dist.distributed_c10d._get_default_group() if process_group is None else process_group
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise LocalProtocolError(
            "this rank is not a member of the joinable's process group "
            "(dist.new_group returned GroupMember.NON_GROUP_MEMBER here): only the "
            "group's ranks may enter a Join over it"
        )
    try:
        rank = dist.get_rank(group)
    except (ValueError, RuntimeError) as exc:
        raise LocalProtocolError(
            f"the joinable's process group {group!r} is not a live group of this "
            f"process (destroyed, or from an earlier init_process_group): {exc}"
        ) from exc
    if rank < 0:
        raise LocalProtocolError(
            "this rank is not a member of the joinable's process group"
        )
    return group


#: Raw process groups (by id) whose joinables in the Join being built can go on
#: over a rebuilt group: a DistributedDataParallel, which ``adapters.torch``
#: registers in its ``join_hook`` (ZeroRedundancyOptimizer's unregisters it);
#: ``start_rank_loss_recovery`` then lets the raw group's TorchGroup recover.
#: The value: the ``store_outlives_ranks`` the Join was given (``None``: guess).
elastic_raw_groups: dict[int, bool | None] = {}

#: The side channel wire of each process group (by id, with the group, so a
#: reused id is not mistaken for it): ``TorchGroup.side_wire``.
_side_wires: dict[int, tuple[Any, Any]] = {}


def _backend_for_process_group(group: Any, device: Any) -> TorchGroup:
    made = TorchGroup(group, device)
    made._for_raw_group = True  # DDP's, ZeRO's, FSDP2's: cannot be rebuilt in place
    return made


def _backend_for_group(group: TorchGroup, device: Any) -> TorchGroup:
    # The Join's collectives run on its first joinable's device (torch's rule);
    # a group on another device gets a sibling there.
    if device is None or torch.device(device) == group.device:
        return group
    return TorchGroup(group.process_group, device)


register_backend(lambda group: group is None, _backend_for_process_group)
register_backend(dist.ProcessGroup, _backend_for_process_group)
register_backend(TorchGroup, _backend_for_group)
