"""The MPI backend's status board: out of band, on point-to-point messages.

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
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time

from .._status import Post, Posted, board_entry, status_text
from ._library import MPI

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

