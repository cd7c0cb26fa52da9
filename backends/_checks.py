"""What every group checks before a collective, in one place, in the same words.

Theory of operation
-------------------
Each backend module (``threads``, ``torch_dist``, ``mpi``) only adapts its
library; what a caller may pass is decided here, so the same call is accepted
by every backend or refused by every backend with the same exception and the
same message. A group holds one :class:`Checks` (its rank, world size and
device) and calls the method named after the collective first thing, before
any communication: a refusal then leaves the ranks in step.

The rules, and why:

- *Buffers* are NumPy arrays or torch tensors (``nn.Parameter`` too), on the
  CPU or on the group's device, strided, of a dtype in :data:`DTYPES`: the
  dtypes every backend can send (MPI has no float16 or bfloat16, gloo no
  uint16/32/64). Non-contiguous buffers are accepted everywhere; a backend
  whose library needs contiguous memory copies (:func:`contiguous`) and
  writes the result back.
- A collective that writes into ``buf`` on *some* rank (``all_reduce``,
  ``broadcast``, ``reduce``, ``scatter``) refuses a read-only ``buf`` on
  *every* rank, so a program that passes the same kind of buffer everywhere
  fails on every rank, not on the root alone while the others wait. It
  refuses, the same way, a ``buf`` whose elements share memory (a stride of
  0, as ``expand()``, ``np.broadcast_to`` or ``as_strided`` make): no result
  can be written into it (each element would get the last value written to
  its address), and handed to a library as it is, gloo writes ``numel``
  elements from its first address and corrupts the heap
  (``docs/reliability.md``, "A heap corruption"). Read, such a buffer is
  fine: it goes out as a contiguous copy.
- *Reduce ops* (:data:`backends.REDUCE_OPS`): every op on bool (logical:
  ``sum``/``max``/``bor`` are OR, ``prod``/``min``/``band`` AND, ``bxor``
  XOR) and integer buffers; the arithmetic ones on floats; on complex buffers
  ``sum`` only: torch sends complex numbers as pairs of reals, where only the
  sum is elementwise, and nothing orders complex numbers.
- *Roots* (``src``, ``dst``) are ints (``operator.index``) naming a rank of
  the group.
- *Scatter chunks* are given on the source rank only: ``world_size`` buffers
  shaped like ``buf`` or one buffer of shape ``(world_size, *buf.shape)``,
  each of ``buf``'s dtype.

This module imports NumPy and joinkit only: a tensor exists only once torch
is imported, so it is recognised by its type's module, and torch is taken
from ``sys.modules`` where a tensor must be written.
"""

from __future__ import annotations

import operator
import sys
from typing import Any

import numpy as np

from ._collective_group import REDUCE_OPS

__all__ = ["Checks", "DTYPES", "contiguous", "host_array", "is_tensor", "shares_elements",
           "write_back"]

#: The dtypes every backend can send, by NumPy name (a tensor's dtype is
#: ``torch.<name>``).
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "float32", "float64",
          "complex64", "complex128")
_DTYPES = {np.dtype(name) for name in DTYPES}
_ARITHMETIC = ("sum", "prod", "min", "max")
_COMPLEX = ("sum",)

# type -> whether it is a torch tensor type; filled on first sight of a type.
_is_tensor_type: dict[type, bool] = {np.ndarray: False}


def is_tensor(buf: Any) -> bool:
    """Whether ``buf`` is a torch tensor (or a subclass), without importing torch."""
    kind = type(buf)
    known = _is_tensor_type.get(kind)
    if known is None:
        known = any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in kind.__mro__)
        _is_tensor_type[kind] = known
    return known


def _dtype_name(buf: Any) -> str:
    """``buf``'s dtype as it spells it: ``float32`` or ``torch.float32``."""
    return str(buf.dtype)


def _numpy_dtype(buf: Any) -> np.dtype[Any] | None:
    """``buf``'s dtype as a NumPy dtype of :data:`DTYPES`, or ``None``."""
    if is_tensor(buf):
        name = str(buf.dtype).rpartition(".")[2]
        return np.dtype(name) if name in DTYPES else None
    return buf.dtype if buf.dtype in _DTYPES else None


class Checks:
    """The checks of one group, run first thing in each of its collectives.

    Each method raises ``TypeError`` (a value of the wrong kind: buffer type,
    dtype, device, op for the dtype, root type) or ``ValueError`` (a value
    out of range: unknown op, root not a rank, read-only buffer, chunk count
    or shape) with a message that starts with the collective's name.

    Args:
        rank: the group's rank.
        world_size: the group's size.
        device: where the group's collectives run (``"cpu"``, or a torch
            device); tensors on the CPU or on this device are accepted.
    """

    __slots__ = ("rank", "world_size", "device")

    def __init__(self, rank: int, world_size: int, device: Any = "cpu") -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device

    # -- one method per collective -------------------------------------------------

    def all_reduce(self, buf: Any, op: Any) -> np.dtype[Any]:
        """Returns: ``buf``'s dtype as a NumPy dtype."""
        dtype = self.buffer(buf, "all_reduce", receives=True)
        self.reduce_op(op, buf, dtype, "all_reduce")
        return dtype

    def broadcast(self, buf: Any, src: Any) -> int:
        """Returns: ``src`` as an int."""
        self.buffer(buf, "broadcast", receives=True)
        return self.root(src, "src", "broadcast")

    def all_gather(self, buf: Any) -> np.dtype[Any]:
        return self.buffer(buf, "all_gather", receives=False)

    def reduce(self, buf: Any, dst: Any, op: Any) -> tuple[int, np.dtype[Any]]:
        """Returns: ``dst`` as an int, and ``buf``'s dtype as a NumPy dtype."""
        dtype = self.buffer(buf, "reduce", receives=True)
        dst = self.root(dst, "dst", "reduce")
        self.reduce_op(op, buf, dtype, "reduce")
        return dst, dtype

    def gather(self, buf: Any, dst: Any) -> int:
        """Returns: ``dst`` as an int."""
        self.buffer(buf, "gather", receives=False)
        return self.root(dst, "dst", "gather")

    def scatter(self, buf: Any, src: Any, chunks: Any) -> tuple[int, list[Any] | None]:
        """Returns: ``src`` as an int, and on ``src`` the chunks as a list of
        ``world_size`` buffers (rows of a stacked buffer), elsewhere ``None``."""
        dtype = self.buffer(buf, "scatter", receives=True)
        src = self.root(src, "src", "scatter")
        if self.rank != src:
            if chunks is not None:
                raise ValueError(
                    f"scatter: only the source rank {src} passes chunks, but rank "
                    f"{self.rank} passed some; pass chunks=None here"
                )
            return src, None
        if chunks is None:
            raise ValueError(
                f"scatter: rank {self.rank} is the source and must pass chunks "
                f"(one buffer per rank, {self.world_size} in all)"
            )
        shape = tuple(buf.shape)
        if isinstance(chunks, np.ndarray) or is_tensor(chunks):
            chunks_dtype = self.buffer(chunks, "scatter chunks", receives=False)
            stacked = (self.world_size, *shape)
            if tuple(chunks.shape) != stacked:
                raise ValueError(
                    f"scatter: chunks as one buffer must have shape {stacked} "
                    f"(world_size, *buf.shape), got {tuple(chunks.shape)}"
                )
            if chunks_dtype != dtype:
                raise TypeError(
                    f"scatter: chunks have dtype {_dtype_name(chunks)}, but buf has "
                    f"{_dtype_name(buf)}; the chunks must match buf"
                )
            return src, list(chunks)
        try:
            parts = list(chunks)
        except TypeError:
            raise TypeError(
                f"scatter: chunks must be a buffer or a sequence of buffers, got "
                f"{type(chunks).__module__}.{type(chunks).__qualname__}"
            ) from None
        if len(parts) != self.world_size:
            raise ValueError(
                f"scatter: needs {self.world_size} chunks (one per rank), got {len(parts)}"
            )
        for i, part in enumerate(parts):
            part_dtype = self.buffer(part, f"scatter chunks[{i}]", receives=False)
            if tuple(part.shape) != shape:
                raise ValueError(
                    f"scatter: chunks[{i}] has shape {tuple(part.shape)}, but buf has "
                    f"{shape}; every chunk must match buf"
                )
            if part_dtype != dtype:
                raise TypeError(
                    f"scatter: chunks[{i}] has dtype {_dtype_name(part)}, but buf has "
                    f"{_dtype_name(buf)}; every chunk must match buf"
                )
        return src, parts

    # -- the rules -------------------------------------------------------------------

    def buffer(self, buf: Any, what: str, receives: bool) -> np.dtype[Any]:
        """Check one buffer; ``receives``: the collective writes into it.

        Returns: its dtype as a NumPy dtype of :data:`DTYPES`.
        """
        tensor = is_tensor(buf)
        if not tensor and not isinstance(buf, np.ndarray):
            raise TypeError(
                f"{what}: buffers must be NumPy arrays or torch tensors, got "
                f"{type(buf).__module__}.{type(buf).__qualname__}"
            )
        if tensor:
            device = buf.device
            # "cuda" (no index) stands for the current device: any index matches.
            if device.type != "cpu" and str(self.device) not in (str(device), device.type):
                raise TypeError(
                    f"{what}: the buffer is on {device}, but this group's collectives "
                    f"run on {self.device}; move it there"
                    + (" with .cpu()" if str(self.device) == "cpu" else "")
                )
            if str(buf.layout) != "torch.strided":
                raise TypeError(
                    f"{what}: the buffer has layout {buf.layout}; pass a dense "
                    "tensor (e.g. t.to_dense())"
                )
        dtype = _numpy_dtype(buf)
        if dtype is None:
            raise TypeError(
                f"{what}: the buffer has dtype {_dtype_name(buf)}, but joinkit's "
                f"collectives take the dtypes every backend can send: {', '.join(DTYPES)}"
            )
        if receives and not tensor and not buf.flags.writeable:
            raise ValueError(
                f"{what}: the buffer is read-only, but {what} writes its result into "
                "it; pass a writable array"
            )
        if receives and shares_elements(buf):
            strides = buf.stride() if tensor else buf.strides
            raise ValueError(
                f"{what}: the buffer's elements share memory (shape {tuple(buf.shape)}, "
                f"strides {tuple(strides)}: an expand()ed, broadcast or as_strided view), "
                f"but {what} writes a result into each element; pass a buffer of its own, "
                "e.g. " + ("t.clone()" if tensor else "arr.copy()")
            )
        return dtype

    def root(self, root: Any, name: str, what: str) -> int:
        """``root`` (``src``/``dst``) as a rank of this group."""
        try:
            value = operator.index(root)
        except TypeError:
            raise TypeError(
                f"{what}: {name} must be an int rank, got {type(root).__qualname__}"
            ) from None
        if not 0 <= value < self.world_size:
            raise ValueError(
                f"{what}: {name}={value} is not a rank of this group (world size "
                f"{self.world_size})"
            )
        return value

    @staticmethod
    def reduce_op(op: Any, buf: Any, dtype: np.dtype[Any], what: str) -> None:
        """``op`` is a reduce op defined for ``dtype`` (module doc)."""
        if not isinstance(op, str) or op not in REDUCE_OPS:
            raise ValueError(
                f"{what}: unknown reduce op {op!r}; use one of {', '.join(REDUCE_OPS)}"
            )
        kind = dtype.kind
        if kind in "biu":
            return
        allowed = _COMPLEX if kind == "c" else _ARITHMETIC
        if op not in allowed:
            reason = (
                "complex buffers reduce with 'sum' only (torch sends them as pairs "
                "of reals, where only the sum is elementwise)"
                if kind == "c"
                else "bitwise ops need an integer or bool buffer"
            )
            raise TypeError(
                f"{what}: op {op!r} is not defined for dtype {_dtype_name(buf)}: "
                f"{reason}; use one of {', '.join(allowed)}"
            )


#: How many elements :func:`shares_elements` lists at most (32 MiB of offsets).
_LISTED = 1 << 22


def shares_elements(buf: Any) -> bool:
    """Whether two elements of ``buf`` (a NumPy array or tensor) share memory.

    Exact: the strides (bytes, either sign) sorted by size, each must reach
    past every element the smaller ones span; a layout that fails that
    (``as_strided`` interleavings) is decided by listing its elements'
    addresses, up to :data:`_LISTED` elements (beyond, it counts as sharing:
    a refusal, never a wrong result).
    """
    if is_tensor(buf):
        if buf.is_contiguous():
            return False
        size = buf.element_size()
        strides: tuple[int, ...] = tuple(s * size for s in buf.stride())
    else:
        if buf.flags.c_contiguous or buf.flags.f_contiguous:
            return False
        size = buf.itemsize
        strides = tuple(buf.strides)
    dims = sorted((abs(stride), n) for n, stride in zip(buf.shape, strides, strict=True)
                  if n > 1)
    if any(n == 0 for n in buf.shape) or not dims:
        return False
    span = size  # bytes from the first element's start to the last one's end, so far
    for stride, n in dims:
        if stride < span:
            break
        span += (n - 1) * stride
    else:
        return False
    if dims[0][0] < size:
        return True  # a stride shorter than an element (0 included)
    if np.prod([n for _, n in dims], dtype=np.int64) > _LISTED:
        return True
    offsets = np.zeros(1, dtype=np.int64)
    for stride, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    offsets.sort()
    return bool((np.diff(offsets) < size).any())


# -- buffers as NumPy arrays (threads, MPI) --------------------------------------------


def host_array(buf: Any) -> tuple[np.ndarray, bool]:
    """A NumPy array of a checked CPU ``buf``, and whether it is ``buf``'s memory.

    A tensor's lazy conjugate or negative view has no NumPy view; it comes back
    resolved, as a copy (``False``): write a result back with :func:`write_back`.
    """
    if not is_tensor(buf):
        return buf, True
    tensor = buf.detach()
    if tensor.is_conj() or tensor.is_neg():
        return tensor.resolve_conj().resolve_neg().numpy(), False
    return tensor.numpy(), True


def contiguous(arr: np.ndarray) -> tuple[np.ndarray, bool]:
    """``arr`` if C-contiguous, else a contiguous copy; and whether it is ``arr``."""
    if arr.flags.c_contiguous:
        return arr, True
    return np.ascontiguousarray(arr), False


def write_back(buf: Any, value: np.ndarray) -> None:
    """Copy ``value`` into ``buf`` (a NumPy array or CPU tensor) in place."""
    if is_tensor(buf):
        torch = sys.modules["torch"]
        # detach(): in place like torch.distributed, also on a leaf that requires grad.
        buf.detach().copy_(torch.from_numpy(value))
    else:
        np.copyto(buf, value)
