"""One daemon thread that watches every Join with a timeout for stalls.

The shell records what it is blocked in (``Join._activity``, a frozen value)
before each join collective or round of hooks. Every ``interval`` seconds the
thread reads each watched Join's state and activity (plain reference reads of
immutable values, so no lock is needed against the rank's own thread) and asks
the pure core, ``stall_message``, whether it has stalled. A stalled Join gets
its ``_on_stall`` called once, from this thread: it records the error and
aborts the backend where it can, which makes the blocked collective fail.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING

from . import _machine as m

if TYPE_CHECKING:
    from ._join import Join

_watched: weakref.WeakSet[Join] = weakref.WeakSet()
_lock = threading.Lock()
_wakeup = threading.Condition(_lock)
_thread: threading.Thread | None = None
_interval = 1.0


def watch(join: Join) -> None:
    """Start watching ``join`` (its ``_timeout`` must be set)."""
    global _thread, _interval
    with _lock:
        _watched.add(join)
        _interval = min(_interval, max(0.01, join._timeout / 4))  # type: ignore[operator]
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="joinery-watchdog", daemon=True)
            _thread.start()
        _wakeup.notify()


def unwatch(join: Join) -> None:
    """Stop watching ``join``."""
    with _lock:
        _watched.discard(join)


def _run() -> None:
    while True:
        with _lock:
            _wakeup.wait(_interval)
            joins = list(_watched)
        now = time.monotonic()
        for join in joins:
            if join._stall is not None or join._state is None:
                continue
            message = m.stall_message(join._state, join._activity, now, join._timeout or 0.0)
            if message is not None:
                join._on_stall(message)
