"""What an epoch of exact shards has consumed: the bookkeeping behind ``ShardSampler.state_dict``.

Theory of operation
-------------------
An epoch has an *order*: a permutation of the dataset's indices (``perm``,
DistributedSampler's, or ``range`` without shuffling). Everything here works
on *positions* in that order, never on dataset indices, so a state says
nothing about the world it was taken on.

A *pass* is one iteration of the sampler: its ``pending`` positions (sorted)
and its ``members``, the original ranks that share them: member ``i`` of
``W`` reads ``pending[i::W]``, its *share*, in order, one batch of
``batch_size`` per iteration. At the start of an epoch ``pending`` is every
position and the members are the world; after a resume it is what the state
left; after a pass in which ranks died (``take_over=True``) it is what they
left, and the members are the survivors.

What a member consumed in a pass is counted from the Join, not from the
sampler's iterator (a DataLoader reads ahead): the loop's *rounds* (the
iterations that completed, the same on every rank at the same point of a
lockstep loop: a joined rank's inputs plus its shadow rounds after the Join),
and for a rank lost in the pass, the iterations the survivors agree it
completed (``LostRank.iterations``). Member ``i`` consumed the first
``min((skip + rounds_i) * batch_size, len(share_i))`` positions of its share.
``skip`` is the batches every member had read before this process counted
(a StatefulDataLoader's own state, restored on the same world).

Every rank computes this from values every rank holds alike (the pass, the
rounds, the report's lost ranks), so the state is the same on every rank
without a collective. The state keeps the unconsumed positions as runs
``[start, stop)``: one or a few for a plain pass (consumption is a prefix of
every share, so only a band of about ``W * batch_size`` positions is ragged).

Standard library and numpy only; ``data.py`` supplies the order (torch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

#: ``state["format"]`` of a ShardSampler's state, and its version.
STATE_FORMAT = "joinkit.ShardSampler"
STATE_VERSION = 1


def order_digest(order: np.ndarray) -> str:
    """A short fingerprint of an epoch's order (the permutation itself)."""
    data = np.ascontiguousarray(order, dtype="<i8").tobytes()
    return "sha256:" + hashlib.sha256(data).hexdigest()[:16]


def to_runs(positions: np.ndarray) -> list[list[int]]:
    """Sorted positions as runs ``[[start, stop], ...]`` (half-open)."""
    if len(positions) == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1)
    starts = positions[np.concatenate(([0], breaks + 1))]
    stops = positions[np.concatenate((breaks, [len(positions) - 1]))] + 1
    return [[int(a), int(b)] for a, b in zip(starts, stops, strict=True)]


def from_runs(runs: Any, length: int) -> np.ndarray:
    """The positions of ``runs``, checked: sorted, disjoint, inside ``[0, length)``.

    Raises:
        ValueError: the runs are not a list of ``[start, stop]`` pairs that
            increase and stay inside the dataset (the message says which).
    """
    if not isinstance(runs, (list, tuple)):
        raise ValueError(f"'remaining' must be a list of [start, stop] runs, not "
                         f"{type(runs).__name__}")
    parts = []
    last = 0
    for run in runs:
        if (not isinstance(run, (list, tuple)) or len(run) != 2
                or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                           for v in run)):
            raise ValueError(f"'remaining' holds {run!r}, which is not a [start, stop] pair "
                             "of ints")
        start, stop = int(run[0]), int(run[1])
        if start < last or start >= stop or stop > length:
            raise ValueError(
                f"'remaining' run [{start}, {stop}] is not inside [0, {length}) after the "
                f"previous run (ending at {last}): the runs must be sorted and disjoint, as "
                "state_dict() writes them")
        parts.append(np.arange(start, stop, dtype=np.int64))
        last = stop
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@attrs.frozen(kw_only=True, eq=False)
class Pass:
    """One iteration of the sampler: what is pending and who shares it (module doc).

    Attributes:
        pending: the sorted positions this pass divides.
        members: the original ranks that share them, in order.
        skip: batches every member had read before this process counted.
    """

    pending: np.ndarray
    members: tuple[int, ...]
    skip: int = 0

    def share(self, member: int) -> np.ndarray:
        """The positions ``member`` reads in this pass, in order."""
        index = self.members.index(member)
        return self.pending[index :: len(self.members)]

    def consumed(self, batch_size: int, rounds: int,
                 lost: Mapping[int, int]) -> dict[int, int]:
        """How many positions of its share each member consumed.

        Args:
            batch_size: positions per iteration.
            rounds: the iterations of the pass that completed (the lockstep count).
            lost: members lost in the pass -> the iterations they completed.

        Returns:
            member -> positions consumed (a prefix of its share).
        """
        world = len(self.members)
        out = {}
        for index, member in enumerate(self.members):
            size = len(range(index, len(self.pending), world))
            done = lost.get(member, rounds)
            out[member] = min(max(0, self.skip + done) * batch_size, size)
        return out

    def left(self, consumed: Mapping[int, int]) -> np.ndarray:
        """The pending positions not consumed (sorted)."""
        world = len(self.members)
        keep = np.ones(len(self.pending), dtype=bool)
        for index, member in enumerate(self.members):
            # Member i's j-th position is pending[i + j * world].
            keep[index : index + consumed.get(member, 0) * world : world] = False
        return self.pending[keep]

    def leftovers(self, consumed: Mapping[int, int], lost: Sequence[int]) -> dict[int, np.ndarray]:
        """Lost member -> the positions of its share it did not consume."""
        return {member: self.share(member)[consumed.get(member, 0):] for member in lost
                if member in self.members}


def assign(pending: np.ndarray, members: Sequence[int],
           origins: Mapping[int, np.ndarray]) -> dict[int, dict[int, np.ndarray]]:
    """Where each lost rank's leftovers land in the next pass.

    Args:
        pending: the next pass's positions.
        members: the next pass's members.
        origins: lost rank -> its leftover positions.

    Returns:
        lost rank -> member of the next pass -> the positions of it that member reads.
    """
    world = len(members)
    out: dict[int, dict[int, np.ndarray]] = {}
    for lost, positions in origins.items():
        # A position's index in the next pass's pending says whose share it is.
        owner = np.searchsorted(pending, positions) % world
        out[lost] = {members[i]: positions[owner == i] for i in range(world)
                     if np.any(owner == i)}
    return out
