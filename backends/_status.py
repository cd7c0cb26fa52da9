"""Status boards: what each rank's Join posts, whatever carries it to the peers.

Theory of operation
-------------------
A rank's Join posts what it is doing (``post_status(what)``: the text and the
time it was posted), and its watchdog thread beats (``post_beat()``: a new
number from this process's sequence, so a restarted group never repeats one).
The peers read the board in two ways: ``peer_status()`` gives every rank's
text for a stall diagnostic, ``"{what} ({age} s ago)"`` or ``"no status
posted"``; ``peer_board(ranks)`` gives entries ``(what, age in seconds,
beat)`` for the watchdog's policy and the drain's progress line, only for the
ranks that posted a status.

This module holds what does not depend on the transport: :class:`Posted` (one
entry: the text, when it was posted, the latest beat), its encoding for a
key-value store (:func:`encode`, :func:`decode`: JSON ``{"what", "at",
"beat"}``), the age, the text and the board tuple of an entry
(:func:`status_text`, :func:`board_entry`), and a rank's own record of what it
posted (:class:`Post`). The transports stay with their backends:
``backends.torch_dist`` publishes entries to the store from a daemon thread and
reads them back; ``backends.mpi`` answers point-to-point queries from a
listener thread; ``backends.threads`` shares one dict between its threads. So
this module imports neither torch nor mpi4py.

*Clocks.* An entry's time is read by the posting rank's clock. Over a store
(torch) the reader computes the age, so that clock is ``time.time()``, which
hosts share; where the poster computes the age itself (MPI's listener, the
threads of one process) it is ``time.monotonic()``. An age is never negative
(clocks of two hosts may disagree by a little).

*Processes.* A rank also posts, once, which process it is
(:func:`this_process`: pid, host name, start time), so that after a
collective fails its peers can tell a rank whose process is gone (SIGKILL,
the out-of-memory killer) from one that is merely silent
(:func:`gone_text`). Only a peer on the same host can look; a pid that now
belongs to another process (a different start time), to a process in
``exit()`` or to a zombie counts as gone.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
from collections.abc import Callable

import attrs

#: What ``peer_status`` says of a rank whose Join has posted nothing.
NO_STATUS = "no status posted"

# This process's beat numbers (post_beat): a restarted group never repeats one.
_beat_numbers = itertools.count(1)


@attrs.frozen(kw_only=True)
class Posted:
    """One rank's board entry as posted.

    Attributes:
        what: what its Join last posted.
        at: when, by the posting rank's clock (module doc).
        beat: its latest liveness number, ``None`` before its first beat.
    """

    what: str
    at: float
    beat: int | None = None


def age(posted: Posted, now: float) -> float:
    """Seconds since ``posted`` was posted, by a clock that reads ``now``; never negative."""
    return max(0.0, now - posted.at)


def status_text(posted: Posted | None, now: float) -> str:
    """An entry as ``peer_status`` shows it: ``"{what} (1.5 s ago)"``, or :data:`NO_STATUS`."""
    if posted is None:
        return NO_STATUS
    return f"{posted.what} ({age(posted, now):.1f} s ago)"


def board_entry(posted: Posted, now: float) -> tuple[str, float, int | None]:
    """An entry as ``peer_board`` returns it: (status, its age, beat)."""
    return posted.what, age(posted, now), posted.beat


def encode(posted: Posted) -> str:
    """``posted`` as a store value (JSON)."""
    return json.dumps({"what": posted.what, "at": posted.at, "beat": posted.beat})


def decode(value: bytes | str) -> Posted:
    """A store value that :func:`encode` made."""
    fields = json.loads(value)
    beat = fields.get("beat")
    return Posted(what=str(fields["what"]), at=float(fields["at"]),
                  beat=None if beat is None else int(beat))


class Post:
    """A rank's own entry on one group's board: its latest status and beat.

    Written by the rank's Join (:meth:`status`) and its watchdog thread
    (:meth:`beat`), read by the transport's thread (:meth:`read`); the lock
    makes a read see a status and a beat that were both current at once.

    Args:
        clock: what stamps a status (module doc: ``time.time`` where peers
            compute the age, ``time.monotonic`` where this process does).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._status: tuple[str, float] | None = None
        self._beat: int | None = None
        self._published: Posted | None = None

    def status(self, what: str) -> None:
        """Record what this rank's Join is doing, stamped now."""
        status = (what, self._clock())
        with self._lock:
            self._status = status

    def beat(self) -> None:
        """Take a new number of this process's beat sequence."""
        number = next(_beat_numbers)
        with self._lock:
            self._beat = number

    def read(self) -> Posted | None:
        """The entry to show the peers; ``None`` until a status is posted."""
        with self._lock:
            status, beat = self._status, self._beat
        if status is None:
            return None
        return Posted(what=status[0], at=status[1], beat=beat)

    def unpublished(self) -> Posted | None:
        """The entry, if it changed since :meth:`published` (for a publishing thread)."""
        posted = self.read()
        return None if posted is None or posted == self._published else posted

    def published(self, posted: Posted) -> None:
        """Note that the peers can now read ``posted`` (it was stored)."""
        self._published = posted


#: The kernel's task flag of a process in ``exit()``, set before its files are
#: closed (field 9 of ``/proc/PID/stat``): a SIGKILLed rank's peers see its
#: sockets close while it is still tearing down, before it is a zombie.
_PF_EXITING = 0x4


def _started(pid: int) -> int | None:
    """``pid``'s start time (clock ticks since boot, /proc), or ``None`` where unknown.

    Raises:
        ProcessLookupError: there is no such process, or it is exiting or a
            zombie.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    except OSError:  # no /proc (not Linux): ask the kernel below
        os.kill(pid, 0)
        return None
    if fields[0] in (b"Z", b"X"):  # killed, not yet reaped by its parent
        raise ProcessLookupError(pid)
    if int(fields[6]) & _PF_EXITING:  # in exit(): its sockets may be closed already
        raise ProcessLookupError(pid)
    return int(fields[19])  # field 22 of stat; fields[0] is field 3


def this_process() -> dict[str, object]:
    """This process as a rank posts it: ``{"pid", "host", "started"}``."""
    pid = os.getpid()
    try:
        started = _started(pid)
    except (OSError, ValueError, IndexError):
        started = None
    return {"pid": pid, "host": socket.gethostname(), "started": started}


def gone_text(process: dict[str, object]) -> str | None:
    """``"pid 4242 on node0"`` if the process that :func:`this_process` gave
    (on another rank) no longer runs; ``None`` if it runs, or if this process
    cannot tell (another host, no such permission, a malformed entry)."""
    pid, host, started = process.get("pid"), process.get("host"), process.get("started")
    if not isinstance(pid, int) or host != socket.gethostname():
        return None
    try:
        now = _started(pid)
    except ProcessLookupError:
        return f"pid {pid} on {host}"
    except (OSError, ValueError, IndexError):  # PermissionError: it runs, as another user
        return None
    if started is not None and now is not None and now != started:  # the pid was reused
        return f"pid {pid} on {host}"
    return None
