"""The join protocol as a pure state machine, one per rank.

Theory of operation
-------------------
Every rank runs the same loop over its own inputs inside ``with Join(...)``.
Each iteration the first joinable calls ``notify_join_context``, which sends a
*heartbeat*: a 1-element SUM all-reduce to which an active rank contributes 1.
A rank whose inputs run out *joins*: in ``__exit__`` it repeatedly *counts* the
non-joined ranks with an all-reduce that shadows the heartbeat (it contributes
0). While the count is non-zero it runs every joinable's main hook, which
shadows the collectives of one training iteration (a *shadow round*). When the
count is zero every rank has joined; each runs the post hooks, passing
``is_last_joiner`` (true when its very first count was already zero, i.e. it
was among the ranks with the most inputs). This is torch's protocol, value for
value, so joinery ranks and torch ranks can share one process group.

With ``throw_on_early_termination`` an active rank follows its heartbeat with a
*termination check* (a blocking all-reduce to which it contributes 0); a joined
rank that sees active ranks *signals termination* on that same all-reduce
(contributing 1) and raises; the active ranks see a non-zero check and raise.

Phases (``Phase``)::

    IDLE        built, not entered
    ACTIVE      inside the loop body, sending heartbeats
    CHECKING    active, waiting for the termination check's result (throw mode)
    TERMINATED  active, the early-termination error was raised inside the loop;
                the loop body must now exit with it
    COUNTING    joined, waiting for the count of non-joined ranks
    SHADOWING   joined, running one round of main hooks
    POST_HOOKS  everyone joined, running the post hooks
    DONE        finished; the shell leaves the context
    ERRORED     an illegal observation arrived; sticky: every later
                observation re-raises the same error

Observations are what the shell saw (``Entered``, ``Notified``,
``TerminationChecked``, ``LoopExited``, ``Counted``, ``HooksDone``); each
carries ``now``, a time the shell read from its clock, because the core never
reads one. Commands are what the shell must do next (``SendHeartbeat``,
``CheckTermination``, ``CountNonjoined``, ``SignalTermination``,
``RunMainHooks``, ``RunPostHooks``, ``WarnSkew``, ``Raise``). A command that
produces a result (a check or a count) is answered by exactly one observation.

Invariants:
- every rank issues the same sequence of join collectives, so the SUM of one
  round is the same number on every rank and all ranks make the same decision;
- a rank's ``is_last_joiner`` is true iff its first count was zero;
- the machine never raises: an illegal (phase, observation) pair moves it to
  ERRORED and emits ``Raise(LocalProtocolError(...))``.

Wire values leave room for later features: a heartbeat/count contribution is
``ACTIVE`` (1) or ``JOINED`` (0); ``FAILED`` is a large weight so a sum still
decodes into (active, failed) counts by ``divmod``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeAlias

import attrs

from ._errors import EarlyTermination, JoinError, LocalProtocolError

__all__ = [
    "Phase",
    "MachineConfig",
    "JoinState",
    "Transition",
    "Entered",
    "Notified",
    "TerminationChecked",
    "LoopExited",
    "Counted",
    "HooksDone",
    "SendHeartbeat",
    "CheckTermination",
    "CountNonjoined",
    "SignalTermination",
    "RunMainHooks",
    "RunPostHooks",
    "WarnSkew",
    "Raise",
    "ACTIVE",
    "JOINED",
    "FAILED",
    "decode_tally",
    "initial_state",
    "step",
    "notify_is_batchable",
    "replay_notifies",
    "TRANSITIONS",
    "SKEW_WARN_THRESHOLD",
    "ACTIVE_RANK_MESSAGE",
    "joined_rank_message",
]

# -- wire values --------------------------------------------------------------

ACTIVE = 1.0
JOINED = 0.0
# A failing rank's contribution; exact in float32 for sums below 2**24, so up
# to 4095 active ranks and 4095 failed ranks decode without loss.
FAILED = 4096.0

SKEW_WARN_THRESHOLD = 1000
ACTIVE_RANK_MESSAGE = (
    "Detected at least one rank that exhausted inputs. Throwing across all ranks."
)


def joined_rank_message(rank: int) -> str:
    """torch's message for the rank that exhausted its inputs in throw mode."""
    return f"Rank {rank} exhausted all inputs."


def decode_tally(total: float) -> tuple[int, int]:
    """Split a heartbeat/count sum into ``(active ranks, failed ranks)``."""
    failed, active = divmod(int(round(total)), int(FAILED))
    return active, failed


class Phase(enum.Enum):
    IDLE = "idle"
    ACTIVE = "active"
    CHECKING = "checking"
    TERMINATED = "terminated"
    COUNTING = "counting"
    SHADOWING = "shadowing"
    POST_HOOKS = "post_hooks"
    DONE = "done"
    ERRORED = "errored"


# -- configuration and state ----------------------------------------------------


@attrs.frozen(kw_only=True)
class MachineConfig:
    """What a rank's machine needs to know about its Join.

    ``skew_warn_threshold`` is the number of shadow rounds after which a joined
    rank warns once about input skew (torch: 1000).
    """

    rank: int
    throw_on_early_termination: bool = False
    skew_warn_threshold: int = SKEW_WARN_THRESHOLD


@attrs.frozen(kw_only=True)
class JoinState:
    """One rank's protocol state. Counters feed the join report.

    ``heartbeats`` is the number of inputs this rank processed (heartbeats sent),
    which is also the round at which it joined; ``shadow_rounds`` counts the
    main-hook rounds it ran after joining.
    """

    phase: Phase
    config: MachineConfig
    heartbeats: int = 0
    shadow_rounds: int = 0
    is_last_joiner: bool = True
    warned_skew: bool = False
    entered_at: float | None = None
    joined_at: float | None = None
    done_at: float | None = None
    error: JoinError | None = None


def initial_state(config: MachineConfig) -> JoinState:
    """The state of a machine that has been built but not entered."""
    return JoinState(phase=Phase.IDLE, config=config)


# -- observations -------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Entered:
    """The rank entered an enabled Join context."""

    now: float = 0.0


@attrs.frozen(kw_only=True)
class Notified:
    """The first joinable called ``notify_join_context``: one more input."""

    now: float = 0.0


@attrs.frozen(kw_only=True)
class TerminationChecked:
    """Result of ``CheckTermination``: the SUM over all ranks."""

    total: float
    now: float = 0.0


@attrs.frozen(kw_only=True)
class LoopExited:
    """The loop body left the context; ``raised`` if it left with an exception."""

    raised: bool = False
    now: float = 0.0


@attrs.frozen(kw_only=True)
class Counted:
    """Result of ``CountNonjoined``: the SUM over all ranks."""

    total: float
    now: float = 0.0


@attrs.frozen(kw_only=True)
class HooksDone:
    """The main hooks (one shadow round) or the post hooks finished."""

    now: float = 0.0


Observation: TypeAlias = (
    Entered | Notified | TerminationChecked | LoopExited | Counted | HooksDone
)

# -- commands -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SendHeartbeat:
    """Start the async heartbeat all-reduce, contributing ``value``."""

    value: float = ACTIVE


@attrs.frozen(kw_only=True)
class CheckTermination:
    """Blocking all-reduce contributing 0; answer with ``TerminationChecked``."""

    value: float = JOINED


@attrs.frozen(kw_only=True)
class CountNonjoined:
    """Blocking all-reduce shadowing the heartbeat; answer with ``Counted``."""

    value: float = JOINED


@attrs.frozen(kw_only=True)
class SignalTermination:
    """Blocking all-reduce contributing ``value`` to the active ranks' check."""

    value: float = ACTIVE


@attrs.frozen(kw_only=True)
class RunMainHooks:
    """Run every joinable's main hook once (shadow round ``round``, from 0)."""

    round: int


@attrs.frozen(kw_only=True)
class RunPostHooks:
    """Run every joinable's post hook; answer with ``HooksDone``."""

    is_last_joiner: bool


@attrs.frozen(kw_only=True)
class WarnSkew:
    """Emit a ``UserWarning`` with ``message`` (once per Join)."""

    message: str


@attrs.frozen(kw_only=True)
class Raise:
    """Raise ``error`` on this rank."""

    error: JoinError


Command: TypeAlias = (
    SendHeartbeat
    | CheckTermination
    | CountNonjoined
    | SignalTermination
    | RunMainHooks
    | RunPostHooks
    | WarnSkew
    | Raise
)


@attrs.frozen
class Transition:
    state: JoinState
    commands: tuple[Command, ...] = ()


# -- transitions ------------------------------------------------------------------

_Handler: TypeAlias = Callable[[JoinState, "Observation"], Transition]


def _enter(s: JoinState, o: Entered) -> Transition:
    return Transition(attrs.evolve(s, phase=Phase.ACTIVE, entered_at=o.now))


def _notify(s: JoinState, o: Notified) -> Transition:
    if s.config.throw_on_early_termination:
        return Transition(
            attrs.evolve(s, phase=Phase.CHECKING, heartbeats=s.heartbeats + 1),
            _HEARTBEAT_AND_CHECK,
        )
    return Transition(attrs.evolve(s, heartbeats=s.heartbeats + 1), _HEARTBEAT)


def _termination_checked(s: JoinState, o: TerminationChecked) -> Transition:
    active, failed = decode_tally(o.total)
    if active or failed:
        error = EarlyTermination(ACTIVE_RANK_MESSAGE)
        return Transition(
            attrs.evolve(s, phase=Phase.TERMINATED, error=error), (Raise(error=error),)
        )
    return Transition(attrs.evolve(s, phase=Phase.ACTIVE))


def _loop_exited(s: JoinState, o: LoopExited) -> Transition:
    if o.raised:
        # The exception propagates as it is (torch's behaviour).
        return Transition(attrs.evolve(s, phase=Phase.DONE, done_at=o.now))
    if s.phase is Phase.CHECKING:
        return _illegal(s, o)
    return Transition(
        attrs.evolve(s, phase=Phase.COUNTING, joined_at=o.now), _COUNT
    )


def _terminated_loop_exited(s: JoinState, o: LoopExited) -> Transition:
    if o.raised:
        return Transition(attrs.evolve(s, phase=Phase.DONE, done_at=o.now))
    error = LocalProtocolError(
        "the loop body swallowed the early-termination error that "
        "throw_on_early_termination=True raised inside the Join context; "
        "let it propagate out of the `with Join(...)` block (every other "
        "rank raised too)"
    )
    return Transition(
        attrs.evolve(s, phase=Phase.ERRORED, error=error), (Raise(error=error),)
    )


def _counted(s: JoinState, o: Counted) -> Transition:
    active, failed = decode_tally(o.total)
    if active == 0:
        return Transition(
            attrs.evolve(s, phase=Phase.POST_HOOKS),
            (RunPostHooks(is_last_joiner=s.is_last_joiner),),
        )
    if s.config.throw_on_early_termination:
        error = EarlyTermination(joined_rank_message(s.config.rank))
        return Transition(
            attrs.evolve(s, phase=Phase.DONE, is_last_joiner=False, error=error,
                         done_at=o.now),
            (SignalTermination(), Raise(error=error)),
        )
    return Transition(
        attrs.evolve(s, phase=Phase.SHADOWING, is_last_joiner=False),
        (RunMainHooks(round=s.shadow_rounds),),
    )


def _shadow_round_done(s: JoinState, o: HooksDone) -> Transition:
    rounds = s.shadow_rounds + 1
    if rounds > s.config.skew_warn_threshold and not s.warned_skew:
        threshold = s.config.skew_warn_threshold
        warning = WarnSkew(
            message=(
                f"Detected uneven input skew of greater than {threshold}. "
                f"This means that rank {s.config.rank} has at least {threshold} "
                "fewer inputs than other currently-active ranks. This level of "
                "skew could lead to performance degradation during training."
            )
        )
        return Transition(
            attrs.evolve(s, phase=Phase.COUNTING, shadow_rounds=rounds,
                         warned_skew=True),
            (warning, *_COUNT),
        )
    return Transition(attrs.evolve(s, phase=Phase.COUNTING, shadow_rounds=rounds),
                      _COUNT)


def _post_hooks_done(s: JoinState, o: HooksDone) -> Transition:
    return Transition(attrs.evolve(s, phase=Phase.DONE, done_at=o.now))


def _illegal(s: JoinState, o: Observation) -> Transition:
    error = LocalProtocolError(
        f"join state machine of rank {s.config.rank} cannot accept "
        f"{type(o).__name__} in phase {s.phase.name}"
    )
    return Transition(
        attrs.evolve(s, phase=Phase.ERRORED, error=error), (Raise(error=error),)
    )


def _still_errored(s: JoinState, o: Observation) -> Transition:
    assert s.error is not None
    return Transition(s, (Raise(error=s.error),))


_HEARTBEAT = (SendHeartbeat(),)
_HEARTBEAT_AND_CHECK = (SendHeartbeat(), CheckTermination())
_COUNT = (CountNonjoined(),)

#: (phase, observation type) -> handler. A pair missing here is illegal.
TRANSITIONS: dict[tuple[Phase, type], _Handler] = {
    (Phase.IDLE, Entered): _enter,
    (Phase.ACTIVE, Notified): _notify,
    (Phase.ACTIVE, LoopExited): _loop_exited,
    (Phase.CHECKING, TerminationChecked): _termination_checked,
    (Phase.CHECKING, LoopExited): _loop_exited,
    (Phase.TERMINATED, LoopExited): _terminated_loop_exited,
    (Phase.COUNTING, Counted): _counted,
    (Phase.SHADOWING, HooksDone): _shadow_round_done,
    (Phase.POST_HOOKS, HooksDone): _post_hooks_done,
}  # type: ignore[dict-item]


def notify_is_batchable(state: JoinState) -> bool:
    """Whether ``Notified`` now always yields the same transition.

    In ACTIVE without throw mode, ``Notified`` keeps the phase, adds one to
    ``heartbeats`` and commands one ``SendHeartbeat(ACTIVE)``. The shell may then
    send heartbeats without stepping the machine (the per-iteration path must be
    cheap) and fold them in with :func:`replay_notifies` before its next
    observation; the result equals stepping ``Notified`` that many times.
    """
    return state.phase is Phase.ACTIVE and not state.config.throw_on_early_termination


def replay_notifies(state: JoinState, count: int) -> JoinState:
    """The state after ``count`` batchable ``Notified`` observations."""
    assert notify_is_batchable(state), state.phase
    return attrs.evolve(state, heartbeats=state.heartbeats + count)


def step(state: JoinState, observation: Observation) -> Transition:
    """Advance one rank's machine by one observation.

    Args:
        state: the current state.
        observation: what the shell saw.

    Returns:
        The next state and the commands the shell must carry out, in order.
        Never raises: an illegal observation yields phase ERRORED and a
        ``Raise`` command.
    """
    if state.phase is Phase.ERRORED:
        return _still_errored(state, observation)
    handler = TRANSITIONS.get((state.phase, type(observation)), _illegal)
    return handler(state, observation)
