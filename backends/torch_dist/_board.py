"""The store side of a TorchGroup: its status board, the abort watcher, bounded store access.

Theory of operation. Every rank reaches the default group's c10d store without
the (possibly stuck) process group, so the failure path goes through it
(``torch_dist``'s module doc has the whole story). This module holds what runs
beside a group's collectives, on threads of its own:

- ``_bounded``: a store access in a helper thread, given up after a patience,
  so a dead store never stalls the watchdog that is reporting a stall;
- the *status publisher* (``_publish_statuses``, ``_publish_loop``): one
  daemon thread that publishes each group's changed board entry (status and
  beat) at most every ``_STATUS_INTERVAL`` s, so the per-round path pays no
  store round trip; a rank posts which process it is once per group;
- the *abort watcher* (``_watch_aborts``, ``_watch_loop``): one daemon thread
  that, while some wait of a CPU group is past its first slice, reads those
  groups' abort keys and sets their abort flag;
- the threads of ``start_stoppable`` (the elastic watchers of ``_elastic``).

``stop_threads`` stops all of them and joins them; the exit guard (``_exit``)
calls it, before Python finalizes: a daemon thread that comes back from a
native call while Python finalizes is ended by ``pthread_exit``, and ended
inside pybind11's GIL release that aborts the process (``std::terminate``).
It reads and writes a few of ``TorchGroup``'s members (``_abort``,
``_store_prefix``, ``_post``, ``rank``, ``world_size``; :class:`BoardGroup`):
this is the group's own machinery, kept apart only to be read apart (and
below ``_group``, which imports it, so it names the group by that protocol).
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist

from .. import _status


class BoardGroup(Protocol):
    """What this module reads and writes of a ``TorchGroup`` (module doc)."""

    rank: int
    world_size: int
    _abort: tuple[int, str] | None
    _store_prefix: str
    _post: _status.Post

#: Seconds a blocking wait on a CPU group waits before it looks for an abort.
_WAIT_SLICE = 1.0
#: Store reads per second that the abort watchers of a whole world may make
#: together while its ranks wait (module doc).
_ABORT_POLLS_PER_SECOND = 200.0
#: Seconds a store access of the failure path may take (a dead store must not
#: stall the watchdog that is trying to report a stall).
_STORE_PATIENCE = 5.0
#: How often the status thread publishes changed statuses.
_STATUS_INTERVAL = 0.5
#: How long gone_peers waits for the store: torchrun ends the survivors soon
#: after a worker dies, so the note must come quickly or not at all.
_GONE_PATIENCE = 1.0
#: This process, as a rank posts it once for gone_peers.
_PROCESS = _status.this_process()
#: Seconds the exit guard waits for the background threads to stop and gloo's


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _bounded(action: Callable[[Any], Any], patience: float = _STORE_PATIENCE) -> Any:
    """``action(store)`` in a helper thread, given up after ``patience`` s.

    The failure path must not hang on a store whose host died. Returns the
    action's result, or ``None`` if it failed or took too long (or the process
    is exiting: module doc).
    """
    result: list[Any] = [None]

    def run() -> None:
        try:
            result[0] = action(_store())
        except Exception:  # noqa: BLE001 - no store, or it is gone: nothing known
            result[0] = None
        finally:
            _helpers.discard(helper)

    helper = threading.Thread(target=run, name="joinkit-store", daemon=True)
    with _threads_lock:
        if _exiting.is_set():
            return None
        _helpers.add(helper)
        helper.start()
    helper.join(patience)
    return result[0]


# Groups with a status to publish; the thread that publishes them; the store
# helpers still running; set once the exit guard stops them all (module doc).
_publishing: weakref.WeakSet[BoardGroup] = weakref.WeakSet()
_publisher: threading.Thread | None = None
_helpers: set[threading.Thread] = set()
_threads_lock = threading.Lock()
_exiting = threading.Event()
# Store prefix -> the store this process posted its pid to for it (gone_peers).
_processes_posted: dict[str, Any] = {}
# Groups with a wait past its first slice -> how many; the abort watcher, and
# what wakes it when the first wait comes (or the exit guard stops it).
_long_waits: dict[int, tuple[BoardGroup, int]] = {}  # by id: groups compare by their PG
_watcher: threading.Thread | None = None
_waits_changed = threading.Condition(_threads_lock)
# The other threads that read the store (the elastic watchers), with the event
# that stops each: stopped and joined with the rest at exit (module doc).
_stoppable: dict[threading.Thread, threading.Event] = {}


def start_stoppable(thread: threading.Thread, stop: threading.Event) -> bool:
    """Start ``thread``, which ends soon after ``stop`` is set, and have the
    exit guard set ``stop`` and join it; the thread calls :func:`forget` last.

    Returns:
        Whether it started (not once the exit guard ran).
    """
    with _threads_lock:
        if _exiting.is_set():
            return False
        _stoppable[thread] = stop
        thread.start()
    return True


def forget(thread: threading.Thread) -> None:
    """A thread of :func:`start_stoppable` is ending."""
    with _threads_lock:
        _stoppable.pop(thread, None)


def _abort_posted(store: Any, prefix: str) -> tuple[int, str] | None:
    """The abort posted for the group with store ``prefix`` (rank, reason), or ``None``."""
    key = prefix + "abort"
    value = store.get(key) if store.check([key]) else None
    if not value:
        return None
    posted = json.loads(value)
    return int(posted["rank"]), str(posted["reason"])


def _watch_aborts(group: BoardGroup, change: int) -> bool:
    """Count a long wait of ``group`` in (+1) or out (-1); start the watcher.

    Returns:
        Whether the wait is counted (not once the exit guard ran).
    """
    global _watcher
    with _waits_changed:
        if _exiting.is_set():
            return False
        waits = _long_waits.get(id(group), (group, 0))[1] + change
        if waits > 0:
            _long_waits[id(group)] = (group, waits)
        else:
            _long_waits.pop(id(group), None)
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_watch_loop, name="joinkit-aborts",
                                        daemon=True)
            _watcher.start()
        _waits_changed.notify_all()
    return True


def _watch_loop() -> None:
    """The abort watcher: while some wait is long, read the abort keys (module doc)."""
    while True:
        with _waits_changed:
            while not _long_waits and not _exiting.is_set():
                _waits_changed.wait()
            if _exiting.is_set():
                return
            world = max(group.world_size for group, _ in _long_waits.values())
        if _exiting.wait(max(_WAIT_SLICE, world / _ABORT_POLLS_PER_SECOND)):
            return
        with _threads_lock:
            groups = [group for group, _ in _long_waits.values() if group._abort is None]
        for group in groups:
            try:
                aborted = _abort_posted(_store(), group._store_prefix)
            except Exception:  # noqa: BLE001 - no store: nothing known
                continue
            if aborted is not None and group._abort is None:
                group._abort = aborted


def _publish_statuses(group: BoardGroup) -> None:
    global _publisher
    try:
        store = _store()
    except Exception:  # noqa: BLE001 - no store: nobody can read it
        store = None
    if store is not None and _processes_posted.get(group._store_prefix) is not store:
        # Which process this rank is, once per process group and store (a
        # group name recurs after a re-init), at once: the status thread first
        # publishes after _STATUS_INTERVAL, and a rank may die sooner.
        # Bounded: a dead store costs this Join's entry _GONE_PATIENCE s.
        _processes_posted[group._store_prefix] = store
        key, value = f"{group._store_prefix}process/{group.rank}", json.dumps(_PROCESS)
        _bounded(lambda store: store.set(key, value), _GONE_PATIENCE)
    with _threads_lock:
        _publishing.add(group)
        if _exiting.is_set():
            return
        if _publisher is None or not _publisher.is_alive():
            _publisher = threading.Thread(target=_publish_loop, name="joinkit-status",
                                          daemon=True)
            _publisher.start()


def _publish_loop() -> None:
    while not _exiting.wait(_STATUS_INTERVAL):
        with _threads_lock:
            groups = list(_publishing)
        for group in groups:
            posted = group._post.unpublished()
            if posted is None:
                continue
            try:
                _store().set(f"{group._store_prefix}status/{group.rank}",
                             _status.encode(posted))
            except Exception:  # noqa: BLE001 - the store is gone; peers see silence
                continue
            group._post.published(posted)


def stop_threads(deadline: float) -> None:
    """Stop the status publisher, the abort watcher, the store helpers and the
    threads of :func:`start_stoppable`.

    Once stopped they stay stopped (the process is leaving): a later status
    is not published and a later store access returns ``None`` at once.

    Args:
        deadline: ``time.monotonic()`` by which to give up waiting for them.
    """
    with _waits_changed:
        _exiting.set()
        _waits_changed.notify_all()
        for stop in _stoppable.values():
            stop.set()
        threads = [t for t in (_publisher, _watcher, *_helpers, *_stoppable) if t is not None]
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
