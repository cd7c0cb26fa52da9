"""Collective backends for joinery, and the registry that picks one.

A *join backend* is the small object the Join shell talks to: it knows its
``rank`` and ``world_size`` and offers the two join collectives, both a
1-element float32 SUM all-reduce on the wire (torch's Join uses the same):

==================  ===========================================================
``heartbeat(v)``    start the all-reduce contributing ``v``; return a handle
                    with ``wait()`` (the active rank does not wait for it)
``count(v)``        all-reduce contributing ``v`` and return the sum (blocking)
==================  ===========================================================

The registry maps a joinable's ``join_process_group`` (plus ``join_device``) to
such a backend. Backends that ship with joinery register themselves when their
module is imported; the module for a library is imported only once that library
is already loaded, so resolving never imports torch or mpi4py by itself.
Third parties register in code with :func:`register`, or through the entry
point group ``joinery.backends``: each entry point names a callable
``resolver(process_group, device) -> JoinBackend | None`` that returns ``None``
for groups it does not handle.

Every backend module also offers a *group*: the framework-agnostic collectives
(:class:`CollectiveGroup`) on NumPy arrays and torch CPU tensors. A group is its
own join backend, so ``join_process_group`` may simply return the group.

This module imports only the standard library.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Handle",
    "JoinBackend",
    "CollectiveGroup",
    "REDUCE_OPS",
    "detect_launcher",
    "register",
    "resolve",
    "ENTRY_POINT_GROUP",
]

ENTRY_POINT_GROUP = "joinery.backends"


@runtime_checkable
class Handle(Protocol):
    """An in-flight collective."""

    def wait(self) -> Any: ...


@runtime_checkable
class JoinBackend(Protocol):
    """What the Join shell needs from a collective library."""

    rank: int
    world_size: int

    def heartbeat(self, value: float) -> Handle:
        """Start a 1-element SUM all-reduce contributing ``value``."""
        ...

    def count(self, value: float) -> float:
        """1-element SUM all-reduce contributing ``value``; return the sum."""
        ...


REDUCE_OPS = ("sum", "prod", "min", "max", "band", "bor", "bxor")


@runtime_checkable
class CollectiveGroup(JoinBackend, Protocol):
    """The framework-agnostic collectives every backend's group offers.

    Buffers are NumPy arrays or torch CPU tensors and are updated in place.
    ``op`` is one of :data:`REDUCE_OPS`. With ``async_op=True`` a call returns a
    :class:`Handle` whose ``wait()`` returns what the blocking call would have
    returned (and only then is the buffer guaranteed to hold the result).
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


def detect_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """Name the launcher that started this process, from its environment.

    Returns:
        ``"torchrun"``, ``"mpirun"`` (Open MPI, MPICH/Hydra or PMIx),
        ``"srun"`` (Slurm), or ``None`` when no launcher is detected.
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env or ("LOCAL_RANK" in env and "WORLD_SIZE" in env):
        return "torchrun"
    if any(
        key in env
        for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
    ):
        return "mpirun"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return "srun"
    return None


Factory = Callable[[Any, Any], JoinBackend]
Resolver = Callable[[Any, Any], "JoinBackend | None"]

# (matcher, factory): matcher is a type (isinstance) or a predicate.
_registered: list[tuple[type | Callable[[Any], bool], Factory]] = []
# library module that must already be loaded -> our module that registers itself
_BUILTIN = {
    "torch.distributed": "backends.torch_dist",
    "mpi4py.MPI": "backends.mpi",
}
_entry_point_resolvers: list[Resolver] | None = None


def register(kind: type | Callable[[Any], bool], factory: Factory) -> None:
    """Teach the registry a new kind of process group.

    Args:
        kind: a type (groups that are instances of it match) or a predicate
            ``kind(process_group) -> bool``.
        factory: ``factory(process_group, device) -> JoinBackend``.

    Later registrations win over earlier ones, so a third party can override
    a built-in backend for its own subclass.
    """
    _registered.insert(0, (kind, factory))


def _matches(kind: type | Callable[[Any], bool], group: Any) -> bool:
    if isinstance(kind, type):
        return isinstance(group, kind)
    return bool(kind(group))


def _load_builtins() -> None:
    for library, module in _BUILTIN.items():
        if library in sys.modules and module not in sys.modules:
            importlib.import_module(module)


def _load_entry_points() -> list[Resolver]:
    global _entry_point_resolvers
    if _entry_point_resolvers is None:
        _entry_point_resolvers = [
            ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP)
        ]
    return _entry_point_resolvers


def resolve(process_group: Any, device: Any = None) -> JoinBackend:
    """Return the join backend for a joinable's process group and device.

    Args:
        process_group: the joinable's ``join_process_group``.
        device: the joinable's ``join_device``.

    Returns:
        A :class:`JoinBackend`.

    Raises:
        TypeError: no registered backend handles this kind of process group.
    """
    _load_builtins()
    for kind, factory in _registered:
        if _matches(kind, process_group):
            return factory(process_group, device)
    for resolver in _load_entry_points():
        backend = resolver(process_group, device)
        if backend is not None:
            return backend
    raise TypeError(
        f"joinery has no backend for a join_process_group of type "
        f"{type(process_group).__module__}.{type(process_group).__qualname__}. "
        "Use a torch.distributed ProcessGroup, an mpi4py communicator or a "
        "backends.threads group, or register a backend for this type with "
        "backends.register(kind, factory) or the 'joinery.backends' entry point "
        "group."
    )
