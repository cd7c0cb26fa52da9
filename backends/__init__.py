"""Collective backends for joinery, and the registry that picks one.

A *join backend* is the small object the Join shell talks to: it knows its
``rank`` and ``world_size`` and offers the two join collectives, both a
1-element float32 SUM all-reduce on the wire (torch's Join uses the same):

==========================  ===================================================
``heartbeat(v)``            start the all-reduce contributing ``v``; return a
                            handle with ``wait()`` (the active rank does not
                            wait for it)
``count(v)``                all-reduce contributing ``v`` and return the sum
                            (blocking)
``all_gather_object(obj)``  every rank's picklable ``obj``, in rank order
                            (agreement check at entry, failure exchange, reports)
==========================  ===================================================

Optional, each making the Join better where a backend can offer it:

==========================  ===================================================
``heartbeat_total(h)``      wait for heartbeat handle ``h``, return its sum: an
                            active rank then learns of a failed peer at its next
                            notify instead of at the end
``collectives_issued``      an int counting the group's own collectives (not
                            heartbeats or counts): tells whether a failure came
                            right after a heartbeat, before the iteration's
                            collectives, so the failing rank can match them
``abort(message)``          make peers' pending and future collectives fail
                            (used when a hook raised and the shadow is broken)
``post_status(what)``       remember what this rank's Join is doing (called on
                            entry, per join collective and on exit: keep it
                            cheap)
``peer_status()``           rank -> its last posted status, read out of band by
                            the watchdog thread for a stall diagnostic
==========================  ===================================================

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
    "init",
    "init_torch",
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

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (blocking)."""
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


# Variables only an MPI launcher sets: Open MPI's mpirun, MPICH's Hydra (also
# Intel MPI), MVAPICH's mpirun_rsh.
_MPIRUN_MARKERS = ("OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")
# Set by any PMI/PMIx process manager, srun's MPI plugins included.
_PMI_MARKERS = ("PMI_SIZE", "PMIX_RANK")
# Set for the tasks of an srun step, not for the batch script itself (whose
# SLURM_NTASKS would describe tasks that do not exist as processes yet).
_SRUN_STEP_MARKERS = ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS")


def detect_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """Name the launcher that started this process, from its environment.

    The checks go from the most to the least specific variable, because
    launchers nest: ``srun torchrun ...`` sets Slurm's variables as well as
    torchrun's, an ``mpirun`` inside an sbatch script inherits Slurm's, srun
    with an MPI plugin sets PMI variables, and ``init_torch`` under mpirun
    exports torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``.

    Args:
        environ: the environment to inspect; ``None`` means ``os.environ``.

    Returns:
        ``"torchrun"``, ``"mpirun"`` (Open MPI, MPICH/Hydra, MVAPICH or a
        PMI/PMIx process manager), ``"srun"`` (Slurm), or ``None`` when no
        launcher is detected.
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if any(key in env for key in _MPIRUN_MARKERS):
        return "mpirun"
    if (
        "SLURM_PROCID" in env
        and ("SLURM_NTASKS" in env or "SLURM_STEP_NUM_TASKS" in env)
        and any(key in env for key in _SRUN_STEP_MARKERS)
    ):
        return "srun"
    if any(key in env for key in _PMI_MARKERS):
        return "mpirun"
    if "LOCAL_RANK" in env and "WORLD_SIZE" in env:
        # torch.distributed.launch or a hand-made torchrun environment.
        return "torchrun"
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


def __getattr__(name: str) -> Any:
    # init/init_torch live in _launch (which imports attrs); load it on first
    # use so importing backends stays standard-library only.
    if name in ("init", "init_torch"):
        from . import _launch

        return getattr(_launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
