"""Edges of the MPI status board, one per launch (``test_mpi_backend.py``).

    python status_board_edges.py funneled|finalize

``funneled``: MPI initialised below ``MPI_THREAD_MULTIPLE``. Posting still
works, ``peer_status`` refuses with the reason, and a stalled Join's
``RankTimeout`` says the peers' statuses are unavailable and why (rank 1
stalls; rank 0's watchdog times out and aborts the job).
``finalize``: the program calls ``MPI.Finalize()`` itself after a post; the
listener thread must stop first, so the job ends cleanly.

Each rank prints ``JOINKIT-EDGE {...}`` lines.
"""

from __future__ import annotations

import json
import sys
import time

import mpi4py

EDGE = sys.argv[1]
if EDGE == "funneled":
    mpi4py.rc.thread_level = "funneled"

from mpi4py import MPI  # noqa: E402

from joinkit.backends.mpi import MPIGroup  # noqa: E402

RANK = MPI.COMM_WORLD.Get_rank()


def emit(**line: object) -> None:
    print("JOINKIT-EDGE " + json.dumps({"rank": RANK, **line}), flush=True)


def funneled() -> None:
    from joinkit import Join

    group = MPIGroup()
    group.post_status("posted")
    try:
        group.peer_status()
    except RuntimeError as exc:
        emit(refused=str(exc))

    from joinkit import Joinable, JoinHook

    class Idle(Joinable):
        """A joinable with no collectives of its own."""

        def __init__(self) -> None:
            super().__init__()

        def join_hook(self, **kwargs: object) -> JoinHook:
            return JoinHook()

        @property
        def join_device(self) -> str:
            return "cpu"

        @property
        def join_process_group(self) -> MPIGroup:
            return group

    idle = Idle()
    # Enter together: on a loaded machine one rank may start seconds after the
    # other, and the first one's watchdog would time the launch, not the stall.
    group.barrier()
    with Join([idle], timeout=3.0):
        for _ in range(1 + group.rank):
            if group.rank == 1:
                time.sleep(30)  # rank 0 counts meanwhile: its watchdog fires
            Join.notify_join_context(idle)
    emit(left=True)  # not reached: the stall aborts the job


def finalize() -> None:
    group = MPIGroup()
    group.post_status("posted")
    seen = group.peer_status(patience=120.0)  # returns at the last answer
    group.barrier()
    from joinkit.backends.mpi import _board as mpi

    assert mpi._listener is not None and mpi._listener.is_alive()
    MPI.Finalize()
    emit(seen=seen, finalized=MPI.Is_finalized(), listening=mpi._listener.is_alive())


{"funneled": funneled, "finalize": finalize}[EDGE]()
