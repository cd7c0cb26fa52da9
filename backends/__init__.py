"""Collective backends for joinkit, and the registry that picks one.

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
``all_agree(v)``            whether every rank passed the same int ``v`` (one
                            small all-reduce; the agreement check at entry)
``gather_object(obj, dst)`` every rank's ``obj`` on ``dst`` only, ``None``
                            elsewhere (``Join.gather_report``)
``broadcast_object``        ``broadcast_object(obj, src)``: ``src``'s ``obj`` on
                            every rank (with ``gather_object``: the failure
                            exchange)
``post_beat()``             show the peers this rank is alive (the watchdog
                            thread calls it every tenth of the timeout; no I/O
                            on the caller's thread, a background one publishes)
``peer_board(ranks)``       rank -> (last posted status, its age, latest beat),
                            for those of ``ranks`` with an entry, read out of
                            band by the watchdog thread: without it the
                            default timeout is a hard limit of 30 min
``aborted``                 ``(rank, reason)`` of an abort this rank knows of
                            (no I/O), or ``None``
``gone_peers()``            rank -> e.g. ``"pid 4242 on node0"`` for the peers
                            whose process no longer runs; asked once when an
                            error leaves the Join, noted on it (within about a
                            second; never raises)
==========================  ===================================================

Without the last three the Join uses ``all_gather_object``, which costs every
rank O(world size) bytes and unpickling; with them a rank's entry, report and
failure exchange cost O(1) (the root of a gather excepted).

The registry, which the core owns (``joinkit.lowlevel``; :func:`register` and
:func:`resolve` here are its ``register_backend`` and ``resolve_backend``), maps a joinable's
``join_process_group`` (plus ``join_device``) to such a backend. Backends that
ship with joinkit register themselves when their module is imported; the
registry reaches them through this package's entry point
(:func:`resolve_builtin`), which imports the module for a library only once
that library is already loaded, so resolving never imports torch or mpi4py by
itself. Third parties register in code with :func:`register`, or through the
entry point group ``joinkit.backends``: each entry point names a callable
``resolver(process_group, device) -> JoinBackend | None`` that returns ``None``
for groups it does not handle.

Every backend module also offers a *group*: the framework-agnostic collectives
(:class:`CollectiveGroup`) on NumPy arrays and torch CPU tensors. A group is its
own join backend, so ``join_process_group`` may simply return the group.

This module imports only the standard library and joinkit's core.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from joinkit.lowlevel import (
    BACKEND_ENTRY_POINTS,
    Handle,
    JoinBackend,
)
from joinkit.lowlevel import find_registered_backend as find_registered
from joinkit.lowlevel import register_backend as register
from joinkit.lowlevel import resolve_backend as resolve

__all__ = [
    "Handle",
    "JoinBackend",
    "CollectiveGroup",
    "REDUCE_OPS",
    "detect_launcher",
    "register",
    "resolve",
    "ENTRY_POINT_GROUP",
    "resolve_builtin",
    "init",
    "init_torch",
    "gloo_interface",
    "is_tensor",
    "shares_elements",
    "ArrayWire",
]

ENTRY_POINT_GROUP = BACKEND_ENTRY_POINTS


REDUCE_OPS = ("sum", "prod", "min", "max", "band", "bor", "bxor")


@runtime_checkable
class CollectiveGroup(JoinBackend, Protocol):
    """The framework-agnostic collectives every backend's group offers.

    Buffers are NumPy arrays or torch CPU tensors and are updated in place.
    ``op`` is one of :data:`REDUCE_OPS`. With ``async_op=True`` a call returns a
    :class:`Handle` whose ``wait()`` returns what the blocking call would have
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


# Variables only an MPI launcher sets: Open MPI's mpirun, MPICH's Hydra (also
# Intel MPI), MVAPICH's mpirun_rsh.
_MPIRUN_MARKERS = ("OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")
# Set by any PMI/PMIx process manager, srun's MPI plugins included.
_PMI_MARKERS = ("PMI_SIZE", "PMIX_RANK")
# Set for the tasks of an srun step, not for the batch script itself (whose
# SLURM_NTASKS would describe tasks that do not exist as processes yet).
_SRUN_STEP_MARKERS = ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS")
# Set by Ray in every process of a Ray worker (and inherited by its
# subprocesses); a Ray Train worker (TorchTrainer) also has torchrun's
# RANK/WORLD_SIZE/LOCAL_RANK and MASTER_ADDR/MASTER_PORT, but no
# TORCHELASTIC_RUN_ID: its rank 0 *process* serves the store at MASTER_PORT.
_RAY_WORKER_MARKERS = ("RAY_RAYLET_PID",)
_RAY_TRAIN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def detect_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """Name the launcher that started this process, from its environment.

    The checks go from the most to the least specific variable, because
    launchers nest: ``srun torchrun ...`` sets Slurm's variables as well as
    torchrun's, an ``mpirun`` inside an sbatch script inherits Slurm's, srun
    with an MPI plugin sets PMI variables, and ``init_torch`` under mpirun
    exports torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``.

    Args:
        environ: the environment to inspect; ``None`` means ``os.environ``.

    A Ray Train worker (``ray.train.torch.TorchTrainer``; ``RAY_RAYLET_PID``
    with torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, which Ray
    Train sets, and no ``TORCHELASTIC_RUN_ID``) and any subprocess of one is
    ``"ray"``; a torchrun or mpirun started inside a Ray task is still that
    launcher.

    Returns:
        ``"torchrun"``, ``"mpirun"`` (Open MPI, MPICH/Hydra, MVAPICH or a
        PMI/PMIx process manager), ``"srun"`` (Slurm), ``"ray"`` (a Ray Train
        worker or its subprocess), or ``None`` when no launcher is detected.
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
    if any(key in env for key in _RAY_WORKER_MARKERS) and all(
        key in env for key in _RAY_TRAIN_VARIABLES
    ):
        return "ray"
    if "LOCAL_RANK" in env and "WORLD_SIZE" in env:
        # torch.distributed.launch or a hand-made torchrun environment.
        return "torchrun"
    return None


# library module that must already be loaded -> our module that registers itself
_BUILTIN = {
    "torch.distributed": "joinkit.backends.torch_dist",
    "mpi4py.MPI": "joinkit.backends.mpi",
}


def resolve_builtin(process_group: Any, device: Any) -> JoinBackend | None:
    """The ``joinkit.backends`` entry point of joinkit's own backends.

    Imports the backend module of each library that is already loaded (torch,
    mpi4py); the module registers its kinds of group in code, and the registry
    is asked again. Nothing is imported for a library nobody loaded.
    """
    loaded = False
    for library, module in _BUILTIN.items():
        if library in sys.modules and module not in sys.modules:
            importlib.import_module(module)
            loaded = True
    return find_registered(process_group, device) if loaded else None


def __getattr__(name: str) -> Any:
    # init/init_torch/gloo_interface live in the launch package, and is_tensor and
    # shares_elements in _checks (NumPy), which import this package: load them on
    # first use.
    if name in ("init", "init_torch", "gloo_interface"):
        from . import launch

        return getattr(launch, name)
    if name in ("is_tensor", "shares_elements"):
        from . import _checks

        return getattr(_checks, name)
    if name == "ArrayWire":  # a SideChannel's wire over any CollectiveGroup (imports NumPy)
        from ._side_wire import ArrayWire

        return ArrayWire
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
