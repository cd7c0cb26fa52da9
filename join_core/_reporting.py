"""What a rank tells about itself: its report, its log lines, a stall's diagnostic.

- the report: ``Join.report`` is the machine's (``_machine.report``);
  :func:`gather_report` collects every rank's on one rank;
- the log (logger ``joinkit``): DEBUG, one line per phase change, a drain's
  batches as one stage (:class:`PhaseLog`); INFO, a long drain's progress line
  naming the ranks still in their loop body (:func:`log_progress`, from the
  backend's status board) and a rank that waits for healthy peers
  (:func:`log_waiting`). The bookkeeping is the same at every level, and
  logging changes nothing else;
- a stall's diagnostic (:func:`stall_diagnostic`): the machine's words for the
  stall (``_messages``) and what every rank was last seen doing, one line per
  distinct status (:func:`peer_status_lines`).

The drive (``_drive``) calls these; none of them decides anything or raises
into the protocol. Standard library and attrs only.
"""

from __future__ import annotations

import datetime
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from . import _machine as m
from . import _messages as text
from . import _ports, _watchdog
from ._errors import LocalProtocolError
from ._reports import JoinReport

__all__ = ["MOST_STATUS_LINES", "MOST_RANK_RANGES", "PhaseLog", "gather_report",
           "log_progress", "log_waiting", "peer_status_lines", "stall_diagnostic"]

_log = logging.getLogger("joinkit")

#: What a rank posts to its peers' status board while in its loop body (a
#: progress line names the ranks whose board entry says so).
_ACTIVE_STATUS = _watchdog.LOOP_BODY
#: The phases of a drain: its batches go back and forth between them (the
#: machine's module doc), which the DEBUG log shows as one stage.
_DRAIN_PHASES = frozenset({m.Phase.DRAINING, m.Phase.SHADOWING})


def gather_report(backend: Any, caps: _ports.BackendCapabilities,
                  report: Callable[[], JoinReport | None], dst: int) -> list[JoinReport] | None:
    """``Join.gather_report``: every rank's ``report()`` on rank ``dst`` (its doc),
    read once ``dst`` is known to be a rank."""
    if backend is None:
        raise LocalProtocolError("gather_report needs an enabled Join (enable=True)")
    world = backend.world_size
    if type(dst) is not int or not 0 <= dst < world:  # bool and "0" are not ranks
        raise ValueError(
            f"gather_report(dst={dst!r}): dst must be a rank of the Join's group, "
            f"an int from 0 to {world - 1}"
        )
    # To dst only: an all-gather would cost every rank O(world size).
    return _ports.gather_object(backend, caps, report(), dst)


class PhaseLog:
    """DEBUG: one line per phase change, a drain's batches as one stage (its
    rounds, batches and seconds)."""

    def __init__(self) -> None:
        # Since when the rank is in its phase, and, across a drain's batches,
        # its first round and its batches (the drive counts them).
        self.since: float | None = None
        self.drain_from = 0
        self.drain_batches = 0

    def changed(self, before: m.Phase, state: m.JoinState, observation: m.Observation) -> None:
        """The machine left phase ``before`` for ``state``'s on ``observation``."""
        now = observation.now
        after = state.phase
        if after in _DRAIN_PHASES:
            if before in _DRAIN_PHASES:
                return  # a batch boundary inside the drain
            self.drain_from, self.drain_batches = state.shadow_rounds, 0
        since, self.since = self.since, now
        if not _log.isEnabledFor(logging.DEBUG):
            return
        what = type(observation).__name__
        if before is m.Phase.ACTIVE:
            what += f" ({state.heartbeats} inputs)"
        if before in _DRAIN_PHASES:
            rounds = state.shadow_rounds - self.drain_from
            failure = getattr(observation, "failure", None)
            total = getattr(observation, "total", None)
            end = (f"a main hook raised {failure.exc_type}" if failure is not None
                   else f"a count of {total:g}" if total is not None else "its hooks")
            what += f" ({rounds} shadow rounds in {self.drain_batches} drain batches, then {end})"
        spent = "" if since is None else f" after {now - since:.3f} s in {before.name}"
        _log.debug("rank %s: %s -> %s on %s%s", state.config.rank, before.name, after.name,
                   what, spent)


def log_progress(command: m.ReportProgress, caps: _ports.BackendCapabilities) -> None:
    """INFO: a long drain's progress line (the machine's ``ReportProgress``)."""
    _log.info("%s", text.progress_message(command, _active_ranks(caps)))


def _active_ranks(caps: _ports.BackendCapabilities) -> list[int] | None:
    """The ranks the backend's status board shows in their loop body, for a
    progress line; ``None`` without a board or when reading it failed (a
    progress line must never break the drain). Called only when a line is
    due (the machine rate-limits them), so the board's own bound on its
    read (a store or peer round trip) is paid at most once per interval."""
    peer_status = caps.peer_status
    if peer_status is None:
        return None
    try:
        board = peer_status()
        return sorted(rank for rank, text in board.items() if _ACTIVE_STATUS in str(text))
    except Exception:
        return None


def log_waiting(rank: int, waiting: _watchdog.Waiting) -> None:
    """INFO: the watchdog finds this rank waiting for healthy peers."""
    if not _log.isEnabledFor(logging.INFO):
        return
    since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
        seconds=waiting.idle)
    peers = ", ".join(
        f"{peer} ({what}" + ("" if age is None else f", posted {age:.0f} s ago") + ")"
        for peer, what, age in waiting.ranks
    )
    _log.info("rank %s has waited %.0f s, since %s, in %s, for ranks %s (alive; "
              "not a stall under the default timeout)", rank,
              waiting.idle, since.strftime("%Y-%m-%d %H:%M:%S UTC"), waiting.what,
              peers)


def stall_diagnostic(stall: _watchdog.Stall, state: m.JoinState, timeout: float,
                     caps: _ports.BackendCapabilities, reads_board: bool) -> str:
    """A stall's message: the stall or silence in the machine's words (``state``
    with the heartbeats the loop body sent so far), then what the ranks were
    last seen doing, where the backend can tell."""
    if stall.silent:
        message = text.silence_message(state, stall.what, stall.ticks,
                                       stall.silent, timeout, stall.board_error)
    else:
        assert stall.what is not None
        message = text.stall_message(state, stall.what, stall.ticks, stall.idle, timeout)
        if stall.board_error is not None and reads_board:
            message += (f" (no peer could be shown alive: its last read of the status "
                        f"board failed: {stall.board_error})")
    peer_status = caps.peer_status
    if peer_status is not None:
        try:
            lines = peer_status_lines(peer_status())
        except Exception as error:  # diagnostics must not hide the stall
            lines = [f"  (peer status unavailable: {error!r})"]
        message += "\nwhat the ranks were last seen doing:\n" + "\n".join(lines)
    else:
        message += "\n(this backend cannot tell what the other ranks were doing)"
    return message


# A status's age ("(1.5 s ago)"), which peer_status_lines leaves out of the
# comparison so that ranks doing the same thing share one line.
_AGO = re.compile(r"\((\d+(?:\.\d+)?) s ago\)")
_AGE_SLOT = "\x00"
#: Most lines a stall diagnostic gives the ranks, and most rank ranges a line names.
MOST_STATUS_LINES = 16
MOST_RANK_RANGES = 8


def peer_status_lines(statuses: Mapping[int, str]) -> list[str]:
    """A stall diagnostic's lines for ``peer_status()``: one per distinct status.

    Ranks whose statuses differ only in how long ago they were posted share a
    line (``ranks 0-4094 (4095 ranks): ... (0.2-1.9 s ago)``), so a world of
    thousands of ranks in one state gives one line and the ranks that differ
    stand out. Lines come in order of their first rank; after
    ``MOST_STATUS_LINES`` of them, one line counts the rest.

    Args:
        statuses: rank -> what it was last seen doing.

    Returns:
        The lines, each indented by two spaces.
    """
    groups: dict[str, tuple[list[int], list[list[float]]]] = {}
    for rank in sorted(statuses):
        text = statuses[rank]
        key = _AGO.sub(lambda _: _AGE_SLOT, text)
        ranks, ages = groups.setdefault(key, ([], []))
        ranks.append(rank)
        ages.append([float(age) for age in _AGO.findall(text)])
    lines = []
    for key, (ranks, ages) in list(groups.items())[:MOST_STATUS_LINES]:
        parts = key.split(_AGE_SLOT)
        # Each age of the text, over the group's ranks: one value or a span.
        spans = [(min(column), max(column)) for column in zip(*ages, strict=True)]
        text = parts[0] + "".join(
            (f"({low:.1f} s ago)" if low == high else f"({low:.1f}-{high:.1f} s ago)") + part
            for (low, high), part in zip(spans, parts[1:], strict=True)
        )
        if len(ranks) == 1:
            lines.append(f"  rank {ranks[0]}: {text}")
        else:
            lines.append(f"  ranks {_rank_ranges(ranks)} ({len(ranks)} ranks): {text}")
    rest = list(groups.values())[MOST_STATUS_LINES:]
    if rest:
        count = sum(len(ranks) for ranks, _ in rest)
        lines.append(f"  ... and {count} more ranks in {len(rest)} other states")
    return lines


def _rank_ranges(ranks: list[int]) -> str:
    """Sorted ranks as ranges, ``"0-3, 5, 7-9"`` (at most ``MOST_RANK_RANGES``)."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    shown = [str(a) if a == b else f"{a}-{b}" for a, b in spans[:MOST_RANK_RANGES]]
    if len(spans) > MOST_RANK_RANGES:
        shown.append("...")
    return ", ".join(shown)
