"""One daemon thread that watches ranks for stalls and silent peers.

Theory of operation
-------------------
A Join with a timeout owns a :class:`Watch` and registers it here
(:func:`watch`) from entering its block to leaving it. Before each join
collective or round of hooks the shell tells the watch what it is blocked in
and since when (:meth:`Watch.begin`); inside a command that takes many steps
it bumps :attr:`Watch.ticks` at each one (a drain: every count and every round
of main hooks); afterwards it calls :meth:`Watch.end`. The shell only ever
replaces or increments these fields, so the thread reads them without a lock,
and the loop body costs nothing.

Every ``interval`` seconds the thread looks at each watch. Its own activity
is *idle* for as long as it stays blocked in the same activity with no change
of ``ticks`` since the thread's previous look (its own sampling: the shell
pays one increment per step, no clock read). Every ``look_every`` seconds
(``timeout / 10``) it also *beats*, the watch's ``beat()`` (the backend
publishes a new liveness number on its status board), and reads the board
entry of its ring neighbour, rank ``r + 1``: each rank is watched by one peer,
so a board read costs one entry per look whatever the world size. A peer
whose entry says it is inside a Join ("active: in its loop body", or a join
collective; or, once the shell has set :attr:`Watch.peers_inside` after the
agreement check at entry, with no entry at all) but whose beat has not
changed for ``SILENT_FRACTION * timeout`` (half of it) is *silent*: dead,
frozen (SIGSTOP), or holding the GIL, since its watchdog thread beats
whatever its main thread does. That is reported at once, in the loop body
too, naming the rank, until the shell clears :attr:`Watch.silence` (every rank
has finished the protocol and may exit). Beats are compared, never clocks,
so hosts need not agree on the time.

The policy is the pure function :func:`judge`; the watch turns its samples
into its arguments (:meth:`Watch.due`, :meth:`Watch.seen`,
:meth:`Watch.verdict`, all given ``now``). For a rank blocked and idle for
``timeout`` seconds:

- ``hard`` (an explicit ``Join(timeout=...)``, or a backend without a status
  board): a stall, whatever the peers do;
- otherwise the thread reads every peer's entry (at most every ``timeout / 2``
  seconds) and it is a stall only if no peer is in its loop body or outside
  the Join, or the board could not be read (no peer can be shown alive): a
  healthy slow rank (a long checkpoint, an evaluation) is waited for, however
  long, and the shell logs whom it waits for (``on_wait``, at most once per
  ``timeout``).

A verdict that is a stall fires once: the thread calls the watch's
``on_stall(stall)``, from this thread. The Join's callback composes the
diagnostic with the pure core, records the error and aborts its backend where
it can, which makes the blocked collective fail.

The module knows nothing of the Join or the protocol, and the Join reaches
nothing here but :class:`Watch`, :class:`Stall`, :class:`Waiting`,
:class:`Entry`, the status texts, :func:`watch` and :func:`unwatch`.

At interpreter exit (``atexit``, before finalization) the thread is stopped
and joined: a thread still inside a backend call (an abort, a store read) once
the interpreter finalizes ends inside C++ code, which aborts the process.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence

import attrs

__all__ = ["Entry", "Stall", "Waiting", "Watch", "judge", "watch", "unwatch"]

#: What a Join posts while its rank runs its loop body (not a join collective).
LOOP_BODY = "active: in its loop body"
#: What a Join posts when its rank leaves the block (it beats no more).
LEFT = "left the Join"
#: A peer inside the Join whose entry never reached the board (module doc).
NO_ENTRY = "inside the Join, but no status of it ever reached the board"
_NO_BEAT = -1
#: A peer whose beat has not changed for this fraction of the timeout is
#: silent, so that a silent peer is reported within the timeout: a live peer
#: beats every ``timeout / 10`` and is read every ``timeout / 10``, so its
#: beat is seen unchanged for at most a fifth of it, plus a read's latency.
SILENT_FRACTION = 0.5


@attrs.frozen(kw_only=True)
class Entry:
    """One rank's status board entry, as a backend's ``peer_board`` reads it.

    Attributes:
        what: what its Join last posted.
        age: seconds since it posted that.
        beat: its latest liveness number (it changes every look of the rank's
            watchdog thread); ``None`` where the backend keeps none.
    """

    what: str
    age: float
    beat: int | None = None


@attrs.frozen(kw_only=True)
class Peer:
    """What a watch knows of one peer, for :func:`judge`.

    Attributes:
        what: its last status seen; ``None``: none seen (it has posted none).
        age: seconds since it posted that status, as of now.
        silent: seconds its beat has not changed; ``None`` where no beat was
            ever seen.
    """

    what: str | None
    age: float | None = None
    silent: float | None = None


@attrs.frozen(kw_only=True)
class Stall:
    """A verdict: report and abort.

    Attributes:
        what: the activity this rank was blocked in; ``None``: its loop body.
        ticks: the activity's ticks then (the round of a drain).
        idle: seconds without progress in it (0 in the loop body).
        silent: the silent peers, as ``(rank, seconds silent, last status)``;
            empty for a stall of this rank's own activity.
        board_error: why the last board read failed, if it did.
    """

    what: str | None
    ticks: int = 0
    idle: float = 0.0
    silent: tuple[tuple[int, float, str], ...] = ()
    board_error: str | None = None


@attrs.frozen(kw_only=True)
class Waiting:
    """A verdict: blocked for the timeout, but waiting for healthy peers.

    Attributes:
        what: the activity this rank is blocked in.
        idle: seconds without progress in it.
        ranks: the peers it waits for, as ``(rank, status, status age or None)``.
    """

    what: str
    idle: float
    ranks: tuple[tuple[int, str, float | None], ...]


def judge(
    *,
    blocked: tuple[str, int, float] | None,
    peers: Mapping[int, Peer],
    timeout: float,
    hard: bool,
    board_error: str | None = None,
) -> Stall | Waiting | None:
    """The watchdog's policy, pure: what to make of this rank and its peers.

    Args:
        blocked: ``(activity, ticks, idle seconds)`` if the rank is blocked in
            a join collective or round of hooks, else ``None`` (loop body).
        peers: what is known of the peers (their latest board entries).
        timeout: the Join's timeout.
        hard: whether an idle activity is a stall whatever the peers do.
        board_error: why the latest read of the board failed, if it did: then
            no peer can be shown alive, and an idle activity is a stall.

    Returns:
        A :class:`Stall` if a peer inside the Join is silent for
        ``SILENT_FRACTION * timeout`` (any mode), or the rank is idle for
        ``timeout`` and ``hard``, or idle for ``timeout`` and every peer is in a
        join collective or round of hooks too, or the board cannot be read;
        :class:`Waiting` if idle for
        ``timeout`` but some peer is in its loop body, outside the Join, or
        has posted nothing; else ``None``.
    """
    silent = tuple(
        (rank, peer.silent, peer.what)
        for rank, peer in sorted(peers.items())
        if peer.silent is not None and peer.what is not None and peer.what != LEFT
        and peer.silent >= SILENT_FRACTION * timeout
    )
    if silent:
        if blocked is None:
            return Stall(what=None, silent=silent, board_error=board_error)
        return Stall(what=blocked[0], ticks=blocked[1], idle=blocked[2], silent=silent,
                     board_error=board_error)
    if blocked is None or blocked[2] < timeout:
        return None
    what, ticks, idle = blocked
    if not hard and board_error is None:
        waiting = tuple(
            (rank, peer.what or "no status posted", peer.age)
            for rank, peer in sorted(peers.items())
            if peer.what is None or peer.what in (LOOP_BODY, LEFT)
        )
        if waiting:
            return Waiting(what=what, idle=idle, ranks=waiting)
    return Stall(what=what, ticks=ticks, idle=idle, board_error=board_error)


#: ``on_stall(stall)``, ``on_wait(waiting)``.
StallCallback = Callable[[Stall], None]
WaitCallback = Callable[[Waiting], None]
#: ``read(ranks)``: those ranks' board entries (a rank with none left out).
BoardReader = Callable[[Sequence[int]], Mapping[int, Entry]]


class Watch:
    """What one rank's shell tells the watchdog thread, and what the thread saw.

    Args:
        timeout: seconds without progress that make a stall.
        on_stall: called once, from the watchdog thread, with the :class:`Stall`.
        hard: an idle activity is a stall whatever the peers do (module doc).
        rank: this rank; with ``world_size``, says who the ring neighbour is.
        world_size: the number of ranks.
        read: reads peers' board entries (the backend's ``peer_board``);
            ``None`` where the backend has no board.
        beat: publishes a new liveness number (the backend's ``post_beat``).
        on_wait: called, at most once per ``timeout``, while the rank waits
            for healthy peers (not ``hard`` only).
    """

    __slots__ = ("timeout", "on_stall", "hard", "rank", "world_size", "read", "beat",
                 "on_wait", "look_every", "peers_inside", "silence", "doing", "ticks", "fired",
                 "_seen",
                 "_next_look",
                 "_full_at", "_waited_at", "_peers", "_board_error", "_blocked",
                 "__weakref__")

    def __init__(
        self,
        timeout: float,
        on_stall: StallCallback,
        *,
        hard: bool = True,
        rank: int = 0,
        world_size: int = 1,
        read: BoardReader | None = None,
        beat: Callable[[], None] | None = None,
        on_wait: WaitCallback | None = None,
    ) -> None:
        self.timeout = timeout
        self.on_stall = on_stall
        self.hard = hard
        self.rank = rank
        self.world_size = world_size
        self.read = read
        self.beat = beat
        self.on_wait = on_wait
        #: Seconds between beats and neighbour reads.
        self.look_every = timeout / 10
        #: Set by the shell once every rank is known to have entered the Join
        #: (the agreement check at entry passed): from then on a peer with no
        #: board entry is expected to beat too (it froze before its first
        #: post reached the board), where the backend keeps beats.
        self.peers_inside = False
        #: Cleared by the shell once every rank has finished the protocol
        #: (post hooks): a peer may then leave and exit before its last
        #: status reaches the board, so silence means nothing any more.
        self.silence = True
        #: ``(what, since)`` while the shell is blocked, else ``None``;
        #: replaced whole, so the thread reads a consistent pair.
        self.doing: tuple[str, float] | None = None
        #: Steps made inside the current activity; the shell bumps it.
        self.ticks = 0
        #: Whether ``on_stall`` was called (it is called once).
        self.fired = False
        # The thread's own samples: (doing, ticks, since when unchanged); when
        # the next look is due; the last full board read; the last on_wait;
        # per peer (status, its age, read at, beat, beat unchanged since); why
        # the last board read failed; the blocked triple of the current look.
        self._seen: tuple[tuple[str, float], int, float] | None = None
        self._next_look: float | None = None
        self._full_at: float | None = None
        self._waited_at: float | None = None
        self._peers: dict[int, tuple[str, float, float, int | None, float]] = {}
        self._board_error: str | None = None
        self._blocked: tuple[str, int, float] | None = None

    def begin(self, what: str, now: float) -> None:
        """The shell is now blocked in ``what`` (since ``now``)."""
        self.ticks = 0  # before ``doing``: a new activity never shows old ticks
        self.doing = (what, now)

    def end(self) -> None:
        """The shell is no longer blocked in a join collective or hooks."""
        self.doing = None

    def blocked(self, now: float) -> tuple[str, int, float] | None:
        """``(what, ticks, idle)`` if the shell is blocked, from the thread's samples.

        Progress is a new activity or a change of ``ticks`` since the thread's
        previous look; the idle time runs from the latest of those.
        """
        doing = self.doing
        if doing is None:
            self._seen = None
            return None
        ticks = self.ticks
        seen = self._seen
        if seen is None or seen[0] is not doing:
            # A new activity: idle since it began, unless it already stepped.
            since = doing[1] if ticks == 0 else now
        elif seen[1] != ticks:
            since = now
        else:
            since = seen[2]
        self._seen = (doing, ticks, since)
        return doing[0], ticks, now - max(since, doing[1])

    def due(self, now: float) -> Sequence[int] | None:
        """Sample the shell; return the peers to read now (``None``: no look due).

        The ring neighbour every ``look_every`` seconds; every peer when the
        rank is blocked and idle for the timeout and not ``hard`` (at most
        every ``timeout / 2`` seconds).
        """
        blocked = self._blocked = self.blocked(now)
        peers = [r for r in range(self.world_size) if r != self.rank]
        if (not self.hard and blocked is not None and blocked[2] >= self.timeout
                and (self._full_at is None or now - self._full_at >= self.timeout / 2)):
            self._full_at = now
            self._next_look = now + self.look_every
            return peers
        if self._next_look is not None and now < self._next_look:
            return None
        first = self._next_look is None
        self._next_look = now + self.look_every
        # The first look only beats: the neighbour may not have posted yet.
        return [(self.rank + 1) % self.world_size] if peers and not first else []

    def seen(self, now: float, asked: Sequence[int], board: Mapping[int, Entry],
             error: str | None = None) -> None:
        """Record a read of ``asked``'s board entries made at ``now``.

        ``error`` says why the read failed. An asked rank missing from a
        board that answered counts as inside the Join without a beat once
        ``peers_inside``.
        """
        self._board_error = error
        if self.peers_inside and self.beat is not None and error is None:
            for rank in asked:
                if rank not in board and rank not in self._peers:
                    self._peers[rank] = (NO_ENTRY, 0.0, now, _NO_BEAT, now)
        for rank, entry in board.items():
            known = self._peers.get(rank)
            since = now if known is None or known[3] != entry.beat else known[4]
            self._peers[rank] = (entry.what, entry.age, now, entry.beat, since)

    def verdict(self, now: float) -> Stall | Waiting | None:
        """What :func:`judge` makes of the latest samples (a wait once per timeout)."""
        peers = {
            rank: Peer(what=what, age=None if beat == _NO_BEAT else age + now - read_at,
                       silent=None if beat is None or not self.silence else now - since)
            for rank, (what, age, read_at, beat, since) in self._peers.items()
        }
        if not self.hard:  # a peer that was never read: no status known
            for rank in range(self.world_size):
                if rank != self.rank:
                    peers.setdefault(rank, Peer(what=None))
        verdict = judge(blocked=self._blocked, peers=peers, timeout=self.timeout,
                        hard=self.hard, board_error=self._board_error)
        if isinstance(verdict, Waiting):
            if self._waited_at is not None and now - self._waited_at < self.timeout:
                return None
            self._waited_at = now
        return verdict


_watched: weakref.WeakSet[Watch] = weakref.WeakSet()
_lock = threading.Lock()
_wakeup = threading.Condition(_lock)
_thread: threading.Thread | None = None
_interval = 1.0
_stopping = False
#: Seconds ``_stop`` waits for the thread (a stall report in progress).
_STOP_PATIENCE = 10.0


def watch(item: Watch) -> None:
    """Start watching ``item`` (the thread starts with the first watch)."""
    global _thread, _interval
    with _lock:
        _watched.add(item)
        interval = min(_interval, max(0.01, item.look_every))
        shorter, _interval = interval < _interval, interval
        if _stopping:
            return
        if _thread is None or not _thread.is_alive():
            if _thread is None:
                atexit.register(_stop)
            _thread = threading.Thread(target=_run, name="joinkit-watchdog", daemon=True)
            _thread.start()
        elif shorter:
            # Only a shorter interval needs the thread now (to wait less); a
            # new watch's first look (a beat) can wait for its next round, so
            # a Join per epoch does not wake it (and take the GIL) every time.
            _wakeup.notify()


def unwatch(item: Watch) -> None:
    """Stop watching ``item``."""
    with _lock:
        _watched.discard(item)


def _stop() -> None:
    """Stop the thread and wait for it (module doc)."""
    global _stopping
    with _lock:
        _stopping = True
        _wakeup.notify()
        thread = _thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(_STOP_PATIENCE)


def _run() -> None:
    while True:
        with _lock:
            if not _stopping:
                _wakeup.wait(_interval)
            if _stopping:
                return
            watches = list(_watched)
        for item in watches:
            if not item.fired and item in _watched:  # not unwatched since
                _look(item)


def _look(item: Watch) -> None:
    """One look at one watch: beat and read the board when due, then judge."""
    asked_at = time.monotonic()
    ranks = item.due(asked_at)
    if ranks is not None:
        if item.beat is not None:
            try:
                item.beat()
            except Exception:  # noqa: BLE001 - a board gone: peers will see silence
                pass
        if ranks and item.read is not None:
            try:
                board, error = item.read(ranks), None
            except Exception as exc:  # noqa: BLE001 - no change seen: silence grows
                board, error = {}, f"{type(exc).__name__}: {exc}"
            # As of the question: a beat seen changed did so after it, and a
            # peer that does not answer (MPI waits for it) was silent since.
            item.seen(asked_at, ranks, board, error)
    verdict = item.verdict(time.monotonic())
    if isinstance(verdict, Stall):
        item.fired = True
        item.on_stall(verdict)
    elif isinstance(verdict, Waiting) and item.on_wait is not None:
        item.on_wait(verdict)
