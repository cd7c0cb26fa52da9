"""One daemon thread that watches every Join with a timeout for stalls.

The shell records what it is blocked in (``Join._activity``, a frozen value)
before each join collective or round of hooks. Every ``interval`` seconds the
thread reads each watched Join's state and activity (plain reference reads of
immutable values, so no lock is needed against the rank's own thread) and asks
the pure core, ``stall_message``, whether it has stalled. A stalled Join gets
its ``_on_stall`` called once, from this thread: it records the error and
aborts the backend where it can, which makes the blocked collective fail.

A draining rank runs its plain shadow rounds in a batch (``Join._shadow_batch``)
that records no activity per round, only a step counter next to the state the
batch started from. The thread notes when it last saw that counter change (its
own sampling: progress is any change since the previous look) and hands the
core the state replayed to the current step, so the diagnostic names the round
the rank is blocked in.

At interpreter exit (``atexit``, before finalization) the thread is stopped
and joined: a thread still inside a backend call (an abort, a store read) once
the interpreter finalizes ends inside C++ code, which aborts the process.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import TYPE_CHECKING

from . import _machine as m

if TYPE_CHECKING:
    from ._join import Join

_watched: weakref.WeakSet[Join] = weakref.WeakSet()
# Join -> (batch base state, steps, when the thread first saw that pair).
_progress: weakref.WeakKeyDictionary[Join, tuple[m.JoinState, int, float]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()
_wakeup = threading.Condition(_lock)
_thread: threading.Thread | None = None
_interval = 1.0
_stopping = False
#: Seconds ``_stop`` waits for the thread (a stall report in progress).
_STOP_PATIENCE = 10.0


def watch(join: Join) -> None:
    """Start watching ``join`` (its ``_timeout`` must be set)."""
    global _thread, _interval
    with _lock:
        _watched.add(join)
        _interval = min(_interval, max(0.01, join._timeout / 4))  # type: ignore[operator]
        if _stopping:
            return
        if _thread is None or not _thread.is_alive():
            if _thread is None:
                atexit.register(_stop)
            _thread = threading.Thread(target=_run, name="joinkit-watchdog", daemon=True)
            _thread.start()
        _wakeup.notify()


def unwatch(join: Join) -> None:
    """Stop watching ``join``."""
    with _lock:
        _watched.discard(join)


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
            joins = list(_watched)
        now = time.monotonic()
        for join in joins:
            if join._stall is not None or join._state is None:
                continue
            state, activity = _progress_of(join, now)
            message = m.stall_message(state, activity, now, join._timeout or 0.0)
            if message is not None:
                join._on_stall(message)


def _progress_of(join: Join, now: float) -> tuple[m.JoinState, m.Activity | None]:
    """The state and activity to judge ``join`` by (a batch's, replayed; module doc)."""
    base = join._batch_base  # read first: the shell sets it after the activity
    activity = join._activity
    if base is None or activity is None:
        _progress.pop(join, None)
        assert join._state is not None
        return join._state, activity
    steps = join._batch_steps
    if steps // 2 > m.shadow_rounds_batchable(base):  # read across two batches: retry later
        steps = 0
    seen = _progress.get(join)
    if seen is None or seen[0] is not base:
        since = activity.since if steps == 0 else now  # a batch new to the thread
        _progress[join] = (base, steps, since)
    elif seen[1] != steps:
        since = now
        _progress[join] = (base, steps, since)
    else:
        since = seen[2]
    state = m.replay_shadow_steps(base, steps)
    return state, m.Activity(what=m.shadow_activity(state), since=max(activity.since, since))
