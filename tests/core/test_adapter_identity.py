"""``joinkit.lowlevel.AdapterCache``: one adapter per live object.

The torch, FSDP2, torchmetrics and optim adapters keep their adapters here; their
own tests check that a model keeps its adapter across Joins. These check the cache
itself, without torch.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from joinkit.lowlevel import AdapterCache


class Thing:
    """An object that, like many framework objects, says it equals any other."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


def made(log: list[Any]) -> Any:
    def make(obj: Any) -> tuple[str, int]:
        log.append(obj)
        return ("adapter", len(log))
    return make


def test_the_same_object_gets_the_same_adapter_and_equal_ones_do_not() -> None:
    cache: AdapterCache[Any] = AdapterCache()
    log: list[Any] = []
    a, b = Thing(), Thing()
    assert a == b
    first = cache.get(a, made(log))
    assert cache.get(a, made(log)) is first
    assert cache.get(b, made(log)) is not first
    assert log == [a, b] and len(cache) == 2


def test_an_entry_goes_with_its_object() -> None:
    cache: AdapterCache[Any] = AdapterCache()
    obj = Thing()
    cache.get(obj, lambda _: "adapter")  # keeps no reference to obj
    alive = weakref.ref(obj)
    del obj
    gc.collect()
    assert alive() is None and len(cache) == 0  # and the cache did not keep it alive


def test_a_reused_id_gets_a_new_adapter() -> None:
    cache: AdapterCache[Any] = AdapterCache()
    log: list[Any] = []
    obj = Thing()
    cache.get(obj, made(log))
    dead = Thing()
    ref = weakref.ref(dead)
    del dead
    gc.collect()
    # A stale entry under obj's id (as if obj's id had belonged to an object that
    # died before its finalizer ran): the weak reference tells them apart.
    cache._by_id[id(obj)] = (ref, ("stale", 0))
    assert cache.get(obj, made(log)) == ("adapter", 2)


def test_an_object_without_weak_references_gets_a_fresh_adapter_each_time() -> None:
    cache: AdapterCache[Any] = AdapterCache()
    log: list[Any] = []
    obj = 12345678901234567890  # ints cannot be weakly referenced
    first = cache.get(obj, made(log))
    assert cache.get(obj, made(log)) is not first
    assert len(cache) == 0
