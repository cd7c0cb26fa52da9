"""The imperative shell's face: ``Join``, with ``Joinable`` and ``JoinHook``.

The shell owns everything the pure machine in ``_machine`` must not touch: the
clock, the backend's collectives, the joinables' hooks, warnings and raising.
``Join`` is its facade, and each part of the shell has a module of its own:

- ``_entry``: building a Join: the arguments checked, the joinables adapted
  and their hooks taken, the way the heartbeat travels, the backend and its
  capabilities, the machine's config with the signature the agreement check
  compares (one frozen ``Setup``); the joinables' configs on entry and exit;
- ``_drive``: the drive loop that carries out the machine's commands, the
  heartbeat path, what the watchdog sees and the stall it finds;
- ``_failures``: how a rank leaves its loop body (its own failure, a peer's,
  an interrupt: what leaves the block, with which notes) and, with
  ``on_rank_loss="finish"``, its lost ranks;
- ``_reporting``: the report, the log lines, a stall's diagnostic.

This module routes a joinable's ``notify_join_context`` and
``fused_heartbeat`` to the Join named by its config (or a framework's own
joinable to its adapter), and keeps the Joins this thread is inside. The API
(names, arguments, messages) follows ``torch.distributed.algorithms.join`` so
code written for torch works by changing one import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

from . import _drive, _entry, _failures, _ports, _reporting
from . import _machine as m
from . import _wire as wire
from ._entry import DEFAULT_TIMEOUT
from ._errors import LocalProtocolError
from ._joinable import Joinable, JoinConfig, JoinHook  # the joinable side
from ._reports import JoinReport

__all__ = ["Join", "Joinable", "JoinHook", "JoinConfig"]

# How many enabled Joins this thread is inside (a rank is a thread on the
# threads backend, so this is per thread).
_active = threading.local()


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
        setup = self._setup = _entry.Setup.build(
            joinables, enable, throw_on_early_termination, check_agreement=check_agreement,
            timeout=timeout, on_rank_loss=on_rank_loss, hook_kwargs=kwargs)
        self._drive = _drive.Drive(setup)
        self._failures = _failures.Failures(setup, self._drive)
        # Between __enter__ and __exit__ (a Join is single-use: _entry.check_entry).
        self._inside = False

    # -- context manager -------------------------------------------------------

    def __enter__(self) -> Join:
        setup, drive = self._setup, self._drive
        _entry.check_entry(setup, self, drive.state, self._inside)
        if setup.elastic:
            self._failures.start_rank_loss_recovery()
        if setup.enable:
            drive.enter()  # the agreement check (may raise), then the loop body
        try:
            _entry.hand_configs(setup, self)
        except BaseException:
            # An adapter refused its config (every rank alike: the settings
            # agree); nothing of the loop has run, so leave as if never entered.
            if setup.enable:
                drive.left()
            raise
        if setup.enable:
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
            if self._setup.enable:
                self._failures.leave(exc)  # raises what leaves the block (its doc)
        finally:
            _entry.take_back_configs(self._setup)
            if self._setup.enable:
                self._inside = False
                _active.joins -= 1
                stack = _entered_joins()
                if self in stack:
                    stack.remove(self)
                self._drive.left()

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
        return None if join is None else join._drive.notify()

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
        return wire.JOINED if join is None else join._drive.fused_heartbeat()

    @staticmethod
    def record_heartbeat_total(joinable: Joinable, total: float) -> None:
        """Hand the Join the sum of a fused heartbeat slot (optional).

        With it, an active rank learns at its next :meth:`fused_heartbeat` that a
        peer failed, instead of when it runs out of inputs.
        """
        config = joinable._join_config
        # A config names the Join that set it (typed as the protocol there).
        join: Join | None = config.join  # type: ignore[assignment]
        if config.is_first_joinable and config.enable and join is not None:
            join._drive.fused_total = total

    def note_rank_loss(self, note: str) -> None:
        """Add ``note`` to this Join's warnings of a lost rank (``on_rank_loss="finish"``).

        The warning says that a lost rank's remaining inputs were not seen in
        this Join; a data source that does something with them (the exact
        shards' ``ShardSampler(take_over=True)``) says what, and what the loop
        must do for it, here. Each note is added once, in the order given.

        Args:
            note: one or more sentences, appended to each loss warning.
        """
        notes = self._drive.loss_notes
        if note not in notes:
            notes.append(note)

    # -- observability -----------------------------------------------------------

    @property
    def backend(self) -> Any:
        """The join backend this Join talks to (``None`` when not enabled).

        The object the backend registry resolved for the joinables' process
        group; adapters use it to wait on framework work the way a peer's
        abort can end (its optional ``wait(work)``).
        """
        return self._setup.backend

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
        return self._drive.before_next_heartbeat(check)

    @property
    def heartbeat_handle(self) -> Any:
        """The async handle of the latest heartbeat this rank sent, or ``None``.

        What the backend's ``heartbeat`` returned (a torch ``Work`` on a torch
        group, whose result is the number of active ranks); ``None`` before
        the first heartbeat and where heartbeats are fused. A later joinable
        reads it after the first joinable's notify, in the same iteration
        (DDP after another joinable, for ``divide_by_initial_world_size=False``).
        """
        return self._drive.last_heartbeat

    @property
    def joinables(self) -> tuple[Joinable, ...]:
        """The Join's joinables in their order, framework objects as their adapters.

        An adapter reads the others of its Join here to refuse a combination
        it cannot shadow (e.g. on entry), or to find the joinable whose
        heartbeat it follows.
        """
        return self._setup.joinables

    @property
    def process_group(self) -> Any:
        """The process group of the Join: the one its joinables share.

        A joinable that follows the Join's group (``join_follows_group``, a
        ``SideCollective`` without ``process_group``) reads it here.
        """
        return self._setup.process_group

    @property
    def device(self) -> Any:
        """The device of the Join's own collectives (its first group owner's ``join_device``)."""
        return self._setup.device

    @property
    def fuses_heartbeat(self) -> bool:
        """Whether the first joinable carries the heartbeat in its own collective.

        True when it sets ``join_fuses_heartbeat``, the Join is not in throw
        mode and the agreement check is on (so every rank is known to fuse).
        """
        return self._setup.fused

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
        return self._setup.heartbeat

    @property
    def rank(self) -> int:
        """This rank in the Join's process group (``enable=True`` only)."""
        return int(self._setup.backend.rank)

    @property
    def state(self) -> m.JoinState | None:
        """The machine's current state (``None`` when not enabled)."""
        self._drive.report_beats()
        return self._drive.state

    @property
    def on_rank_loss(self) -> str:
        """``"raise"`` or ``"finish"``, as given (adapters refuse what cannot finish)."""
        return self._setup.on_rank_loss

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
        return _reporting.gather_report(self._setup.backend, self._setup.caps,
                                        lambda: self.report, dst)


def _enabled_joins() -> int:
    """How many enabled Joins this thread is inside (its loop body or shadowing)."""
    return int(getattr(_active, "joins", 0))


def _entered_joins() -> list[Join]:
    """The enabled Joins this thread is inside, innermost last (Join.current)."""
    stack: list[Join] | None = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    return stack


def _heartbeat_owner(joinable: Any) -> Join | None:
    """The enabled Join whose heartbeat ``joinable`` sends (it is the first), or None."""
    config = getattr(joinable, "_join_config", None)
    if config is None:
        raise _entry.missing_config(joinable)
    if config.__class__ is not JoinConfig:
        raise _ForeignConfig
    # A config names the Join that set it (typed as the protocol there).
    join: Join | None = config.join  # type: ignore[assignment]
    if config.is_first_joinable and config.enable:
        return join
    if join is not None:
        if config.enable:
            join._drive.later_notify(joinable)
        return None
    if getattr(_active, "joins", 0) > 0:
        # Outside any Join the call does nothing (as in torch). Inside one that
        # does not include this joinable, nobody would shadow its collectives
        # once a rank joins: a hang later, so an error now.
        raise LocalProtocolError(
            f"{_entry.name(joinable)} called notify_join_context inside a `with Join(...)` "
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
