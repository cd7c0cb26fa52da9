"""The imperative shell: ``Join``, ``Joinable`` and ``JoinHook``.

The shell owns everything the pure machine in ``_machine`` must not touch: the
clock, the backend's collectives, the joinables' hooks, warnings and raising.
It feeds observations to ``step`` and carries out the commands that come back,
in order. It executes and never decides: the per-iteration path is the
machine's standing ``HeartbeatOrder`` (the shell sends the heartbeats, checks
the previous sum against the order's alarm, and reports how many it sent as
one ``Notified`` before its next observation), a joined rank's rounds are
``Drain`` commands, each a batch of rounds answered by one ``Drained``, and
logging takes the same path. A long drain says so at INFO (the machine's
rate-limited ``ReportProgress``, completed with the active ranks' names from
the backend's status board), and DEBUG logs phase changes, a whole drain as one
line. It tells its watchdog ``Watch`` what it is blocked in (and ticks it at
every step of a drain); the watchdog calls back ``_on_stall``. The API (names,
arguments, messages) follows ``torch.distributed.algorithms.join`` so code
written for torch works by changing one import.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, cast

import attrs

from . import _machine as m
from . import _messages as text
from . import _ports, _watchdog
from . import _wire as wire
from ._errors import LocalProtocolError, PeerAborted, PeerFailure, RankTimeout
from ._joinable import _DISABLED, Joinable, JoinConfig, JoinHook  # the joinable side
from ._reports import Failure, JoinReport

__all__ = ["Join", "Joinable", "JoinHook", "JoinConfig"]

_log = logging.getLogger("joinkit")

# How many enabled Joins this thread is inside (a rank is a thread on the
# threads backend, so this is per thread).
_active = threading.local()

#: What a rank posts to its peers' status board while in its loop body (a
#: progress line names the ranks whose board entry says so).
_ACTIVE_STATUS = _watchdog.LOOP_BODY

class _DefaultTimeout(float):
    """The type of :data:`DEFAULT_TIMEOUT`, so that a Join can tell it was not given."""

    __slots__ = ()


#: Default ``Join(timeout=...)``: a stall (every rank in a join collective or
#: round of hooks, or a silent peer) fails within minutes rather than at
#: torch's 30, while a healthy rank that spends longer in its loop body is
#: waited for (the watchdog module doc). An explicit ``timeout=`` is a hard
#: limit instead. Identity tells the default from an explicit 300.
DEFAULT_TIMEOUT: float = _DefaultTimeout(300.0)
#: A private knob, for tests only: the default timeout's seconds (not its
#: policy), read when a Join is built (docs/reliability.md).
_DEFAULT_TIMEOUT_ENV = "JOINKIT_DEFAULT_TIMEOUT"
#: Under the default, a backend without a status board (no ``peer_board``)
#: cannot tell a slow peer from a stalled one, so its watchdog is a hard limit
#: of this many default timeouts: torch's own process group timeout (30 min),
#: so no healthy iteration that torch would allow is cut short, and a hang
#: still ends with joinkit's diagnostic (MPI's would never end).
_BOARDLESS_FACTOR = 6


def _as_joinable(obj: Any) -> Joinable:
    """Return ``obj`` if it is a joinkit Joinable, else its adapter."""
    if isinstance(obj, Joinable):
        return obj
    # Framework objects (torch's DDP, ZeRO, any torch Joinable) are bridged by
    # the adapters registered with the core's adapter port.
    adapted = _ports.adapt(obj)
    if adapted is not None:
        return adapted
    raise TypeError(
        f"Join expects Joinable objects, got {type(obj).__qualname__}: subclass "
        "joinkit.Joinable (or torch.distributed.algorithms.join.Joinable) and "
        "implement join_hook, join_device and join_process_group"
    )


class Join:
    """Context manager for data-parallel loops whose ranks have uneven inputs.

    Inside ``with Join(joinables):`` each rank runs its own loop. When a rank
    runs out of inputs it *joins*: on leaving the block it keeps running every
    joinable's main hook, shadowing the collectives of the ranks still in their
    loop, until all ranks have joined; then each rank runs the post hooks.
    A Join object is single-use: create a new one for each loop (e.g. one per
    epoch); entering a used one raises :class:`~joinkit.LocalProtocolError`.

    If the loop body raises on one rank, that rank keeps shadowing too, its
    peers learn of the failure through the join collectives, and every rank
    leaves the block with an error: the failing rank with its own exception,
    the others with :class:`~joinkit.PeerFailure` naming it. Only where the
    Join cannot tell whether the peers wait in the collectives of the failing
    rank's last iteration (it raised after a heartbeat, and the backend cannot
    count the joinables' collectives: a raw mpi4py communicator, or a joinable
    with ``join_raw_collectives``) does the failing rank instead abort the
    group at once, with its exception in the abort's message (on MPI:
    ``MPI_Abort``, which ends the job, as ``python -m mpi4py`` does).

    Args:
        joinables: the participating joinables; their hooks run in this order
            and the first one sends the heartbeat.
        enable: ``False`` makes the context manager do nothing (only for inputs
            known to be even).
        throw_on_early_termination: raise ``RuntimeError`` on every rank as soon
            as one rank runs out of inputs, instead of shadowing.
        check_agreement: on entry, check that all ranks pass the same number
            of joinables and flags on the same backend: one small collective
            comparing digests of the settings, and only on a difference an
            all-gather of the settings for the error's table (turn it off to
            share a group with torch's own Join). A fused heartbeat
            changes what goes on the wire, so it is used only with the check
            on; without it the first joinable sends torch's heartbeat.
        timeout: the watchdog's seconds. By default (300 s) a rank blocked
            in a join collective or a round of hooks with no progress for that
            long raises ``RankTimeout`` (saying what it and, where the backend
            can tell, its peers were doing) and aborts the group where the
            backend can, unless some peer is alive in its loop body: a slow
            healthy rank is waited for, however long, and the waiting rank
            logs at INFO whom it waits for. A peer that stops beating on the
            status board (dead, frozen, holding the GIL) is reported within
            the timeout, also while this rank is in its loop body. An
            explicit ``timeout=`` is a hard limit on every join collective
            and round of hooks; ``None`` turns the watchdog off.
        on_rank_loss: what a rank that dies inside the Join (SIGKILL, the
            out-of-memory killer, a lost node) does to the others.
            ``"raise"`` (the default): they leave promptly with an error naming
            it. ``"finish"``: it counts as a rank that joined; the backend
            rebuilds the group over the survivors, who finish the loop and run
            the post hooks, and ``report.lost_ranks`` (plus one warning per
            loss) names it and the iterations it completed. A joinable
            that fuses its heartbeat sends the classic one in this mode.
            Needs a backend that can rebuild its group (an MPIGroup under
            ``mpirun --with-ft ulfm``; docs/elastic.md), checked on entry
            before any collective. In this mode the watchdog does not read
            the status board (ranks are renumbered after a loss): a stall is
            judged by the hard timeout (by default six times ``timeout``).
        **kwargs: forwarded to every joinable's ``join_hook``.

    Raises:
        ValueError: ``on_rank_loss`` is neither ``"raise"`` nor ``"finish"``,
            or ``"finish"`` comes with ``throw_on_early_termination``; on
            entry, the backend cannot recover from a rank loss (the message
            says what works). ``joinables`` is empty, the joinables use different
            process groups, every joinable follows the Join's group (a
            ``SideCollective`` without ``process_group`` alone), or the
            group has more than 2**24 ranks (the heartbeat's float32 sum
            could not count them).
        TypeError: an element is not a Joinable, or its hook is not a JoinHook,
            or no backend handles the joinables' process group.
    """

    def __init__(
        self,
        joinables: Iterable[Any],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        *,
        check_agreement: bool = True,
        timeout: float | None = DEFAULT_TIMEOUT,
        on_rank_loss: str = "raise",
        **kwargs: Any,
    ) -> None:
        m.check_on_rank_loss(on_rank_loss, throw_on_early_termination)
        hard = timeout is not DEFAULT_TIMEOUT
        if not hard:
            timeout = _default_timeout()
        if timeout is not None and not timeout > 0:
            raise ValueError(
                f"timeout must be a positive number of seconds or None, not {timeout!r}"
            )
        if isinstance(joinables, Joinable) or not isinstance(joinables, Iterable):
            raise TypeError(
                f"Join expects a list of Joinables, got {type(joinables).__qualname__}: "
                "write Join([joinable])"
            )
        joinable_list = [_as_joinable(j) for j in joinables]
        if not joinable_list:
            raise ValueError("The join context manager requires at least one joinable")
        _ports.check_joinables(joinable_list)
        hooks = [joinable.join_hook(**kwargs) for joinable in joinable_list]
        for joinable, hook in zip(joinable_list, hooks, strict=True):
            if not isinstance(hook, JoinHook) and not _looks_like_hook(hook):
                raise TypeError(
                    f"{_name(joinable)}.join_hook() returned "
                    f"{type(hook).__qualname__}, not a JoinHook: return an object "
                    "with main_hook() and post_hook(is_last_joiner)"
                )
            shadow = getattr(type(hook), "fused_shadow", None)
            if _fuses(joinable) and (shadow is None or shadow is JoinHook.fused_shadow):
                raise TypeError(
                    f"{_name(joinable)} sets join_fuses_heartbeat but its "
                    f"hook {type(hook).__qualname__} has no fused_shadow(heartbeat) -> "
                    "float: add one that shadows the joinable's first collective"
                )
        # The joinables that follow the Join's group (a SideCollective without
        # one) take the group and device of the first one that has its own.
        owners = [j for j in joinable_list if not _follows(j)]
        if not owners:
            raise ValueError(
                f"{_name(joinable_list[0])} follows the process group of the Join's other "
                "joinables, and this Join has no joinable with a group of its own: give it "
                "one (SideCollective(fn, shadow=..., process_group=group)) or list it with "
                "the model whose collectives it runs beside, Join([model, side])"
            )
        leader = owners[0]
        process_group = leader.join_process_group
        for joinable in owners[1:]:
            if joinable.join_process_group != process_group:
                raise ValueError(
                    "Using join context manager with multiple process groups: "
                    f"{_name(joinable)} uses a different "
                    f"join_process_group from {_name(leader)}; all joinables "
                    "of one Join must share one process group"
                )
        self._joinables = joinable_list
        self._hooks = hooks
        # Which joinables fuse a heartbeat slot into their first collective
        # (a shadow round shadows it first, see _round_plan).
        fuses = [_fuses(j) for j in joinable_list]
        self._fuses_slot = fuses
        # Fused only where the agreement check proves every rank fuses: torch's
        # Join (which a group shared with it needs, check_agreement=False)
        # speaks only the classic heartbeat.
        # Not with on_rank_loss="finish" either: a backend that rebuilds its group
        # after a death must see every heartbeat (its sum says which ranks were
        # active in each iteration, whence a lost rank's iterations).
        self._fused = (fuses[0] and not throw_on_early_termination and check_agreement
                       and on_rank_loss != "finish")
        # The round heartbeat (a fused one in every collective of the first
        # joinable's rounds, nothing per input): only where no other joinable
        # has collectives of its own per iteration (its main hook shadows
        # nothing), so that the first joinable's rounds are all a joined rank
        # must meet.
        self._round = self._fused and _in_round(joinable_list[0]) and all(
            not fused and _quiet(hook) for hook, fused in zip(hooks[1:], fuses[1:], strict=True))
        self._fused_total: float | None = None
        self._enable = bool(enable)
        self._throw_on_early_termination = bool(throw_on_early_termination)
        self._process_group = process_group
        self._device = leader.join_device
        self._clock: Callable[[], float] = time.monotonic
        self._backend: Any = None
        # The backend's optional members, looked up once (_ports.capabilities).
        self._caps = _ports.BackendCapabilities()
        self._post_status: Callable[[str], None] | None = None
        self._state: m.JoinState | None = None
        # The machine's standing heartbeat order (m.HeartbeatOrder), while one
        # stands, and the heartbeats sent under it but not yet reported.
        self._order: m.HeartbeatOrder | None = None
        self._beats = 0
        # The previous heartbeat's handle, and the backend's collective
        # counter when that heartbeat went out (see _leave).
        self._last_heartbeat: Any = None
        self._collectives_at_heartbeat: int | None = None
        self._counts_collectives = False
        # The watchdog's view (what the rank is blocked in, registered only
        # with a timeout), and its verdict.
        self._timeout = timeout
        self._watch = _watchdog.Watch(timeout or 1.0, self._on_stall)
        self._stall: RankTimeout | None = None
        # The AbortGroup message, once this rank aborted the group after its
        # own failure in the loop body (fail fast, see _leave).
        self._aborted: str | None = None
        # Between __enter__ and __exit__ (a Join is single-use: see _reentered).
        self._inside = False
        # Later joinables: the heartbeats counted at each one's latest notify
        # (by id; see _later_notify).
        self._notified: dict[int, int] = {}
        # Checks to run before this rank's next heartbeat (before_next_heartbeat);
        # while any waits, no standing order stands, so the fast path never looks.
        self._checks: list[Callable[[], None]] = []
        self._held_order: m.HeartbeatOrder | None = None
        # For the DEBUG log (_log_phase): since when the rank is in its phase,
        # and, across a drain's batches, its first round and its batches.
        self._phase_since: float | None = None
        self._drain_from = 0
        self._drain_batches = 0
        # on_rank_loss="finish": the backend's lost_ranks (read after each
        # heartbeat and at the end) and how many of them the machine has seen.
        self._on_rank_loss = on_rank_loss
        self._elastic = self._enable and on_rank_loss == "finish"
        self._read_lost: Callable[[], tuple[Any, ...]] = tuple
        self._losses_seen = self._losses_before = 0
        if self._enable:
            backend = _ports.resolve(process_group, self._device)
            self._backend = backend
            caps = self._caps = _ports.capabilities(backend)
            self._heartbeat = backend.heartbeat
            self._heartbeat_total = caps.heartbeat_total
            self._post_status = caps.post_status
            # Read per heartbeat only where it exists and sees every collective
            # of the joinables (else a failure's place is unknown: None).
            self._counts_collectives = caps.counts_collectives and not any(
                getattr(j, "join_raw_collectives", False) for j in joinable_list
            )
            if timeout is not None:
                board = caps.peer_board
                if self._elastic:
                    # Ranks are renumbered when the group is rebuilt, and a
                    # dead rank's silence is the backend's to handle: no board.
                    board = None
                read = None if board is None else functools.partial(_read_board, board)
                if read is None and not hard:  # cannot tell slow from stalled
                    hard, timeout = True, timeout * _BOARDLESS_FACTOR
                self._timeout = timeout
                self._watch = _watchdog.Watch(
                    timeout, self._on_stall, hard=hard, rank=backend.rank,
                    world_size=backend.world_size, read=read,
                    beat=caps.post_beat, on_wait=self._on_wait,
                )
            signature = (
                ("joinables", len(joinable_list)),
                ("throw_on_early_termination", self._throw_on_early_termination),
                ("backend", type(backend).__name__),
                ("heartbeat", self.heartbeat),
                ("on_rank_loss", on_rank_loss),
            )
            self._state = m.initial_state(
                m.MachineConfig(
                    rank=backend.rank,
                    throw_on_early_termination=self._throw_on_early_termination,
                    signature=signature if check_agreement else None,
                    fused_heartbeat=self._fused,
                    round_heartbeat=self._round,
                    world_size=backend.world_size,
                    can_abort=caps.abort is not None,
                    progress_interval=m.PROGRESS_INTERVAL,
                    on_rank_loss=on_rank_loss,
                )
            )

    # -- context manager -------------------------------------------------------

    def __enter__(self) -> Join:
        if self._state is not None and self._state.phase is not m.Phase.IDLE:
            raise _reentered(self._state.phase, self._inside)
        for joinable in self._joinables:
            config = getattr(joinable, "_join_config", None)
            if config is None:
                raise _missing_config(joinable)
            if config.enable and config.join is not self:
                raise LocalProtocolError(
                    f"{_name(joinable)} is already inside another "
                    "enabled Join; Joins over the same joinable cannot be nested"
                )
        if self._elastic:
            # Before any collective, on every rank alike: a backend that cannot
            # rebuild its group says so here, not at the first death.
            backend = self._backend
            _ports.start_rank_loss_recovery(backend, self._caps, _ports.RankLossConfig(
                progress=self._recovery_progress, world_size=backend.world_size,
                rank=backend.rank))
            self._read_lost = _ports.lost_ranks(self._caps)
            # A group outlives its Joins: the losses of earlier ones are not this one's.
            self._losses_seen = self._losses_before = len(self._read_lost())
        if self._enable:
            if self._timeout is not None:
                _watchdog.watch(self._watch)
            try:
                self._feed(m.Entered(now=self._clock()))  # may raise AgreementError
            except BaseException:
                _watchdog.unwatch(self._watch)
                raise
            if self._state is not None and self._state.config.signature is not None:
                self._watch.peers_inside = True  # every rank passed the agreement check
            # Not an activity: the loop body may take as long as it likes.
            self._post(_watchdog.LOOP_BODY)
        try:
            for index, joinable in enumerate(self._joinables):
                joinable._join_config = JoinConfig(
                    enable=self._enable,
                    throw_on_early_termination=self._throw_on_early_termination,
                    is_first_joinable=index == 0,
                    join=self,
                )
        except BaseException:
            # An adapter refused its config (every rank alike: the settings
            # agree); nothing of the loop has run, so leave as if never entered.
            for joinable in self._joinables:
                joinable._join_config = _DISABLED
            if self._enable:
                _watchdog.unwatch(self._watch)
                self._post(_watchdog.LEFT)
            raise
        if self._enable:
            _active.joins = getattr(_active, "joins", 0) + 1
            _entered_joins().append(self)
            self._inside = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._enable:
                # A stall found while this rank was still in its loop body (a
                # silent peer) came first: the exception leaving the body (the
                # abort's) follows from it. A stall found later, while the rank
                # shadows after its own failure, is a note on that failure.
                stalled_in_body = self._stall
                own: Exception | None = None
                if exc is None:
                    own = exc = self._leave_loop()
                left = self._loop_exited()
                if exc is None and left is not None:
                    own = exc = left
                if isinstance(exc, Exception):
                    self._note_gone_peers(exc)
                try:
                    finished = self._leave(exc)
                    self._settle_last_heartbeat(exc, finished)
                    if self._elastic and finished:
                        self._poll_losses()  # the losses seen while shadowing
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
        finally:
            for joinable in self._joinables:
                joinable._join_config = _DISABLED
            if self._enable:
                self._inside = False
                _active.joins -= 1
                stack = _entered_joins()
                if self in stack:
                    stack.remove(self)
                _watchdog.unwatch(self._watch)
                self._post(_watchdog.LEFT)

    def _leave_loop(self) -> Exception | None:
        """Call each joinable's ``join_leave_loop()`` (the Joinable doc).

        Returns:
            The first exception one raised (then handled as the loop body's
            own failure), else ``None``.
        """
        for joinable in self._joinables:
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
        for joinable in self._joinables:
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
        gone_peers = self._caps.gone_peers
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
        handle, self._last_heartbeat = self._last_heartbeat, None
        if handle is None or not finished:
            return
        wait = self._caps.wait
        try:
            if wait is not None:
                wait(handle)
            else:
                handle.wait()
        except Exception as error:
            if exc is None:
                raise
            _add_note(exc, f"joinkit could not settle the last heartbeat after it: {error!r}")

    def _leave(self, exc: BaseException | None) -> bool:
        """Run the protocol to its end; return whether it got there.

        Only after a failure in the loop body can it end early (the follow-up
        becomes a note on the rank's own exception); otherwise the machine's
        error propagates.
        """
        if exc is None:
            self._feed(m.LoopExited(now=self._clock()))
            return True
        if isinstance(exc, PeerAborted):
            self._feed(m.LoopExited(outcome=m.Outcome.ABORTED, now=self._clock()))
            return True
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit
            self._feed(m.LoopExited(outcome=m.Outcome.INTERRUPTED, now=self._clock()))
            return True
        try:
            self._feed(
                m.LoopExited(
                    outcome=m.Outcome.FAILED,
                    failure=_failure(exc, self._backend.rank),
                    collectives_since_heartbeat=self._collectives_since_heartbeat(),
                    round_open=self._round_open(),
                    now=self._clock(),
                )
            )
        except Exception as follow_up:
            # The rank's own exception is the one to report; keep the follow-up.
            _add_note(exc, f"joinkit could not finish shadowing after it: {follow_up!r}")
            return False
        if self._aborted is not None:
            # Failed fast (where the abort returns: the exception leaves the block).
            _add_note(exc, f"joinkit aborted the group after it: {self._aborted}")
            return False
        return True

    def _round_open(self) -> bool | None:
        """With a round heartbeat, whether this rank left midway through one of
        the first joinable's rounds (its ``join_round_open()``; ``None``: it
        cannot tell, or no round heartbeat)."""
        if not self._round:
            return None
        ask = getattr(self._joinables[0], "join_round_open", None)
        return None if ask is None else ask()

    def _collectives_since_heartbeat(self) -> int | None:
        """The group's own collectives since this rank's last heartbeat.

        The machine tells from it whether the rank failed midway through an
        iteration its peers are still in. ``None`` where the backend cannot
        count them all (no ``collectives_issued``, or a joinable with
        ``join_raw_collectives``), or before any heartbeat.
        """
        if not self._counts_collectives:
            return None
        counter = self._backend.collectives_issued
        mark = self._collectives_at_heartbeat
        if counter is None or mark is None:
            return None
        return int(counter - mark)

    # -- the heartbeat ---------------------------------------------------------

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Any:
        """Tell the Join that this rank has not joined yet (one more input).

        Call it from a joinable before its per-iteration collectives. Only the
        first joinable of the Join sends the heartbeat; for the others, and
        outside any enabled Join, this does nothing. With
        ``throw_on_early_termination=True`` it raises if a rank has joined.

        Args:
            joinable: the joinable calling.

        Returns:
            The heartbeat's async handle for the first joinable, else ``None``.

        Raises:
            LocalProtocolError: the joinable's constructor did not call
                ``Joinable.__init__``.
            RuntimeError: throw mode, and some rank exhausted its inputs.
            PeerAborted: another rank failed; let it leave the Join block.
        """
        try:
            join = _heartbeat_owner(joinable)
        except _ForeignConfig:
            return _notify_foreign(joinable)
        return None if join is None else join._notify()

    @staticmethod
    def current() -> Join | None:
        """The innermost enabled Join this thread is inside, or ``None``.

        Inside means between a successful ``__enter__`` and the end of
        ``__exit__``: the loop body and, on a rank that joined, its shadowing.
        A data source that counts what the loop consumed (the exact shards'
        ``ShardSampler.state_dict``) reads the Join's :attr:`report` here:
        ``report.inputs`` is this rank's iterations so far.

        Returns:
            The Join, or ``None`` outside any enabled Join (a rank is a thread
            on the threads backend, so this is per thread).
        """
        stack = _entered_joins()
        return stack[-1] if stack else None

    @staticmethod
    def fused_heartbeat(joinable: Joinable) -> float:
        """The heartbeat value a fused joinable puts into its collective's slot.

        The fused counterpart of :meth:`notify_join_context`, called at the same
        point: ``1.0`` for the first joinable of an enabled Join on a rank that
        has not joined, else ``0.0``. (In throw mode, which cannot fuse, it sends
        the classic heartbeat and check and returns ``0.0``.)

        Args:
            joinable: the joinable calling; it sets ``join_fuses_heartbeat``.

        Returns:
            The value for the heartbeat slot.

        Raises:
            LocalProtocolError: the constructor did not call ``Joinable.__init__``.
            RuntimeError: throw mode, and some rank exhausted its inputs.
            PeerAborted: another rank failed; let it leave the Join block.
        """
        try:
            join = _heartbeat_owner(joinable)
        except _ForeignConfig:
            raise _foreign_error(joinable, "fused_heartbeat") from None
        if join is not None:
            # (Never fused with on_rank_loss="finish": _notify below reads the losses.)
            order = join._order
            if order is None and join._checks:
                # Checks wait (before_next_heartbeat): they run before this
                # collective; the held order comes back.
                order = join._run_checks()
            if order is not None and order.fused:
                # The standing order, inlined (this is the per-iteration path).
                total = join._fused_total
                if total is not None and total >= order.alarm:
                    join._feed(m.HeartbeatSeen(total=total, now=join._clock()))  # PeerAborted
                    return wire.JOINED
                join._beats += 1
                if join._counts_collectives:
                    join._collectives_at_heartbeat = join._backend.collectives_issued
                return order.value
            join._notify()
        return wire.JOINED

    @staticmethod
    def record_heartbeat_total(joinable: Joinable, total: float) -> None:
        """Hand the Join the sum of a fused heartbeat slot (optional).

        With it, an active rank learns at its next :meth:`fused_heartbeat` that a
        peer failed, instead of when it runs out of inputs.
        """
        config = joinable._join_config
        join = cast("Join | None", config.join)  # a config names the Join that set it
        if config.is_first_joinable and config.enable and join is not None:
            join._fused_total = total

    def _recovery_progress(self) -> None:
        """The backend's recovery made a step (``RankLossConfig.progress``)."""
        self._watch.ticks += 1

    def _poll_losses(self) -> None:
        """Hand the machine the backend's losses, if any are new."""
        lost = self._read_lost()
        if len(lost) != self._losses_seen:
            self._losses_seen = len(lost)
            mine = tuple(lost[self._losses_before:])
            self._feed(m.RanksLost(lost=mine, now=self._clock()))

    def _notify(self) -> Any:
        if self._elastic:
            self._poll_losses()  # those found since the previous heartbeat
        order = self._order
        if order is None and self._checks:
            order = self._run_checks()
        if order is None:
            # No standing order (throw mode): the machine decides each notify.
            handle = self._feed(m.Notified(now=self._clock()))
        elif order.fused:
            # A fused joinable notifying: its heartbeat rides in its collective.
            self._fused_beat(order)
            return None
        else:
            # The standing order: the previous heartbeat's sum (where the
            # backend can tell) if it is an alarm, else this heartbeat.
            previous = self._last_heartbeat
            if previous is not None and self._heartbeat_total is not None:
                total = self._heartbeat_total(previous)
                if total >= order.alarm:
                    return self._feed(m.HeartbeatSeen(total=total, now=self._clock()))
            self._beats += 1
            handle = self._last_heartbeat = self._heartbeat(order.value)
        # A failure before the backend issues another collective leaves this
        # iteration open for the peers (see _leave).
        if self._counts_collectives:
            self._collectives_at_heartbeat = self._backend.collectives_issued
        return handle

    def _run_checks(self) -> m.HeartbeatOrder | None:
        """Run the checks waiting for this heartbeat; give back the held order."""
        checks, self._checks = self._checks, []
        for check in checks:
            check()  # may raise: the loop body's failure, before the heartbeat
        # The standing order held while the checks waited (None in throw mode).
        order, self._held_order = self._held_order, None
        self._order = order
        return order

    def _fused_beat(self, order: m.HeartbeatOrder) -> float:
        """The standing order for a fused heartbeat: the value for the slot."""
        total = self._fused_total
        if total is not None and total >= order.alarm:
            self._feed(m.HeartbeatSeen(total=total, now=self._clock()))  # raises PeerAborted
            return wire.JOINED
        self._beats += 1
        if self._counts_collectives:
            self._collectives_at_heartbeat = self._backend.collectives_issued
        return order.value

    def _later_notify(self, joinable: Any) -> None:
        """A later joinable's notify: refuse one that no heartbeat announced.

        A joined rank runs each main hook once per heartbeat, so two notifies of
        a later joinable with no heartbeat in between (or one before the first
        heartbeat) mean the first joinable skipped its notify: the joined ranks
        would pair this joinable's collectives with their counts. Only in the
        loop body (a shadow round's own notifies are not inputs). Costs two
        attribute reads, a dict look-up and a store per later notify.
        """
        state = self._state
        if state is None or state.phase is not m.Phase.ACTIVE:
            return
        beats = state.heartbeats + self._beats
        key = id(joinable)
        if self._notified.get(key, 0) == beats and getattr(
                joinable, "join_notifies_per_iteration", 1) is not None:
            first = self._joinables[0]
            since = "since the Join was entered" if beats == 0 else (
                f"since its previous notify (after input {beats})")
            raise LocalProtocolError(
                f"{_name(joinable)} called notify_join_context with no heartbeat {since}: "
                f"the Join's first joinable, {_name(first)}, must call "
                "Join.notify_join_context(self) (or send its fused heartbeat) once per "
                "iteration before its collectives, because a joined rank shadows every "
                "joinable once per heartbeat. Add that call to "
                f"{type(first).__qualname__}, or list a joinable that notifies every "
                f"iteration first (e.g. Join([{_name(joinable)}, ...]))"
            )
        self._notified[key] = beats

    # -- observability -----------------------------------------------------------

    @property
    def backend(self) -> Any:
        """The join backend this Join talks to (``None`` when not enabled).

        The object the backend registry resolved for the joinables' process
        group; adapters use it to wait on framework work the way a peer's
        abort can end (its optional ``wait(work)``).
        """
        return self._backend

    def before_next_heartbeat(self, check: Callable[[], None]) -> bool:
        """Run ``check`` on this rank right before its next heartbeat, once.

        For a later joinable that must settle (or refuse) what it did in this
        iteration before the first joinable announces the next one (DDP after
        another joinable: a forward with gradients and no backward). While a
        check waits, the next notify takes the machine's path instead of the
        standing order's inline check (a branch, once); an exception from ``check``
        leaves the first joinable's notify (or its :meth:`fused_heartbeat`,
        called before its own collective), in the loop body, before anything
        is sent.

        Args:
            check: called with no arguments.

        Returns:
            Whether the check was taken: ``False`` outside the loop body.
        """
        state = self._state
        if state is None or state.phase is not m.Phase.ACTIVE:
            return False
        self._checks.append(check)
        if self._order is not None:
            self._order, self._held_order = None, self._order
        return True

    @property
    def heartbeat_handle(self) -> Any:
        """The async handle of the latest heartbeat this rank sent, or ``None``.

        What the backend's ``heartbeat`` returned (a torch ``Work`` on a torch
        group, whose result is the number of active ranks); ``None`` before
        the first heartbeat and where heartbeats are fused. A later joinable
        reads it after the first joinable's notify, in the same iteration
        (DDP after another joinable, for ``divide_by_initial_world_size=False``).
        """
        return self._last_heartbeat

    @property
    def joinables(self) -> tuple[Joinable, ...]:
        """The Join's joinables in their order, framework objects as their adapters.

        An adapter reads the others of its Join here to refuse a combination
        it cannot shadow (e.g. on entry), or to find the joinable whose
        heartbeat it follows.
        """
        return tuple(self._joinables)

    @property
    def process_group(self) -> Any:
        """The process group of the Join: the one its joinables share.

        A joinable that follows the Join's group (``join_follows_group``, a
        ``SideCollective`` without ``process_group``) reads it here.
        """
        return self._process_group

    @property
    def device(self) -> Any:
        """The device of the Join's own collectives (its first group owner's ``join_device``)."""
        return self._device

    @property
    def fuses_heartbeat(self) -> bool:
        """Whether the first joinable carries the heartbeat in its own collective.

        True when it sets ``join_fuses_heartbeat``, the Join is not in throw
        mode and the agreement check is on (so every rank is known to fuse).
        """
        return self._fused

    @property
    def heartbeat(self) -> str:
        """How this Join's heartbeat travels, the same on every rank.

        ``"classic"``: its own 1-element all-reduce per input (torch's wire
        format; throw mode, ``check_agreement=False``, ``on_rank_loss="finish"``,
        or a first joinable that cannot carry it). ``"fused"``: one more
        element in the first joinable's first collective of each input.
        ``"round"``: one more element in every collective of the first
        joinable's rounds, nothing per input (the first joinable sets
        ``join_heartbeat_in_round`` and no other joinable has collectives of
        its own: its main hook is :class:`JoinHook`'s). ``join.report`` records it.
        """
        if self._round:
            return "round"
        return "fused" if self._fused else "classic"

    @property
    def rank(self) -> int:
        """This rank in the Join's process group (``enable=True`` only)."""
        return int(self._backend.rank)

    @property
    def state(self) -> m.JoinState | None:
        """The machine's current state (``None`` when not enabled)."""
        self._report_beats()
        return self._state

    @property
    def on_rank_loss(self) -> str:
        """``"raise"`` or ``"finish"``, as given (adapters refuse what cannot finish)."""
        return self._on_rank_loss

    @property
    def report(self) -> JoinReport | None:
        """What this rank did: inputs, join round, shadow rounds and time, last joiner.

        ``None`` when the Join is not enabled.
        """
        state = self.state
        return None if state is None else m.report(state)

    def gather_report(self, dst: int = 0) -> list[JoinReport] | None:
        """Collect every rank's report on rank ``dst`` (a collective: call it on all ranks).

        Args:
            dst: the rank that receives the reports.

        Returns:
            The reports in rank order on ``dst``, ``None`` elsewhere. Render them
            with :func:`joinkit.format_reports`.

        Raises:
            LocalProtocolError: the Join is not enabled.
            ValueError: ``dst`` is not a rank of the group (checked on every
                rank before anything is sent, so all ranks raise together).
        """
        if self._backend is None:
            raise LocalProtocolError("gather_report needs an enabled Join (enable=True)")
        world = self._backend.world_size
        if type(dst) is not int or not 0 <= dst < world:  # bool and "0" are not ranks
            raise ValueError(
                f"gather_report(dst={dst!r}): dst must be a rank of the Join's group, "
                f"an int from 0 to {world - 1}"
            )
        # To dst only: an all-gather would cost every rank O(world size).
        return _ports.gather_object(self._backend, self._caps, self.report, dst)

    # -- driving the machine ---------------------------------------------------

    def _report_beats(self) -> None:
        """Tell the machine the heartbeats sent under its standing order."""
        if self._beats:
            beats, self._beats = self._beats, 0
            self._feed(m.Notified(count=beats, now=self._clock()))

    def _feed(self, observation: m.Observation) -> Any:
        """Step the machine and carry out its commands until none is pending.

        Returns the heartbeat handle if a heartbeat was sent.
        """
        try:
            self._report_beats()  # before anything the machine hears next
            return self._run(observation)
        except Exception as error:
            if self._stall is not None and error is not self._stall:
                raise self._stall from error
            raise
        finally:
            self._watch.end()

    def _on_stall(self, stall: _watchdog.Stall) -> None:
        """Called by the watchdog thread, once, on a stall or a silent peer."""
        assert self._state is not None and self._timeout is not None
        if stall.silent and self._caps.knows_aborts and self._backend.aborted is not None:
            # A rank aborted the group (and may have left since, so it beats
            # no more): the blocked or next collective raises that abort.
            return
        if stall.silent:
            # Inputs the loop body has notified but not yet reported (it runs on).
            state = attrs.evolve(self._state, heartbeats=self._state.heartbeats + self._beats)
            message = text.silence_message(state, stall.what, stall.ticks,
                                        stall.silent, self._timeout, stall.board_error)
        else:
            assert stall.what is not None
            message = text.stall_message(self._state, stall.what, stall.ticks, stall.idle,
                                      self._timeout)
            if stall.board_error is not None and self._watch.read is not None:
                message += (f" (no peer could be shown alive: its last read of the status "
                            f"board failed: {stall.board_error})")
        peer_status = self._caps.peer_status
        if peer_status is not None:
            try:
                lines = peer_status_lines(peer_status())
            except Exception as error:  # diagnostics must not hide the stall
                lines = [f"  (peer status unavailable: {error!r})"]
            message += "\nwhat the ranks were last seen doing:\n" + "\n".join(lines)
        else:
            message += "\n(this backend cannot tell what the other ranks were doing)"
        self._stall = RankTimeout(message)
        _log.error("%s", message)
        abort = self._caps.abort
        if abort is not None:
            abort(message)

    def _on_wait(self, waiting: _watchdog.Waiting) -> None:
        """Called by the watchdog thread while this rank waits for healthy peers."""
        if not _log.isEnabledFor(logging.INFO):
            return
        since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
            seconds=waiting.idle)
        peers = ", ".join(
            f"{rank} ({what}" + ("" if age is None else f", posted {age:.0f} s ago") + ")"
            for rank, what, age in waiting.ranks
        )
        _log.info("rank %s has waited %.0f s, since %s, in %s, for ranks %s (alive; "
                  "not a stall under the default timeout)", self._backend.rank,
                  waiting.idle, since.strftime("%Y-%m-%d %H:%M:%S UTC"), waiting.what,
                  peers)

    def _doing(self, what: str, status: str | None = None) -> None:
        """Record what the rank is now blocked in, for the watchdog and (or
        ``status``, if given) for the peers."""
        self._watch.begin(what, self._clock())
        self._post(what if status is None else status)

    def _post(self, what: str) -> None:
        """Tell the peers' stall diagnostics what this rank is doing (if the backend can).

        After its own failure, with it: a peer's diagnostic then names it.
        """
        if self._post_status is not None:
            failure = None if self._state is None else self._state.failure
            if failure is not None:
                what = f"{what}; {text.failure_text(failure)}"
            self._post_status(what)

    def _active_ranks(self) -> list[int] | None:
        """The ranks the backend's status board shows in their loop body, for a
        progress line; ``None`` without a board or when reading it failed (a
        progress line must never break the drain). Called only when a line is
        due (the machine rate-limits them), so the board's own bound on its
        read (a store or peer round trip) is paid at most once per interval."""
        peer_status = self._caps.peer_status
        if peer_status is None:
            return None
        try:
            board = peer_status()
            return sorted(rank for rank, text in board.items() if _ACTIVE_STATUS in str(text))
        except Exception:
            return None

    def _log_phase(self, before: m.Phase, state: m.JoinState, observation: m.Observation) -> None:
        """DEBUG: one line per phase change, a drain's batches as one stage
        (its rounds, batches and seconds). The bookkeeping is the same at every
        level (only the line's formatting is skipped), and logging changes
        nothing else."""
        now = observation.now
        after = state.phase
        if after in _DRAIN_PHASES:
            if before in _DRAIN_PHASES:
                return  # a batch boundary inside the drain
            self._drain_from, self._drain_batches = state.shadow_rounds, 0
        since, self._phase_since = self._phase_since, now
        if not _log.isEnabledFor(logging.DEBUG):
            return
        what = type(observation).__name__
        if before is m.Phase.ACTIVE:
            what += f" ({state.heartbeats} inputs)"
        if before in _DRAIN_PHASES:
            rounds = state.shadow_rounds - self._drain_from
            failure = getattr(observation, "failure", None)
            total = getattr(observation, "total", None)
            end = (f"a main hook raised {failure.exc_type}" if failure is not None
                   else f"a count of {total:g}" if total is not None else "its hooks")
            what += f" ({rounds} shadow rounds in {self._drain_batches} drain batches, then {end})"
        spent = "" if since is None else f" after {now - since:.3f} s in {before.name}"
        _log.debug("rank %s: %s -> %s on %s%s", state.config.rank, before.name, after.name,
                   what, spent)

    def _round_plan(self, first_shadowed: bool) -> list[Callable[[], Any]]:
        """What one shadow round calls, in order: for each joinable, the shadow
        of its fused slot (``JOINED``: not a heartbeat; skipped for the first
        joinable when ``first_shadowed``) and its main hook (skipped where it
        is ``JoinHook``'s, which does nothing)."""
        plan: list[Callable[[], Any]] = []
        for index, (hook, fuses) in enumerate(zip(self._hooks, self._fuses_slot, strict=True)):
            if fuses and not (index == 0 and first_shadowed):
                plan.append(functools.partial(hook.fused_shadow, wire.JOINED))
            main_hook = hook.main_hook
            if getattr(main_hook, "__func__", None) is not JoinHook.main_hook:
                plan.append(main_hook)
        return plan

    def _main_hooks(self, command: m.RunMainHooks) -> None:
        self._doing(f"main hooks of shadow round {command.round}")
        for call in self._round_plan(command.first_shadowed):
            call()

    def _post_hooks(self, command: m.RunPostHooks) -> None:
        # Every rank has finished counting: peers may leave (and exit) now.
        self._watch.silence = False
        self._doing("post hooks")
        for hook in self._hooks:
            hook.post_hook(command.is_last_joiner)

    def _drain(self, command: m.Drain) -> tuple[m.Drained, Exception | None]:
        """Carry out ``Drain``: count and shadow until the command's own stop.

        Each round is the count, then every main hook; the drain ends at a
        count below ``command.until`` (nobody active), after ``command.limit``
        rounds, or when a hook raises. The watchdog sees one activity and a
        tick per count and per round of hooks.

        Returns:
            The ``Drained`` observation, and the hook's exception if one raised.
        """
        state = self._state
        assert state is not None
        watch = self._watch
        self._doing(
            text.drain_activity(state, 0),
            f"shadowing from shadow round {state.shadow_rounds} on (counting non-joined "
            "ranks, then main hooks, round after round)",
        )
        count = self._hooks[0].fused_shadow if command.fused else self._backend.count
        plan = self._round_plan(command.fused)
        value, then, until, limit = command.first, command.value, command.until, command.limit
        rounds = 0
        while True:
            total = count(value)
            watch.ticks += 1
            if total < until or rounds == limit:
                return m.Drained(rounds=rounds, total=total, now=self._clock()), None
            value = then
            try:
                for call in plan:
                    call()
            except Exception as error:
                if self._stall is not None:
                    raise self._stall from error
                failure = _failure(error, self._backend.rank)
                return m.Drained(rounds=rounds, total=None, failure=failure,
                                 now=self._clock()), error
            rounds += 1
            watch.ticks += 1

    def _run(self, observation: m.Observation) -> Any:
        assert self._state is not None
        backend = self._backend
        handle = None
        hook_error: BaseException | None = None
        pending: m.Observation | None = observation
        while pending is not None:
            before = self._state.phase
            # A standing order ends with the next observation; the transition
            # issues it again where it still stands.
            self._order = self._held_order = None
            transition = m.step(self._state, pending)
            self._state = state = transition.state
            if state.phase is not before:
                self._log_phase(before, state, pending)
            pending = None
            for command in transition.commands:
                match command:
                    case m.HeartbeatOrder():
                        if self._checks:
                            # Pending checks: the next notify runs them first.
                            self._order, self._held_order = None, command
                        else:
                            self._order = command
                    case m.Drain():
                        self._drain_batches += 1
                        pending, hook_error = self._drain(command)
                    case m.SendHeartbeat():
                        handle = self._last_heartbeat = backend.heartbeat(command.value)
                    case m.CheckTermination():
                        self._doing(f"the termination check after input {state.heartbeats}")
                        total = backend.count(command.value)
                        pending = m.TerminationChecked(total=total, now=self._clock())
                    case m.SignalTermination():
                        self._doing("signalling early termination")
                        backend.count(command.value)
                    case m.RunMainHooks() | m.RunPostHooks():
                        try:
                            if isinstance(command, m.RunMainHooks):
                                self._main_hooks(command)
                            else:
                                self._post_hooks(command)
                        except Exception as error:
                            if self._stall is not None:
                                raise self._stall from error
                            hook_error = error
                            pending = m.HookFailed(
                                failure=_failure(error, backend.rank), now=self._clock()
                            )
                        else:
                            pending = m.HooksDone(now=self._clock())
                    case m.CompareSignatures():
                        self._doing("the agreement check at entry")
                        same = _ports.all_agree(backend, self._caps, command.digest)
                        pending = m.SignaturesCompared(same=same, now=self._clock())
                    case m.CheckAgreement():
                        self._doing("the agreement check at entry (gathering the settings)")
                        signatures = backend.all_gather_object(command.signature)
                        pending = m.AgreementChecked(
                            signatures=tuple(signatures), now=self._clock()
                        )
                    case m.ExchangeFailures():
                        self._doing("exchanging failures")
                        failures = _ports.all_gather_sparse(backend, self._caps,
                                                            command.failure)
                        self._watch.silence = False  # every rank now leaves (and may exit)
                        pending = m.FailuresExchanged(
                            failures=tuple(failures), now=self._clock()
                        )
                    case m.AbortGroup():
                        abort = self._caps.abort
                        if abort is not None:
                            abort(command.message)  # MPI: ends the job here
                        if hook_error is not None:
                            raise hook_error
                        # Failed fast after the loop body's exception, which
                        # leaves the block (see _leave).
                        self._aborted = command.message
                    case m.WarnSkew():
                        # At the user's `with Join(...)` line, however deep the
                        # call that got here (its exit, or a hook's notify).
                        warnings.warn(command.message, UserWarning, stacklevel=_user_stacklevel())
                    case m.WarnRankLost():
                        warnings.warn(command.message, UserWarning, stacklevel=_user_stacklevel())
                    case m.ReportProgress():
                        _log.info("%s", text.progress_message(command, self._active_ranks()))
                    case m.Raise():
                        raise command.error
                    case _:  # pragma: no cover - a new command without a handler
                        raise AssertionError(f"unhandled command {command!r}")
        return handle


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


#: The phases of a drain: its batches go back and forth between them (the
#: machine's module doc), which the DEBUG log shows as one stage.
_DRAIN_PHASES = frozenset({m.Phase.DRAINING, m.Phase.SHADOWING})


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, for its caller, of the first frame
    outside joinkit: the user's code that entered or notified the Join."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and _in_joinkit(frame.f_globals.get("__name__", "")):
        frame = frame.f_back
        level += 1
    return level


def _in_joinkit(module: str) -> bool:
    return module == "joinkit" or module.startswith("joinkit.")


def _read_board(board: Callable[[Any], Any], ranks: Any) -> dict[int, _watchdog.Entry]:
    """A backend's ``peer_board(ranks)`` as the watchdog's entries."""
    return {int(rank): _watchdog.Entry(what=str(what), age=float(age),
                                       beat=None if beat is None else int(beat))
            for rank, (what, age, beat) in board(ranks).items()}


def _default_timeout() -> float:
    """The default timeout's seconds: 300, or the private knob's (module top)."""
    knob = os.environ.get(_DEFAULT_TIMEOUT_ENV)
    if not knob:
        return float(DEFAULT_TIMEOUT)
    try:
        return float(knob)
    except ValueError:
        raise ValueError(f"{_DEFAULT_TIMEOUT_ENV}={knob!r} is not a number of seconds") from None


def _failure(error: BaseException, rank: int) -> Failure:
    return Failure(rank=rank, exc_type=type(error).__qualname__, message=str(error))


def _add_note(error: BaseException, note: str) -> None:
    add_note = getattr(error, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(note)


def _name(joinable: Any) -> str:
    """The joinable's class, or its repr where it has one (adapters say what they wrap)."""
    if getattr(type(joinable), "__repr__", None) is object.__repr__:
        return type(joinable).__qualname__
    return repr(joinable)


def _fuses(joinable: Any) -> bool:
    return bool(getattr(joinable, "join_fuses_heartbeat", False))


def _in_round(joinable: Any) -> bool:
    return bool(getattr(joinable, "join_heartbeat_in_round", False))


def _quiet(hook: Any) -> bool:
    """Whether a joinable's hook shadows nothing per round (its main hook is JoinHook's)."""
    return getattr(getattr(hook, "main_hook", None), "__func__", None) is JoinHook.main_hook


def _follows(joinable: Any) -> bool:
    return bool(getattr(joinable, "join_follows_group", False))


def _enabled_joins() -> int:
    """How many enabled Joins this thread is inside (its loop body or shadowing)."""
    return int(getattr(_active, "joins", 0))


def _entered_joins() -> list[Join]:
    """The enabled Joins this thread is inside, innermost last (Join.current)."""
    stack: list[Join] | None = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    return stack


def _looks_like_hook(hook: Any) -> bool:
    # torch's JoinHook subclasses (DDP's, ZeRO's) are hooks too.
    return callable(getattr(hook, "main_hook", None)) and callable(
        getattr(hook, "post_hook", None)
    )


def _heartbeat_owner(joinable: Any) -> Join | None:
    """The enabled Join whose heartbeat ``joinable`` sends (it is the first), or None."""
    config = getattr(joinable, "_join_config", None)
    if config is None:
        raise _missing_config(joinable)
    if config.__class__ is not JoinConfig:
        raise _ForeignConfig
    join = cast("Join | None", config.join)  # a config names the Join that set it
    if config.is_first_joinable and config.enable:
        return join
    if join is not None:
        if config.enable:
            join._later_notify(joinable)
        return None
    if getattr(_active, "joins", 0) > 0:
        # Outside any Join the call does nothing (as in torch). Inside one that
        # does not include this joinable, nobody would shadow its collectives
        # once a rank joins: a hang later, so an error now.
        raise LocalProtocolError(
            f"{_name(joinable)} called notify_join_context inside a `with Join(...)` "
            "block that does not include it: pass it to Join([...]) with the other "
            "joinables so that joined ranks shadow its collectives"
        )
    return None


class _ForeignConfig(Exception):
    """The joinable carries another framework's join config (see _notify_foreign)."""


def _notify_foreign(obj: Any) -> Any:
    """``Join.notify_join_context`` called with a framework's own joinable.

    A torch Joinable written for torch's Join calls ``Join.notify_join_context``
    with itself; after a one-import switch that is joinkit's. Its adapter knows
    what torch's notify means for it, so the call goes there.
    """
    adapted = _ports.adapt(obj)
    if adapted is None:
        raise _foreign_error(obj, "notify_join_context")
    notify = getattr(adapted, "notify", None)
    if callable(notify):
        return notify()
    return Join.notify_join_context(adapted)


def _foreign_error(obj: Any, method: str) -> LocalProtocolError:
    return LocalProtocolError(
        f"Join.{method} got {type(obj).__qualname__}, whose join config is not "
        "joinkit's and which no adapter handles: subclass joinkit.Joinable, or "
        "register an adapter for its framework (joinkit.register_adapter)"
    )


def _reentered(phase: m.Phase, inside: bool) -> LocalProtocolError:
    # The machine would reject Entered outside IDLE ("cannot accept Entered in
    # phase DONE"); say what the user did instead, and leave the machine as is
    # (a Join still in use must not be errored by the mistake).
    if not inside:
        return LocalProtocolError(
            f"this Join was already used (its protocol is in phase {phase.name}): a "
            "Join is single-use; create a new Join([...]) for each loop, e.g. one "
            "per epoch inside the epoch loop"
        )
    return LocalProtocolError(
        f"this Join is already entered (phase {phase.name}): a Join is single-use and "
        "cannot be nested in itself; create a new Join([...]) for each loop"
    )


def _missing_config(joinable: Any) -> LocalProtocolError:
    return LocalProtocolError(
        f"{_name(joinable)} has no join config: its constructor must "
        "call Joinable.__init__(self) (e.g. super().__init__())"
    )
