"""The MPI backend (mpi4py): joinkit's only door to mpi4py.

Importing this package registers its kinds of ``join_process_group`` (an
``mpi4py.MPI.Comm`` and an :class:`MPIGroup`); ``joinkit.backends.resolve_builtin``
imports it once the program has imported ``mpi4py.MPI``.

The room (each module's doc says more):

- ``_group``: :class:`MPIGroup`, the collectives over a communicator and the
  join backend, and the registry's factories;
- ``_library``: the guarded import of mpi4py, the datatype and op tables;
- ``_board``: the status board (a listener thread answering queries out of band);
- ``_elastic``: the recovery from a lost rank under ULFM
  (``Join(on_rank_loss="finish")``);
- ``_launcher``: what ``joinkit.backends.launch`` and the doctor need of MPI,
  and :func:`finalize_or_exit`.
"""

from __future__ import annotations

from ._group import MPIGroup
from ._launcher import (
    abort_world,
    any_rank,
    broadcast_object,
    finalize_or_exit,
    gather_objects,
    library_facts,
    world_layout,
    world_size,
)

__all__ = [
    "MPIGroup",
    "finalize_or_exit",
    "library_facts",
    "world_size",
    "world_layout",
    "broadcast_object",
    "any_rank",
    "gather_objects",
    "abort_world",
]
