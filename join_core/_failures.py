"""How a rank leaves its loop body, whatever the way, and finish mode's lost ranks.

Theory of operation
-------------------
``Join.__exit__`` hands :meth:`Failures.leave` the exception leaving the loop
body (or ``None``). The joinables are told first: ``join_leave_loop()`` on a
clean exit (an exception from it is the loop body's own), ``join_loop_exited()``
on every exit. Then the machine hears ``LoopExited`` with the outcome, and the
drive runs the protocol to its end: shadowing, the failure exchange, the post
hooks. What leaves the block:

- after a clean exit, the machine's own error if the protocol failed (a
  peer's failure, an abort), else nothing, or a joinable's refusal;
- after this rank's own exception, that exception: a failure to finish the
  protocol after it (the follow-up) and an abort of the group (fail fast)
  become notes on it, not the error;
- a stall the watchdog found while the rank was still in its loop body (a
  silent peer) comes first: the exception leaving the body followed from it.

An error that does not name its rank gets a note naming the peers whose
process is gone (``gone_peers``), and the last heartbeat is settled once the
protocol finished. With ``on_rank_loss="finish"`` the backend's recovery is
started on entry (before any collective) and its lost ranks are polled before
each heartbeat and at the end, each new one a ``RanksLost`` observation.

Standard library and attrs only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _machine as m
from . import _ports
from ._drive import Drive, failure_of
from ._entry import Setup
from ._errors import PeerAborted, PeerFailure

__all__ = ["Failures"]


class Failures:
    """One Join's way out of its loop body, and its lost ranks (module doc).

    Args:
        setup: what the Join was built with.
        drive: the Join's drive.
    """

    def __init__(self, setup: Setup, drive: Drive) -> None:
        self.setup = setup
        self.drive = drive
        # on_rank_loss="finish": the backend's lost_ranks (read after each
        # heartbeat and at the end) and how many of them the machine has seen.
        self.read_lost: Callable[[], tuple[Any, ...]] = tuple
        self.losses_seen = self.losses_before = 0
        if setup.elastic:
            drive.poll_losses = self.poll_losses

    # -- on_rank_loss="finish" -------------------------------------------------------

    def start_rank_loss_recovery(self) -> None:
        """On entry, before any collective, on every rank alike: a backend that
        cannot rebuild its group says so here, not at the first death."""
        setup = self.setup
        backend = setup.backend
        _ports.start_rank_loss_recovery(backend, setup.caps, _ports.RankLossConfig(
            progress=self.recovery_progress, world_size=backend.world_size,
            rank=backend.rank))
        self.read_lost = _ports.lost_ranks(setup.caps)
        # A group outlives its Joins: the losses of earlier ones are not this one's.
        self.losses_seen = self.losses_before = len(self.read_lost())

    def recovery_progress(self) -> None:
        """The backend's recovery made a step (``RankLossConfig.progress``)."""
        self.drive.watch.ticks += 1

    def poll_losses(self) -> None:
        """Hand the machine the backend's losses, if any are new."""
        lost = self.read_lost()
        if len(lost) != self.losses_seen:
            self.losses_seen = len(lost)
            mine = tuple(lost[self.losses_before:])
            self.drive.feed(m.RanksLost(lost=mine, now=self.drive.clock()))

    # -- leaving the loop body -------------------------------------------------------

    def leave(self, exc: BaseException | None) -> None:
        """Leave the loop body, ``exc`` leaving it (or ``None``): run the
        protocol to its end and raise what must leave the block (module doc)."""
        # A stall found while this rank was still in its loop body (a
        # silent peer) came first: the exception leaving the body (the
        # abort's) follows from it. A stall found later, while the rank
        # shadows after its own failure, is a note on that failure.
        stalled_in_body = self.drive.stall
        own: Exception | None = None
        if exc is None:
            own = exc = self._leave_loop()
        left = self._loop_exited()
        if exc is None and left is not None:
            own = exc = left
        if isinstance(exc, Exception):
            self._note_gone_peers(exc)
        try:
            finished = self._finish(exc)
            self._settle_last_heartbeat(exc, finished)
            if self.setup.elastic and finished:
                self.poll_losses()  # the losses seen while shadowing
        except Exception as error:
            if error is not exc:  # a join collective failed
                self._note_gone_peers(error)
            raise
        if (stalled_in_body is not None and isinstance(exc, Exception)
                and exc is not stalled_in_body):
            # The watchdog aborted the group: its report is the error.
            raise stalled_in_body from exc
        if own is not None:
            raise own  # a joinable refused the loop's last iteration

    def _leave_loop(self) -> Exception | None:
        """Call each joinable's ``join_leave_loop()`` (the Joinable doc).

        Returns:
            The first exception one raised (then handled as the loop body's
            own failure), else ``None``.
        """
        for joinable in self.setup.joinables:
            leave = getattr(joinable, "join_leave_loop", None)
            if leave is None:
                continue
            try:
                leave()
            except Exception as error:
                return error
        return None

    def _loop_exited(self) -> Exception | None:
        """Call each joinable's ``join_loop_exited()`` (the Joinable doc), on every exit path.

        Returns:
            The first exception one raised, else ``None``.
        """
        first: Exception | None = None
        for joinable in self.setup.joinables:
            exited = getattr(joinable, "join_loop_exited", None)
            if exited is None:
                continue
            try:
                exited()
            except Exception as error:
                first = first or error
        return first

    def _note_gone_peers(self, error: Exception) -> None:
        """Name the peers whose process is gone on ``error`` leaving the Join.

        A rank killed outright (SIGKILL, the out-of-memory killer) leaves its
        peers with their library's error (gloo: "Connection closed by peer"),
        which names an address, not a rank; a backend's ``gone_peers`` can
        tell which. Before the shadowing: a launcher may end this process soon
        (torchrun SIGTERMs the survivors). An error that names its rank (a
        peer's failure or abort) needs no note. Never raises.
        """
        gone_peers = self.setup.caps.gone_peers
        if gone_peers is None or isinstance(error, (PeerFailure, PeerAborted)):
            return
        try:
            gone = gone_peers()
        except Exception:  # noqa: BLE001 - a hint only: the error is the news
            return
        for rank, process in sorted(gone.items()):
            _add_note(error, f"joinkit: rank {rank} ({process}) is no longer running "
                             "(killed? out of memory?): it is the likely cause of this error")

    def _settle_last_heartbeat(self, exc: BaseException | None, finished: bool) -> None:
        # Heartbeats are never waited on in the loop. Once the protocol has
        # finished, every later join collective has completed, so the last one
        # has too, and waiting returns at once and lets go of it. If the
        # protocol did not finish (a peer aborted the group, or froze), the
        # heartbeat may never complete: it stays with the backend, whose own
        # exit handling owns it (a torch group's exit guard). The wait goes
        # through the backend's (a torch group's gives up once a rank aborted);
        # a failure of it must not replace the exception leaving the block (the
        # rank's own, which its peers were told about).
        drive = self.drive
        handle, drive.last_heartbeat = drive.last_heartbeat, None
        if handle is None or not finished:
            return
        wait = self.setup.caps.wait
        try:
            if wait is not None:
                wait(handle)
            else:
                handle.wait()
        except Exception as error:
            if exc is None:
                raise
            _add_note(exc, f"joinkit could not settle the last heartbeat after it: {error!r}")

    def _finish(self, exc: BaseException | None) -> bool:
        """Run the protocol to its end; return whether it got there.

        Only after a failure in the loop body can it end early (the follow-up
        becomes a note on the rank's own exception); otherwise the machine's
        error propagates.
        """
        drive = self.drive
        if exc is None:
            drive.feed(m.LoopExited(now=drive.clock()))
            return True
        if isinstance(exc, PeerAborted):
            drive.feed(m.LoopExited(outcome=m.Outcome.ABORTED, now=drive.clock()))
            return True
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit
            drive.feed(m.LoopExited(outcome=m.Outcome.INTERRUPTED, now=drive.clock()))
            return True
        try:
            drive.feed(
                m.LoopExited(
                    outcome=m.Outcome.FAILED,
                    failure=failure_of(exc, self.setup.backend.rank),
                    collectives_since_heartbeat=self._collectives_since_heartbeat(),
                    round_open=self._round_open(),
                    now=drive.clock(),
                )
            )
        except Exception as follow_up:
            # The rank's own exception is the one to report; keep the follow-up.
            _add_note(exc, f"joinkit could not finish shadowing after it: {follow_up!r}")
            return False
        if drive.aborted is not None:
            # Failed fast (where the abort returns: the exception leaves the block).
            _add_note(exc, f"joinkit aborted the group after it: {drive.aborted}")
            return False
        return True

    def _round_open(self) -> bool | None:
        """With a round heartbeat, whether this rank left midway through one of
        the first joinable's rounds (its ``join_round_open()``; ``None``: it
        cannot tell, or no round heartbeat)."""
        if not self.setup.round:
            return None
        ask = getattr(self.setup.joinables[0], "join_round_open", None)
        return None if ask is None else ask()

    def _collectives_since_heartbeat(self) -> int | None:
        """The group's own collectives since this rank's last heartbeat.

        The machine tells from it whether the rank failed midway through an
        iteration its peers are still in. ``None`` where the backend cannot
        count them all (no ``collectives_issued``, or a joinable with
        ``join_raw_collectives``), or before any heartbeat.
        """
        if not self.setup.counts_collectives:
            return None
        counter = self.setup.backend.collectives_issued
        mark = self.drive.collectives_at_heartbeat
        if counter is None or mark is None:
            return None
        return int(counter - mark)


def _add_note(error: BaseException, note: str) -> None:
    add_note = getattr(error, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(note)
