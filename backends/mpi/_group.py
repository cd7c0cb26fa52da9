"""The MPI backend: joinkit's collectives over an mpi4py communicator.

Theory of operation
-------------------
:class:`MPIGroup` wraps one communicator (``COMM_WORLD`` by default) and is
both a :class:`backends.CollectiveGroup` and its own join backend. Importing
this module registers two kinds of ``join_process_group`` with the registry: an
``MPIGroup`` resolves to itself, and a raw ``mpi4py.MPI.Comm`` resolves to a
new ``MPIGroup`` over it. ``backends`` imports this module by itself once
``mpi4py.MPI`` is loaded, so a joinable may simply return its communicator.

*Every collective is nonblocking on the wire.* MPI does not match a blocking
collective with a nonblocking one (MPI-3.1 section 5.12: "nonblocking
collective operations do not match with blocking collective operations"); with
Open MPI 5 and MPICH 5, one rank in ``Allreduce`` and another in ``Iallreduce``
hang. The
join protocol pairs an active rank's heartbeat (which must not block) with a
joined rank's count (which must), so both are an ``Iallreduce``; the count
waits at once. For the same reason the group's blocking calls are the
nonblocking call plus ``Wait()``: a hook that shadows an ``async_op=True``
all-reduce with a blocking one matches, as it does in torch.distributed. (The
nonblocking variants measured no slower than the blocking ones for large
buffers.) Code that calls the communicator directly must keep its own calls
consistent across ranks, as MPI always requires.

*The heartbeat allocates nothing of its own.* Its 1-element float32 send and
receive buffers (float32 like torch's, so the wire format is the same on every
backend) live on the group, and so does the handle it returns. MPI forbids
touching the buffers of an ``Iallreduce`` before it completes, so each
heartbeat first waits for the previous one, which finished long ago: every
rank has since passed the collectives of a whole iteration. The count first
completes a pending heartbeat too, so no request outlives the Join. The handle
is the group's one heartbeat handle: ``wait()`` completes the latest heartbeat
and returns its sum.

*Buffers are used in place where MPI can.* What a collective accepts is
decided by ``backends._checks``, the same for every backend, on every rank
before any communication, so a refusal leaves the ranks in step. A contiguous
NumPy array is handed to MPI as it is; a torch CPU tensor through its
``tensor.numpy()`` view (torch is never imported here: tensors are recognised
by the module of their type). MPI needs contiguous memory, so a non-contiguous
buffer (or a tensor's lazy conjugate view) is copied into a staging array and
the result copied back when the collective completes. The MPI datatype and
reduce op are looked up in tables built once.

*The Join's extras.* The object collectives (``all_gather_object``,
``all_agree``, ``gather_object``, ``broadcast_object``) are
``backends._objects``' over the group's own collectives (so an elastic group
sequences them too); ``heartbeat_total`` reads the latest heartbeat's sum;
``collectives_issued`` counts the group's own collectives (a raw communicator's
backend has none, since the joinable's calls bypass it: there a rank that fails
after a heartbeat cannot know whether its peers wait in that iteration's
collectives, and fails fast); ``abort`` is ``MPI_Abort``, which ends the whole
job: MPI cannot cancel a collective a peer waits in. Before it, the reason (and
the traceback of the exception being handled, if any, as ``python -m mpi4py``
prints it) goes to standard error, so the job's output names the failure.

Only MPI-3 calls are used (nonblocking collectives, ``MPI_IN_PLACE``,
``MPI_C_BOOL``), so Open MPI and MPICH both work.

*Where the parts live* (the package ``joinkit.backends.mpi``): this module
holds :class:`MPIGroup` (the collectives and the join backend) and the
registry's factories; ``_library`` the guarded import of mpi4py and the
datatype and op tables; ``_board`` the status board (the listener thread and
its queries); ``_elastic`` the recovery from a lost rank under ULFM (a mixin of
the group's sequenced collectives); ``_launcher`` what the launcher and the
doctor need of MPI (on ``COMM_WORLD``).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from joinkit import LostRank
from joinkit.lowlevel import register_backend

from .. import _objects
from .._checks import Checks, host_array, is_tensor
from . import _board
from ._elastic import Done, ElasticGroup, _Rounds
from ._library import DATATYPES, MPI, Request, reduce_op, staged

__all__ = ["MPIGroup"]


class _HeartbeatHandle:
    """The group's one heartbeat handle (allocated once, see the module doc)."""

    __slots__ = ("_group",)

    def __init__(self, group: MPIGroup) -> None:
        self._group = group

    def wait(self) -> float:
        """Complete the latest heartbeat; return its sum over all ranks."""
        return self._group.heartbeat_total(self)



class MPIGroup(ElasticGroup):
    """joinkit's collectives over an mpi4py communicator.

    Every method is collective: all ranks of the communicator call it in the
    same order with matching arguments (same shapes and dtypes, same root).
    Results land in the callers' buffers, which are used in place.

    Args:
        comm: an intra-communicator; ``None`` means ``MPI.COMM_WORLD``. It is
            used as it is, not duplicated, so the Join's collectives and your
            own interleave on it like torch's do on a process group.

    Raises:
        TypeError: ``comm`` is not an intra-communicator.
    """

    device = "cpu"

    def __init__(self, comm: MPI.Comm | None = None) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
            raise TypeError(
                "MPIGroup needs an MPI intra-communicator, got MPI.COMM_NULL: the "
                "communicator was freed (comm.Free()), or this rank is not a member "
                "of it (comm.Split with MPI.UNDEFINED)"
            )
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(
                f"MPIGroup needs an MPI intra-communicator, got {comm!r}"
            )
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.world_size: int = comm.Get_size()
        # The per-iteration path: bound methods and buffers made once.
        self._iallreduce = comm.Iallreduce
        self._heartbeat_send = np.zeros(1, dtype=np.float32)
        self._heartbeat_recv = np.zeros(1, dtype=np.float32)
        self._heartbeat_msgs = (
            [self._heartbeat_send, MPI.FLOAT],
            [self._heartbeat_recv, MPI.FLOAT],
        )
        self._count_send = np.zeros(1, dtype=np.float32)
        self._count_recv = np.zeros(1, dtype=np.float32)
        self._count_msgs = ([self._count_send, MPI.FLOAT], [self._count_recv, MPI.FLOAT])
        self._heartbeat_request: MPI.Request = MPI.REQUEST_NULL
        # Whether _heartbeat_request may still be in flight: a Python flag is
        # cheaper than MPI_Wait on a completed request, and the Join reads the
        # previous heartbeat (heartbeat_total) right before sending the next.
        self._heartbeat_pending = False
        self._heartbeat_value = 0.0
        self._heartbeat_handle = _HeartbeatHandle(self)
        #: Collectives issued through this group's collective methods (not the
        #: join collectives). The Join shell compares it with its value at the
        #: last heartbeat to tell whether a failing rank left an iteration open.
        self.collectives_issued = 0
        self._board_key: int = comm.py2f()
        self._hash = hash(("MPIGroup", self._board_key))
        self._checks = Checks(self.rank, self.world_size)
        #: This rank in the communicator the group was built over; ``rank``
        #: and ``world_size`` change when a rank loss shrinks the group.
        self.initial_rank: int = self.rank
        self.initial_world_size: int = self.world_size
        # Rank loss (module doc): off until start_rank_loss_recovery.
        self._elastic = False
        self._members: list[int] = list(range(self.world_size))  # current -> original
        self._lost: list[LostRank] = []
        self._completed = 0  # sequenced collectives completed
        self._last: Any = None  # the last one's result (a copy)
        self._heartbeats = 0
        self._rounds = _Rounds()
        self._losses_before = 0  # the losses before the latest Join's entry
        self._progress: Callable[[], None] | None = None
        # Tests only: called with the attempt number inside each recovery.
        self._recovery_hook: Callable[[int], None] | None = None

    def __repr__(self) -> str:
        return f"MPIGroup(rank={self.rank}, world_size={self.world_size})"

    # An MPIGroup stands for its communicator, so a joinable holding the group
    # and one holding the raw communicator may share a Join (which compares
    # their process groups with ``!=``).
    def __eq__(self, other: object) -> bool:
        if isinstance(other, MPIGroup):
            return bool(other.comm == self.comm)
        if isinstance(other, MPI.Comm):
            return bool(other == self.comm)
        return NotImplemented

    def __hash__(self) -> int:
        # The communicator's at construction: a rank loss replaces self.comm.
        return self._hash

    # -- join backend ------------------------------------------------------------

    def heartbeat(self, value: float) -> _HeartbeatHandle:
        """Start the 1-element float32 SUM all-reduce contributing ``value``.

        Args:
            value: this rank's contribution.

        Returns:
            The group's heartbeat handle; ``wait()`` returns the sum.
        """
        if self._elastic:
            self._heartbeats += 1
            self._heartbeat_recv[0] = self._sequenced_count(value, "heartbeat")
            return self._heartbeat_handle
        if self._heartbeat_pending:
            # The previous heartbeat's buffers are about to be reused.
            self._heartbeat_request.Wait()
        if value != self._heartbeat_value:  # nearly always ACTIVE: skip the store
            self._heartbeat_send[0] = self._heartbeat_value = value
        send, recv = self._heartbeat_msgs
        self._heartbeat_request = self._iallreduce(send, recv, MPI.SUM)
        self._heartbeat_pending = True
        return self._heartbeat_handle

    def count(self, value: float) -> float:
        """1-element float32 SUM all-reduce contributing ``value`` (blocking).

        Args:
            value: this rank's contribution.

        Returns:
            The sum over all ranks.
        """
        if self._elastic:
            return self._sequenced_count(value, "count")
        if self._heartbeat_pending:
            self._heartbeat_request.Wait()
            self._heartbeat_pending = False
        self._count_send[0] = value
        send, recv = self._count_msgs
        self._iallreduce(send, recv, MPI.SUM).Wait()
        return self._count_recv.item()  # a Python float

    def heartbeat_total(self, handle: Any) -> float:
        """The sum of the latest heartbeat (completing it first).

        Args:
            handle: the latest heartbeat's handle.

        Returns:
            Its sum over all ranks.
        """
        if self._heartbeat_pending:
            self._heartbeat_request.Wait()
            self._heartbeat_pending = False
        return self._heartbeat_recv.item()  # a Python float

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every rank, on every rank.

        Args:
            obj: this rank's object.

        Returns:
            Every rank's object, in rank order.
        """
        return _objects.all_gather_object(self, obj)

    def all_agree(self, value: int) -> bool:
        """Whether every rank passed the same ``value``: one 2-element int64
        MAX all-reduce of ``value`` and its negation (``backends._objects``).

        Args:
            value: an int in ``[0, 2**63)`` (the Join passes a settings digest).

        Returns:
            The same answer on every rank.
        """
        return _objects.all_agree(self, value)

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None:
        """Gather one picklable object from every rank on rank ``dst``
        (``backends._objects``: the lengths' maximum, then one gather).

        Args:
            obj: this rank's object.
            dst: the rank that receives them.

        Returns:
            The objects in rank order on ``dst``, ``None`` elsewhere.

        Raises:
            ValueError: ``dst`` is not a rank of the communicator.
        """
        root = self._checks.root(dst, "dst", "gather_object")
        return _objects.gather_object(self, obj, root)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank (``backends._objects``:
        the pickle's length, then the pickle).

        Args:
            obj: the object on ``src``; ignored elsewhere.
            src: the rank that sends.

        Returns:
            A copy of ``src``'s object (``src`` gets ``obj`` itself).

        Raises:
            ValueError: ``src`` is not a rank of the communicator.
        """
        root = self._checks.root(src, "src", "broadcast_object")
        return _objects.broadcast_object(self, obj, root)

    def side_wire(self) -> Any:
        """The side channel's wire: an ``MPIGroup`` over a duplicate of the communicator.

        The ``Dup`` is collective: a ``joinkit.SideChannel`` asks on Join entry,
        when every rank is there; it is made once per communicator and kept.
        The channel's service thread calls MPI beside the main thread, which
        needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default).

        Returns:
            A ``backends._side_wire.ArrayWire``.
        """
        return _side_wire_of(self.comm)

    def abort(self, message: str) -> None:
        """Abort every process of the communicator (``MPI_Abort``).

        The Join calls this when a hook failed midway through a round, or a
        rank failed where it cannot tell whether its peers wait in collectives
        of its last iteration (a raw communicator), or its watchdog found a
        stall: its peers wait in collectives that may never complete, and MPI
        cannot cancel a collective, so ending the job is the only alternative
        to a hang.

        Args:
            message: why; written to standard error first, after the traceback
                of the exception being handled, if any (the loop body's, when
                the Join fails fast: the process never gets to print it).
        """
        error = sys.exc_info()[1]
        if error is not None:
            traceback.print_exception(error, file=sys.stderr)
        sys.stderr.write(f"joinkit: rank {self.rank} aborts the MPI job: {message}\n")
        sys.stderr.flush()
        self.comm.Abort(1)

    def post_status(self, what: str) -> None:
        """Record what this rank's Join is doing, for its peers' stall diagnostics.

        No MPI call: the text waits in a dict for the listener thread to send
        it to a peer that asks (module doc). The first post on a communicator
        starts answering on it.

        Args:
            what: e.g. ``"counting non-joined ranks (shadow round 3)"``.
        """
        key = self._board_key
        if key not in _board._board_comms:
            _board._open_board(self.comm, key)
        _board._post(key).status(what)

    def peer_status(self, patience: float | None = None) -> dict[int, str]:
        """What every rank's Join last posted, asked of the ranks themselves.

        Sends each peer a status query and waits up to ``patience`` seconds
        for the answers (module doc); it returns as soon as every peer
        answered. Meant for the watchdog thread while this rank's own thread
        is blocked in a join collective.

        Args:
            patience: seconds to wait for the answers; default
                ``_STATUS_PATIENCE`` (``_board``).

        Returns:
            rank -> its last posted status and how long ago, or why it did not
            answer.

        Raises:
            RuntimeError: MPI runs below ``MPI_THREAD_MULTIPLE``, so no rank
                has a listener to answer.
        """
        patience = _board._STATUS_PATIENCE if patience is None else patience
        answers = self._ask([r for r in range(self.world_size) if r != self.rank], patience)
        out = {self.rank: _board._status_text(self._board_key)}
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            answer = answers.get(peer)
            out[peer] = answer[0] if answer is not None else (
                f"no answer within {patience:g} s: dead, stuck without "
                "releasing the GIL, or never in a Join on this communicator"
            )
        return dict(sorted(out.items()))

    def post_beat(self) -> None:
        """Show the peers that this rank is alive (called by the watchdog thread).

        No MPI call: the listener hands the number to a peer that asks.
        """
        key = self._board_key
        if key not in _board._board_comms:
            _board._open_board(self.comm, key)
        _board._post(key).beat()

    def peer_board(self, ranks: Sequence[int], patience: float | None = None
                   ) -> dict[int, tuple[str, float, int | None]]:
        """The status board entries of ``ranks``, asked of the ranks themselves.

        Called by the watchdog thread; a rank that does not answer within
        ``patience`` seconds (dead, frozen, holding the GIL) is left out, so
        its beat does not change.

        Args:
            ranks: the ranks to ask.
            patience: seconds to wait for the answers; default ``_STATUS_PATIENCE`` (``_board``).

        Returns:
            rank -> (its last posted status, seconds since, its latest beat),
            for the ranks that answered with one.

        Raises:
            RuntimeError: MPI runs below ``MPI_THREAD_MULTIPLE``, or the
                board is closed (MPI is being finalized).
        """
        if _board._listener_stop.is_set() or MPI.Is_finalized():
            raise RuntimeError("the status board is closed (MPI is being finalized)")
        patience = _board._STATUS_PATIENCE if patience is None else patience
        answers = self._ask([r for r in ranks if r != self.rank], patience)
        return {rank: answer[1] for rank, answer in answers.items() if answer[1] is not None}

    def _ask(self, peers: Sequence[int], patience: float
             ) -> dict[int, tuple[str, tuple[str, float, int | None] | None]]:
        """Send ``peers`` a status query; their (text, entry) answers within ``patience``."""
        problem = _board._thread_level_problem()
        if problem is not None:
            raise RuntimeError(problem)
        comm, rank = self.comm, self.rank
        query_tag, answer_tag = _board._board_tags()
        query = (rank, next(_board._query_ids))
        waiting = set(peers)
        sends = [comm.isend(query, peer, query_tag) for peer in sorted(waiting)]
        status = MPI.Status()
        out = {}
        deadline = time.monotonic() + patience
        while waiting and time.monotonic() < deadline:
            message = comm.improbe(MPI.ANY_SOURCE, answer_tag, status)
            if message is None:
                time.sleep(0.005)
                continue
            answered, text, entry = message.recv()
            peer = status.Get_source()
            if answered == query and peer in waiting:  # not a late answer to an old query
                out[peer] = (text, entry)
                waiting.discard(peer)
        _board._unsent.extend(send for send in sends if not send.Test())  # a dead peer's
        return out

    # -- collectives ---------------------------------------------------------------

    def _finish(self, request: MPI.Request, result: Any, async_op: bool,
                buffers: Any = None, back: Callable[[], None] | None = None) -> Any:
        if async_op:
            return Request(request, result, buffers, back)
        request.Wait()
        if back is not None:
            back()
        return result

    def all_reduce(self, buf: Any, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce ``buf`` over all ranks, in place; every rank gets the result.

        Args:
            buf: a contiguous NumPy array or torch CPU tensor.
            op: one of :data:`backends.REDUCE_OPS`.
            async_op: return a handle instead of waiting.

        Returns:
            ``buf`` (or a handle whose ``wait()`` returns it).

        Raises:
            TypeError: unsupported buffer type or dtype, or ``op`` undefined for it.
            ValueError: unknown ``op``, or ``buf`` not contiguous/writable/on CPU.
        """
        dtype = self._checks.all_reduce(buf, op)
        arr, back = staged(buf)
        self.collectives_issued += 1
        if self._elastic:
            return self._e_all_reduce(buf, arr, back, DATATYPES[dtype],
                                      reduce_op(dtype, op), async_op)
        request = self._iallreduce(MPI.IN_PLACE, [arr, DATATYPES[dtype]], reduce_op(dtype, op))
        return self._finish(request, buf, async_op, arr, back)

    def broadcast(self, buf: Any, src: int, async_op: bool = False) -> Any:
        """Copy ``buf`` of rank ``src`` into ``buf`` of every rank.

        Args:
            buf: a contiguous NumPy array or torch CPU tensor.
            src: the rank whose buffer is sent.
            async_op: return a handle instead of waiting.

        Returns:
            ``buf`` (or a handle whose ``wait()`` returns it).

        Raises:
            TypeError: unsupported buffer type or dtype.
            ValueError: ``src`` is not a rank, or ``buf`` is unusable.
        """
        src = self._checks.broadcast(buf, src)
        arr, back = staged(buf)
        self.collectives_issued += 1
        if self._elastic:
            self._e_broadcast(arr, self._members[src], "broadcast")
            if back is not None:
                back()
            return Done(buf) if async_op else buf
        request = self.comm.Ibcast([arr, DATATYPES[arr.dtype]], src)
        return self._finish(request, buf, async_op, arr, back)

    def all_gather(self, buf: Any, async_op: bool = False) -> Any:
        """Gather every rank's ``buf`` on every rank.

        Args:
            buf: a contiguous NumPy array or torch CPU tensor; same shape and
                dtype on every rank.
            async_op: return a handle instead of waiting.

        Returns:
            A list of ``world_size`` new buffers of ``buf``'s kind, in rank
            order (views of one fresh buffer), or a handle whose ``wait()``
            returns it.

        Raises:
            TypeError: unsupported buffer type or dtype.
            ValueError: ``buf`` is unusable.
        """
        self._checks.all_gather(buf)
        arr, _ = staged(buf)
        self.collectives_issued += 1
        if self._elastic:
            parts = self._e_all_gather(buf, arr)
            return Done(parts) if async_op else parts
        out, parts = self._stacked(buf)
        datatype = DATATYPES[arr.dtype]
        request = self.comm.Iallgather([arr, datatype], [out, datatype])
        return self._finish(request, parts, async_op, (arr, out))

    def all_gather_into(self, buf: np.ndarray, out: np.ndarray) -> Any:
        """Gather every rank's ``buf`` into row ``rank`` of ``out``, on every rank.

        The optional per-call path of ``Gather``, which calls it with the same
        two buffers until it needs larger ones: they are not checked, and no
        buffer is made. A rank may call :meth:`all_gather` with a buffer of
        ``buf``'s size instead: the collective is the same.

        Args:
            buf: a 1-D contiguous uint8 NumPy array of the same size on every rank.
            out: a contiguous, writeable uint8 NumPy array of shape
                ``(world_size, buf.size)``.

        Returns:
            ``out``; or, with ``on_rank_loss="finish"`` (where the group may
            lose ranks), what :meth:`all_gather` returns.
        """
        if self._elastic:
            return self.all_gather(buf)
        self.collectives_issued += 1
        self.comm.Iallgather([buf, MPI.BYTE], [out, MPI.BYTE]).Wait()
        return out

    def reduce(self, buf: Any, dst: int, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce ``buf`` over all ranks into ``buf`` of rank ``dst``.

        Other ranks' buffers are left as they were.

        Args:
            buf: a contiguous NumPy array or torch CPU tensor.
            dst: the rank that receives the result.
            op: one of :data:`backends.REDUCE_OPS`.
            async_op: return a handle instead of waiting.

        Returns:
            ``buf`` (or a handle whose ``wait()`` returns it).

        Raises:
            TypeError: unsupported buffer type or dtype, or ``op`` undefined for it.
            ValueError: unknown ``op``, ``dst`` not a rank, or ``buf`` unusable.
        """
        dst, dtype = self._checks.reduce(buf, dst, op)
        arr, back = staged(buf)
        mpi_op = reduce_op(dtype, op)
        msg = [arr, DATATYPES[dtype]]
        self.collectives_issued += 1
        if self._elastic:
            # An all-reduce into a scratch copy; only dst keeps the result.
            owner = self._members[dst]
            scratch = arr.copy()
            self._e_all_reduce(scratch, scratch, None, DATATYPES[dtype], mpi_op, False)
            if self.initial_rank == owner:
                arr[...] = scratch
                if back is not None:
                    back()
            return Done(buf) if async_op else buf
        if self.rank == dst:
            request = self.comm.Ireduce(MPI.IN_PLACE, msg, mpi_op, dst)
            return self._finish(request, buf, async_op, arr, back)
        request = self.comm.Ireduce(msg, None, mpi_op, dst)
        return self._finish(request, buf, async_op, arr)

    def gather(self, buf: Any, dst: int, async_op: bool = False) -> Any:
        """Gather every rank's ``buf`` on rank ``dst``.

        Args:
            buf: a contiguous NumPy array or torch CPU tensor; same shape and
                dtype on every rank.
            dst: the rank that receives the list.
            async_op: return a handle instead of waiting.

        Returns:
            On ``dst`` a list of ``world_size`` new buffers in rank order, on
            the other ranks ``None`` (or a handle whose ``wait()`` returns it).

        Raises:
            TypeError: unsupported buffer type or dtype.
            ValueError: ``dst`` is not a rank, or ``buf`` is unusable.
        """
        dst = self._checks.gather(buf, dst)
        arr, _ = staged(buf)
        datatype = DATATYPES[arr.dtype]
        self.collectives_issued += 1
        if self._elastic:
            owner = self._members[dst]
            parts = self._e_all_gather(buf, arr)
            result = parts if self.initial_rank == owner else None
            return Done(result) if async_op else result
        if self.rank == dst:
            out, parts = self._stacked(buf)
            request = self.comm.Igather([arr, datatype], [out, datatype], dst)
            return self._finish(request, parts, async_op, (arr, out))
        request = self.comm.Igather([arr, datatype], None, dst)
        return self._finish(request, None, async_op, arr)

    def scatter(
        self, buf: Any, src: int, chunks: Any = None, async_op: bool = False
    ) -> Any:
        """Fill every rank's ``buf`` with ``chunks[rank]`` of rank ``src``.

        Args:
            buf: a contiguous NumPy array or torch CPU tensor that receives.
            src: the rank that sends.
            chunks: on ``src`` only: ``world_size`` buffers shaped like ``buf``,
                or one buffer of shape ``(world_size, *buf.shape)`` (sent
                without a copy when contiguous).
            async_op: return a handle instead of waiting.

        Returns:
            ``buf`` (or a handle whose ``wait()`` returns it).

        Raises:
            TypeError: unsupported buffer type or dtype, or chunks of another dtype.
            ValueError: ``src`` is not a rank, ``chunks`` missing on ``src`` or
                of the wrong number or shape, or ``buf`` unusable.
        """
        src, parts = self._checks.scatter(buf, src, chunks)
        arr, back = staged(buf)
        datatype = DATATYPES[arr.dtype]
        if self._elastic:
            # Every chunk to every rank (a broadcast), each keeps its own row.
            self.collectives_issued += 1
            row = self.rank
            stacked = np.empty((self.world_size, *arr.shape), dtype=arr.dtype)
            if parts is not None:
                stacked[...] = np.stack([host_array(part)[0] for part in parts])
            self._e_broadcast(stacked, self._members[src], "scatter")
            arr[...] = stacked[row]
            if back is not None:
                back()
            return Done(buf) if async_op else buf
        if parts is None:
            self.collectives_issued += 1
            request = self.comm.Iscatter(None, [arr, datatype], src)
            return self._finish(request, buf, async_op, arr, back)
        if isinstance(chunks, np.ndarray) or is_tensor(chunks):
            send, _ = staged(chunks)  # one buffer: sent as it is when contiguous
        else:
            send = np.stack([host_array(part)[0] for part in parts])
        self.collectives_issued += 1
        request = self.comm.Iscatter([send, datatype], [arr, datatype], src)
        return self._finish(request, buf, async_op, (arr, send), back)

    def barrier(self) -> None:
        """Return once every rank of the group has called ``barrier``."""
        self.collectives_issued += 1
        if self._elastic:
            self._sequenced("Ibarrier", lambda comm: comm.Ibarrier().Wait())
            return
        self.comm.Ibarrier().Wait()

    # -- helpers -------------------------------------------------------------------

    def _stacked(self, buf: Any, rows: int | None = None) -> tuple[np.ndarray, list[Any]]:
        """A fresh ``(rows, *shape)`` buffer of ``buf``'s kind (``rows``: the world
        size by default), and its rows."""
        rows = self.world_size if rows is None else rows
        if is_tensor(buf):
            out = buf.new_empty((rows, *buf.shape))
            return out.numpy(), list(out.unbind(0))
        stacked = np.empty((rows, *buf.shape), dtype=buf.dtype)
        return stacked, list(stacked)



class _CommJoinBackend:
    """The join backend of a raw communicator: an MPIGroup's join methods only.

    The joinable's own collectives go to the communicator directly, where no
    one counts them, so unlike an MPIGroup this has no ``collectives_issued``:
    a failure after a heartbeat makes the Join abort the job (fail fast).
    """

    __slots__ = ("group", "rank", "world_size", "heartbeat", "count",
                 "heartbeat_total", "all_gather_object", "all_agree", "gather_object",
                 "broadcast_object", "abort", "post_status", "peer_status", "post_beat",
                 "peer_board")

    def __init__(self, comm: MPI.Comm) -> None:
        group = self.group = MPIGroup(comm)
        self.rank, self.world_size = group.rank, group.world_size
        # Bound methods of the group: the per-iteration call costs the same.
        self.heartbeat = group.heartbeat
        self.count = group.count
        self.heartbeat_total = group.heartbeat_total
        self.all_gather_object = group.all_gather_object
        self.all_agree = group.all_agree
        self.gather_object = group.gather_object
        self.broadcast_object = group.broadcast_object
        self.abort = group.abort
        self.post_status = group.post_status
        self.peer_status = group.peer_status
        self.post_beat = group.post_beat
        self.peer_board = group.peer_board

    def side_wire(self) -> Any:
        """The side channel's wire (``MPIGroup.side_wire``)."""
        return _side_wire_of(self.group.comm)

    def start_rank_loss_recovery(self, config: Any) -> None:
        """Refuse: the joinable's own collectives bypass joinkit on a raw communicator.

        Raises:
            ValueError: always (the message says what works).
        """
        raise ValueError(
            "Join(on_rank_loss='finish') cannot repair a raw mpi4py communicator used "
            "as a joinable's join_process_group: the joinable's own collectives go to "
            "it directly, past joinkit, and would fail or hang when a rank dies. Wrap "
            "it, group = joinkit.backends.MPIGroup(comm), return the group from "
            "join_process_group and issue the collectives through it (e.g. "
            "group.all_reduce(buf)); launch with `mpirun --with-ft ulfm`"
        )



def _check_device(device: Any) -> None:
    """The Join's collectives run on the CPU; refuse any other join_device."""
    if device is not None and str(device).partition(":")[0] != "cpu":
        raise TypeError(
            f"join_device {device!r} is not supported by the MPI backend: its "
            "collectives run on CPU buffers (joinkit does not assume a CUDA-aware "
            "MPI); return 'cpu' from join_device"
        )


#: Each communicator's side channel wire (by its handle, with the communicator).
_side_wires: dict[int, tuple[MPI.Comm, Any]] = {}


def _side_wire_of(comm: MPI.Comm) -> Any:
    """The side wire over a duplicate of ``comm``, made once (collective then)."""
    key = comm.py2f()
    known = _side_wires.get(key)
    if known is not None and known[0] == comm:
        return known[1]
    problem = _board._thread_level_problem()
    if problem is not None:
        raise RuntimeError(
            "a joinkit.SideChannel answers the active ranks' calls from a service thread, "
            f"which needs MPI_THREAD_MULTIPLE: {problem}"
        )
    from .._side_wire import ArrayWire

    wire = ArrayWire(MPIGroup(comm.Dup()))
    _side_wires[key] = (comm, wire)
    return wire


def _backend_for_comm(comm: MPI.Comm, device: Any) -> _CommJoinBackend:
    _check_device(device)
    return _CommJoinBackend(comm)


def _backend_for_group(group: MPIGroup, device: Any) -> MPIGroup:
    _check_device(device)
    return group



register_backend(MPI.Comm, _backend_for_comm)
register_backend(MPIGroup, _backend_for_group)
