"""The threads backend: ranks as threads of one process, and joinkit's test harness.

Theory of operation
-------------------
``spawn(fn, world_size)`` starts one daemon thread per rank; each runs
``fn(group, *args)`` with its own :class:`ThreadGroup`. The groups of one spawn
share a ``_World``: the rendezvous of their collectives and the record of how
each rank ended.

*Slots.* Every collective is world-wide, so call #k of every rank must be the
same collective. A rank numbers its calls 1, 2, 3, ...; call #k lands in *slot*
k. The caller snapshots its contribution (an async caller may reuse its buffer
at once), files it in the slot with its *signature* ``(kind, op, shape, dtype,
root)`` and its call site, and waits on a *gate* (a lock of its own, held
shut), except the last rank to arrive: it removes the slot from the world,
compares the signatures, computes the result once (a reduction, a stack of
buffers, ...) and opens the gates. So a collective costs O(world size) work
and exactly one wakeup per waiting rank, with no lock they all contend for.
The gates of ranks blocked in a blocking call open one after another, in
order of arrival: the last arriver opens the first, and each rank it wakes
opens the next before going on: 64 threads woken at once would only queue for
the GIL, with futile wakeups and context switches; in a relay a rank is woken
when the one before it runs (measured: 64 ranks x 1000 Counter iterations
2.5x faster). An async caller's gate opens at once,
since it may not be waiting yet and must not hold up the relay. Each rank
then copies its share of the result into its own buffer; for an async call
that happens in ``wait()``. The join collectives (``heartbeat``,
``count``) are 1-element float32 SUM all-reduces, as on every backend, which
is how an active rank's heartbeat matches a joined rank's count;
``all_gather_object`` (and ``gather_object``, ``broadcast_object``) move
pickles, so objects cross ranks as they would cross processes. ``all_agree``,
``gather_object`` and ``broadcast_object`` cost a rank other than the root
O(1): the last arriver does the O(world size) work once (entry at 4095 ranks
took 48 s when every rank unpickled every rank's settings).

*Who issued it.* The last element of a signature is its *origin*: ``"join"``
for the join backend's own collectives (``heartbeat``, ``count``, the object
collectives and ``all_agree``), ``"user"`` for the group's collective methods, which
joinables and their hooks call (a fused heartbeat rides in one of these, and
a fused shadow is one: user matches user). On a real wire a joined rank's
count and an active rank's own 1-element float32 SUM would pair up silently;
here they differ in origin, so a ``main_hook`` that forgets to shadow a
collective is a ``CollectiveMismatch`` at the joined rank's next count, not a
run that returns plausible totals.

*The harness.* Every way a multi-rank program can hang becomes an error:

- signatures differ in slot k: ``CollectiveMismatch`` with a per-rank table
  (rank | kind | op | shape | dtype | root | call site) on every rank (a join
  collective's kind says which: ``all_reduce (count)``), and when the origins
  differ a note saying which ranks ran the Join's collective and which their
  own (``backends._mismatch`` builds the table); a rank that issued call #k
  async and did not wait gets it at its next collective;
- a rank does not arrive within ``timeout`` seconds: the slot *expires* and
  every rank waiting in it gets ``RankTimeout``, naming the missing ranks and
  where each was last seen (a latecomer gets one too); a missing rank that
  already returned from ``fn`` can never arrive, so then the error is
  immediate;
- a rank raises (or calls ``abort``): the world is *aborted*; waiting ranks
  wake at once and every later collective raises :class:`SpawnAborted`.
  ``spawn`` re-raises the first root-cause exception, noting its rank; an
  error that only reports another rank's failure (``SpawnAborted``, the Join's
  ``PeerFailure``/``PeerAborted``) is never the root cause.

*The status board* (``post_status``, ``peer_status``, ``peer_board``) is
``_board.ThreadsBoard``, one dict the ranks' threads share;
``peer_status`` puts each rank's entry after where it was last seen.

A call site is the first frame outside this module and outside the core
(``joinkit``, ``joinkit._*``), so a heartbeat points at the joinable that
called ``notify_join_context``; it is captured as ``(file, line, function)``
with ``sys._getframe`` and only formatted when an error message needs it.

Invariants: exactly one thread (the last arriver) completes a slot, and a
completed slot never changes; an aborted world stays aborted; a rank's buffers
are only written by that rank's thread.
"""

from __future__ import annotations

import operator
import pickle
import sys
import threading
import time
from _thread import allocate_lock as _allocate_lock
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np

from joinkit import CollectiveMismatch, PeerAborted, PeerFailure, RankTimeout
from joinkit.lowlevel import register_backend as register

from .._checks import Checks, host_array, is_tensor, write_back
from .._collective_group import REDUCE_OPS
from ._board import ThreadsBoard
from ._mismatch import _JOIN, _USER, _format_site, _ranks, _Signature, _Site, mismatch_table

__all__ = ["ThreadGroup", "ThreadWork", "SpawnAborted", "spawn"]

# After a rank fails, how long spawn() waits for the others before it raises
# anyway: ranks in a collective are released at once, so a rank still running
# after this is stuck in its own code.
_FAILURE_GRACE = 1.0

_Deliver: TypeAlias = "Callable[[Any], Any]"

_UFUNCS: dict[str, np.ufunc] = {
    "sum": np.add,
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}
assert tuple(_UFUNCS) == REDUCE_OPS

# Both join collectives: a 1-element float32 SUM all-reduce, as on every
# backend, but of origin "join", so only another join collective matches it.
_JOIN_SIGNATURE: _Signature = ("all_reduce", "sum", (1,), np.dtype(np.float32), None, _JOIN)
_OBJECT_SIGNATURE: _Signature = ("all_gather_object", None, None, None, None, _JOIN)
_AGREE_SIGNATURE: _Signature = ("all_agree", None, None, None, None, _JOIN)
# SpawnAborted.exc_type when a rank called ThreadGroup.abort() (no exception yet).
_GROUP_ABORT = "abort"


class SpawnAborted(PeerFailure):
    """Another rank of this ``spawn`` raised, so this rank's collective was abandoned.

    Attributes:
        rank: the rank that raised first (``-1`` if ``spawn`` itself gave up).
        exc_type: the name of its exception type (``"abort"`` if that rank
            called :meth:`ThreadGroup.abort`).
        exc_message: the first line of its exception message (or the abort's
            message).
    """

    def __init__(self, rank: int, exc_type: str, exc_message: str, where: str) -> None:
        super().__init__(rank, exc_type, exc_message)
        if rank < 0:
            cause = exc_message
        elif exc_type == _GROUP_ABORT:
            cause = f"rank {rank} aborted the group: {exc_message}"
        else:
            cause = f"rank {rank} raised {exc_type}: {exc_message}"
        # PeerFailure's message speaks of a Join context; this one is the harness's.
        self.args = (f"{cause}; {where}",)
        self.where = where

    def __reduce__(self) -> tuple[Any, ...]:
        # args holds the message, not the constructor's arguments.
        return (type(self), (self.rank, self.exc_type, self.exc_message, self.where))


class _Slot:
    """Collective #index of every rank: what each filed, and the result."""

    __slots__ = ("index", "entries", "payloads", "arrived", "gates", "relay", "opened",
                 "expired", "done", "result", "mismatch", "error")

    def __init__(self, index: int, size: int) -> None:
        self.index = index
        # per rank: (signature, label, call site), None until it arrives
        self.entries: list[tuple[_Signature, str, _Site] | None] = [None] * size
        self.payloads: list[Any] = [None] * size
        self.arrived = 0
        # One shut lock per waiting rank; opening releases each exactly once.
        # ``gates``: async callers', opened together; ``relay``: blocking
        # callers', opened one by one (module doc).
        self.gates: list[Any] = []
        self.relay: list[Any] = []
        self.opened = False
        self.expired = False  # a waiting rank timed out; the slot never completes
        self.done = False
        self.result: Any = None
        self.mismatch: str | None = None
        self.error: BaseException | None = None


class _World:
    """The shared state of one spawn: pending slots, failures, finished ranks."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        # What lock waits accept (math.inf would overflow them).
        self.wait_limit = min(timeout, threading.TIMEOUT_MAX)
        self.groups: list[ThreadGroup] = []
        # The rendezvous. Held only to file an arrival or to read/record an
        # abort, never while computing a result or waiting.
        self.lock = threading.Lock()
        self.slots: dict[int, _Slot] = {}
        self.mismatch: str | None = None  # the first mismatch table
        self.failure: tuple[int, str, str] | None = None  # (rank, type, message)
        self.returned: dict[int, int] = {}  # rank -> collective calls it made
        # How ranks ended, for spawn(); guarded by exits.
        self.exits = threading.Condition(threading.Lock())
        self.running = set(range(size))
        self.failures: list[tuple[int, BaseException]] = []
        self.first_exit_at: float | None = None
        self.failed_at: float | None = None
        # What each rank's Join last said it was doing (backends._status).
        self.board = ThreadsBoard()
        # The second world of the ranks' side channels (side()), made on first use.
        self.side_world: _World | None = None

    # -- a rank's thread ---------------------------------------------------------

    def run(self, fn: Callable[..., Any], group: ThreadGroup, args: tuple[Any, ...],
            results: list[Any]) -> None:
        rank = group.rank
        try:
            results[rank] = fn(group, *args)
        except BaseException as exc:  # noqa: B036 - reported by spawn(), not lost
            self.abort(rank, type(exc).__name__, _first_line(exc))
            self.exit(rank, exc)
        else:
            self.rank_returned(rank, group._calls)
            side = self.side_world
            if side is not None:
                side.rank_returned(rank, side.groups[rank]._calls)
            self.exit(rank, None)

    def exit(self, rank: int, exc: BaseException | None) -> None:
        with self.exits:
            now = time.monotonic()
            self.running.discard(rank)
            if self.first_exit_at is None:
                self.first_exit_at = now
            if exc is not None:
                self.failures.append((rank, exc))
                if self.failed_at is None:
                    self.failed_at = now
            self.exits.notify_all()

    def abort(self, rank: int, exc_type: str, message: str) -> None:
        """Release every waiting rank and refuse every later collective."""
        with self.lock:
            if self.failure is None:
                self.failure = (rank, exc_type, message)
            for slot in self.slots.values():
                _open(slot)
            side = self.side_world
        if side is not None:  # a rank's side channel waits end with its collectives'
            side.abort(rank, exc_type, message)

    def side(self, rank: int) -> ThreadGroup:
        """Rank ``rank``'s group of the spawn's second world (its side channel)."""
        with self.lock:
            side = self.side_world
            if side is None:
                side = self.side_world = _World(self.size, self.timeout)
                side.groups = [ThreadGroup(side, r) for r in range(self.size)]
                if self.failure is not None:
                    side.failure = self.failure
        return side.groups[rank]

    def rank_returned(self, rank: int, calls: int) -> None:
        """Release the ranks waiting in a slot that ``rank`` will never reach."""
        with self.lock:
            self.returned[rank] = calls
            for index, slot in self.slots.items():
                if index > calls:
                    _open(slot)

    # -- spawn()'s thread ----------------------------------------------------------

    def wait_for_ranks(self) -> list[int]:
        """Wait until every rank ended, or gave up; return the ranks still running.

        Once one rank has ended, the others get ``timeout`` seconds more (they
        can no longer complete a collective with it); once one has failed, they
        get ``min(timeout, _FAILURE_GRACE)`` (collectives release them at once).
        """
        with self.exits:
            while self.first_exit_at is None:
                self.exits.wait()
            while self.running:
                deadline = self.first_exit_at + self.timeout
                if self.failed_at is not None:
                    deadline = min(deadline,
                                   self.failed_at + min(self.timeout, _FAILURE_GRACE))
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.exits.wait(min(left, self.wait_limit))
            return sorted(self.running)

    # -- collectives -----------------------------------------------------------------

    def arrive(self, group: ThreadGroup, signature: _Signature, label: str,
               site: _Site, payload: Any, blocking: bool = False
               ) -> tuple[_Slot, Any, int]:
        """File ``group``'s next collective; complete the slot if it is the last.

        ``blocking``: the caller waits at once (its gate joins the relay).
        Returns the slot, the caller's gate (``None`` for the last arriver) and
        the gate's place in the relay (``-1``: not in it).
        """
        rank = group.rank
        index = group._calls + 1
        group._calls = index
        group._last = (index, label, site)
        slot: _Slot | None = None
        expired: _Slot | None = None
        gate = None
        place = -1
        with self.lock:
            refused = (self.mismatch is not None or self.failure is not None
                       or (bool(self.returned)
                           and any(calls < index for calls in self.returned.values())))
            if not refused:
                slot = self.slots.get(index)
                if slot is None:
                    slot = self.slots[index] = _Slot(index, self.size)
                slot.entries[rank] = (signature, label, site)
                if slot.expired:  # the others already gave up waiting for this rank
                    expired, slot = slot, None
                else:
                    slot.payloads[rank] = payload
                    slot.arrived += 1
                    if slot.arrived == self.size:
                        # The table holds incomplete slots only, so an abort
                        # cannot open this one while it is being completed.
                        del self.slots[index]
                    else:
                        gate = _allocate_lock()
                        gate.acquire()
                        if blocking:
                            place = len(slot.relay)
                            slot.relay.append(gate)
                        else:
                            slot.gates.append(gate)
        if slot is None:
            raise self.refusal(rank, index, label, site, slot=expired, late=expired is not None)
        if gate is None:
            self.complete(slot)
        return slot, gate, place

    def complete(self, slot: _Slot) -> None:
        """Check the signatures and compute the result (last arriver only)."""
        entries = slot.entries
        first = entries[0][0]  # type: ignore[index]
        if any(entry[0] != first for entry in entries):  # type: ignore[index]
            slot.mismatch = mismatch_table(slot.index, self.size, slot.entries)
            with self.lock:
                if self.mismatch is None:
                    self.mismatch = slot.mismatch
        else:
            try:
                slot.result = _COMPUTE[first[0]](slot.payloads, first)
            except Exception as exc:  # pragma: no cover - inputs were validated
                slot.error = exc
        slot.payloads = []
        slot.done = True
        slot.opened = True
        for gate in slot.gates:
            gate.release()
        _pass_relay(slot, -1)

    def await_slot(self, rank: int, slot: _Slot, gate: Any, place: int = -1) -> Any:
        """Wait at ``gate`` for ``slot``; return its result or raise what stopped it.

        ``place``: the gate's place in the slot's relay (``-1``: not in it).
        """
        if gate is not None and not gate.acquire(True, self.wait_limit):
            with self.lock:
                completing = slot.arrived == self.size
                if not completing and not slot.opened:
                    # Give up on the slot for everyone in it: each waiting rank
                    # gets the RankTimeout now, not a SpawnAborted later.
                    slot.expired = True
                    _open(slot)
            if completing:  # everyone came just in time; the last one is computing
                gate.acquire()
        if slot.done:
            if place >= 0:
                _pass_relay(slot, place)
            if slot.mismatch is not None:
                raise CollectiveMismatch(slot.mismatch)
            if slot.error is not None:  # pragma: no cover - inputs were validated
                raise RuntimeError(
                    f"collective #{slot.index} failed to compute its result"
                ) from slot.error
            return slot.result
        entry = slot.entries[rank]
        assert entry is not None
        _, label, site = entry
        raise self.refusal(rank, slot.index, label, site, slot=slot)

    # -- error messages ----------------------------------------------------------------

    def refusal(self, rank: int, index: int, label: str, site: _Site,
                slot: _Slot | None = None, late: bool = False) -> Exception:
        """The error for a collective that cannot complete.

        ``slot`` is given if the rank waited in it, or (``late``) if it arrived
        after the others gave up on it.
        """
        with self.lock:
            mismatch, failure = self.mismatch, self.failure
            returned = dict(self.returned)
        here = f"collective #{index} ({label}) at {_format_site(site)}"
        if mismatch is not None:
            return CollectiveMismatch(mismatch)
        expired = slot is not None and slot.expired
        if failure is not None and not expired:
            verb = "was released from" if slot is not None else "cannot enter"
            return SpawnAborted(*failure, where=f"rank {rank} {verb} {here}")
        if late:
            return RankTimeout(
                f"rank {rank} reached {here} too late: the other ranks gave up "
                f"waiting for it after the {self.timeout:g} s timeout"
            )
        if slot is None:
            missing = [r for r, calls in returned.items() if calls < index]
        else:
            missing = [r for r, entry in enumerate(slot.entries) if entry is None]
        gone = [r for r in missing if r in returned and returned[r] < index]
        if gone:
            headline = (
                f"rank {rank} cannot complete {here}: {_ranks(gone)} returned from "
                f"fn before making that call and will never arrive"
            )
        else:
            headline = (
                f"rank {rank} waited in {here}, but {_ranks(missing)} did not "
                f"arrive within the {self.timeout:g} s timeout"
            )
        seen = [self.whereabouts(r, returned) for r in missing[:16]]
        if len(missing) > 16:
            seen.append(f"... and {len(missing) - 16} more")
        return RankTimeout("\n  ".join([headline + "; last seen:", *seen]))

    def whereabouts(self, rank: int, returned: dict[int, int]) -> str:
        if rank in returned:
            return f"rank {rank}: returned from fn after {returned[rank]} collective calls"
        last = self.groups[rank]._last
        if last is None:
            return f"rank {rank}: has made no collective call"
        index, label, site = last
        pending = ", incomplete" if index in self.slots else ""
        return (f"rank {rank}: last called collective #{index} ({label}{pending}) at "
                f"{_format_site(site)}")

def _open(slot: _Slot) -> None:
    """Wake the ranks waiting in an incomplete slot (hold the world's lock)."""
    if not slot.opened:
        slot.opened = True
        for gate in slot.gates:
            gate.release()
        for gate in slot.relay:
            gate.release()


def _pass_relay(slot: _Slot, place: int) -> None:
    """Open the relay gate after ``place`` of a completed slot, if any (module doc).

    The last arriver starts the relay (``place=-1``), and the rank at each
    place, once woken, opens the next: the gates open in order, each once.
    """
    following = place + 1
    if following < len(slot.relay):
        slot.relay[following].release()


def _first_line(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not hide the failure
        text = "<unprintable>"
    first, _, rest = text.partition("\n")
    return first + (" ..." if rest else "")


def _call_site() -> _Site:
    """The caller's (file, line, function): the first frame outside joinkit's core."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        # Skip this module and the core's (joinkit, joinkit._join, ...).
        if module != __name__ and module != "joinkit" and not module.startswith("joinkit._"):
            code = frame.f_code
            return (code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back  # type: ignore[assignment]
    return ("<unknown>", 0, "?")


# -- buffers ----------------------------------------------------------------------


def _new_buffers(parts: list[np.ndarray], tensor: bool) -> list[Any]:
    """Fresh buffers of ``buf``'s kind holding ``parts`` (rows of one new array)."""
    stacked = np.stack(parts)
    if tensor:
        return list(sys.modules["torch"].from_numpy(stacked).unbind(0))
    return list(stacked)


# -- results, computed once per slot by the last arriver ---------------------------


def _reduced(payloads: list[Any], signature: _Signature) -> np.ndarray:
    stacked = np.stack(payloads)
    op = signature[1]
    assert op is not None
    return np.asarray(_UFUNCS[op].reduce(stacked, axis=0, dtype=stacked.dtype))


def _from_root(payloads: list[Any], signature: _Signature) -> Any:
    root = signature[4]
    assert root is not None
    return payloads[root]


def _everyone(payloads: list[Any], signature: _Signature) -> list[Any]:
    return payloads


def _nothing(payloads: list[Any], signature: _Signature) -> None:
    return None


def _all_equal(payloads: list[Any], signature: _Signature) -> bool:
    first = payloads[0]
    return all(payload == first for payload in payloads)


_COMPUTE: dict[str, Callable[[list[Any], _Signature], Any]] = {
    "all_reduce": _reduced,
    "reduce": _reduced,
    "broadcast": _from_root,
    "scatter": _from_root,
    "all_gather": _everyone,
    "gather": _everyone,
    "barrier": _nothing,
    "all_gather_object": _everyone,
    "all_agree": _all_equal,
    "gather_object": _everyone,
    "broadcast_object": _from_root,
}


def _first_float(result: np.ndarray) -> float:
    return float(result[0])


def _returns_none(result: Any) -> None:
    return None


def _unpickled(payloads: list[bytes]) -> list[Any]:
    return [pickle.loads(payload) for payload in payloads]


def _same(result: bool) -> bool:
    return result


# -- the public classes --------------------------------------------------------------


class ThreadWork:
    """An async collective of a :class:`ThreadGroup` (``async_op=True``)."""

    __slots__ = ("_world", "_rank", "_slot", "_gate", "_place", "_deliver", "_done", "_value")

    def __init__(self, world: _World, rank: int, slot: _Slot, gate: Any, place: int,
                 deliver: _Deliver) -> None:
        self._world = world
        self._rank = rank
        self._slot = slot
        self._gate = gate
        self._place = place
        self._deliver = deliver
        self._done = False
        self._value: Any = None

    def wait(self) -> Any:
        """Wait for every rank's contribution; write this rank's result in place.

        Returns:
            What the blocking call returns (the buffer, a list, a float, None).

        Raises:
            CollectiveMismatch: the ranks called different collectives here.
            RankTimeout: a rank did not arrive within the spawn's timeout.
            SpawnAborted: another rank raised.
        """
        if not self._done:
            result = self._world.await_slot(self._rank, self._slot, self._gate, self._place)
            self._value = self._deliver(result)
            self._done = True
        return self._value

    def is_completed(self) -> bool:
        """Whether every rank has contributed (never blocks)."""
        return self._done or self._slot.done


class ThreadGroup:
    """One rank's handle on a :func:`spawn`: collectives over threads, and a join backend.

    ``spawn`` makes one per rank and passes it to ``fn``; do not build one
    yourself. Every collective is world-wide: all ranks call the same ones in
    the same order with matching shapes, dtypes and roots (the harness checks).
    Buffers are NumPy arrays or torch CPU tensors and are updated in place; a
    caller's contribution is copied when it calls, so after ``async_op=True``
    the buffer may be reused at once, and it holds the result once ``wait()``
    returned. Reduce ops on bool buffers follow torch and MPI: ``sum``, ``max``,
    ``bor`` are OR; ``prod``, ``min``, ``band`` are AND; ``bxor`` is XOR.
    What a collective accepts (dtypes, reduce ops, roots, chunks) is decided by
    ``backends._checks``, the same for every backend.

    Attributes:
        rank: this rank, ``0 <= rank < world_size``.
        world_size: the number of ranks of the spawn.
        device: ``"cpu"``.
        collectives_issued: how many collectives this rank issued besides the
            join backend's own (heartbeats, counts, object all-gathers).
    """

    def __init__(self, world: _World, rank: int) -> None:
        self.rank = rank
        self.world_size = world.size
        self.device = "cpu"
        self.collectives_issued = 0
        self._world = world
        self._calls = 0  # collective calls made so far
        self._last: tuple[int, str, _Site] | None = None  # (index, label, site)
        self._checks = Checks(rank, world.size)
        self._side_wire: Any = None

    def __repr__(self) -> str:
        return f"ThreadGroup(rank={self.rank}, world_size={self.world_size})"

    def _start(self, label: str, signature: _Signature, payload: Any,
               deliver: _Deliver, own: bool = True, blocking: bool = True) -> ThreadWork:
        """File a collective; ``blocking``: the caller waits for it at once."""
        if own:
            self.collectives_issued += 1
        slot, gate, place = self._world.arrive(self, signature, label, _call_site(), payload,
                                               blocking)
        return ThreadWork(self._world, self.rank, slot, gate, place, deliver)

    # -- join backend --------------------------------------------------------------

    def heartbeat(self, value: float) -> ThreadWork:
        """Start the 1-element float32 SUM all-reduce contributing ``value``.

        Args:
            value: this rank's contribution.

        Returns:
            A handle; ``wait()`` returns the sum over all ranks as a float.
        """
        payload = np.array([value], dtype=np.float32)
        return self._start("all_reduce (heartbeat)", _JOIN_SIGNATURE, payload, _first_float,
                           own=False, blocking=False)

    def count(self, value: float) -> float:
        """1-element float32 SUM all-reduce contributing ``value`` (blocking).

        Args:
            value: this rank's contribution.

        Returns:
            The sum over all ranks.

        Raises:
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        payload = np.array([value], dtype=np.float32)
        work = self._start("all_reduce (count)", _JOIN_SIGNATURE, payload, _first_float,
                           own=False)
        return float(work.wait())

    def heartbeat_total(self, handle: ThreadWork) -> float:
        """The sum of a heartbeat this group sent (waits for it).

        Args:
            handle: what :meth:`heartbeat` returned.

        Returns:
            The sum over all ranks.

        Raises:
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        return float(handle.wait())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every rank, on every rank (blocking).

        The object is pickled when called and unpickled by each receiver, as on
        the process backends, so each rank gets its own copies and an object
        that would not cross a process boundary fails here too.

        Args:
            obj: this rank's object.

        Returns:
            Every rank's object, in rank order.

        Raises:
            pickle.PicklingError, TypeError, AttributeError: ``obj`` cannot be
                pickled (raised before the collective).
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        work = self._start("all_gather_object", _OBJECT_SIGNATURE, payload, _unpickled,
                           own=False)
        return list(work.wait())

    def all_agree(self, value: int) -> bool:
        """Whether every rank passed the same ``value`` (blocking).

        The last rank to arrive compares the values once; the others only
        wait, so a rank's cost does not grow with the world.

        Args:
            value: this rank's value (the Join passes a digest of its settings).

        Returns:
            The same answer on every rank.

        Raises:
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        work = self._start("all_agree", _AGREE_SIGNATURE, value, _same, own=False)
        return bool(work.wait())

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None:
        """Gather one picklable object from every rank on rank ``dst`` (blocking).

        Pickled as :meth:`all_gather_object` does, but only ``dst`` unpickles.

        Args:
            obj: this rank's object.
            dst: the rank that receives them.

        Returns:
            Every rank's object in rank order on ``dst``, ``None`` elsewhere.

        Raises:
            TypeError, ValueError: ``dst`` is not a rank.
            pickle.PicklingError, TypeError, AttributeError: ``obj`` cannot be
                pickled (raised before the collective).
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        dst = self._checks.root(dst, "dst", "gather_object")
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        signature: _Signature = ("gather_object", None, None, None, dst, _JOIN)
        deliver = _unpickled if self.rank == dst else _returns_none
        gathered: list[Any] | None = self._start("gather_object", signature, payload, deliver,
                                                 own=False).wait()
        return gathered

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s picklable ``obj``, on every rank (blocking).

        Args:
            obj: the object on ``src``; ignored elsewhere.
            src: the rank that sends.

        Returns:
            A copy of ``src``'s object (``src`` gets ``obj`` itself).

        Raises:
            TypeError, ValueError: ``src`` is not a rank.
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        src = self._checks.root(src, "src", "broadcast_object")
        signature: _Signature = ("broadcast_object", None, None, None, src, _JOIN)
        if self.rank == src:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            return self._start("broadcast_object", signature, payload,
                               lambda result: obj, own=False).wait()
        return self._start("broadcast_object", signature, None, pickle.loads,
                           own=False).wait()

    def post_status(self, what: str) -> None:
        """Record what this rank's Join is doing (for :meth:`peer_status`).

        Args:
            what: e.g. ``"counting non-joined ranks (shadow round 3)"``.
        """
        self._world.board.post(self.rank, what)

    def peer_status(self) -> dict[int, str]:
        """Where every rank of the spawn was last seen, for a stall diagnostic.

        Returns:
            rank -> its last collective call (index, kind, call site, whether
            still incomplete) and what its Join last posted, how long ago.
        """
        world = self._world
        now = time.monotonic()
        with world.lock:
            returned = dict(world.returned)
            seen = {rank: world.whereabouts(rank, returned) for rank in range(world.size)}
        out = {}
        for rank, text in seen.items():
            # whereabouts starts with "rank r: "
            out[rank] = text.split(": ", 1)[1] + world.board.note(rank, now)
        return out

    def peer_board(self, ranks: Sequence[int]) -> dict[int, tuple[str, float, None]]:
        """What the Joins of ``ranks`` last posted, for the watchdog's policy.

        The ranks are threads of one process, so none can fall silent while
        this one runs: there is no liveness beat (``None``).

        Args:
            ranks: the ranks to read.

        Returns:
            rank -> (its last posted status, seconds since, ``None``), for the
            ranks that posted one.
        """
        return self._world.board.entries(ranks)

    def side_wire(self) -> Any:
        """The side channel's wire: a group of the spawn's second world, same ranks.

        Its collectives are matched (and checked) among themselves, never with
        this group's (``joinkit.SideChannel``).

        Returns:
            A ``backends._side_wire.ArrayWire``, the same one on every call.
        """
        wire = self._side_wire
        if wire is None:
            from .._side_wire import ArrayWire

            wire = self._side_wire = ArrayWire(self._world.side(self.rank))
        return wire

    def abort(self, message: str) -> None:
        """Make the other ranks' pending and future collectives fail.

        The Join calls this when a hook failed midway through a shadow round,
        so peers would otherwise wait for collectives that never come. They
        raise :class:`SpawnAborted` naming this rank and ``message``.

        Args:
            message: why.
        """
        self._world.abort(self.rank, _GROUP_ABORT, message)

    # -- collectives ---------------------------------------------------------------

    def all_reduce(self, buf: Any, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce ``buf`` over all ranks, in place; every rank gets the result.

        Args:
            buf: a NumPy array or torch CPU tensor.
            op: one of :data:`backends.REDUCE_OPS`.
            async_op: return a handle instead of waiting.

        Returns:
            ``buf``, or a :class:`ThreadWork` whose ``wait()`` returns it.

        Raises:
            TypeError: ``buf`` is not a usable buffer, or ``op`` is undefined
                for its dtype (``backends._checks``: bitwise ops on floats, all but
                ``sum`` on complex).
            ValueError: unknown ``op``, or ``buf`` is read-only.
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        self._checks.all_reduce(buf, op)
        arr, _ = host_array(buf)

        def deliver(result: np.ndarray) -> Any:
            write_back(buf, result)
            return buf

        signature = ("all_reduce", op, arr.shape, arr.dtype, None, _USER)
        work = self._start("all_reduce", signature, arr.copy(), deliver, blocking=not async_op)
        return work if async_op else work.wait()

    def broadcast(self, buf: Any, src: int, async_op: bool = False) -> Any:
        """Copy ``buf`` of rank ``src`` into ``buf`` of every rank.

        Args:
            buf: a NumPy array or torch CPU tensor, same shape and dtype everywhere.
            src: the rank whose buffer is sent.
            async_op: return a handle instead of waiting.

        Returns:
            ``buf``, or a :class:`ThreadWork` whose ``wait()`` returns it.

        Raises:
            TypeError: ``buf`` is not a usable buffer, or ``src`` is not an int.
            ValueError: ``src`` is not a rank, or ``buf`` is read-only.
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        src = self._checks.broadcast(buf, src)
        arr, _ = host_array(buf)
        signature = ("broadcast", None, arr.shape, arr.dtype, src, _USER)
        if self.rank == src:
            return self._finish(self._start("broadcast", signature, arr.copy(),
                                            lambda result: buf, blocking=not async_op),
                                async_op)

        def deliver(result: np.ndarray) -> Any:
            write_back(buf, result)
            return buf

        return self._finish(self._start("broadcast", signature, None, deliver,
                                        blocking=not async_op), async_op)

    def all_gather(self, buf: Any, async_op: bool = False) -> Any:
        """Gather every rank's ``buf`` on every rank.

        Args:
            buf: a NumPy array or torch CPU tensor, same shape and dtype everywhere.
            async_op: return a handle instead of waiting.

        Returns:
            A list of ``world_size`` new buffers of ``buf``'s kind in rank order
            (rows of one fresh array), or a :class:`ThreadWork` whose ``wait()``
            returns it.

        Raises:
            TypeError: ``buf`` is not a usable buffer.
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        self._checks.all_gather(buf)
        arr, _ = host_array(buf)
        tensor = is_tensor(buf)
        signature = ("all_gather", None, arr.shape, arr.dtype, None, _USER)
        work = self._start("all_gather", signature, arr.copy(),
                           lambda parts: _new_buffers(parts, tensor), blocking=not async_op)
        return self._finish(work, async_op)

    def reduce(self, buf: Any, dst: int, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce ``buf`` over all ranks into ``buf`` of rank ``dst``.

        Other ranks' buffers are left as they were.

        Args:
            buf: a NumPy array or torch CPU tensor.
            dst: the rank that receives the result.
            op: one of :data:`backends.REDUCE_OPS`.
            async_op: return a handle instead of waiting.

        Returns:
            ``buf``, or a :class:`ThreadWork` whose ``wait()`` returns it.

        Raises:
            TypeError: ``buf`` is not a usable buffer, ``dst`` is not an int,
                or ``op`` is undefined for the dtype.
            ValueError: unknown ``op``, ``dst`` is not a rank, or ``buf`` is
                read-only.
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        dst, _ = self._checks.reduce(buf, dst, op)
        arr, _ = host_array(buf)
        signature = ("reduce", op, arr.shape, arr.dtype, dst, _USER)
        if self.rank != dst:
            return self._finish(self._start("reduce", signature, arr.copy(),
                                            lambda result: buf, blocking=not async_op),
                                async_op)

        def deliver(result: np.ndarray) -> Any:
            write_back(buf, result)
            return buf

        return self._finish(self._start("reduce", signature, arr.copy(), deliver,
                                        blocking=not async_op), async_op)

    def gather(self, buf: Any, dst: int, async_op: bool = False) -> Any:
        """Gather every rank's ``buf`` on rank ``dst``.

        Args:
            buf: a NumPy array or torch CPU tensor, same shape and dtype everywhere.
            dst: the rank that receives the list.
            async_op: return a handle instead of waiting.

        Returns:
            On ``dst`` a list of ``world_size`` new buffers of ``buf``'s kind in
            rank order, elsewhere ``None``; or a :class:`ThreadWork` whose
            ``wait()`` returns that.

        Raises:
            TypeError: ``buf`` is not a usable buffer, or ``dst`` is not an int.
            ValueError: ``dst`` is not a rank.
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        dst = self._checks.gather(buf, dst)
        arr, _ = host_array(buf)
        tensor = is_tensor(buf)
        signature = ("gather", None, arr.shape, arr.dtype, dst, _USER)
        if self.rank == dst:
            deliver: _Deliver = lambda parts: _new_buffers(parts, tensor)  # noqa: E731
        else:
            deliver = _returns_none
        return self._finish(self._start("gather", signature, arr.copy(), deliver,
                                        blocking=not async_op), async_op)

    def scatter(
        self, buf: Any, src: int, chunks: Any = None, async_op: bool = False
    ) -> Any:
        """Fill every rank's ``buf`` with ``chunks[rank]`` of rank ``src``.

        Args:
            buf: a NumPy array or torch CPU tensor that receives, same shape and
                dtype everywhere.
            src: the rank that sends.
            chunks: on ``src`` only: ``world_size`` buffers shaped like ``buf``,
                or one buffer of shape ``(world_size, *buf.shape)``; ``None``
                on the other ranks.
            async_op: return a handle instead of waiting.

        Returns:
            ``buf``, or a :class:`ThreadWork` whose ``wait()`` returns it.

        Raises:
            TypeError: ``buf`` or a chunk is not a usable buffer, a chunk's
                dtype differs from ``buf``'s, or ``src`` is not an int.
            ValueError: ``src`` is not a rank, ``chunks`` is missing on ``src``,
                given elsewhere, or of the wrong number or shape; or ``buf``
                is read-only.
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        src, parts = self._checks.scatter(buf, src, chunks)
        arr, _ = host_array(buf)
        payload = None if parts is None else np.stack([host_array(p)[0] for p in parts])
        rank = self.rank

        def deliver(stacked: np.ndarray) -> Any:
            write_back(buf, stacked[rank])
            return buf

        signature = ("scatter", None, arr.shape, arr.dtype, src, _USER)
        return self._finish(self._start("scatter", signature, payload, deliver,
                                        blocking=not async_op), async_op)

    def barrier(self) -> None:
        """Return once every rank has called ``barrier``.

        Raises:
            CollectiveMismatch, RankTimeout, SpawnAborted: see :meth:`ThreadWork.wait`.
        """
        signature: _Signature = ("barrier", None, None, None, None, _USER)
        self._start("barrier", signature, None, _returns_none).wait()

    # -- helpers -------------------------------------------------------------------

    @staticmethod
    def _finish(work: ThreadWork, async_op: bool) -> Any:
        return work if async_op else work.wait()


def _backend_for_group(group: ThreadGroup, device: Any) -> ThreadGroup:
    # The Join's collectives run on the CPU; refuse any other join_device.
    if device is not None and str(device).partition(":")[0] != "cpu":
        raise TypeError(
            f"join_device {device!r} is not supported by the threads backend: its "
            "collectives run on NumPy arrays and CPU tensors; return 'cpu' from "
            "join_device"
        )
    return group


register(ThreadGroup, _backend_for_group)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 30.0,
) -> list[Any]:
    """Run ``fn(group, *args)`` on ``world_size`` threads, one per rank.

    Each rank gets its own :class:`ThreadGroup`. The threads are daemons, so a
    rank stuck in its own code cannot keep the interpreter alive.

    Args:
        fn: the per-rank function; its first argument is the rank's group.
        world_size: the number of ranks, at least 1.
        args: more positional arguments for ``fn``, the same for every rank.
        timeout: seconds a rank waits in a collective for the others before
            ``RankTimeout``; also how long ``spawn`` waits for the remaining
            ranks once one rank has returned (``math.inf``: no limit).

    Returns:
        The ranks' return values, in rank order.

    Raises:
        BaseException: the first root-cause exception a rank raised (not one
            that reports another rank's failure: ``SpawnAborted``,
            ``PeerFailure``, ``PeerAborted``, or an error raised while handling
            one), re-raised as the same object with a note naming the rank (on
            Python 3.10, which has no notes, the rank is added to its message).
        RankTimeout: no rank raised, but some did not return within
            ``timeout`` seconds after another rank returned.
        TypeError: ``fn`` is not callable.
        ValueError: ``world_size`` < 1, or ``timeout`` is not positive.
    """
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable, got {type(fn).__qualname__}")
    size = operator.index(world_size)
    if size < 1:
        raise ValueError(f"spawn: world_size must be at least 1, got {size}")
    timeout = float(timeout)
    if not timeout > 0:
        raise ValueError(f"spawn: timeout must be a positive number of seconds, got {timeout}")
    world = _World(size, timeout)
    world.groups = [ThreadGroup(world, rank) for rank in range(size)]
    results: list[Any] = [None] * size
    arguments = tuple(args)
    threads = [
        threading.Thread(target=world.run, args=(fn, group, arguments, results),
                         name=f"joinkit-rank-{group.rank}", daemon=True)
        for group in world.groups
    ]
    for thread in threads:
        thread.start()
    stuck: list[int] = list(range(size))
    try:
        stuck = world.wait_for_ranks()
    finally:
        if stuck:
            # Release the stuck ranks at their next collective.
            world.abort(-1, "", "spawn() stopped waiting for this rank")
    with world.exits:
        failures = list(world.failures)
    if failures:
        raise _root_cause(failures, stuck)
    if stuck:
        returned = sorted(set(range(size)) - set(stuck))
        raise RankTimeout(
            f"{_ranks(stuck)} did not return within {timeout:g} s after "
            f"{_ranks(returned)} returned; last seen:\n  "
            + "\n  ".join(world.whereabouts(rank, {}) for rank in stuck[:16])
        )
    return results


def _root_cause(failures: list[tuple[int, BaseException]], stuck: list[int]) -> BaseException:
    """The first failure not caused by another, annotated with its rank."""
    rank, exc = next(
        ((r, e) for r, e in failures if not _is_derived(e)), failures[0]
    )
    _add_note(exc, f"raised on rank {rank} (backends.threads.spawn)")
    others: dict[str, list[int]] = {}
    for other_rank, other in failures:
        if other is not exc:
            others.setdefault(type(other).__name__, []).append(other_rank)
    if others:
        _add_note(exc, "other ranks failed too: " + "; ".join(
            f"{name} on {_ranks(sorted(ranks))}" for name, ranks in others.items()))
    if stuck:
        _add_note(exc, f"{_ranks(stuck)} still running when spawn() stopped waiting")
    return exc


def _is_derived(exc: BaseException) -> bool:
    """Whether ``exc`` reports another rank's failure, or arose while handling one.

    ``SpawnAborted`` (this harness) and ``PeerFailure``/``PeerAborted`` (the
    Join's failure protocol) all point at a failure elsewhere.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (PeerFailure, PeerAborted)):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _add_note(exc: BaseException, note: str) -> None:
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)
    elif exc.args and isinstance(exc.args[0], str):  # Python 3.10: no notes
        exc.args = (f"{exc.args[0]} [{note}]", *exc.args[1:])
    else:
        exc.args = (*exc.args, note)
