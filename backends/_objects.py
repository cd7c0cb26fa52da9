"""The Join's object collectives, written once over a group's array collectives.

Rules of this room: no library of its own (NumPy only, for host buffers); a
backend hands in its group, whose array collectives (``all_reduce``,
``all_gather``, ``gather``, ``broadcast``) carry the bytes, and a
:class:`Buffers` that makes the group's buffers (NumPy arrays; a torch group's
tensors on its device). Whatever the group does to its own collectives applies
to these too: a group that sequences its collectives to survive a lost rank
(MPI under ULFM) sequences these.

What each costs a rank (``W`` ranks, pickles of at most ``L`` bytes):

- :func:`all_agree`: one 2-element int64 MAX all-reduce of ``value`` and
  ``-value``: O(1).
- :func:`all_gather_object`: an all-gather of the lengths, then of the pickles
  padded to the longest: O(W L).
- :func:`gather_object`: a MAX all-reduce of the lengths, then a gather of the
  length-prefixed pickles padded to the longest: O(L) off ``dst``.
- :func:`broadcast_object`: a broadcast of the pickle's length, then of the
  pickle: O(L).

The threads backend keeps its own (one slot of the harness per call, which
its mismatch table names as a join collective).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

__all__ = ["Buffers", "HOST", "all_agree", "all_gather_object", "gather_object",
           "broadcast_object"]

#: Bytes of the length prefix of each pickle ``gather_object`` sends.
LENGTH_BYTES = 8


class _Group(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, buf: Any, op: str = "sum") -> Any: ...

    def all_gather(self, buf: Any) -> Any: ...

    def gather(self, buf: Any, dst: int) -> Any: ...

    def broadcast(self, buf: Any, src: int) -> Any: ...


class Buffers(Protocol):
    """How a group's buffers are made and read."""

    def ints(self, values: list[int]) -> Any:
        """An int64 buffer holding ``values``."""
        ...

    def read_ints(self, buf: Any) -> list[int]:
        """The values of an int64 buffer."""
        ...

    def data(self, raw: bytes | bytearray) -> Any:
        """A uint8 buffer holding ``raw`` (a copy)."""
        ...

    def read_data(self, buf: Any) -> bytes:
        """The bytes of a uint8 buffer."""
        ...


class _Host:
    """NumPy buffers on the host."""

    def ints(self, values: list[int]) -> Any:
        return np.array(values, dtype=np.int64)

    def read_ints(self, buf: Any) -> list[int]:
        return [int(v) for v in np.asarray(buf).tolist()]

    def data(self, raw: bytes | bytearray) -> Any:
        return np.frombuffer(bytes(raw), dtype=np.uint8).copy()

    def read_data(self, buf: Any) -> bytes:
        return np.asarray(buf).tobytes()


#: NumPy buffers (the MPI backend's).
HOST: Buffers = _Host()


def all_agree(group: _Group, value: int, buffers: Buffers = HOST) -> bool:
    """Whether every rank passed the same ``value`` (an int in ``[0, 2**63)``)."""
    buf = group.all_reduce(buffers.ints([value, -value]), "max")
    highest, negated_lowest = buffers.read_ints(buf)
    return bool(highest == -negated_lowest)


def _padded(payload: bytes, size: int, prefix: bool = False) -> bytearray:
    start = LENGTH_BYTES if prefix else 0
    raw = bytearray(start + size)
    if prefix:
        raw[:LENGTH_BYTES] = len(payload).to_bytes(LENGTH_BYTES, "little")
    raw[start:start + len(payload)] = payload
    return raw


def all_gather_object(group: _Group, obj: Any, buffers: Buffers = HOST,
                      loads: Callable[[bytes], Any] = pickle.loads) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank."""
    payload = pickle.dumps(obj)
    sizes = group.all_gather(buffers.ints([len(payload)]))
    lengths = [buffers.read_ints(size)[0] for size in sizes]
    parts = group.all_gather(buffers.data(_padded(payload, max(lengths))))
    return [loads(buffers.read_data(part)[:length])
            for part, length in zip(parts, lengths, strict=True)]


def gather_object(group: _Group, obj: Any, dst: int,
                  buffers: Buffers = HOST) -> list[Any] | None:
    """Every rank's picklable ``obj`` on rank ``dst`` (rank order), ``None`` elsewhere."""
    payload = pickle.dumps(obj)
    longest = group.all_reduce(buffers.ints([len(payload)]), "max")
    raw = _padded(payload, buffers.read_ints(longest)[0], prefix=True)
    parts = group.gather(buffers.data(raw), dst)
    if parts is None:
        return None
    objects = []
    for part in parts:
        data = buffers.read_data(part)
        length = int.from_bytes(data[:LENGTH_BYTES], "little")
        objects.append(pickle.loads(data[LENGTH_BYTES:LENGTH_BYTES + length]))
    return objects


def broadcast_object(group: _Group, obj: Any, src: int, buffers: Buffers = HOST) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (``src`` gets ``obj`` itself)."""
    payload = pickle.dumps(obj) if group.rank == src else b""
    length = group.broadcast(buffers.ints([len(payload)]), src)
    raw = payload if group.rank == src else bytes(buffers.read_ints(length)[0])
    data = group.broadcast(buffers.data(raw), src)
    if group.rank == src:
        return obj
    return pickle.loads(buffers.read_data(data))
