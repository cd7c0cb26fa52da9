"""One daemon thread that watches ranks for stalls.

Theory of operation
-------------------
A Join with a timeout owns a :class:`Watch` and registers it here
(:func:`watch`). Before each join collective or round of hooks the shell tells
the watch what it is blocked in and since when (:meth:`Watch.begin`); inside a
command that takes many steps it bumps :attr:`Watch.ticks` at each one (a
drain: every count and every round of main hooks); afterwards it calls
:meth:`Watch.end`. The shell only ever replaces or increments these fields,
so the thread reads them without a lock.

Every ``interval`` seconds the thread asks each watch whether it has stalled
(:meth:`Watch.stalled`, the policy): blocked in the same activity with no
change of ``ticks`` for ``timeout`` seconds, where a change is any difference
since the thread's previous look (its own sampling: the shell pays one
increment per step, no clock read). A stalled watch fires once: the thread
calls its ``on_stall(what, ticks, idle)``, from this thread. The Join's
callback composes the diagnostic with the pure core (``stall_message``),
records the error and aborts its backend where it can, which makes the
blocked collective fail.

The module knows nothing of the Join or the protocol, and the Join reaches
nothing here but :class:`Watch`, :func:`watch` and :func:`unwatch`. A
different judgement of what counts as a stall (for example, asking the peers
before giving up on a slow rank) is a change to :meth:`Watch.stalled` alone.

At interpreter exit (``atexit``, before finalization) the thread is stopped
and joined: a thread still inside a backend call (an abort, a store read) once
the interpreter finalizes ends inside C++ code, which aborts the process.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["Watch", "watch", "unwatch"]

#: ``on_stall(what, ticks, idle seconds)``.
StallCallback = Callable[[str, int, float], None]


class Watch:
    """What one rank's shell tells the watchdog thread.

    Args:
        timeout: seconds without progress that make a stall.
        on_stall: called once, from the watchdog thread, with what the rank
            was blocked in, its ``ticks`` then and the seconds without progress.
    """

    __slots__ = ("timeout", "on_stall", "doing", "ticks", "fired", "_seen", "__weakref__")

    def __init__(self, timeout: float, on_stall: StallCallback) -> None:
        self.timeout = timeout
        self.on_stall = on_stall
        #: ``(what, since)`` while the shell is blocked, else ``None``;
        #: replaced whole, so the thread reads a consistent pair.
        self.doing: tuple[str, float] | None = None
        #: Steps made inside the current activity; the shell bumps it.
        self.ticks = 0
        #: Whether ``on_stall`` was called (it is called once).
        self.fired = False
        # The thread's own sample: (doing, ticks, since when unchanged).
        self._seen: tuple[tuple[str, float], int, float] | None = None

    def begin(self, what: str, now: float) -> None:
        """The shell is now blocked in ``what`` (since ``now``)."""
        self.ticks = 0  # before ``doing``: a new activity never shows old ticks
        self.doing = (what, now)

    def end(self) -> None:
        """The shell is no longer blocked in a join collective or hooks."""
        self.doing = None

    def stalled(self, now: float) -> tuple[str, int, float] | None:
        """The policy, called by the thread: ``(what, ticks, idle)`` if stalled.

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
        idle = now - max(since, doing[1])
        if idle < self.timeout:
            return None
        return doing[0], ticks, idle


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
        _interval = min(_interval, max(0.01, item.timeout / 4))
        if _stopping:
            return
        if _thread is None or not _thread.is_alive():
            if _thread is None:
                atexit.register(_stop)
            _thread = threading.Thread(target=_run, name="joinkit-watchdog", daemon=True)
            _thread.start()
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
        now = time.monotonic()
        for item in watches:
            if item.fired:
                continue
            stall = item.stalled(now)
            if stall is not None:
                item.fired = True
                item.on_stall(*stall)
