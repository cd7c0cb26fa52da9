"""The join collectives' wire values, and how a sum of them is read.

Rules of this room: pure functions and constants over floats; the standard
library only. Everything a rank puts into a heartbeat, count or termination
check is one of the weights below, and every reader of such a sum (the
machine, a backend that recovers from a dead rank) decodes it here.

Theory of operation
-------------------
Failures ride on the join collectives, in three weights (*wire values*)::

    ACTIVE   1        an active rank's heartbeat
    JOINED   0        a joined rank's count
    FAILING  2**53    a failed rank's first join collective after it failed
    FAILED   2**-100  each later one

A float32 sum counts active ranks exactly up to ``MAX_WORLD_SIZE`` = 2**24
(bigger worlds are refused), so no weight can carry an exact failure count
beside it. The protocol needs less (``decode_tally``):

- *A sum of at least* ``ALARM`` (2**52) says that a rank failed in this
  round; the FAILING weights swamp the active count, which is then unknown.
- *With some rank active*, FAILED weights round away (2**-100 is below half a
  float32 unit of 1): the sum is the exact active count.
- *With no rank active*, the sum is 0 if nobody failed and ``f * 2**-100``
  (positive, below 0.5) if f ranks did.

A float64 slot can carry one more per-rank flag beside the heartbeat,
``HEARTBEAT_FLAG`` (2**28) per flagged rank: exact up to 2**24 ranks, between
the active count and the FAILING weight (``split_heartbeat_flags``; DDP's fused
gradient-sync check). ``signature_digest`` is the entry agreement check's
digest, the same in every process.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

__all__ = [
    "ACTIVE",
    "JOINED",
    "FAILING",
    "FAILED",
    "ALARM",
    "NOBODY_ACTIVE_BELOW",
    "MAX_WORLD_SIZE",
    "HEARTBEAT_FLAG",
    "decode_tally",
    "split_heartbeat_flags",
    "signature_digest",
]

ACTIVE = 1.0
JOINED = 0.0
# A failed rank's first join collective: 2**24 of them still sum exactly in
# float32 (2**77) and far above any active count; in float64, 2**53 sits just
# above the flag lane (HEARTBEAT_FLAG).
FAILING = 2.0**53
# Each later one: below half a float32 unit of 1, so it rounds away as soon as
# one rank is active, and 2**24 of them still sum exactly (2**-76).
FAILED = 2.0**-100
#: A sum at least this large includes a FAILING weight.
ALARM = 2.0**52
#: A count below this shows no rank active (0, or FAILED weights only).
NOBODY_ACTIVE_BELOW = 0.5
#: The largest world whose active count a float32 sum holds exactly.
MAX_WORLD_SIZE = 2**24
#: One flagged rank's weight in a float64 heartbeat slot (``split_heartbeat_flags``).
HEARTBEAT_FLAG = 2.0**28


def signature_digest(signature: tuple[tuple[str, Any], ...]) -> int:
    """A digest of an agreement signature, the same in every process: an int
    in ``[0, 2**63)`` (it fits a signed 64-bit all-reduce, negated too).

    ``hash()`` would not do: string hashes differ between processes.
    """
    data = repr(signature).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1


def decode_tally(total: float) -> tuple[int | None, bool]:
    """Read a heartbeat, count or termination-check sum (module doc).

    Returns:
        ``(active, failure)``: the number of active ranks, ``None`` when a
        FAILING weight hides it; whether the sum shows a failure (with some
        rank active and no FAILING weight, failed ranks do not show).
    """
    if total >= ALARM:
        return None, True
    if total >= NOBODY_ACTIVE_BELOW:
        return int(round(total)), False
    return 0, total > 0.0


def split_heartbeat_flags(total: float, unit: float = HEARTBEAT_FLAG) -> tuple[float, int]:
    """Split a float64 slot's sum of ``heartbeat + HEARTBEAT_FLAG * flag``.

    Each rank puts its heartbeat value (``ACTIVE``, ``JOINED``, ``FAILING``,
    ``FAILED``) plus ``HEARTBEAT_FLAG`` if its flag is set into one float64
    element; the sum splits into the heartbeat sum (read it with
    :func:`decode_tally`) and the number of flagged ranks. Exact for every
    world up to ``MAX_WORLD_SIZE``: the active count stays below 2**25, the
    flags below 2**53, and where FAILING weights push the sum above 2**53 the
    rounding stays far below one flag (tested in every summation order).

    Args:
        total: the slot's sum.
        unit: the weight of one flag. A smaller power of two (above every
            heartbeat sum the world can make, e.g. 2**24 for worlds below
            2**24 ranks) leaves room for per-rank counts above one, as long as
            their sum times ``unit`` stays below 2**53 (FAILING's lane).

    Returns:
        ``(heartbeat sum, flags)``: the flags (or counts) summed over the ranks.
    """
    flags = math.floor(math.fmod(total, FAILING) / unit)
    return total - flags * unit, flags
