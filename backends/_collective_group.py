"""What every backend's group offers: :class:`CollectiveGroup` and :data:`REDUCE_OPS`.

A module of its own, below the package and every backend module: the groups
(``threads``, ``mpi``, ``torch_dist``) and the shared checks (``_checks``) take
these names from here, never from the package's ``__init__``, which loads
them on demand (the import graph stays a hierarchy). Standard library and
joinkit's core only.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from joinkit.lowlevel import JoinBackend

__all__ = ["CollectiveGroup", "REDUCE_OPS"]

#: The reduce ops every group's ``all_reduce``/``reduce`` accepts.
REDUCE_OPS = ("sum", "prod", "min", "max", "band", "bor", "bxor")


@runtime_checkable
class CollectiveGroup(JoinBackend, Protocol):
    """The framework-agnostic collectives every backend's group offers.

    Buffers are NumPy arrays or torch CPU tensors and are updated in place.
    ``op`` is one of :data:`REDUCE_OPS`. With ``async_op=True`` a call returns a
    :class:`~joinkit.backends.Handle` whose ``wait()`` returns what the blocking call would have
    returned (and only then is the buffer guaranteed to hold the result; a
    second ``wait()`` returns the same) and whose ``is_completed()`` says,
    without blocking, whether the collective has completed. What every group
    accepts and refuses is decided in one place, ``backends._checks``.
    """

    device: Any

    def all_reduce(self, buf: Any, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce ``buf`` over all ranks; every rank gets the result."""
        ...

    def broadcast(self, buf: Any, src: int, async_op: bool = False) -> Any:
        """Copy ``buf`` of rank ``src`` into ``buf`` of every rank."""
        ...

    def all_gather(self, buf: Any, async_op: bool = False) -> Any:
        """Return a list of every rank's ``buf`` (new buffers, rank order)."""
        ...

    def reduce(self, buf: Any, dst: int, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce ``buf`` over all ranks into ``buf`` of rank ``dst``."""
        ...

    def gather(self, buf: Any, dst: int, async_op: bool = False) -> Any:
        """Return the list of every rank's ``buf`` on ``dst``; ``None`` elsewhere."""
        ...

    def scatter(
        self, buf: Any, src: int, chunks: Any = None, async_op: bool = False
    ) -> Any:
        """Fill ``buf`` with ``chunks[rank]`` of rank ``src`` (``chunks`` on src only)."""
        ...

    def barrier(self) -> None:
        """Return once every rank has called ``barrier``."""
        ...
