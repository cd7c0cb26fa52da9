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
import sys
from typing import Any

from joinkit.lowlevel import (
    BACKEND_ENTRY_POINTS,
    Handle,
    JoinBackend,
)
from joinkit.lowlevel import find_registered_backend as find_registered
from joinkit.lowlevel import register_backend as register
from joinkit.lowlevel import resolve_backend as resolve

from ._collective_group import REDUCE_OPS, CollectiveGroup
from ._detect import detect_launcher

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
