"""The torch.distributed members that differ between the releases joinkit supports.

Rules of this room: this module is the one place in ``backends.torch_dist``
that knows a torch.distributed member has more than one form (or none) across
torch 2.6 and later; the rest of the room calls the functions here. Each asks
torch's objects (does the class have the method), never ``torch.__version__``.

==================================  ==========================================
What                                Forms, newest first (releases seen)
==================================  ==========================================
A store's own connection            ``Store.clone()`` (2.8 and later); before,
(:func:`own_connection`)            a new client of the same ``TCPStore``
                                    under a prefix the caller names (a
                                    ``PrefixStore``'s own prefix cannot be
                                    read back). Needed: a TCPStore client
                                    runs one request at a time, so gloo's
                                    rendezvous blocked in a ``get`` for a rank
                                    that died holds every other request on
                                    that client (the recovery's, the
                                    watcher's) for the store's timeout
``ProcessGroup.abort()``            a method (2.7 and later); none in 2.6,
(:func:`abort_group`)               where a gloo group cannot be aborted
                                    either (peers learn of an abort from the
                                    store)
``dist.get_backend(group)`` of a    ``ValueError`` or ``RuntimeError`` (2.7
group torch does not map (a raw     and later); ``TypeError`` (2.6)
group joinkit built)
(:func:`backend_name`)
==================================  ==========================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["clone_or_share", "own_connection", "abort_group", "backend_name"]


def clone_or_share(store: Any) -> Any:
    """``store.clone()`` where torch has it (2.8 and later); before, ``store`` itself.

    For a thread that reads ``store``'s own keys with short requests (a
    clone with those keys cannot be made before 2.8: :func:`own_connection`).
    """
    clone = getattr(store, "clone", None)
    return store if clone is None else clone()


def own_connection(store: Any, scope: Callable[[], str]) -> Any:
    """A store over a connection of its own, for keys that only such connections use.

    Where torch has ``Store.clone()`` (2.8 and later): the clone, with
    ``store``'s keys. Before, a new client of the ``TCPStore`` beneath
    ``store``'s ``PrefixStore``s, under the prefix ``scope()``: those prefixes
    cannot be read back before 2.8, so ``scope()`` must name ``store``'s key
    space, the same on every rank (it is called only then, and may use
    ``store``). A store with no ``TCPStore`` beneath (a ``FileStore``, a
    ``HashStore``) is returned as is, shared.

    Raises:
        What the store raises when its server does not answer.
    """
    clone = getattr(store, "clone", None)
    return clone() if clone is not None else _new_client(store, scope)


def _new_client(store: Any, scope: Callable[[], str]) -> Any:
    """:func:`own_connection` without ``Store.clone()`` (before torch 2.8)."""
    base: Any = store
    while isinstance(base, dist.PrefixStore):  # type: ignore[attr-defined]
        base = base.underlying_store
    if not isinstance(base, dist.TCPStore):  # type: ignore[attr-defined]
        return store
    fresh = dist.TCPStore(  # type: ignore[attr-defined]
        base.host, base.port, None, False, getattr(base, "timeout"),  # noqa: B009 - not in the stubs
        use_libuv=bool(getattr(base, "libuvBackend", True)))
    return dist.PrefixStore(scope(), fresh)  # type: ignore[attr-defined]


def abort_group(process_group: Any) -> None:
    """``process_group.abort()`` where the group has one (none in torch 2.6).

    Raises what the abort raises (gloo: ``RuntimeError`` or
    ``NotImplementedError`` on some releases).
    """
    abort = getattr(process_group, "abort", None)
    if abort is not None:
        abort()


def backend_name(group: Any) -> str:
    """``dist.get_backend(group)``, or ``"?"`` for a group torch does not map."""
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError, TypeError):  # TypeError: torch 2.6
        return "?"
