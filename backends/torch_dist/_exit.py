"""A TorchGroup's clean exit: gloo's worker threads never free a Python object at finalization.

Theory of operation (``torch_dist``'s module doc, "Leaving the interpreter",
has the why). Every collective's tensors are held here (``_hold``) until torch
lets go of them; every ``TorchGroup`` registers in ``_groups``. The exit
guard, ``settle_at_exit`` (registered with ``atexit`` when this module is
imported, so before finalization), stops the store threads
(``_board.stop_threads``), keeps every tensor still held alive through
exit, and waits, the GIL released, until gloo's worker threads are idle
(``_runloops_idle`` reads each ``pt_gloo_runloop`` thread's system call from
``/proc``). If a collective is still pending it keeps every process group
alive through exit too.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import _board


class ExitGroup(Protocol):
    """What the exit guard takes from a ``TorchGroup`` (this module sits below
    ``_group``, which imports it): its one-element buffers, their latest works,
    its process group."""

    process_group: Any
    _beats: tuple[torch.Tensor, torch.Tensor]
    _beat_works: list[Any]
    _tally: torch.Tensor
    _count_work: Any
    _barrier_buf: torch.Tensor
    _barrier_work: Any

#: worker threads to finish their collectives (module doc).
_EXIT_PATIENCE = 5.0


# Every TorchGroup of the process; the staged tensors of collectives in flight,
# as [work or None, *tensors], oldest first; the length at which _hold next
# looks at every entry (not just the oldest).
_groups: weakref.WeakSet[ExitGroup] = weakref.WeakSet()
_held: collections.deque[list[Any]] = collections.deque()
_held_lock = threading.Lock()
_prune_at = 64
# What the exit guard keeps alive through finalization (one reference that
# nothing releases: finalization frees none of it), and its verdict.
_kept: list[Any] = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_kept))
_settled: bool | None = None
_use_count: Callable[[torch.Tensor], int] | None = getattr(torch.Tensor, "_use_count", None)


def _hold(work: Any, *tensors: torch.Tensor) -> Any:
    """Keep ``tensors`` referenced until torch lets go of them; return ``work``.

    Called with every collective's tensors right after it is issued. The
    oldest entries are dropped as torch lets go of them (usually one entry
    per call: the previous collective's), and all of them once the list grows
    (async work waited out of order), so little outlives its collective.
    """
    global _prune_at
    with _held_lock:
        while _held and _let_go(_held[0]):
            _held.popleft()
        _held.append([work, *tensors])
        if len(_held) >= _prune_at:
            kept = [entry for entry in _held if not _let_go(entry)]
            _held.clear()
            _held.extend(kept)
            _prune_at = max(64, 2 * len(_held))
    return work


def _let_go(entry: list[Any]) -> bool:
    """Whether torch holds none of the entry's tensors any more.

    Drops the entry's handle on its work once the work completed: the worker
    thread may still hold its own reference for a moment, and the tensors stay
    referenced here until it has let go too.
    """
    work = entry[0]
    if work is not None:
        if not work.is_completed():
            return False
        entry[0] = None
    if _use_count is None:  # an older torch: completion is all we can know
        return True
    return all(_use_count(tensor) == 1 for tensor in entry[1:])


def _group_entries(group: ExitGroup) -> list[list[Any]]:
    """The group's one-element buffers with their latest works, taken from it."""
    entries = [
        [group._beat_works[0], group._beats[0]],
        [group._beat_works[1], group._beats[1]],
        [group._count_work, group._tally],
        [group._barrier_work, group._barrier_buf],
    ]
    group._beat_works = [None, None]
    group._count_work = group._barrier_work = None
    return entries


# The futex system call's number, where /proc/self/task/*/syscall can be read.
_FUTEX = {"x86_64": "202", "aarch64": "98"}.get(os.uname().machine)


def _runloops_idle() -> bool | None:
    """Whether every gloo worker thread of this process waits for work.

    An idle worker (``ProcessGroupGloo::runLoop``) waits on its group's
    condition variable with no timeout, holding no work; one inside a
    collective waits with the group's timeout, and one finishing a collective
    is running or waits (with a timeout) for the GIL. Linux only: ``None``
    where ``/proc`` cannot tell.
    """
    if _FUTEX is None:
        return None
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    seen = False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() != "pt_gloo_runloop":
                    continue
            with open(f"/proc/self/task/{task}/syscall") as f:
                call = f.read().split()  # number, six arguments, stack, pc
        except OSError:
            continue  # the thread ended, or the kernel will not say
        seen = True
        # futex(uaddr, op, val, timeout=NULL, ...)
        if len(call) < 5 or call[0] != _FUTEX or call[4] != "0x0":
            return False
    return True if seen else None


def settle_at_exit(patience: float = _EXIT_PATIENCE) -> bool:
    """Leave nothing for gloo's worker threads to free once Python finalizes.

    Registered with ``atexit`` when this module is imported (module doc):
    stops the status thread, the abort watcher and the store helpers, keeps
    the tensors of every ``TorchGroup`` collective still held alive through
    exit (so no worker thread ever frees them), and waits up to ``patience`` seconds, the GIL
    released, until gloo's worker threads are idle, which settles collectives
    that other code issued too. Later calls return the first call's answer.
    Call it yourself only once the process is done with torch.distributed:
    the status thread and store helpers stay stopped.

    Args:
        patience: seconds to wait in all.

    Returns:
        ``True`` if everything settled; ``False`` if a collective was still
        pending (a peer never joined it) or a worker thread stayed busy: then
        every process group is kept alive through exit too, so that no group
        destructor joins a blocked worker thread.
    """
    global _settled
    if _settled is not None:
        return _settled
    deadline = time.monotonic() + patience
    _board.stop_threads(deadline)
    with _held_lock:
        entries = list(_held)
        _held.clear()
    groups = list(_groups)
    for group in groups:
        entries += _group_entries(group)
    _keep_through_exit(entries)
    # A collective of ours still pending keeps a worker thread blocked for
    # good (its peer never joined it): nothing to wait for.
    settled = all(entry[0] is None or entry[0].is_completed() for entry in entries)
    idle_polls = 0
    while settled:
        idle = _runloops_idle()
        if idle is None:  # cannot tell: a moment for a worker finishing a collective
            time.sleep(0.05)
            break
        # Three idle looks in a row: a worker woken for queued work shows up.
        idle_polls = idle_polls + 1 if idle else 0
        if idle_polls >= 3:
            break
        if time.monotonic() >= deadline:
            settled = False
            break
        time.sleep(0.005)
    if not settled:
        _keep_through_exit([group.process_group for group in groups])
        try:
            _keep_through_exit(list(dist.distributed_c10d._world.pg_map))
        except AttributeError:
            pass
    _settled = settled
    return settled


def _keep_through_exit(objects: list[Any]) -> None:
    """Make ``objects`` outlive the interpreter.

    They go into ``_kept``, which finalization never frees: a worker thread
    that lets go of a collective late finds its tensors still owned by
    Python, and no group destructor joins a worker thread blocked in a
    collective.
    """
    _kept.extend(objects)


atexit.register(settle_at_exit)
