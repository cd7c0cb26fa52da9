"""The threads backend's status board: the ranks are threads sharing one object."""

from __future__ import annotations

import time
from collections.abc import Sequence

from .._status import Posted, age, status_text

__all__ = ["ThreadsBoard"]


class ThreadsBoard:
    """The threads backend's board: the ranks are threads sharing this object.

    One dict item assignment per post, atomic under the GIL, so no lock. The
    ranks cannot fall silent while one of them runs, so there are no beats.
    """

    def __init__(self) -> None:
        # rank -> (what its Join last said it was doing, time.monotonic() then)
        self._statuses: dict[int, tuple[str, float]] = {}

    def post(self, rank: int, what: str) -> None:
        """Record what the Join of ``rank`` is doing."""
        self._statuses[rank] = (what, time.monotonic())

    def _posted(self, rank: int) -> Posted | None:
        status = self._statuses.get(rank)
        return None if status is None else Posted(what=status[0], at=status[1])

    def note(self, rank: int, now: float) -> str:
        """What the Join of ``rank`` posted, for the end of its whereabouts
        (``"; its Join: ... (1.5 s ago)"``); empty if it posted nothing."""
        posted = self._posted(rank)
        return "" if posted is None else f"; its Join: {status_text(posted, now)}"

    def entries(self, ranks: Sequence[int]) -> dict[int, tuple[str, float, None]]:
        """rank -> (its last posted status, seconds since, ``None``), for the
        ``ranks`` that posted one."""
        now = time.monotonic()
        return {rank: (posted.what, age(posted, now), None)
                for rank in ranks if (posted := self._posted(rank)) is not None}
