"""Building a Join: its joinables, its heartbeat, its backend and its machine.

What ``Join(...)`` decides before anything is sent, the same on every rank:
the arguments checked; the joinables adapted (a framework object through the
core's adapter port) and their hooks taken; the process group they share; how
the heartbeat travels (classic, fused into the first joinable's collective, or
in its rounds); the join backend resolved and its optional members looked up
once (``_ports.capabilities``); the watchdog's timeout and whether it reads
the status board; and the machine's config, with the signature the agreement
check compares at entry. All of it is one frozen :class:`Setup`, which the
other parts of the shell read (``_drive``, ``_failures``) and the ``Join``
facade answers its properties from. The checks a joinable's config gets on
entry, and the configs handed out and taken back, are here too.

Standard library and attrs only.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from . import _machine as m
from . import _ports, _watchdog
from ._errors import LocalProtocolError
from ._joinable import _DISABLED, Joinable, JoinConfig, JoinContext, JoinHook

__all__ = ["DEFAULT_TIMEOUT", "Setup", "check_entry", "hand_configs", "take_back_configs",
           "name", "missing_config"]


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


@attrs.frozen(kw_only=True, eq=False)
class Setup:
    """What a Join was built with and decided, before any collective.

    Attributes:
        joinables: the joinables in their order, framework objects as their adapters.
        hooks: each joinable's ``join_hook(**kwargs)``.
        fuses_slot: which joinables fuse a heartbeat slot into their first
            collective (a shadow round shadows it first, see ``_drive``).
        fused: whether the first joinable carries the heartbeat.
        round: whether it carries it in every collective of its rounds.
        enable, throw_on_early_termination, on_rank_loss: as given.
        elastic: ``on_rank_loss="finish"`` on an enabled Join.
        process_group: the group the joinables share.
        device: the device of the Join's own collectives.
        backend: the join backend (``None`` when not enabled).
        caps: the backend's optional members, looked up once.
        counts_collectives: whether a heartbeat reads the backend's collective
            counter (it exists and sees every collective of the joinables).
        timeout: the watchdog's seconds (``None``: no watchdog).
        hard: whether the timeout is a hard limit (given, or no status board).
        read_board: the watchdog's read of the peers' status board, if any.
        machine: the machine's config (``None`` when not enabled).
    """

    joinables: tuple[Joinable, ...]
    hooks: tuple[Any, ...]
    fuses_slot: tuple[bool, ...]
    fused: bool
    round: bool
    enable: bool
    throw_on_early_termination: bool
    on_rank_loss: str
    elastic: bool
    process_group: Any
    device: Any
    backend: Any = None
    caps: _ports.BackendCapabilities = attrs.field(factory=_ports.BackendCapabilities)
    counts_collectives: bool = False
    timeout: float | None
    hard: bool
    read_board: _watchdog.BoardReader | None = None
    machine: m.MachineConfig | None = None

    @property
    def heartbeat(self) -> str:
        """``"round"``, ``"fused"`` or ``"classic"`` (``Join.heartbeat``)."""
        if self.round:
            return "round"
        return "fused" if self.fused else "classic"

    @classmethod
    def build(
        cls,
        joinables: Iterable[Any],
        enable: bool,
        throw_on_early_termination: bool,
        *,
        check_agreement: bool,
        timeout: float | None,
        on_rank_loss: str,
        hook_kwargs: dict[str, Any],
    ) -> Setup:
        """Check ``Join(...)``'s arguments and decide (the Join's doc says what raises)."""
        m.check_on_rank_loss(on_rank_loss, throw_on_early_termination)
        hard = timeout is not DEFAULT_TIMEOUT
        if not hard:
            timeout = _default_timeout()
        if timeout is not None and not timeout > 0:
            raise ValueError(
                f"timeout must be a positive number of seconds or None, not {timeout!r}"
            )
        joinable_list, hooks = _joinables_and_hooks(joinables, hook_kwargs)
        leader = _group_owner(joinable_list)
        fuses = tuple(_fuses(j) for j in joinable_list)
        # Fused only where the agreement check proves every rank fuses: torch's
        # Join (which a group shared with it needs, check_agreement=False)
        # speaks only the classic heartbeat.
        # Not with on_rank_loss="finish" either: a backend that rebuilds its group
        # after a death must see every heartbeat (its sum says which ranks were
        # active in each iteration, whence a lost rank's iterations).
        fused = (fuses[0] and not throw_on_early_termination and check_agreement
                 and on_rank_loss != "finish")
        # The round heartbeat (a fused one in every collective of the first
        # joinable's rounds, nothing per input): only where no other joinable
        # has collectives of its own per iteration (its main hook shadows
        # nothing), so that the first joinable's rounds are all a joined rank
        # must meet.
        in_round = fused and _in_round(joinable_list[0]) and all(
            not fuses_ and _quiet(hook) for hook, fuses_ in zip(hooks[1:], fuses[1:], strict=True))
        setup = cls(
            joinables=tuple(joinable_list), hooks=tuple(hooks), fuses_slot=fuses, fused=fused,
            round=in_round, enable=bool(enable),
            throw_on_early_termination=bool(throw_on_early_termination),
            on_rank_loss=on_rank_loss, elastic=bool(enable) and on_rank_loss == "finish",
            process_group=leader.join_process_group, device=leader.join_device,
            timeout=timeout, hard=hard,
        )
        return setup._resolved(check_agreement) if setup.enable else setup

    def _resolved(self, check_agreement: bool) -> Setup:
        """The enabled Join's part: its backend, watchdog and machine."""
        backend = _ports.resolve(self.process_group, self.device)
        caps = _ports.capabilities(backend)
        # Read per heartbeat only where it exists and sees every collective
        # of the joinables (else a failure's place is unknown: None).
        counts_collectives = caps.counts_collectives and not any(
            getattr(j, "join_raw_collectives", False) for j in self.joinables
        )
        timeout, hard, read = self.timeout, self.hard, None
        if timeout is not None:
            board = caps.peer_board
            if self.elastic:
                # Ranks are renumbered when the group is rebuilt, and a
                # dead rank's silence is the backend's to handle: no board.
                board = None
            read = None if board is None else functools.partial(_read_board, board)
            if read is None and not hard:  # cannot tell slow from stalled
                hard, timeout = True, timeout * _BOARDLESS_FACTOR
        signature = (
            ("joinables", len(self.joinables)),
            ("throw_on_early_termination", self.throw_on_early_termination),
            ("backend", type(backend).__name__),
            ("heartbeat", self.heartbeat),
            ("on_rank_loss", self.on_rank_loss),
        )
        machine = m.MachineConfig(
            rank=backend.rank,
            throw_on_early_termination=self.throw_on_early_termination,
            signature=signature if check_agreement else None,
            fused_heartbeat=self.fused,
            round_heartbeat=self.round,
            world_size=backend.world_size,
            can_abort=caps.abort is not None,
            progress_interval=m.PROGRESS_INTERVAL,
            on_rank_loss=self.on_rank_loss,
        )
        return attrs.evolve(self, backend=backend, caps=caps,
                            counts_collectives=counts_collectives, timeout=timeout, hard=hard,
                            read_board=read, machine=machine)


def _joinables_and_hooks(joinables: Iterable[Any],
                         hook_kwargs: dict[str, Any]) -> tuple[list[Joinable], list[Any]]:
    """The joinables (adapted) and their hooks, checked."""
    if isinstance(joinables, Joinable) or not isinstance(joinables, Iterable):
        raise TypeError(
            f"Join expects a list of Joinables, got {type(joinables).__qualname__}: "
            "write Join([joinable])"
        )
    joinable_list = [_as_joinable(j) for j in joinables]
    if not joinable_list:
        raise ValueError("The join context manager requires at least one joinable")
    _ports.check_joinables(joinable_list)
    hooks = [joinable.join_hook(**hook_kwargs) for joinable in joinable_list]
    for joinable, hook in zip(joinable_list, hooks, strict=True):
        if not isinstance(hook, JoinHook) and not _looks_like_hook(hook):
            raise TypeError(
                f"{name(joinable)}.join_hook() returned "
                f"{type(hook).__qualname__}, not a JoinHook: return an object "
                "with main_hook() and post_hook(is_last_joiner)"
            )
        shadow = getattr(type(hook), "fused_shadow", None)
        if _fuses(joinable) and (shadow is None or shadow is JoinHook.fused_shadow):
            raise TypeError(
                f"{name(joinable)} sets join_fuses_heartbeat but its "
                f"hook {type(hook).__qualname__} has no fused_shadow(heartbeat) -> "
                "float: add one that shadows the joinable's first collective"
            )
    return joinable_list, hooks


def _group_owner(joinables: list[Joinable]) -> Joinable:
    """The first joinable with a group of its own, after checking that all of
    them share it."""
    # The joinables that follow the Join's group (a SideCollective without
    # one) take the group and device of the first one that has its own.
    owners = [j for j in joinables if not _follows(j)]
    if not owners:
        raise ValueError(
            f"{name(joinables[0])} follows the process group of the Join's other "
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
                f"{name(joinable)} uses a different "
                f"join_process_group from {name(leader)}; all joinables "
                "of one Join must share one process group"
            )
    return leader


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


# -- the joinables' configs, on entry and exit ----------------------------------------


def check_entry(setup: Setup, join: JoinContext, state: m.JoinState | None,
                inside: bool) -> None:
    """Refuse to enter a used Join, or one whose joinable is in another Join.

    Raises:
        LocalProtocolError: the Join is used or already entered, a joinable
            has no join config, or one is inside another enabled Join.
    """
    if state is not None and state.phase is not m.Phase.IDLE:
        raise _reentered(state.phase, inside)
    for joinable in setup.joinables:
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise missing_config(joinable)
        if config.enable and config.join is not join:
            raise LocalProtocolError(
                f"{name(joinable)} is already inside another "
                "enabled Join; Joins over the same joinable cannot be nested"
            )


def hand_configs(setup: Setup, join: JoinContext) -> None:
    """Give each joinable its config for ``join``; an adapter may refuse one
    (then every joinable gets the disabled one back, and the error propagates)."""
    try:
        for index, joinable in enumerate(setup.joinables):
            joinable._join_config = JoinConfig(
                enable=setup.enable,
                throw_on_early_termination=setup.throw_on_early_termination,
                is_first_joinable=index == 0,
                join=join,
            )
    except BaseException:
        take_back_configs(setup)
        raise


def take_back_configs(setup: Setup) -> None:
    """Give each joinable the disabled config (on exit, or a refused entry)."""
    for joinable in setup.joinables:
        joinable._join_config = _DISABLED


def name(joinable: Any) -> str:
    """The joinable's class, or its repr where it has one (adapters say what they wrap)."""
    if getattr(type(joinable), "__repr__", None) is object.__repr__:
        return type(joinable).__qualname__
    return repr(joinable)


def missing_config(joinable: Any) -> LocalProtocolError:
    return LocalProtocolError(
        f"{name(joinable)} has no join config: its constructor must "
        "call Joinable.__init__(self) (e.g. super().__init__())"
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


def _fuses(joinable: Any) -> bool:
    return bool(getattr(joinable, "join_fuses_heartbeat", False))


def _in_round(joinable: Any) -> bool:
    return bool(getattr(joinable, "join_heartbeat_in_round", False))


def _quiet(hook: Any) -> bool:
    """Whether a joinable's hook shadows nothing per round: its main hook is JoinHook's,
    or the hook declares its main hook local (``JoinHook.main_hook_is_local``)."""
    if getattr(hook, "main_hook_is_local", False) is True:
        return True
    return getattr(getattr(hook, "main_hook", None), "__func__", None) is JoinHook.main_hook


def _follows(joinable: Any) -> bool:
    return bool(getattr(joinable, "join_follows_group", False))


def _looks_like_hook(hook: Any) -> bool:
    # torch's JoinHook subclasses (DDP's, ZeRO's) are hooks too.
    return callable(getattr(hook, "main_hook", None)) and callable(
        getattr(hook, "post_hook", None)
    )
