"""The side channel's protocol: what one side call's headers mean, as pure values.

Theory of operation
-------------------
A *side call* is a collective that an active rank issues in its loop body
outside the joinables (an evaluation gather, a logging all-reduce, a token
count), in a number and order that may change from iteration to iteration
(``joinkit.SideChannel``). Such calls cannot share the joinables' group: a
joined rank, shadowing the joinables' collectives round after round, could not
tell whether the next collective on the wire is a model's all-reduce or a side
call. So side calls go to a second communicator over the same ranks (a
backend's *side wire*, :class:`SideWire`), where each is two collectives:

1. a *header* all-gather: every rank contributes one :class:`Header` of
   ``HEADER_FIELDS`` integers. An active rank's header describes its call
   (``present``: kind, reduce op, dtype, size, rows, root, a fingerprint of the
   shape); a joined rank's *service thread* sends an absent header;
2. the *data* collective that the headers call for (:func:`decide`), in which an
   absent rank contributes the neutral element: the op's identity for a
   reduction, no rows for a gather (each rank's bytes padded to the largest),
   nothing for a broadcast. So a result is the active ranks' alone: a sum over
   them, a gather of only their rows, a mean over their number.

*Small gathers travel in the header.* A gather of at most ``INLINE_BYTES`` bytes
(a token count, a logged loss, a flop count: what a trainer gathers every step)
carries its bytes in the header's last ``INLINE_WORDS`` integers; when every
present rank's bytes fit, the headers are the whole call (the plan's ``inline``)
and no data collective follows: one collective per call, as the call without a
Join. The bytes are moved, not combined, so the result is the same either way.

From the same headers every rank decides the same :class:`Plan`:

- *every header absent* (:class:`Stop`): every rank has left its loop and runs
  its service thread, which ends. This is the channel's end: each rank issues
  exactly one collective for it (its service thread's pending header), and no
  rank has to know who joined last;
- the present headers disagree (kind, op, dtype, shape, root), or describe
  different *windows* (:class:`Mismatch`): no data collective follows; every
  present rank raises :class:`~joinkit.CollectiveMismatch` with a table of the
  ranks, and the absent ranks go on serving;
- a broadcast whose root has joined (:class:`Refused`): present ranks raise a
  :class:`~joinkit.LocalProtocolError`; no data moves;
- else the data collective: :class:`ReducePlan`, :class:`GatherPlan`,
  :class:`BroadcastPlan`, or nothing for a barrier (:class:`BarrierPlan`).

*Windows.* A header carries the sender's heartbeat count in the Join: a present
rank's heartbeats so far (its calls since heartbeat ``w`` belong to *window*
``w``, up to its next heartbeat), an absent rank's total, the inputs it
processed. Present ranks must be in the same window, and an absent rank must
have left in that window or before (a total above ``w`` means it went on to
later iterations without making this call). So two active ranks that make a
different number of side calls in one iteration get a mismatch, not a wrong
pairing; only a rank that makes fewer calls in its own last window before
leaving cannot be told from one that left before them.

Standard library and attrs only; the arrays are the wire's (``joinkit.backends``).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Protocol, TypeAlias

import attrs

__all__ = [
    "HEADER_FIELDS",
    "OPS",
    "DTYPES",
    "Kind",
    "Neutral",
    "Header",
    "absent_header",
    "pack_inline",
    "unpack_inline",
    "INLINE_BYTES",
    "fingerprint",
    "Stop",
    "Mismatch",
    "Refused",
    "BarrierPlan",
    "ReducePlan",
    "GatherPlan",
    "BroadcastPlan",
    "Plan",
    "decide",
    "decide_encoded",
    "neutral",
    "SideWire",
]

#: A gather of at most this many bytes per rank travels in the headers (module doc).
INLINE_BYTES = 32
#: The header's integers that carry those bytes.
INLINE_WORDS = INLINE_BYTES // 8
#: The integers of one header: present, window, kind, op, dtype, size, rows,
#: root, fingerprint, then ``INLINE_WORDS`` of a small gather's bytes.
HEADER_FIELDS = 9 + INLINE_WORDS
#: ``INLINE_BYTES`` as ``INLINE_WORDS`` little-endian signed 64-bit integers.
_INLINE = struct.Struct(f"<{INLINE_WORDS}q")

#: The reduce ops, by their index in a header (``backends.REDUCE_OPS``).
OPS = ("sum", "prod", "min", "max", "band", "bor", "bxor")

#: The dtypes a header names, by index + 1 (0: raw bytes, or none). A reduction
#: needs one its backend can send; a gather or broadcast moves raw bytes, so
#: any dtype the wire can view as bytes goes (``float16``, ``bfloat16``).
DTYPES = ("bool", "int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16",
          "float32", "float64", "complex64", "complex128", "uint16", "uint32", "uint64")


class Kind(enum.IntEnum):
    """What a present rank's call is (a header's ``kind``)."""

    BARRIER = 1
    ALL_REDUCE = 2
    ALL_GATHER = 3
    BROADCAST = 4


class Neutral(enum.Enum):
    """What an absent rank contributes to a reduction: the op's identity."""

    ZERO = "zero"          # sum, bor, bxor
    ONE = "one"            # prod; band on bool
    ALL_ONES = "all ones"  # band on integers: every bit set
    LOWEST = "lowest"      # max: the dtype's lowest value (-inf for floats)
    HIGHEST = "highest"    # min: the dtype's highest value (+inf for floats)


@attrs.frozen(kw_only=True)
class Header:
    """One rank's part of a side call's header all-gather.

    Attributes:
        present: an active rank's call (``False``: a service thread, absent).
        window: a present rank's heartbeats so far in its Join; an absent
            rank's total (module doc, *Windows*).
        kind: a :class:`Kind` value (0 when absent).
        op: the reduce op's index in :data:`OPS` (-1: none).
        dtype: the dtype's index in :data:`DTYPES` + 1 (0: bytes or none).
        size: a reduction's elements; a gather's or broadcast's bytes.
        rows: a gather's rows (the first dimension).
        root: a broadcast's source rank (-1: none).
        fingerprint: a digest of what must agree between the present ranks
            (:func:`fingerprint`).
        inline: a gather's bytes when they fit (:func:`pack_inline`), else zeros.
    """

    present: bool
    window: int
    kind: int = 0
    op: int = -1
    dtype: int = 0
    size: int = 0
    rows: int = 0
    root: int = -1
    fingerprint: int = 0
    inline: tuple[int, ...] = (0,) * INLINE_WORDS

    def encode(self) -> tuple[int, ...]:
        """The header as ``HEADER_FIELDS`` integers (each fits an int64)."""
        return (int(self.present), self.window, self.kind, self.op, self.dtype, self.size,
                self.rows, self.root, self.fingerprint, *self.inline)

    @classmethod
    def decode(cls, values: Sequence[int]) -> Header:
        """The header of ``encode``'s integers."""
        present, window, kind, op, dtype, size, rows, root, digest = (int(v) for v in values[:9])
        return cls(present=bool(present), window=window, kind=kind, op=op, dtype=dtype,
                   size=size, rows=rows, root=root, fingerprint=digest,
                   inline=tuple(int(v) for v in values[9:HEADER_FIELDS]))

    def describe(self) -> str:
        """The call in words, for a mismatch table."""
        if not self.present:
            return f"absent (left its loop after {self.window} inputs)"
        try:
            kind = Kind(self.kind).name.lower()
        except ValueError:
            kind = f"kind {self.kind}"
        parts = [kind]
        if 0 <= self.op < len(OPS):
            parts.append(f"op={OPS[self.op]}")
        if 0 < self.dtype <= len(DTYPES):
            parts.append(f"dtype={DTYPES[self.dtype - 1]}")
        if self.kind == Kind.ALL_REDUCE:
            parts.append(f"elements={self.size}")
        elif self.kind in (Kind.ALL_GATHER, Kind.BROADCAST):
            parts.append(f"bytes={self.size}")
        if self.kind == Kind.ALL_GATHER:
            parts.append(f"rows={self.rows}")
        if self.root >= 0:
            parts.append(f"root={self.root}")
        return f"{' '.join(parts)} (iteration window {self.window})"


def pack_inline(data: bytes) -> tuple[int, ...]:
    """``data`` (at most ``INLINE_BYTES``) as a header's ``inline`` integers."""
    if len(data) > INLINE_BYTES:
        raise ValueError(f"{len(data)} bytes do not fit a header (at most {INLINE_BYTES})")
    return _INLINE.unpack(data.ljust(INLINE_BYTES, b"\0"))


def unpack_inline(words: Sequence[int], size: int) -> bytes:
    """The first ``size`` bytes that :func:`pack_inline` put in ``words``."""
    return _INLINE.pack(*words[:INLINE_WORDS])[:size]


def absent_header(inputs: int) -> Header:
    """A service thread's header: absent, after ``inputs`` heartbeats."""
    return Header(present=False, window=inputs)


def fingerprint(*parts: Any) -> int:
    """A signed 64-bit digest of ``parts`` (their ``repr``), the same in every process."""
    data = repr(parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


# -- plans: what every rank decides from one call's headers --------------------------


@attrs.frozen(kw_only=True)
class Stop:
    """Every header was absent: every rank left its loop; service threads end."""


@attrs.frozen(kw_only=True)
class Mismatch:
    """The present ranks' calls differ: they raise ``CollectiveMismatch(message)``."""

    message: str


@attrs.frozen(kw_only=True)
class Refused:
    """A call that cannot complete (a broadcast from a joined rank): the present
    ranks raise ``LocalProtocolError(message)``."""

    message: str


@attrs.frozen(kw_only=True)
class BarrierPlan:
    """A barrier: the headers were all of it."""

    present: tuple[int, ...]


@attrs.frozen(kw_only=True)
class ReducePlan:
    """An all-reduce of ``size`` elements of ``dtype`` with ``op``; absent ranks
    contribute ``neutral``."""

    present: tuple[int, ...]
    op: str
    dtype: str
    size: int
    neutral: Neutral


@attrs.frozen(kw_only=True)
class GatherPlan:
    """An all-gather of each rank's bytes, padded to ``max(sizes)``; absent ranks
    send zeros. ``sizes`` and ``rows`` are per rank (0 for absent ranks).
    ``inline``: every rank's bytes, when they came in the headers (module doc)."""

    present: tuple[int, ...]
    sizes: tuple[int, ...]
    rows: tuple[int, ...]
    inline: tuple[bytes, ...] | None = None

    @property
    def padded(self) -> int:
        """The bytes every rank sends (0: no data collective at all)."""
        return 0 if self.inline is not None else max(self.sizes, default=0)


@attrs.frozen(kw_only=True)
class BroadcastPlan:
    """A broadcast of ``size`` bytes from ``root`` (a present rank)."""

    present: tuple[int, ...]
    root: int
    size: int


Plan: TypeAlias = (
    "Stop | Mismatch | Refused | BarrierPlan | ReducePlan | GatherPlan | BroadcastPlan"
)


def neutral(op: str, dtype: str) -> Neutral:
    """The identity of ``op`` on ``dtype``: what an absent rank contributes."""
    if op in ("sum", "bor", "bxor"):
        return Neutral.ZERO
    if op == "prod":
        return Neutral.ONE
    if op == "band":
        return Neutral.ONE if dtype == "bool" else Neutral.ALL_ONES
    if op == "max":
        return Neutral.LOWEST
    if op == "min":
        return Neutral.HIGHEST
    raise ValueError(f"unknown reduce op {op!r}: one of {', '.join(OPS)}")


def decide(headers: Sequence[Header]) -> Plan:
    """What one side call is, from every rank's header (the same on every rank).

    Args:
        headers: the headers in rank order.

    Returns:
        The :class:`Plan` (module doc).
    """
    present = tuple(rank for rank, header in enumerate(headers) if header.present)
    if not present:
        return Stop()
    first = headers[present[0]]
    window = first.window
    problem = None
    if any(headers[r].window != window for r in present):
        problem = ("ranks in different iterations made this call: a rank made more side "
                   "calls in one iteration than another (each active rank must make the same "
                   "side calls, in the same order, in each iteration)")
    else:
        late = [r for r, h in enumerate(headers) if not h.present and h.window > window]
        if late:
            problem = (f"{_ranks(late)} left the loop after more iterations without making "
                       "this call, which the others made in an earlier iteration: ranks made "
                       "different side calls in one iteration")
        elif any(_agreed(headers[r]) != _agreed(first) for r in present):
            problem = "the ranks' calls differ (kind, reduce op, dtype, shape or root)"
    if problem is not None:
        return Mismatch(message=_table(problem, headers))
    kind = first.kind
    if kind == Kind.BARRIER:
        return BarrierPlan(present=present)
    if kind == Kind.ALL_REDUCE:
        op, dtype = OPS[first.op], DTYPES[first.dtype - 1]
        return ReducePlan(present=present, op=op, dtype=dtype, size=first.size,
                          neutral=neutral(op, dtype))
    if kind == Kind.ALL_GATHER:
        sizes = tuple(h.size if h.present else 0 for h in headers)
        inline = None
        if 0 < max(sizes) <= INLINE_BYTES:
            inline = tuple(unpack_inline(h.inline, size)
                           for h, size in zip(headers, sizes, strict=True))
        return GatherPlan(present=present, sizes=sizes,
                          rows=tuple(h.rows if h.present else 0 for h in headers),
                          inline=inline)
    if kind == Kind.BROADCAST:
        root = first.root
        if not 0 <= root < len(headers) or not headers[root].present:
            return Refused(message=(
                f"a side channel broadcast from rank {root}, which has left its loop (joined): "
                "a joined rank has no value to send. Broadcast from a rank that is still "
                "training (e.g. the lowest active rank), or send the value before the loop"))
        return BroadcastPlan(present=present, root=root, size=headers[root].size)
    return Mismatch(message=_table(f"unknown side call kind {kind}", headers))


def decide_encoded(rows: Sequence[Sequence[int]]) -> Plan:
    """:func:`decide` of encoded headers (what the wire's exchange returns).

    The same plan as ``decide([Header.decode(row) for row in rows])``; the call
    that every step of a training loop makes (every rank present, in one window,
    agreeing on a gather or a reduction) is read from the integers directly,
    without a :class:`Header` per rank; anything else goes through :func:`decide`.
    """
    first = rows[0]
    kind, window, digest = first[2], first[1], first[8]
    if first[0] == 1 and kind in (Kind.ALL_GATHER, Kind.ALL_REDUCE):
        if kind == Kind.ALL_GATHER:
            agree = all(r[0] == 1 and r[1] == window and r[2] == kind and r[8] == digest
                        for r in rows)
        else:
            agree = all(r[0] == 1 and r[1] == window and r[2:6] == first[2:6]
                        and r[8] == digest for r in rows)
        if agree:
            return _all_present(kind, first, rows)
    return decide([Header.decode(row) for row in rows])


def _all_present(kind: int, first: Sequence[int], rows: Sequence[Sequence[int]]) -> Plan:
    """The plan of a gather or reduction whose headers all agree (:func:`decide_encoded`)."""
    present = tuple(range(len(rows)))
    if kind == Kind.ALL_REDUCE:
        op, dtype = OPS[first[3]], DTYPES[first[4] - 1]
        return ReducePlan(present=present, op=op, dtype=dtype, size=int(first[5]),
                          neutral=neutral(op, dtype))
    sizes = tuple(int(r[5]) for r in rows)
    inline = None
    if 0 < max(sizes) <= INLINE_BYTES:
        inline = tuple(unpack_inline(r[9:], size) for r, size in zip(rows, sizes, strict=True))
    return GatherPlan(present=present, sizes=sizes, rows=tuple(int(r[6]) for r in rows),
                      inline=inline)


def _agreed(header: Header) -> tuple[int, ...]:
    """What the present ranks' headers of one call must share."""
    if header.kind == Kind.ALL_REDUCE:
        return (header.kind, header.op, header.dtype, header.size, header.fingerprint)
    if header.kind == Kind.BROADCAST:
        return (header.kind, header.root, header.fingerprint)
    return (header.kind, header.fingerprint)


def _table(problem: str, headers: Sequence[Header]) -> str:
    lines = [f"side channel call mismatch: {problem}:"]
    lines += [f"  rank {rank}: {header.describe()}" for rank, header in enumerate(headers)]
    return "\n".join(lines)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# -- the port: what a backend gives the channel ----------------------------------------


class SideWire(Protocol):
    """A backend's second communicator over the Join's ranks, with the array work.

    A join backend offers one through its optional ``side_wire()`` (collective
    the first time on a group, so the channel asks on Join entry, when every
    rank is there; cached after). joinkit's backends build theirs with
    ``joinkit.backends.ArrayWire`` over a second group of their library (threads:
    a second world; torch: ``dist.new_group``; MPI: ``Comm.Dup``). Every method
    is collective on the wire's own communicator, blocking, and never pairs with
    the joinables' collectives. Buffers are the caller's NumPy arrays or torch
    tensors; ``None`` stands for an absent rank's neutral part.
    """

    rank: int
    world_size: int

    def exchange(self, header: tuple[int, ...]) -> list[tuple[int, ...]]:
        """All-gather one header of ``HEADER_FIELDS`` integers; every rank's, in order."""
        ...

    def layout(self, buf: Any) -> tuple[str, tuple[int, ...], int]:
        """``(dtype name, shape, nbytes)`` of an array or tensor; ``TypeError`` otherwise."""
        ...

    def bytes_of(self, buf: Any) -> bytes:
        """An array's or tensor's bytes, as a gather sends them (a small gather's header)."""
        ...

    def reduce(self, plan: ReducePlan, buf: Any) -> Any:
        """The plan's all-reduce into ``buf`` (``None``: contribute the neutral element)."""
        ...

    def gather(self, plan: GatherPlan, buf: Any) -> list[Any] | None:
        """The plan's gather; the present ranks' arrays of ``buf``'s kind (``None`` for absent).
        A plan with ``inline`` bytes moves nothing (the headers had them)."""
        ...

    def gather_bytes(self, plan: GatherPlan, data: bytes | None) -> list[bytes] | None:
        """The plan's gather of raw bytes; the present ranks' bytes (``None`` for absent)."""
        ...

    def broadcast(self, plan: BroadcastPlan, buf: Any) -> Any:
        """The plan's broadcast into ``buf`` (``None`` on an absent rank)."""
        ...

    def broadcast_bytes(self, plan: BroadcastPlan, data: bytes | None) -> bytes | None:
        """The plan's broadcast of the root's bytes (``data`` on the root only)."""
        ...
