"""What joinkit's launcher and doctor need of MPI, each collective one on ``COMM_WORLD``.

Rules of this room: ``joinkit.backends.launch`` calls these functions, which
``joinkit.backends.mpi`` exports, instead of importing mpi4py.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import Any

from ._board import _close_board
from ._elastic import lost_any
from ._library import MPI

__all__ = [
    "library_facts",
    "world_size",
    "world_layout",
    "broadcast_object",
    "any_rank",
    "gather_objects",
    "finalize_or_exit",
    "abort_world",
]

_THREAD_LEVELS = {
    "THREAD_SINGLE": "single",
    "THREAD_FUNNELED": "funneled",
    "THREAD_SERIALIZED": "serialized",
    "THREAD_MULTIPLE": "multiple",
}


def library_facts() -> dict[str, str]:
    """What ``python -m joinkit doctor`` reports of the MPI library here."""
    provided = MPI.Query_thread()
    level = next((name for name in _THREAD_LEVELS if getattr(MPI, name) == provided),
                 str(provided))
    major, minor = MPI.Get_version()
    return {
        "library": MPI.Get_library_version().strip().splitlines()[0].split(",")[0],
        "standard": f"MPI {major}.{minor}",
        "thread level": _THREAD_LEVELS.get(level, level),
    }


def world_size() -> int:
    """The size of ``COMM_WORLD``."""
    return int(MPI.COMM_WORLD.Get_size())


def world_layout(hostname: str) -> tuple[int, int, int, list[str]]:
    """This rank, the world size, the rank on this node, every rank's host (collective)."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank = node.Get_rank()
    node.Free()
    return rank, comm.Get_size(), local_rank, comm.allgather(hostname)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (collective)."""
    return MPI.COMM_WORLD.bcast(obj, root=0)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on some rank (collective, O(log W))."""
    return bool(MPI.COMM_WORLD.allreduce(flag, op=MPI.LOR))


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (collective)."""
    return list(MPI.COMM_WORLD.allgather(obj))


def finalize_or_exit(grace: float = 5.0) -> None:
    """End MPI in a process that may have survived a rank loss; call it last.

    After a rank died under ULFM, Open MPI 5's ``MPI_Finalize`` sometimes never
    returns (here about 1 run in 10, with plain mpi4py too, on every
    survivor), while a survivor that ends without it leaves ``mpirun`` with
    status 0 (10 runs of 10). So: if an elastic group of this process lost a
    rank, this stops the status board, flushes standard output and error and
    ends the process at once with status 0, without ``MPI_Finalize`` (and
    without ``atexit`` handlers: close your files first). Otherwise it calls
    ``MPI.Finalize()`` and returns, and if that has not returned within
    ``grace`` seconds, ``faulthandler``'s timer ends the process with status 1.

    Args:
        grace: seconds to wait for ``MPI_Finalize`` when no rank was lost.
    """
    if MPI.Is_finalized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if lost_any():
        _close_board()
        os._exit(0)
    with open(os.devnull, "w") as sink:
        faulthandler.dump_traceback_later(grace, exit=True, file=sink)
        try:
            MPI.Finalize()
        finally:
            faulthandler.cancel_dump_traceback_later()


def abort_world() -> None:
    """``MPI_Abort`` on ``COMM_WORLD`` where MPI runs with more than one rank."""
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

