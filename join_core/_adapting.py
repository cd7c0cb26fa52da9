"""What every framework adapter needs: one adapter per live object, the object
held weakly, and the Join's config seen as entry and exit.

Rules of this room: the standard library and the core's own values only; an
adapter (a joinkit Joinable standing for a framework object) subclasses
:class:`AdapterJoinable` and fills in its hooks, and keeps its adapters in an
:class:`AdapterCache`. Both are public for plug-in authors through
``joinkit.lowlevel``.

Theory of operation
-------------------
The Join sets ``joinable._join_config`` on entry (an enabled config naming the
Join) and the disabled one on exit. An adapter must act on those two edges,
install its hooks on the framework object on entry, take them away on exit,
and may refuse an entry (before any collective, the same on every rank as the
settings agree). :class:`AdapterJoinable` turns the assignments into calls, in
this order:

- ``join_entering(config)``: an entry is about to happen; raise to refuse it
  (the config is not set, so the adapter stays outside);
- the config is set, then ``join_config_set(config)`` on every assignment
  (mirror it somewhere, e.g. onto a torch joinable's own ``_join_config``);
- ``join_entered(join)`` on the entry edge, ``join_left()`` on the exit edge.

The cache is keyed by identity (a framework object may define ``__eq__``),
holds the object only weakly and forgets the entry when the object is
collected; an object that cannot be weakly referenced gets a fresh adapter
every time (and is then held strongly by it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from ._errors import LocalProtocolError
from ._joinable import _DISABLED, Joinable, JoinConfig

if TYPE_CHECKING:
    from ._join import Join

__all__ = ["AdapterCache", "AdapterJoinable"]

A = TypeVar("A")


class AdapterCache(Generic[A]):
    """The adapter made for each live object (see the module doc)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref[Any], A]] = {}

    def get(self, obj: Any, make: Callable[[Any], A]) -> A:
        """``obj``'s adapter: the one made for it before, else ``make(obj)``."""
        entry = self._by_id.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        adapter = make(obj)
        try:
            ref = weakref.ref(obj)
        except TypeError:  # not weak-referenceable: a fresh adapter every time
            return adapter
        # A dead object's id may be reused: the weak reference tells them apart,
        # and the entry goes with its object.
        weakref.finalize(obj, self._by_id.pop, id(obj), None)
        self._by_id[id(obj)] = (ref, adapter)
        return adapter

    def __len__(self) -> int:
        return len(self._by_id)


def _inside(config: JoinConfig) -> bool:
    return config.enable and config.join is not None


class AdapterJoinable(Joinable):
    """Base of a joinkit Joinable standing for one framework object.

    Holds the object weakly (a cached adapter never keeps a model alive) and
    turns the Join's config assignments into the hooks below (module doc).
    Subclasses implement ``join_hook``, ``join_device`` and
    ``join_process_group`` as any Joinable, and override the hooks they need.

    Args:
        obj: the framework object.

    Attributes:
        describes: what the object is, for the message when it was deleted
            (a class attribute, e.g. ``"FSDP module"``).
    """

    describes = "object"

    def __init__(self, obj: Any) -> None:
        # Not Joinable.__init__: its assignment would run the hooks.
        try:
            self._obj: Callable[[], Any] = weakref.ref(obj)
        except TypeError:
            self._obj = lambda: obj
        self._config: JoinConfig = _DISABLED

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.obj).__qualname__})"

    @property
    def obj(self) -> Any:
        """The framework object this adapter stands for.

        Raises:
            LocalProtocolError: the object was deleted.
        """
        obj = self._obj()
        if obj is None:
            raise LocalProtocolError(
                f"the {self.describes} behind {type(self).__name__} was deleted")
        return obj

    @property
    def _join_config(self) -> JoinConfig:
        return self._config

    @_join_config.setter
    def _join_config(self, config: JoinConfig) -> None:
        entering = _inside(config) and not _inside(self._config)
        leaving = _inside(self._config) and not _inside(config)
        if entering:
            assert config.join is not None
            self.join_entering(config)
        self._config = config
        self.join_config_set(config)
        if entering:
            assert config.join is not None
            self.join_entered(cast("Join", config.join))  # the Join that set the config
        elif leaving:
            self.join_left()

    def join_entering(self, config: JoinConfig) -> None:
        """An entry is about to happen; raise (``ValueError``) to refuse it."""

    def join_config_set(self, config: JoinConfig) -> None:
        """The Join set ``config`` (on every assignment, after entering checks)."""

    def join_entered(self, join: Join) -> None:
        """The adapter is now inside ``join``: install what it needs."""

    def join_left(self) -> None:
        """The adapter left its Join: take away what ``join_entered`` installed."""
