"""Exact per-batch gathering inside a Join: :class:`Gather`.

Theory of operation
-------------------
Evaluating on uneven shards, every call ``gather(preds, y)`` must return the
rows of exactly the ranks that are still evaluating, in rank order, with
nothing padded and nothing dropped, while ranks that ran out of data have left
their loop. A :class:`Gather` is a joinable: active ranks call it, joined
ranks shadow each call from their Join's hooks, so every rank issues the same
collectives in the same order.

*One call.* Every rank contributes one buffer of bytes to an ``all_gather``:
a fixed *header* of four 64-bit fields, then, where it fits, its data::

    heartbeat    float64   the Join's fused heartbeat slot (Join.fused_heartbeat)
    rows         int64     rows this call, -1 for a joined rank
    nbytes       int64     bytes of data (rows x bytes per row, all arrays)
    fingerprint  int64     a digest of the arrays' count, dtypes, trailing shapes

A joined rank needs no knowledge of the arrays: it sends a header with
``rows = -1`` and learns every size it must shadow from the headers. From the
same headers every rank decides the same things:

- the fingerprints of the active ranks differ: every rank all-gathers a short
  description of its arrays (a second fixed-size collective) and each active
  rank raises :class:`GatherMismatch` with the table of ranks; no data
  collective follows, so nobody hangs. Joined ranks go on shadowing and leave
  the Join with ``PeerFailure`` naming the failing rank.
- every active rank's data fitted in the *inline capacity* behind its header:
  the call is over after this one collective;
- otherwise a second collective moves the data (each rank's bytes, padded to
  the largest; ``gather`` to ``dst`` when one is given).

The inline capacity starts at 0 and becomes the largest data any rank sent so
far (up to :data:`INLINE_LIMIT` bytes), a number every rank computes from the
same headers, so it is always the same on every rank. An evaluation loop with
a fixed batch size thus pays one collective per call from its second call on
(its smaller last batch fits too). With ``dst`` the data always goes in a
second, rooted collective, so the other ranks receive headers only.

*The heartbeat.* ``Gather`` sets ``join_fuses_heartbeat``: as the Join's first
joinable its header carries the heartbeat, so a call costs the Join nothing
extra; a joined rank's count is its shadow of the header. Anywhere else in the
list its slot holds 0 and the first joinable sends the heartbeat.

*Keep.* With ``keep=True`` every rank that receives (all, or ``dst``) also
keeps each call's rows, a joined rank the raw bytes it received while
shadowing; ``collected()`` decodes and concatenates them after the Join. A
rank that made no call does not know the arrays' dtypes and shapes: it says
so in its header's ``nbytes`` field (unused for a joined rank), and only then
(or where the Join's last collective was not this Gather's header) the post
hook all-gathers the layouts the ranks know, so the usual Join costs nothing
more.

*Types.* Arrays travel as raw bytes (``uint8``), so any dtype NumPy or torch
can view as bytes crosses every backend. Each call returns the type it was
given: NumPy arrays, or torch tensors on the input's device (CUDA tensors go
through the group's device, an nccl group's GPU).

This module imports NumPy and joinkit; torch only when a tensor is passed.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from joinkit import Join, Joinable, JoinHook, LocalProtocolError
from joinkit.backends import is_tensor, resolve

__all__ = ["Gather", "GatherMismatch", "INLINE_LIMIT"]

#: The most bytes of data a rank sends behind its header (one collective per
#: call); larger data goes in a second collective, where the header's extra
#: round trip costs little next to the data.
INLINE_LIMIT = 1 << 16
#: Header fields (int64 each): heartbeat (float64 bits), rows, nbytes, fingerprint.
_FIELDS = 4
_HEADER_BYTES = 8 * _FIELDS
#: A rank's description of its arrays in a mismatch's table (utf-8, truncated).
_DESCRIPTION_BYTES = 256
#: ``rows`` of a rank that gives nothing (joined, or failing).
_NO_ROWS = -1


class GatherMismatch(ValueError):
    """The ranks gave arrays of different dtypes or trailing shapes to one call.

    Raised on every active rank after the header, before any data moves; the
    message has one line per rank.
    """


class _Layout:
    """What a call's arrays look like, checked once per kind of call (see :func:`_batch`)."""

    __slots__ = ("torch", "device", "wire_torch", "arrays", "row_bytes", "fingerprint",
                 "description", "numpy_views", "numpy_dtypes", "cpu_views", "block_views")

    def __init__(self, torch: bool, device: Any,
                 arrays: list[tuple[str, tuple[int, ...], int]], settings: tuple[Any, ...],
                 numpy_views: bool) -> None:
        self.torch = torch  # the results are torch tensors on ``device``
        self.device = device
        # The bytes travel as a torch tensor on the group's device only for
        # tensors off the CPU; NumPy arrays and CPU tensors travel as NumPy
        # (cheaper per call than torch's dispatch for small batches).
        self.wire_torch = torch and device.type != "cpu"
        # (dtype name, trailing shape, bytes per row) of each array.
        self.arrays = arrays
        self.row_bytes = sum(per_row for _, _, per_row in arrays)
        text = repr(([(dtype, shape) for dtype, shape, _ in arrays], settings)).encode()
        self.fingerprint = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(),
                                          "little", signed=True)
        self.description = ", ".join(f"{dtype}[{', '.join(['rows', *map(str, shape)])}]"
                                     for dtype, shape, _ in arrays)
        # CPU tensors whose dtype NumPy has: .numpy() gives their bytes directly.
        self.numpy_views = numpy_views
        self.numpy_dtypes = [_numpy_dtype(name) for name, _, _ in arrays]
        # Results of CPU tensors whose dtypes NumPy has: decoded by _decode's
        # fast path (each column's bytes concatenated once, viewed as a tensor).
        self.cpu_views = (torch and device.type == "cpu" and numpy_views
                          and all(per_row > 0 for _, _, per_row in arrays))
        # Results decoded by _decode_block from the gathered rows' block, one
        # strided copy per array (NumPy arrays, CPU tensors that view as NumPy).
        self.block_views = (self.cpu_views if torch else
                            all(per_row > 0 for _, _, per_row in arrays)
                            and None not in self.numpy_dtypes)


class _Batch:
    """One call's arrays on this rank: their layout, rows and bytes."""

    __slots__ = ("layout", "flats", "rows", "nbytes")

    def __init__(self, layout: _Layout, flats: list[Any], rows: int) -> None:
        self.layout = layout
        # Each array's bytes (1-D uint8), made before any collective: a
        # failure here leaves the ranks in step.
        self.flats = flats
        self.rows = rows
        self.nbytes = rows * layout.row_bytes


class _Round:
    """What one call's headers say, the same on every rank."""

    __slots__ = ("rows", "nbytes", "inline", "data_bytes", "mismatch", "fingerprint")

    def __init__(self, rows: list[int], nbytes: list[int], inline: bool, data_bytes: int,
                 mismatch: bool, fingerprint: int) -> None:
        self.fingerprint = fingerprint  # the active ranks' (one of them on a mismatch)
        self.rows = rows
        self.nbytes = nbytes
        self.inline = inline  # every active rank's data came with its header
        self.data_bytes = data_bytes  # the second collective's size per rank (0: none)
        self.mismatch = mismatch


class _Arena:
    """The bytes a ``keep=True`` Gather keeps, appended to one growing buffer.

    One buffer rather than an array per call: a small array kept per call,
    allocated between a model's large temporaries, fragments the heap, and
    the allocator then gives back and faults in those temporaries' pages
    every batch (measured: about 3,500 more page faults and 5-10 % more time
    per epoch of 40 batches of an MLP 64-512-512-10; benchmarks/RESULTS.md).
    The buffer is reused after :meth:`Gather.collected`, so it stays as large
    as the most bytes kept between two of its calls.
    """

    __slots__ = ("buffer", "fill")

    def __init__(self) -> None:
        self.buffer = np.empty(0, dtype=np.uint8)
        self.fill = 0

    def add(self, pieces: Sequence[tuple[int, np.ndarray]]) -> list[tuple[int, int, int]]:
        """Append each piece's bytes (rows, 1-D uint8), one after the other;
        each piece's (rows, start, end) in :attr:`buffer`."""
        fill = self.fill
        end = fill
        for _, data in pieces:
            end += data.shape[0]
        buffer = self._room(end)
        spans = []
        for rows, data in pieces:
            start, fill = fill, fill + data.shape[0]
            buffer[start:fill] = data
            spans.append((rows, start, fill))
        self.fill = fill
        return spans

    def add_block(self, rows: int, block: np.ndarray) -> list[tuple[int, int, int]]:
        """Append a ``(ranks, bytes)`` block of pieces of ``rows`` rows each (one
        copy); each piece's (rows, start, end) in :attr:`buffer`."""
        count, width = block.shape
        fill = self.fill
        end = fill + count * width
        buffer = self._room(end)
        buffer[fill:end].reshape(count, width)[...] = block
        self.fill = end
        return [(rows, start, start + width) for start in range(fill, end, width)]

    def _room(self, end: int) -> np.ndarray:
        """The buffer, grown (at least doubled) to hold ``end`` bytes, the kept ones copied."""
        buffer = self.buffer
        if end > buffer.shape[0]:
            grown = np.empty(max(end, 2 * buffer.shape[0], 1 << 16), dtype=np.uint8)
            grown[:self.fill] = buffer[:self.fill]
            self.buffer = buffer = grown
        return buffer

    def clear(self) -> None:
        self.fill = 0


class Gather(Joinable):
    """Gather every active rank's rows of each call, in rank order, exactly.

    Use it inside a Join, as the only joinable or beside others::

        gather = Gather(group)
        with Join([gather]):
            for x, y in loader:
                preds = model(x).argmax(1)   # a forward without collectives
                all_preds, all_y = gather(preds, y)

    Each call is collective over the ranks still in their loop; a rank that
    has left its loop shadows the call from the Join's hooks and contributes
    nothing. Outside any Join it is a plain exact gather (every rank calls).

    As the Join's first joinable it carries the Join's heartbeat in its own
    header, so each call is one collective (the second and later calls, while
    each rank's data stays under :data:`INLINE_LIMIT` bytes). Anywhere else in
    the list, call it exactly once per iteration of the first joinable (a
    model's forward): a joined rank shadows one call per iteration.

    Args:
        group: a joinkit group (``TorchGroup``, ``MPIGroup``, a threads group),
            a ``torch.distributed`` ProcessGroup (``None`` is not accepted:
            pass ``dist.group.WORLD`` or a ``TorchGroup``) or an mpi4py
            communicator.
        dst: a rank to receive the rows, ``None`` (default) for every rank.
        keep: also keep every call's rows on every rank that receives them
            (every rank, or ``dst``), including the calls a rank shadowed after
            it joined; :meth:`collected` returns them all. Without it a rank
            gets the rows of the calls it made itself, and a rank that joined
            early misses the later calls'.

    Raises:
        TypeError: no joinkit backend handles ``group``.
        ValueError: ``dst`` is not a rank of the group.
    """

    join_fuses_heartbeat = True

    def __init__(self, group: Any, dst: int | None = None, *, keep: bool = False) -> None:
        super().__init__()
        self._group = _collective_group(group)
        self._rank = int(self._group.rank)
        self._world = int(self._group.world_size)
        if dst is not None and (type(dst) is not int or not 0 <= dst < self._world):
            raise ValueError(
                f"Gather(dst={dst!r}): dst must be a rank of the group, an int from 0 "
                f"to {self._world - 1}, or None to return the rows on every rank"
            )
        self._dst = dst
        self._keep = bool(keep)
        self._receives = dst is None or dst == self._rank
        # With keep: each call's rows in call order, as the bytes every rank
        # gave ("bytes": fingerprint, [(rows, start, end) in the arena per
        # rank], this rank's own calls and those it shadowed while joined),
        # decoded by collected() with the layouts of each fingerprint (learned
        # from calls, or from the peers in the post hook); or, for tensors off
        # the CPU, this rank's own decoded call ("own").
        self._kept: list[tuple[Any, ...]] = []
        self._arena = _Arena()
        self._layouts: dict[int, _Layout] = {}
        # The checked layout of each kind of call this rank made (see _batch).
        self._call_layouts: dict[Any, _Layout] = {}
        self._kept_kind: tuple[bool, Any] | None = None
        # Kept raw entries whose layout this rank does not know, and whether
        # a joined rank said so in the last header (see _share_layouts).
        self._unknown = 0
        self._someone_unknown = False
        # Where a torch call's bytes travel: the group's device (an nccl group's
        # GPU, else the CPU), whatever the inputs' device.
        self._device = str(getattr(self._group, "device", "cpu"))
        # Bytes of data a rank sends behind its header; the same on every rank
        # (see the module doc). Always 0 with a dst: data goes to dst only.
        self._capacity = 0
        # The data collective a joined rank shadows in main_hook, after its
        # shadow of the header (fused_shadow) showed one: its bytes per rank.
        self._pending = 0
        self._pending_keep: _Round | None = None
        # The per-call path on the CPU where the group has all_gather_into
        # (TorchGroup): the header collective's two buffers, made again when
        # the capacity grows, instead of new ones and conversions each call.
        self._into = getattr(self._group, "all_gather_into", None) if dst is None else None
        self._rows: tuple[np.ndarray, np.ndarray] | None = None

    def __repr__(self) -> str:
        return (f"Gather(rank={self._rank}, world_size={self._world}, dst={self._dst}, "
                f"keep={self._keep})")

    @property
    def group(self) -> Any:
        """The joinkit group the collectives run on."""
        return self._group

    @property
    def dst(self) -> int | None:
        """The rank that receives the rows, or ``None`` for every rank."""
        return self._dst

    # -- the call ------------------------------------------------------------------

    def __call__(self, *arrays: Any) -> Any:
        """Gather this iteration's rows of every active rank.

        Args:
            *arrays: one or more NumPy arrays, or one or more torch tensors on
                one device, each with at least one dimension and the same
                number of rows (``shape[0]``, which may be 0 and may differ
                between ranks and calls). Their dtypes and trailing shapes
                must be the same on every rank.

        Returns:
            For each array, the concatenation in rank order of the rows every
            active rank gave to this call (one array for one input, else a
            tuple), of the input's type (a tensor on the input's device); with
            ``dst`` set, ``None`` on every other rank.

        Raises:
            TypeError: an input is not a NumPy array or torch tensor, or they
                mix NumPy and torch or devices (checked before any collective).
            ValueError: no input, a 0-dimensional input, or inputs with
                different numbers of rows (checked before any collective).
            GatherMismatch: the ranks' dtypes or trailing shapes differ (on
                every active rank, before any data moves).
            PeerAborted: another rank failed; let it leave the Join block.
        """
        batch = _batch(arrays, (self._dst, self._keep), self._call_layouts)
        layout = batch.layout
        heartbeat = Join.fused_heartbeat(self)
        capacity = self._capacity
        inline = batch.nbytes <= capacity
        wire = self._wire(batch, heartbeat, capacity, inline)
        if self._into is not None and not layout.wire_torch:
            parts = self._into(wire, self._rows[1])  # type: ignore[index]  # _wire made them
        else:
            parts = self._group.all_gather(wire)
        heads, total = _headers(parts)
        Join.record_heartbeat_total(self, total)
        round_ = self._read(heads, capacity)
        if round_.mismatch:
            self._explain(layout.description, heads, fail=True)
        if round_.data_bytes:
            data = self._buffer(batch, round_.data_bytes)
            _fill(data, 0, batch)
            if self._dst is None:
                parts = self._group.all_gather(data)
            else:
                parts = self._group.gather(data, self._dst)
            offset = 0
        else:
            offset = _HEADER_BYTES
        if self._keep:  # every rank: a joined dst may need the layout (post hook)
            self._layouts[layout.fingerprint] = layout
        if self._dst is not None and self._rank != self._dst:
            return None
        assert parts is not None
        rows = batch.rows
        if (offset and rows and layout.block_views and isinstance(parts, np.ndarray)
                and round_.rows.count(rows) == len(round_.rows)):
            # The usual call: every rank gave as many rows inline, in the rows
            # of one array (all_gather_into): a copy per array, none per rank.
            block = parts[:, offset:offset + batch.nbytes]
            out = _decode_block(layout, block, rows)
            if self._keep:
                self._kept_kind = self._kept_kind or (layout.torch, layout.device)
                self._kept.append(("bytes", layout.fingerprint,
                                   self._arena.add_block(rows, block)))
            return out[0] if len(out) == 1 else tuple(out)
        pieces = [(rows, parts[rank][offset:offset + round_.nbytes[rank]])
                  for rank, rows in enumerate(round_.rows) if rows > 0]
        out = _decode(layout, pieces, layout.torch, layout.device)
        if self._keep:
            self._kept_kind = self._kept_kind or (layout.torch, layout.device)
            if layout.wire_torch:  # bytes on a device: keep the decoded tensors
                self._kept.append(("own", out))
            else:
                self._keep_bytes(layout.fingerprint, pieces)
        return out[0] if len(out) == 1 else tuple(out)

    def collected(self) -> Any:
        """Every row kept since the last ``collected()`` (needs ``keep=True``).

        Call it after the Join block: for each array, the rows of every call
        of every rank, in call order and, within a call, in rank order; the
        same on every rank (with ``dst``: on ``dst``, ``None`` elsewhere).
        Empties what was kept.

        Returns:
            One array for calls of one array, else a tuple; NumPy arrays, or
            torch tensors on the device of this rank's own inputs (a rank that
            made no call: the group's device); ``None`` if no call was made
            or this rank is not ``dst``.

        Raises:
            LocalProtocolError: the Gather was made without ``keep=True``, or
                the Join ended early (a failure) before the ranks could tell
                each other the layouts of the rows a joined rank kept.
        """
        if not self._keep:
            raise LocalProtocolError(
                "Gather.collected() needs Gather(..., keep=True): without it no rows are kept"
            )
        kept, self._kept = self._kept, []
        try:
            return self._collect(kept) if self._receives and kept else None
        finally:
            self._arena.clear()  # what it held is decoded (copied) or dropped

    def _collect(self, kept: list[tuple[Any, ...]]) -> Any:
        """:meth:`collected`'s rows of ``kept`` (entries in call order)."""
        torch, device = self._kept_kind or (None, None)
        columns: list[list[Any]] = []
        # Consecutive calls of one layout are decoded together: one
        # concatenation per array, straight from the arena's bytes.
        run: list[tuple[int, int, int]] = []
        run_layout: _Layout | None = None
        shared = False

        def add(out: list[Any]) -> None:
            nonlocal columns
            columns = columns or [[] for _ in out]
            for column, array in zip(columns, out, strict=True):
                column.append(array)

        def flush() -> None:
            nonlocal run, run_layout
            if run_layout is not None:
                add(_decode_kept(run_layout, self._arena.buffer, run, bool(torch), device))
            run, run_layout = [], None

        for entry in kept:
            if entry[0] == "own":
                flush()
                add(entry[1])
                shared = True  # the tensors this call returned: copy them below
                continue
            _, fingerprint, spans = entry
            layout = self._layouts.get(fingerprint)
            if layout is None:
                raise LocalProtocolError(
                    "Gather.collected(): rows this rank kept while joined cannot be "
                    "decoded, because the Join did not finish normally (its post hook "
                    "tells every rank the arrays' layouts)"
                )
            if torch is None:
                torch = layout.torch
                device = sys.modules["torch"].device(self._device) if torch else None
            if layout is not run_layout:
                flush()
                run_layout = layout
            run.extend(spans)
        flush()
        if len(columns[0]) == 1 and not shared:  # decoded above: already a copy
            joined = [column[0] for column in columns]
        elif torch:
            cat = sys.modules["torch"].cat
            joined = [cat([c.to(device) for c in column]) for column in columns]
        else:
            joined = [np.concatenate([_host_array(c) for c in column]) for column in columns]
        return joined[0] if len(joined) == 1 else tuple(joined)

    # -- the shadow (a joined rank) ----------------------------------------------------

    def _shadow_header(self, heartbeat: float) -> float:
        """A joined rank's part of a call's header collective; return the slot's sum."""
        capacity = self._capacity
        # A joined rank's nbytes field says whether it kept rows it cannot
        # decode yet (see _share_layouts).
        header = (heartbeat, _NO_ROWS, int(self._unknown > 0), 0)
        if self._into is not None:  # the same collective as a call's, into its buffers
            wire, received = self._into_buffers(capacity)
            _HEADER.pack_into(wire, 0, *header)  # type: ignore[arg-type]
            parts = self._into(wire, received)
        else:
            wire = np.zeros(_HEADER_BYTES + capacity, dtype=np.uint8)
            wire[:_HEADER_BYTES] = _header(*header)
            parts = self._group.all_gather(wire)
        heads, total = _headers(parts)
        self._someone_unknown = any(head[1] < 0 and head[2] for head in heads)
        round_ = self._read(heads, capacity)
        if round_.mismatch:
            self._explain("", heads, fail=False)
        self._pending = round_.data_bytes
        if self._keep and self._receives and not round_.mismatch:
            if round_.data_bytes:
                self._pending_keep = round_
            else:
                self._keep_raw(round_, parts, _HEADER_BYTES)
        return total

    def _keep_raw(self, round_: _Round, parts: Sequence[Any], offset: int) -> None:
        """Keep the bytes a joined rank received of one call (``keep=True``)."""
        if all(rows < 0 for rows in round_.rows):
            return  # nobody called (a drain's last count): no call to keep
        # Even a call of 0 rows is kept: it tells collected() the arrays' layout.
        pieces = [(rows, _host(parts[rank][offset:offset + round_.nbytes[rank]]))
                  for rank, rows in enumerate(round_.rows) if rows > 0]
        self._keep_bytes(round_.fingerprint, pieces)
        self._unknown += round_.fingerprint not in self._layouts

    def _keep_bytes(self, fingerprint: int, pieces: Sequence[tuple[int, np.ndarray]]) -> None:
        """Keep one call's bytes (rows, uint8 per rank) in the arena (``keep=True``)."""
        self._kept.append(("bytes", fingerprint, self._arena.add(pieces)))

    def _shadow_data(self) -> None:
        """A joined rank's part of the call's data collective, if it has one."""
        size, self._pending = self._pending, 0
        keep, self._pending_keep = self._pending_keep, None
        if size:
            data = np.zeros(size, dtype=np.uint8)
            if self._dst is None:
                parts = self._group.all_gather(data)
            else:
                parts = self._group.gather(data, self._dst)
            if keep is not None:
                self._keep_raw(keep, parts, 0)

    def _share_layouts(self) -> None:
        """Post hook with ``keep``: every rank learns the layouts the others know
        (an object all-gather), to decode what it kept while joined.

        Skipped where the Join's last collective was this Gather's header (it
        is the first joinable of a fused Join) and no rank flagged rows it
        cannot decode in it: usually only a rank that made no call needs them.
        """
        config = self._join_config
        join = config.join
        if (config.is_first_joinable and join is not None and join.fuses_heartbeat
                and not self._someone_unknown):
            return
        for known in self._group.all_gather_object(dict(self._layouts)):
            for fingerprint, layout in known.items():
                self._layouts.setdefault(fingerprint, layout)
        self._unknown = 0

    # -- helpers ---------------------------------------------------------------------

    def _read(self, heads: list[_Head], capacity: int) -> _Round:
        """What the headers decide, the same on every rank; updates the capacity."""
        rows = [head[1] for head in heads]
        nbytes = [head[2] for head in heads]
        if min(rows) >= 0:  # every rank active (the usual call): no filtering
            fingerprint = heads[0][3]
            mismatch = any(head[3] != fingerprint for head in heads)
            if mismatch:
                fingerprint = min(head[3] for head in heads)
            need = max(nbytes)
        else:
            active = [r for r, n in enumerate(rows) if n >= 0]
            fingerprints = {heads[r][3] for r in active}
            mismatch = len(fingerprints) > 1
            fingerprint = min(fingerprints, default=0)
            need = max((nbytes[r] for r in active), default=0)
        inline = need <= capacity
        if not mismatch and self._dst is None and capacity < need <= INLINE_LIMIT:
            self._capacity = -(-need // 8) * 8
        data_bytes = 0 if mismatch or inline else need
        return _Round(rows, nbytes, inline, data_bytes, mismatch, fingerprint)

    def _explain(self, description: str, heads: list[_Head], fail: bool) -> None:
        """Every rank's description of its arrays (one collective); raise if ``fail``."""
        text = np.zeros(_DESCRIPTION_BYTES, dtype=np.uint8)
        encoded = description.encode()[:_DESCRIPTION_BYTES]
        text[: len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
        parts = self._group.all_gather(text)
        if not fail:
            return
        lines = []
        for rank, part in enumerate(parts):
            if heads[rank][1] < 0:
                lines.append(f"  rank {rank}: (joined: gives nothing)")
                continue
            said = bytes(_host(part)).rstrip(b"\0").decode(errors="replace")
            lines.append(f"  rank {rank}: {said}")
        raise GatherMismatch(
            "Gather: the ranks gave arrays of different dtypes or trailing shapes to the "
            "same call (only the number of rows may differ between ranks):\n"
            + "\n".join(lines)
            + "\nPass the same arrays, in the same order, with the same dtype and shape "
            "after the first dimension, on every rank (e.g. cast with .astype/.to)"
        )

    def _wire(self, batch: _Batch, heartbeat: float, capacity: int, inline: bool) -> Any:
        """This rank's header collective buffer: header, then the data where it fits."""
        if not batch.layout.wire_torch:  # the per-call path on the CPU: no conversions
            if self._into is None:
                wire = np.zeros(_HEADER_BYTES + capacity, dtype=np.uint8)
            else:  # all_gather_into's buffers (bytes past the call's are never read)
                wire = self._into_buffers(capacity)[0]
            _HEADER.pack_into(wire, 0, heartbeat,  # type: ignore[arg-type]
                              batch.rows, batch.nbytes, batch.layout.fingerprint)
            if inline:
                offset = _HEADER_BYTES
                for flat in batch.flats:
                    end = offset + flat.shape[0]
                    wire[offset:end] = flat
                    offset = end
            return wire
        wire = self._buffer(batch, _HEADER_BYTES + capacity)
        header = _header(heartbeat, batch.rows, batch.nbytes, batch.layout.fingerprint)
        torch = sys.modules["torch"]
        wire[:_HEADER_BYTES] = torch.from_numpy(header).to(wire.device)
        if inline and batch.nbytes:
            _fill(wire, _HEADER_BYTES, batch)
        return wire

    def _into_buffers(self, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """all_gather_into's buffers for ``capacity``: this rank's wire and the
        ``(world, bytes)`` rows it gathers into, made again when either changes."""
        rows = self._rows
        size = _HEADER_BYTES + capacity
        if rows is None or rows[1].shape != (self._group.world_size, size):
            self._rows = rows = (np.zeros(size, dtype=np.uint8),
                                 np.zeros((self._group.world_size, size), dtype=np.uint8))
        return rows

    def _buffer(self, batch: _Batch, size: int) -> Any:
        if batch.layout.wire_torch:
            torch = sys.modules["torch"]
            return torch.zeros(size, dtype=torch.uint8, device=self._device)
        return np.zeros(size, dtype=np.uint8)

    # -- Joinable --------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows each call on a joined rank (takes no options)."""
        return _GatherHook(self)

    @property
    def join_device(self) -> Any:
        return getattr(self._group, "device", "cpu")

    @property
    def join_process_group(self) -> Any:
        return self._group


class _GatherHook(JoinHook):
    """A joined rank's shadow of one :class:`Gather` call: the header, then the data."""

    def __init__(self, gather: Gather) -> None:
        self._gather = gather

    def fused_shadow(self, heartbeat: float) -> float:
        """Shadow the header collective (``heartbeat`` in its slot); return the slot's sum."""
        return self._gather._shadow_header(heartbeat)

    def main_hook(self) -> None:
        """Shadow the call's data collective, where its headers showed one."""
        self._gather._shadow_data()

    def post_hook(self, is_last_joiner: bool) -> None:
        """With ``keep``: share the arrays' layouts (see ``Gather.collected``)."""
        if self._gather._keep:
            self._gather._share_layouts()


# -- functions ---------------------------------------------------------------------------


def _collective_group(group: Any) -> Any:
    """``group`` as a joinkit group with ``all_gather`` and ``gather``."""
    if group is None:
        raise TypeError(
            "Gather(group): got None; pass a joinkit group (e.g. joinkit.backends.init()), "
            "a torch.distributed ProcessGroup (dist.group.WORLD) or an mpi4py communicator"
        )
    resolved = resolve(group, getattr(group, "device", None))
    if callable(getattr(resolved, "all_gather", None)) and callable(
            getattr(resolved, "gather", None)):
        return resolved
    if type(group).__module__.startswith("mpi4py"):
        from joinkit.backends.mpi import MPIGroup

        return MPIGroup(group)
    raise TypeError(
        f"Gather needs a group with all_gather and gather; {type(group).__qualname__} "
        f"resolves to {type(resolved).__qualname__}, which has neither: pass a joinkit "
        "group (TorchGroup, MPIGroup, a threads group)"
    )


def _batch(arrays: Sequence[Any], settings: tuple[Any, ...],
           layouts: dict[Any, _Layout]) -> _Batch:
    """Check one call's inputs (before any collective) and describe them.

    ``settings`` (dst, keep) go into the fingerprint: ranks that disagree on
    them would disagree on the collectives, so they get a GatherMismatch.
    ``layouts`` caches the checked layout of each kind of call (types, dtypes,
    dimensions, trailing shapes, devices), so a call like the last one only
    reads its rows and bytes.
    """
    try:
        key = tuple([(type(a), a.dtype, a.shape[1:], a.ndim, getattr(a, "device", None))
                     for a in arrays])
    except (AttributeError, TypeError):
        key = None
    layout = layouts.get(key) if key is not None else None
    if layout is None:
        layout = _check(arrays, settings)
        if key is not None:
            layouts[key] = layout
    rows = int(arrays[0].shape[0])
    for array in arrays:
        if array.shape[0] != rows:
            raise ValueError(
                f"Gather: the arrays of one call have different numbers of rows "
                f"{[int(a.shape[0]) for a in arrays]}: every array must have one row per "
                "sample (the same shape[0])"
            )
    # (ravel() copies an array that is not contiguous: its bytes, in order.)
    if not layout.torch:
        flats = [a.ravel().view(np.uint8) for a in arrays]
    elif layout.wire_torch:
        flats = [_device_bytes(a) for a in arrays]
    elif layout.numpy_views:
        try:
            flats = [(a.detach().numpy() if a.requires_grad else a.numpy())
                     .ravel().view(np.uint8) for a in arrays]
        except RuntimeError:  # a lazy conjugate or negation
            flats = [_cpu_numpy(a).ravel().view(np.uint8)
                     for a in arrays]
    else:
        flats = [_cpu_numpy(a).ravel().view(np.uint8) for a in arrays]
    return _Batch(layout, flats, rows)


def _check(arrays: Sequence[Any], settings: tuple[Any, ...]) -> _Layout:
    """Check a kind of call's inputs; their :class:`_Layout`."""
    if not arrays:
        raise ValueError("Gather() needs at least one array: gather(preds) or gather(preds, y)")
    tensors = [is_tensor(a) for a in arrays]
    for index, (array, tensor) in enumerate(zip(arrays, tensors, strict=True)):
        if not tensor and not isinstance(array, np.ndarray):
            raise TypeError(
                f"Gather: argument {index} is a {type(array).__qualname__}, not a NumPy array "
                "or torch tensor: pass arrays (np.asarray(x), torch.as_tensor(x))"
            )
        if array.ndim == 0:
            raise ValueError(
                f"Gather: argument {index} is 0-dimensional; pass arrays whose first "
                "dimension is the rows (x.reshape(1) for a single value)"
            )
    torch = any(tensors)
    if torch and not all(tensors):
        raise TypeError(
            "Gather: one call mixes NumPy arrays and torch tensors: pass one kind "
            "(torch.from_numpy(a) or t.numpy())"
        )
    device = arrays[0].device if torch else None
    if torch and any(a.device != device for a in arrays):
        raise TypeError(
            f"Gather: one call's tensors are on different devices "
            f"({', '.join(str(a.device) for a in arrays)}): move them to one (.to(device))"
        )
    described = []
    numpy_views = True
    for index, array in enumerate(arrays):
        if not torch and (array.dtype.hasobject or array.dtype.fields is not None):
            raise TypeError(
                f"Gather: argument {index} has dtype {array.dtype}, which is not plain "
                "numbers: pass numeric or bool arrays"
            )
        name = str(array.dtype).removeprefix("torch.")
        shape = tuple(int(s) for s in array.shape[1:])
        itemsize = array.element_size() if torch else array.itemsize
        described.append((name, shape, itemsize * math.prod(shape)))
        if torch:
            numpy_views = numpy_views and _numpy_dtype(name) is not None
    return _Layout(torch, device, described, settings, numpy_views)


def _numpy_dtype(name: str) -> np.dtype[Any] | None:
    """NumPy's dtype of that name, or None (torch's bfloat16, float8...)."""
    try:
        return np.dtype(name)
    except TypeError:
        return None


def _device_bytes(tensor: Any) -> Any:
    """A tensor off the CPU as 1-D uint8 on its device."""
    uint8 = sys.modules["torch"].uint8
    if tensor.numel() == 0:
        return tensor.new_empty(0, dtype=uint8)
    return tensor.detach().contiguous().reshape(-1).view(uint8)


def _cpu_numpy(tensor: Any) -> np.ndarray:
    """A CPU tensor's memory as a NumPy array (no copy), whatever its dtype."""
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if _numpy_dtype(str(tensor.dtype).removeprefix("torch.")) is not None:
        return tensor.numpy()  # type: ignore[no-any-return]
    # bfloat16 and other dtypes NumPy lacks: the same bytes as an integer.
    torch = sys.modules["torch"]
    same = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(same[tensor.element_size()]).numpy()  # type: ignore[no-any-return]


_HEADER = struct.Struct("<dqqq")  # heartbeat, rows, nbytes, fingerprint
#: One rank's header, unpacked.
_Head = tuple[float, int, int, int]


def _header(heartbeat: float, rows: int, nbytes: int, fingerprint: int) -> np.ndarray:
    return np.frombuffer(bytearray(_HEADER.pack(heartbeat, rows, nbytes, fingerprint)),
                         dtype=np.uint8)


def _host(part: Any) -> np.ndarray:
    """A gathered uint8 part as a NumPy array (a copy from a GPU)."""
    if isinstance(part, np.ndarray):
        return part
    return part.cpu().numpy()  # type: ignore[no-any-return]


def _headers(parts: Sequence[Any]) -> tuple[list[_Head], float]:
    """The ranks' headers (heartbeat, rows, nbytes, fingerprint), and the
    heartbeat slot's sum added in rank order from 0 (so the same on every rank)."""
    if isinstance(parts[0], np.ndarray):  # the per-call path: no NumPy work
        heads = [_HEADER.unpack_from(part) for part in parts]
    else:  # bytes on a device: one copy of the headers to the host
        torch = sys.modules["torch"]
        block = torch.stack([p[:_HEADER_BYTES] for p in parts]).cpu().numpy()
        heads = [_HEADER.unpack_from(row) for row in block]
    total = 0.0
    for head in heads:
        total += head[0]
    return heads, total


def _fill(buffer: Any, offset: int, batch: _Batch) -> None:
    """Write the batch's arrays' bytes into ``buffer`` from ``offset``, array after array."""
    for flat in batch.flats:
        size = int(flat.shape[0])
        if size:
            buffer[offset:offset + size] = (flat.to(buffer.device) if batch.layout.wire_torch
                                            else flat)
        offset += size


def _host_array(value: Any) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else np.asarray(value)


def _decode_kept(layout: _Layout, buffer: np.ndarray, spans: list[tuple[int, int, int]],
                 torch: bool, device: Any) -> list[Any]:
    """Each array's rows from kept calls: ``spans`` are (rows, start, end) of
    ``buffer``, each one rank's bytes of one call (as :func:`_decode` reads them).

    Spans kept one after the other with the same rows (the full batches of an
    epoch: every call, every rank) form one 2-D block, [span, bytes], whose
    columns of one array are copied at once: a few NumPy operations per array
    for a whole epoch, not a few per call.
    """
    stretches: list[list[int]] = []  # [rows, start, spans]
    for rows, start, end in spans:
        last = stretches[-1] if stretches else None
        if last is not None and last[0] == rows and last[1] + last[2] * (end - start) == start:
            last[2] += 1
        else:
            stretches.append([rows, start, 1])
    total = 0
    for rows, _, count in stretches:
        total += rows * count
    out = []
    offset = 0  # this array's first byte within a row of every array
    for name, shape, per_row in layout.arrays:
        raw = np.empty(total * per_row, dtype=np.uint8)
        at = 0
        for rows, start, count in stretches:
            width = rows * layout.row_bytes
            block = buffer[start:start + count * width].reshape(count, width)
            size = count * rows * per_row
            raw[at:at + size].reshape(count, rows * per_row)[...] = (
                block[:, rows * offset:rows * (offset + per_row)])
            at += size
        offset += per_row
        out.append(_typed(raw, total, name, shape, torch, device))
    return out


def _typed(raw: np.ndarray, total: int, name: str, shape: tuple[int, ...], torch: bool,
           device: Any) -> Any:
    """``raw`` (fresh uint8 bytes of ``total`` rows) as the array it encodes."""
    dtype = _numpy_dtype(name)
    if not torch:
        assert dtype is not None  # NumPy results come from NumPy arrays
        return raw.view(dtype).reshape(total, *shape)
    module = sys.modules["torch"]
    if dtype is not None and raw.size:
        tensor = module.from_numpy(raw.view(dtype).reshape(total, *shape))
    elif raw.size:
        tensor = module.from_numpy(raw).view(getattr(module, name)).reshape(total, *shape)
    else:  # from_numpy gives an empty array stride 0, which view refuses
        tensor = module.empty((total, *shape), dtype=getattr(module, name))
    return tensor if device is None or device.type == "cpu" else tensor.to(device)


def _decode_block(layout: _Layout, block: np.ndarray, rows: int) -> list[Any]:
    """Each array's rows from ``block`` (uint8, one row per rank: its ``rows``
    rows' bytes, each array after the previous), for a ``block_views`` layout.

    An array's bytes of every rank are one column range of the block: copied
    at once, they are the concatenation in rank order.
    """
    total = block.shape[0] * rows
    from_numpy = sys.modules["torch"].from_numpy if layout.torch else None
    out = []
    start = 0
    for (_, shape, per_row), dtype in zip(layout.arrays, layout.numpy_dtypes, strict=True):
        end = start + rows * per_row
        array = block[:, start:end].copy().view(dtype).reshape(total, *shape)
        start = end
        out.append(array if from_numpy is None else from_numpy(array))
    return out


def _decode(layout: _Layout, pieces: list[tuple[int, Any]], torch: bool, device: Any
            ) -> list[Any]:
    """Each array's rows from ``pieces`` (rows, uint8 bytes: NumPy, or torch on a
    device) in order: the ranks' bytes of one call, each array after the previous.
    ``torch``: return tensors on ``device``, else NumPy arrays."""
    total = 0
    for rows, _ in pieces:
        total += rows
    out = []
    start = 0
    if (layout.cpu_views and torch and total and (device is None or device.type == "cpu")
            and isinstance(pieces[0][1], np.ndarray)):
        # The per-call path of CPU tensors: NumPy bytes in, tensors viewing them out.
        from_numpy = sys.modules["torch"].from_numpy
        for (_, shape, per_row), dtype in zip(layout.arrays, layout.numpy_dtypes, strict=True):
            if len(pieces) == 1:
                rows, data = pieces[0]
                raw = data[start * rows:(start + per_row) * rows].copy()
            else:  # piece by piece into one new array: fewer calls than a concatenate
                raw = np.empty(total * per_row, dtype=np.uint8)
                at = 0
                for rows, data in pieces:
                    size = rows * per_row
                    first = start * rows
                    raw[at:at + size] = data[first:first + size]
                    at += size
            start += per_row
            assert dtype is not None  # cpu_views: NumPy has every dtype
            out.append(from_numpy(raw.view(dtype).reshape(total, *shape)))
        return out
    for name, shape, per_row in layout.arrays:
        column = []
        for rows, data in pieces:
            column.append(data[start * rows:(start + per_row) * rows])
        start += per_row
        if column and not isinstance(column[0], np.ndarray):  # bytes on a device
            module = sys.modules["torch"]
            data = module.cat(column).to(device)
            out.append(data.view(getattr(module, name)).reshape(total, *shape))
            continue
        if len(column) > 1:
            raw = np.concatenate(column)
        else:
            raw = column[0].copy() if column else np.empty(0, dtype=np.uint8)
        out.append(_typed(raw, total, name, shape, torch, device))
    return out
