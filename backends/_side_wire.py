"""The side wire of joinkit's backends: a side channel's collectives on a second group.

Theory of operation
-------------------
``joinkit.SideChannel`` decides every call from headers (``joinkit._side_protocol``)
and asks its backend's *side wire* to move the data. :class:`ArrayWire` is that
wire over any :class:`~joinkit.backends.CollectiveGroup` (the threads, torch and
MPI groups; a third party's too): the backend makes a second group over the same
ranks, whose collectives never pair with the first one's, and returns
``ArrayWire(second_group)`` from its ``side_wire()``.

What travels, on every backend alike:

- a header: an int64 all-gather of ``HEADER_FIELDS`` integers;
- a reduction: the caller's buffer, flattened (a view where the memory allows,
  else a copy written back), reduced in place; an absent rank sends a 1-D
  buffer of the same number of elements and dtype holding the op's identity;
- a gather: each rank's bytes (uint8, any dtype torch or NumPy can view as
  bytes, bfloat16 too), zero-padded to the largest, in one all-gather; an
  absent rank sends zeros; each present rank's rows are cut out and viewed
  back as the caller's dtype and trailing shape. A gather of at most
  ``INLINE_BYTES`` per rank came in the headers (the plan's ``inline``): no
  all-gather. CUDA tensors travel through
  host memory (the group stages them where it needs);
- a broadcast: the root's bytes.

``gather`` and ``gather_bytes`` are the same collective on the wire, as are
``broadcast`` and ``broadcast_bytes``: an absent rank, which knows nothing of
the caller's arrays, always takes the byte form.

This module imports NumPy; torch only through the tensors it is given.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

from joinkit.lowlevel import BroadcastPlan, GatherPlan, Neutral, ReducePlan

from ._checks import is_tensor

__all__ = ["ArrayWire"]

#: The torch dtypes whose bytes NumPy reads as they are (:meth:`ArrayWire.bytes_of`).
_PLAIN = frozenset({"torch.float32", "torch.float64", "torch.int64", "torch.int32"})


class ArrayWire:
    """A side channel's wire over a second group of the Join's ranks.

    Args:
        group: a :class:`~joinkit.backends.CollectiveGroup` over the same ranks
            as the Join's group, used by nothing else.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = int(group.rank)
        self.world_size = int(group.world_size)
        #: Each thread's header buffers (:meth:`exchange`).
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"ArrayWire({self.group!r})"

    def exchange(self, header: tuple[int, ...]) -> list[tuple[int, ...]]:
        """All-gather one header; every rank's, in rank order.

        Through the group's fixed-buffer ``all_gather_into`` where it has one
        (torch, MPI): the header's bytes, into buffers of this thread's that
        every call reuses (a side call is made every step; the service thread
        has its own). Every rank of a group takes the same path: the same
        collective on the wire.
        """
        gather_into = getattr(self.group, "all_gather_into", None)
        if gather_into is None:
            parts = self.group.all_gather(np.array(header, dtype=np.int64))
            return [tuple(np.asarray(part, dtype=np.int64).tolist()) for part in parts]
        buffers = getattr(self._local, "headers", None)
        if buffers is None:
            send = np.zeros(len(header), np.int64)
            out = np.zeros((self.world_size, len(header)), np.int64)
            # The same byte views each call: the group keeps its tensors for them.
            buffers = self._local.headers = (send, send.view(np.uint8), out.view(np.uint8))
        send, send_bytes, out_bytes = buffers
        send[:] = header
        received = gather_into(send_bytes, out_bytes)
        if isinstance(received, np.ndarray):
            return [tuple(row) for row in received.view(np.int64).tolist()]
        return [tuple(np.asarray(part).view(np.int64).tolist()) for part in received]

    def layout(self, buf: Any) -> tuple[str, tuple[int, ...], int]:
        """``(dtype name, shape, nbytes)`` of a NumPy array or torch tensor.

        Raises:
            TypeError: ``buf`` is neither.
        """
        if is_tensor(buf):
            name = str(buf.dtype).rpartition(".")[2]
            return name, tuple(int(d) for d in buf.shape), int(buf.numel() * buf.element_size())
        if isinstance(buf, np.ndarray):
            return str(buf.dtype), tuple(int(d) for d in buf.shape), int(buf.nbytes)
        raise TypeError(
            f"a side channel call takes a NumPy array or a torch tensor, not "
            f"{type(buf).__qualname__} (use all_gather_object for other objects)"
        )

    # -- reductions --------------------------------------------------------------------

    def reduce(self, plan: ReducePlan, buf: Any) -> Any:
        """The plan's all-reduce into ``buf``; ``None``: the neutral part."""
        if buf is None:
            self.group.all_reduce(_identity(plan), plan.op)
            return None
        flat = buf.reshape(-1)
        self.group.all_reduce(flat, plan.op)
        if not _shares_memory(flat, buf):
            if is_tensor(buf):
                buf.copy_(flat.reshape(buf.shape))
            else:
                buf[...] = flat.reshape(buf.shape)
        return buf

    # -- gathers -----------------------------------------------------------------------

    def bytes_of(self, buf: Any) -> bytes:
        """``buf``'s bytes, as a gather sends them (a small gather's header)."""
        if is_tensor(buf) and buf.device.type == "cpu" and str(buf.dtype) in _PLAIN:
            # A logged loss, a token or flop count, every step: the tensor's own bytes.
            flat = buf.detach().reshape(-1)
            if flat.is_contiguous() and not flat.is_conj() and not flat.is_neg():
                return bytes(flat.numpy().data)
        return _bytes_of(buf).tobytes()

    def gather_bytes(self, plan: GatherPlan, data: bytes | None) -> list[bytes] | None:
        """The plan's gather of raw bytes (``None``: an absent rank's zeros)."""
        parts = self._gather(plan, None if data is None else np.frombuffer(data, np.uint8))
        if data is None:
            return None
        return [parts[rank][: plan.sizes[rank]].tobytes() for rank in plan.present]

    def gather(self, plan: GatherPlan, buf: Any) -> list[Any] | None:
        """The plan's gather of arrays: the present ranks' rows, as ``buf``'s kind."""
        if buf is None:
            self._gather(plan, None)
            return None
        trailing = tuple(buf.shape[1:])
        scalar = len(buf.shape) == 0
        parts: list[np.ndarray]
        if plan.inline is not None and is_tensor(buf):  # the headers had it all
            return [_tensor_of(buf, plan.inline[rank], plan.rows[rank], trailing, scalar)
                    for rank in plan.present]
        if plan.inline is None and plan.padded == 0:
            parts = [np.zeros(0, np.uint8)] * self.world_size
        else:  # (the bytes of an inline plan came in the headers)
            parts = self._gather(plan, None if plan.inline is not None else _bytes_of(buf))
        return [_decode(buf, parts[rank][: plan.sizes[rank]], plan.rows[rank], trailing, scalar)
                for rank in plan.present]

    def _gather(self, plan: GatherPlan, data: np.ndarray | None) -> list[np.ndarray]:
        if plan.inline is not None:  # the headers had it all
            return [np.frombuffer(part, np.uint8) for part in plan.inline]
        send = np.zeros(plan.padded, dtype=np.uint8)
        if data is not None and data.size:
            send[: data.size] = data
        return [np.asarray(part) for part in self.group.all_gather(send)]

    # -- broadcasts --------------------------------------------------------------------

    def broadcast_bytes(self, plan: BroadcastPlan, data: bytes | None) -> bytes | None:
        """The plan's broadcast of the root's bytes (``data`` on the root)."""
        buf = np.zeros(plan.size, dtype=np.uint8)
        if data is not None and self.rank == plan.root and plan.size:
            buf[:] = np.frombuffer(data, np.uint8)
        if plan.size:
            self.group.broadcast(buf, plan.root)
        return None if data is None else buf.tobytes()

    def broadcast(self, plan: BroadcastPlan, buf: Any) -> Any:
        """The plan's broadcast into ``buf``."""
        if buf is None:
            self.broadcast_bytes(plan, None)
            return None
        data = _bytes_of(buf).tobytes() if self.rank == plan.root else b""
        received = self.broadcast_bytes(plan, data)
        if self.rank != plan.root and received:
            value = _decode(buf, np.frombuffer(received, np.uint8), buf.shape[0] if buf.shape
                            else 1, tuple(buf.shape[1:]), len(buf.shape) == 0)
            if is_tensor(buf):
                buf.copy_(value)
            else:
                buf[...] = value
        return buf


def _identity(plan: ReducePlan) -> np.ndarray:
    """A buffer of ``plan.size`` elements holding the op's identity."""
    dtype = np.dtype(plan.dtype)
    neutral = plan.neutral
    value: Any
    if neutral is Neutral.ZERO:
        value = 0
    elif neutral is Neutral.ONE:
        value = 1
    elif neutral is Neutral.ALL_ONES:
        value = np.iinfo(dtype).max if dtype.kind == "u" else -1
    elif dtype.kind == "b":
        value = neutral is Neutral.HIGHEST
    elif dtype.kind == "f":
        value = np.inf if neutral is Neutral.HIGHEST else -np.inf
    else:
        info = np.iinfo(dtype)
        value = info.max if neutral is Neutral.HIGHEST else info.min
    return np.full(plan.size, value, dtype=dtype)


def _shares_memory(flat: Any, buf: Any) -> bool:
    if is_tensor(buf):
        return bool(flat.data_ptr() == buf.data_ptr()) and bool(flat.is_contiguous())
    return bool(np.shares_memory(flat, buf))


def _bytes_of(buf: Any) -> np.ndarray:
    """``buf``'s bytes as a 1-D uint8 NumPy array (host memory)."""
    if is_tensor(buf):
        torch = sys.modules["torch"]
        flat = buf.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        flat = flat.contiguous()
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        return np.asarray(flat.view(torch.uint8).numpy())
    arr = np.ascontiguousarray(buf).reshape(-1)
    return arr.view(np.uint8)


def _tensor_of(like: Any, data: bytes, rows: int, trailing: tuple[int, ...],
               scalar: bool) -> Any:
    """One rank's bytes of a small gather as a tensor of ``like``'s kind (:func:`_decode`
    without NumPy: a logged loss, a token count, every step)."""
    if not data:
        return _decode(like, np.frombuffer(data, np.uint8), rows, trailing, scalar)
    torch = sys.modules["torch"]
    wire_dtype = torch.uint8 if like.dtype == torch.bool else like.dtype
    out = torch.frombuffer(bytearray(data), dtype=wire_dtype).reshape(
        () if scalar else (rows, *trailing))
    if like.dtype == torch.bool:
        out = out.to(torch.bool)
    return out.to(like.device) if like.device.type != "cpu" else out


def _decode(like: Any, data: np.ndarray, rows: int, trailing: tuple[int, ...],
            scalar: bool) -> Any:
    """One rank's bytes as an array of ``like``'s kind, dtype and device."""
    shape = () if scalar else (rows, *trailing)
    if is_tensor(like):
        torch = sys.modules["torch"]
        if data.size == 0:
            out = torch.empty(shape, dtype=like.dtype)
        else:
            raw = torch.from_numpy(np.array(data, dtype=np.uint8))
            wire_dtype = torch.uint8 if like.dtype == torch.bool else like.dtype
            out = raw.view(wire_dtype).reshape(shape)
            if like.dtype == torch.bool:
                out = out.to(torch.bool)
        return out.to(like.device) if like.device.type != "cpu" else out
    if data.size == 0:
        return np.empty(shape, dtype=like.dtype)
    return np.array(data).view(like.dtype).reshape(shape)
