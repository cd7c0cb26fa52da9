"""The threads backend: ranks as threads of one process, and joinkit's test harness.

``spawn(fn, world_size)`` runs ``fn(group)`` on one thread per rank, each with
its own :class:`ThreadGroup`; every rank's collective sequence is matched, and a
mismatch is reported as a table (:class:`~joinkit.CollectiveMismatch`) instead
of a hang. Importing this package registers :class:`ThreadGroup` with the
backend registry.

The room: ``_world`` (the rendezvous and matching of the ranks' collectives,
the group and ``spawn``), ``_mismatch`` (the mismatch table) and ``_board``
(the status board the ranks' threads share).
"""

from __future__ import annotations

from ._world import SpawnAborted, ThreadGroup, ThreadWork, spawn

__all__ = ["ThreadGroup", "ThreadWork", "SpawnAborted", "spawn"]
