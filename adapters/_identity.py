"""One adapter per framework object, for as long as the object lives.

The adapters of ``joinkit.adapters.torch``, ``fsdp``, ``torchmetrics`` and
``optim`` keep what they learn about an object (hooks, buffers, a guard's
verdict) from one Join to the next, so each ``adapt(obj)`` returns the adapter
it made for that object before. The cache is keyed by identity (a framework
object may define ``__eq__``), holds the object only weakly, and forgets the
entry when the object is collected; an object that cannot be weakly referenced
gets a fresh adapter every time.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

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
