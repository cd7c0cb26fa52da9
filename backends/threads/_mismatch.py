"""The threads harness's mismatch detector: signatures, and the table of a mismatch.

Every collective a rank files in the threads backend carries a *signature*
``(kind, op, shape, dtype, root, origin)`` and a call site. All ranks'
signatures in one slot must be equal; :func:`mismatch_table` says how they are
not, as a per-rank table (rank | kind | op | shape | dtype | root | call site)
with a headline naming the fields that differ, and a note when some ranks ran a
collective of the Join where others ran their own (``origin``: ``"join"`` or
``"user"``; see ``backends.threads``). The rank and call-site formatting is
shared with the harness's other messages.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np

_Site: TypeAlias = "tuple[str, int, str]"  # (file, line, function)
# (kind, op, shape, dtype, root, origin); all ranks' must be equal in a slot.
# origin: "join" (the join backend's collectives) or "user" (module doc).
_Signature: TypeAlias = (
    "tuple[str, str | None, tuple[int, ...] | None, np.dtype[Any] | None, int | None, str]"
)
# What each signature element is called in a mismatch's headline.
_FIELDS = ("kind", "op", "shape", "dtype", "root", "join vs user")
_JOIN, _USER = "join", "user"


def mismatch_table(index: int, size: int,
                   entries: Sequence[tuple[_Signature, str, _Site] | None]) -> str:
    """The message of collective ``index`` whose ranks' signatures differ.

    Args:
        index: the collective's number (every rank's call #index).
        size: the world size.
        entries: per rank, its (signature, label, call site); all present.
    """
    header = ("rank", "kind", "op", "shape", "dtype", "root", "call site")
    rows = []
    signatures = []
    for rank, entry in enumerate(entries):
        assert entry is not None
        signature, label, site = entry
        signatures.append(signature)
        _, op, shape, dtype, root, _ = signature
        rows.append((str(rank), label, _cell(op), _cell(shape), _cell(dtype),
                     _cell(root), _format_site(site)))
    fields = [name for i, name in enumerate(_FIELDS)
              if len({s[i] for s in signatures}) > 1]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    table = [
        f"collective #{index} differs across the {size} ranks "
        f"(they disagree on {', '.join(fields)}):",
        line(header),
        "-+-".join("-" * w for w in widths),
        *(line(row) for row in rows),
    ]
    join = [rank for rank, s in enumerate(signatures) if s[5] == _JOIN]
    if join and len(join) < size:
        user = [rank for rank, s in enumerate(signatures) if s[5] != _JOIN]
        table.append(textwrap.fill(
            f"{_ranks(join)} ran a collective of the Join (its heartbeat, count or "
            f"object exchange) where {_ranks(user)} ran "
            f"{'one of its own' if len(user) == 1 else 'their own'}, and a join "
            "collective only ever matches a join collective. Usually a joined "
            "rank's JoinHook.main_hook (or fused_shadow) does not shadow every "
            "collective of an active rank's iteration: see the call sites above.",
            width=88,
        ))
    return "\n".join(table)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks))}"


def _format_site(site: _Site) -> str:
    filename, lineno, function = site
    try:
        shown = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        shown = filename
    if shown.startswith(os.pardir):
        shown = filename
    return f"{shown}:{lineno} in {function}"
