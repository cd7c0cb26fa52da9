"""The drive loop: the machine's commands carried out, and the heartbeat path.

Theory of operation
-------------------
The drive feeds observations to the pure machine's ``step`` (``_machine``)
and carries out the commands that come back, in order (:meth:`Drive.feed`).
It executes and never decides. The per-iteration path is the machine's
standing ``HeartbeatOrder``: the drive sends the heartbeats
(:meth:`Drive.notify`, :meth:`Drive.fused_heartbeat`), checks the previous
sum against the order's alarm, and reports how many it sent as one
``Notified`` before its next observation. A joined rank's rounds are
``Drain`` commands, each a batch of rounds answered by one ``Drained``
(:meth:`Drive._drain`). Logging takes the same path (``_reporting``).

It tells its watchdog ``Watch`` what it is blocked in (and ticks it at every
step of a drain); the watchdog calls back :meth:`Drive.on_stall`, which turns
the verdict into the ``RankTimeout`` the blocked collective then raises (and
aborts the group where the backend can). A check that must run before the
next heartbeat (``Join.before_next_heartbeat``) holds the standing order back
until it ran. The drive's state is the shell's: the ``Join`` facade, the
failure handling (``_failures``) and the side channel read it.

Standard library and attrs only.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import attrs

from . import _machine as m
from . import _messages as text
from . import _ports, _reporting, _watchdog
from . import _wire as wire
from ._entry import Setup, name
from ._errors import LocalProtocolError, RankTimeout
from ._joinable import JoinHook
from ._reports import Failure

__all__ = ["Drive", "failure_of"]

_log = logging.getLogger("joinkit")


class Drive:
    """One Join's machine and the commands it gives, carried out (module doc).

    Args:
        setup: what the Join was built with (``_entry``).
    """

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        backend = self.backend = setup.backend
        caps = self.caps = setup.caps
        self.clock: Callable[[], float] = time.monotonic
        self.state: m.JoinState | None = (
            None if setup.machine is None else m.initial_state(setup.machine))
        self.counts_collectives = setup.counts_collectives
        self.send_heartbeat: Any = None if backend is None else backend.heartbeat
        self.heartbeat_total = caps.heartbeat_total
        self.post_status = caps.post_status
        # The machine's standing heartbeat order (m.HeartbeatOrder), while one
        # stands, and the heartbeats sent under it but not yet reported.
        self.order: m.HeartbeatOrder | None = None
        self.beats = 0
        # Checks to run before this rank's next heartbeat (before_next_heartbeat);
        # while any waits, no standing order stands, so the fast path never looks.
        self.checks: list[Callable[[], None]] = []
        self.held_order: m.HeartbeatOrder | None = None
        # The previous heartbeat's handle, and the backend's collective
        # counter when that heartbeat went out (_failures reads both).
        self.last_heartbeat: Any = None
        self.collectives_at_heartbeat: int | None = None
        # The sum of the first joinable's latest fused heartbeat slot.
        self.fused_total: float | None = None
        # Later joinables: the heartbeats counted at each one's latest notify
        # (by id; see later_notify).
        self.notified: dict[int, int] = {}
        # The watchdog's verdict; and the AbortGroup message, once this rank
        # aborted the group after its own failure in the loop body (fail fast).
        self.stall: RankTimeout | None = None
        self.aborted: str | None = None
        # on_rank_loss="finish": the poll of the backend's lost ranks before
        # each heartbeat (_failures sets it on entry).
        self.poll_losses: Callable[[], None] | None = None
        # Join.note_rank_loss: what a data source says becomes of a lost rank's
        # remaining inputs, added to each loss warning.
        self.loss_notes: list[str] = []
        self.phases = _reporting.PhaseLog()
        # The watchdog's view (what the rank is blocked in, registered only
        # with a timeout).
        timeout = setup.timeout
        if backend is not None and timeout is not None:
            self.watch = _watchdog.Watch(
                timeout, self.on_stall, hard=setup.hard, rank=backend.rank,
                world_size=backend.world_size, read=setup.read_board,
                beat=caps.post_beat, on_wait=self.on_wait,
            )
        else:
            self.watch = _watchdog.Watch(timeout or 1.0, self.on_stall)

    # -- entering and leaving the loop body -------------------------------------------

    def enter(self) -> None:
        """The machine's entry (the agreement check: may raise), watched; then
        the loop body, posted."""
        if self.setup.timeout is not None:
            _watchdog.watch(self.watch)
        try:
            self.feed(m.Entered(now=self.clock()))  # may raise AgreementError
        except BaseException:
            _watchdog.unwatch(self.watch)
            raise
        if self.state is not None and self.state.config.signature is not None:
            self.watch.peers_inside = True  # every rank passed the agreement check
        # Not an activity: the loop body may take as long as it likes.
        self.post(_watchdog.LOOP_BODY)

    def left(self) -> None:
        """The rank left the Join (or a refused entry): unwatched, posted."""
        _watchdog.unwatch(self.watch)
        self.post(_watchdog.LEFT)

    # -- the heartbeat ---------------------------------------------------------------

    def notify(self) -> Any:
        """The first joinable's notify: this rank has one more input."""
        if self.poll_losses is not None:
            self.poll_losses()  # those found since the previous heartbeat
        order = self.order
        if order is None and self.checks:
            order = self.run_checks()
        if order is None:
            # No standing order (throw mode): the machine decides each notify.
            handle = self.feed(m.Notified(now=self.clock()))
        elif order.fused:
            # A fused joinable notifying: its heartbeat rides in its collective
            # (the standing order is self.order, and no check waits for it).
            self.fused_heartbeat()
            return None
        else:
            # The standing order: the previous heartbeat's sum (where the
            # backend can tell) if it is an alarm, else this heartbeat.
            previous = self.last_heartbeat
            if previous is not None and self.heartbeat_total is not None:
                total = self.heartbeat_total(previous)
                if total >= order.alarm:
                    return self.feed(m.HeartbeatSeen(total=total, now=self.clock()))
            self.beats += 1
            handle = self.last_heartbeat = self.send_heartbeat(order.value)
        # A failure before the backend issues another collective leaves this
        # iteration open for the peers (see _failures).
        if self.counts_collectives:
            self.collectives_at_heartbeat = self.backend.collectives_issued
        return handle

    def fused_heartbeat(self) -> float:
        """The first joinable's ``Join.fused_heartbeat``: the value for its slot."""
        # (Never fused with on_rank_loss="finish": notify below reads the losses.)
        order = self.order
        if order is None and self.checks:
            # Checks wait (before_next_heartbeat): they run before this
            # collective; the held order comes back.
            order = self.run_checks()
        if order is None or not order.fused:
            self.notify()
            return wire.JOINED
        # The standing order for a fused heartbeat (this is the per-iteration path).
        total = self.fused_total
        if total is not None and total >= order.alarm:
            self.feed(m.HeartbeatSeen(total=total, now=self.clock()))  # raises PeerAborted
            return wire.JOINED
        self.beats += 1
        if self.counts_collectives:
            self.collectives_at_heartbeat = self.backend.collectives_issued
        return order.value

    def run_checks(self) -> m.HeartbeatOrder | None:
        """Run the checks waiting for this heartbeat; give back the held order."""
        checks, self.checks = self.checks, []
        for check in checks:
            check()  # may raise: the loop body's failure, before the heartbeat
        # The standing order held while the checks waited (None in throw mode).
        order, self.held_order = self.held_order, None
        self.order = order
        return order

    def later_notify(self, joinable: Any) -> None:
        """A later joinable's notify: refuse one that no heartbeat announced.

        A joined rank runs each main hook once per heartbeat, so two notifies of
        a later joinable with no heartbeat in between (or one before the first
        heartbeat) mean the first joinable skipped its notify: the joined ranks
        would pair this joinable's collectives with their counts. Only in the
        loop body (a shadow round's own notifies are not inputs). Costs two
        attribute reads, a dict look-up and a store per later notify.
        """
        state = self.state
        if state is None or state.phase is not m.Phase.ACTIVE:
            return
        beats = state.heartbeats + self.beats
        key = id(joinable)
        if self.notified.get(key, 0) == beats and getattr(
                joinable, "join_notifies_per_iteration", 1) is not None:
            first = self.setup.joinables[0]
            since = "since the Join was entered" if beats == 0 else (
                f"since its previous notify (after input {beats})")
            raise LocalProtocolError(
                f"{name(joinable)} called notify_join_context with no heartbeat {since}: "
                f"the Join's first joinable, {name(first)}, must call "
                "Join.notify_join_context(self) (or send its fused heartbeat) once per "
                "iteration before its collectives, because a joined rank shadows every "
                "joinable once per heartbeat. Add that call to "
                f"{type(first).__qualname__}, or list a joinable that notifies every "
                f"iteration first (e.g. Join([{name(joinable)}, ...]))"
            )
        self.notified[key] = beats

    def before_next_heartbeat(self, check: Callable[[], None]) -> bool:
        """``Join.before_next_heartbeat`` (its doc): hold the standing order back."""
        state = self.state
        if state is None or state.phase is not m.Phase.ACTIVE:
            return False
        self.checks.append(check)
        if self.order is not None:
            self.order, self.held_order = None, self.order
        return True

    # -- driving the machine ---------------------------------------------------------

    def report_beats(self) -> None:
        """Tell the machine the heartbeats sent under its standing order."""
        if self.beats:
            beats, self.beats = self.beats, 0
            self.feed(m.Notified(count=beats, now=self.clock()))

    def feed(self, observation: m.Observation) -> Any:
        """Step the machine and carry out its commands until none is pending.

        Returns the heartbeat handle if a heartbeat was sent.
        """
        try:
            self.report_beats()  # before anything the machine hears next
            return self._run(observation)
        except Exception as error:
            if self.stall is not None and error is not self.stall:
                raise self.stall from error
            raise
        finally:
            self.watch.end()

    def _run(self, observation: m.Observation) -> Any:
        assert self.state is not None
        backend = self.backend
        handle = None
        hook_error: BaseException | None = None
        pending: m.Observation | None = observation
        while pending is not None:
            before = self.state.phase
            # A standing order ends with the next observation; the transition
            # issues it again where it still stands.
            self.order = self.held_order = None
            transition = m.step(self.state, pending)
            self.state = state = transition.state
            if state.phase is not before:
                self.phases.changed(before, state, pending)
            pending = None
            for command in transition.commands:
                match command:
                    case m.HeartbeatOrder():
                        if self.checks:
                            # Pending checks: the next notify runs them first.
                            self.order, self.held_order = None, command
                        else:
                            self.order = command
                    case m.Drain():
                        self.phases.drain_batches += 1
                        pending, hook_error = self._drain(command)
                    case m.SendHeartbeat():
                        handle = self.last_heartbeat = backend.heartbeat(command.value)
                    case m.CheckTermination():
                        self.doing(f"the termination check after input {state.heartbeats}")
                        total = backend.count(command.value)
                        pending = m.TerminationChecked(total=total, now=self.clock())
                    case m.SignalTermination():
                        self.doing("signalling early termination")
                        backend.count(command.value)
                    case m.RunMainHooks() | m.RunPostHooks():
                        try:
                            if isinstance(command, m.RunMainHooks):
                                self._main_hooks(command)
                            else:
                                self._post_hooks(command)
                        except Exception as error:
                            if self.stall is not None:
                                raise self.stall from error
                            hook_error = error
                            pending = m.HookFailed(
                                failure=failure_of(error, backend.rank), now=self.clock()
                            )
                        else:
                            pending = m.HooksDone(now=self.clock())
                    case m.CompareSignatures():
                        self.doing("the agreement check at entry")
                        same = _ports.all_agree(backend, self.caps, command.digest)
                        pending = m.SignaturesCompared(same=same, now=self.clock())
                    case m.CheckAgreement():
                        self.doing("the agreement check at entry (gathering the settings)")
                        signatures = backend.all_gather_object(command.signature)
                        pending = m.AgreementChecked(
                            signatures=tuple(signatures), now=self.clock()
                        )
                    case m.ExchangeFailures():
                        self.doing("exchanging failures")
                        failures = _ports.all_gather_sparse(backend, self.caps,
                                                            command.failure)
                        self.watch.silence = False  # every rank now leaves (and may exit)
                        pending = m.FailuresExchanged(
                            failures=tuple(failures), now=self.clock()
                        )
                    case m.AbortGroup():
                        abort = self.caps.abort
                        if abort is not None:
                            abort(command.message)  # MPI: ends the job here
                        if hook_error is not None:
                            raise hook_error
                        # Failed fast after the loop body's exception, which
                        # leaves the block (see _failures).
                        self.aborted = command.message
                    case m.WarnSkew():
                        # At the user's `with Join(...)` line, however deep the
                        # call that got here (its exit, or a hook's notify).
                        warnings.warn(command.message, UserWarning, stacklevel=_user_stacklevel())
                    case m.WarnRankLost():
                        message = ". ".join((command.message, " ".join(self.loss_notes))
                                            ) if self.loss_notes else command.message
                        warnings.warn(message, UserWarning, stacklevel=_user_stacklevel())
                    case m.ReportProgress():
                        _reporting.log_progress(command, self.caps)
                    case m.Raise():
                        raise command.error
                    case _:  # pragma: no cover - a new command without a handler
                        raise AssertionError(f"unhandled command {command!r}")
        return handle

    def _drain(self, command: m.Drain) -> tuple[m.Drained, Exception | None]:
        """Carry out ``Drain``: count and shadow until the command's own stop.

        Each round is the count, then every main hook; the drain ends at a
        count below ``command.until`` (nobody active), after ``command.limit``
        rounds, or when a hook raises. The watchdog sees one activity and a
        tick per count and per round of hooks.

        Returns:
            The ``Drained`` observation, and the hook's exception if one raised.
        """
        state = self.state
        assert state is not None
        watch = self.watch
        self.doing(
            text.drain_activity(state, 0),
            f"shadowing from shadow round {state.shadow_rounds} on (counting non-joined "
            "ranks, then main hooks, round after round)",
        )
        count = self.setup.hooks[0].fused_shadow if command.fused else self.backend.count
        plan = self._round_plan(command.fused)
        value, then, until, limit = command.first, command.value, command.until, command.limit
        rounds = 0
        while True:
            total = count(value)
            watch.ticks += 1
            if total < until or rounds == limit:
                return m.Drained(rounds=rounds, total=total, now=self.clock()), None
            value = then
            try:
                for call in plan:
                    call()
            except Exception as error:
                if self.stall is not None:
                    raise self.stall from error
                failure = failure_of(error, self.backend.rank)
                return m.Drained(rounds=rounds, total=None, failure=failure,
                                 now=self.clock()), error
            rounds += 1
            watch.ticks += 1

    def _round_plan(self, first_shadowed: bool) -> list[Callable[[], Any]]:
        """What one shadow round calls, in order: for each joinable, the shadow
        of its fused slot (``JOINED``: not a heartbeat; skipped for the first
        joinable when ``first_shadowed``) and its main hook (skipped where it
        is ``JoinHook``'s, which does nothing)."""
        plan: list[Callable[[], Any]] = []
        setup = self.setup
        for index, (hook, fuses) in enumerate(zip(setup.hooks, setup.fuses_slot, strict=True)):
            if fuses and not (index == 0 and first_shadowed):
                plan.append(functools.partial(hook.fused_shadow, wire.JOINED))
            main_hook = hook.main_hook
            if getattr(main_hook, "__func__", None) is not JoinHook.main_hook:
                plan.append(main_hook)
        return plan

    def _main_hooks(self, command: m.RunMainHooks) -> None:
        self.doing(f"main hooks of shadow round {command.round}")
        for call in self._round_plan(command.first_shadowed):
            call()

    def _post_hooks(self, command: m.RunPostHooks) -> None:
        # Every rank has finished counting: peers may leave (and exit) now.
        self.watch.silence = False
        self.doing("post hooks")
        for hook in self.setup.hooks:
            hook.post_hook(command.is_last_joiner)

    # -- the watchdog and the status board -------------------------------------------

    def doing(self, what: str, status: str | None = None) -> None:
        """Record what the rank is now blocked in, for the watchdog and (or
        ``status``, if given) for the peers."""
        self.watch.begin(what, self.clock())
        self.post(what if status is None else status)

    def post(self, what: str) -> None:
        """Tell the peers' stall diagnostics what this rank is doing (if the backend can).

        After its own failure, with it: a peer's diagnostic then names it.
        """
        if self.post_status is not None:
            failure = None if self.state is None else self.state.failure
            if failure is not None:
                what = f"{what}; {text.failure_text(failure)}"
            self.post_status(what)

    def on_stall(self, stall: _watchdog.Stall) -> None:
        """Called by the watchdog thread, once, on a stall or a silent peer."""
        state, timeout = self.state, self.setup.timeout
        assert state is not None and timeout is not None
        if stall.silent and self.caps.knows_aborts and self.backend.aborted is not None:
            # A rank aborted the group (and may have left since, so it beats
            # no more): the blocked or next collective raises that abort.
            return
        if stall.silent:
            # Inputs the loop body has notified but not yet reported (it runs on).
            state = attrs.evolve(state, heartbeats=state.heartbeats + self.beats)
        message = _reporting.stall_diagnostic(stall, state, timeout, self.caps,
                                              reads_board=self.watch.read is not None)
        self.stall = RankTimeout(message)
        _log.error("%s", message)
        abort = self.caps.abort
        if abort is not None:
            abort(message)

    def on_wait(self, waiting: _watchdog.Waiting) -> None:
        """Called by the watchdog thread while this rank waits for healthy peers."""
        _reporting.log_waiting(self.backend.rank, waiting)


def failure_of(error: BaseException, rank: int) -> Failure:
    """``error`` on ``rank`` as the machine's value."""
    return Failure(rank=rank, exc_type=type(error).__qualname__, message=str(error))


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
