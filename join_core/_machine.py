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
value, so joinkit ranks and torch ranks can share one process group.

With ``throw_on_early_termination`` an active rank follows its heartbeat with a
*termination check* (a blocking all-reduce to which it contributes 0); a joined
rank that sees active ranks *signals termination* on that same all-reduce
(contributing 1) and raises; the active ranks see a non-zero check and raise.

Failures ride on the same collectives. A rank whose loop body raises does not
leave: it counts and shadows like a joined rank but contributes ``FAILED`` (a
weight far above any rank count, so every sum decodes into ``(active,
failed)``). If it raised right after its heartbeat, before any other collective
of that iteration, it first runs one *completion round* of main hooks so that
iteration's collectives are matched. Active ranks read each heartbeat's sum at
their next notify; seeing a failure they stop (``PeerAborted`` is raised inside
the loop) and count as joined. Once a count shows no active rank and some
failure, no post hook runs: all ranks *exchange failures* (one all-gather of
``Failure`` values) and every rank raises ``PeerFailure`` naming the failing
rank, except the failing ranks, which re-raise their own exception.

A *fused* heartbeat (``MachineConfig.fused_heartbeat``) rides inside the first
joinable's own first collective of each iteration (one extra element), so an
active iteration costs no extra collective: ``Notified`` then commands nothing,
and ``CountNonjoined(fused=True)`` is carried out by that joinable's shadow of
the same collective. A count of zero stops the joined ranks before any other
side effect of the round. Throw mode needs its separate check and so never
fuses.

On entry, ranks may first *check agreement*: one all-gather of each rank's
``signature`` (number of joinables, throw mode, backend); a difference raises
``AgreementError`` with a per-rank table on every rank instead of a later hang.

Phases (``Phase``)::

    IDLE        built, not entered
    AGREEING    entered, waiting for the agreement check's result
    ACTIVE      inside the loop body, sending heartbeats
    CHECKING    active, waiting for the termination check's result (throw mode)
    TERMINATED  active, the early-termination error (or, in throw mode, a
                PeerFailure) was raised inside the loop; the body must exit
    ABORTING    active, a heartbeat showed a failed peer and PeerAborted was
                raised inside the loop; the loop body must now exit
    COUNTING    out of the loop, waiting for the count of non-joined ranks
    SHADOWING   out of the loop, running one round of main hooks
    EXCHANGING  a failure was seen; waiting for the exchange of failures
    POST_HOOKS  everyone joined, running the post hooks
    DONE        finished; the shell leaves the context
    ERRORED     an illegal observation arrived; sticky: every later
                observation re-raises the same error

Observations are what the shell saw; each carries ``now``, a time the shell
read from its clock, because the core never reads one. Commands are what the
shell must do next, in order. A command that produces a result (a check, a
count, an exchange, hooks that run) is answered by exactly one observation.

Invariants:
- every rank issues the same sequence of join collectives, so the SUM of one
  round is the same number on every rank and all ranks make the same decision;
- a rank's ``is_last_joiner`` is true iff its first count was zero;
- after a failure, post hooks never run and every rank leaves with an error;
- the machine never raises: an illegal (phase, observation) pair moves it to
  ERRORED and emits ``Raise(LocalProtocolError(...))``.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from typing import Any, TypeAlias

import attrs

from ._errors import (
    AgreementError,
    EarlyTermination,
    JoinError,
    LocalProtocolError,
    PeerAborted,
    PeerError,
    PeerFailure,
)

__all__ = [
    "Phase",
    "Outcome",
    "Failure",
    "MachineConfig",
    "JoinState",
    "JoinReport",
    "Transition",
    "Entered",
    "AgreementChecked",
    "Notified",
    "HeartbeatSeen",
    "TerminationChecked",
    "LoopExited",
    "Counted",
    "HooksDone",
    "HookFailed",
    "FailuresExchanged",
    "CheckAgreement",
    "SendHeartbeat",
    "CheckTermination",
    "CountNonjoined",
    "SignalTermination",
    "RunMainHooks",
    "RunPostHooks",
    "ExchangeFailures",
    "AbortGroup",
    "WarnSkew",
    "Raise",
    "ACTIVE",
    "JOINED",
    "FAILED",
    "decode_tally",
    "tally_has_failure",
    "initial_state",
    "step",
    "report",
    "notify_is_batchable",
    "replay_notifies",
    "shadow_rounds_batchable",
    "count_is_plain",
    "replay_shadow_steps",
    "shadow_activity",
    "Activity",
    "stall_message",
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


def tally_has_failure(total: float) -> bool:
    """Whether a heartbeat/count sum includes a failed rank (cheap check)."""
    return total >= FAILED - 0.5


class Phase(enum.Enum):
    # Enum's __hash__ is Python code and step hashes the phase on every call;
    # members are singletons, so identity hashing is equivalent and cheaper.
    __hash__ = object.__hash__

    IDLE = "idle"
    AGREEING = "agreeing"
    ACTIVE = "active"
    CHECKING = "checking"
    TERMINATED = "terminated"
    ABORTING = "aborting"
    COUNTING = "counting"
    SHADOWING = "shadowing"
    EXCHANGING = "exchanging"
    POST_HOOKS = "post_hooks"
    DONE = "done"
    ERRORED = "errored"


class Outcome(enum.Enum):
    """How the loop body left the context."""

    NORMAL = "normal"  # inputs exhausted: the rank joins
    FAILED = "failed"  # it raised an Exception of its own
    ABORTED = "aborted"  # it raised PeerAborted (a peer failed)
    INTERRUPTED = "interrupted"  # KeyboardInterrupt, SystemExit: leave at once


# -- values -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Failure:
    """A rank's exception, as data that can cross the wire."""

    rank: int
    exc_type: str
    message: str


@attrs.frozen(kw_only=True)
class MachineConfig:
    """What a rank's machine needs to know about its Join.

    ``signature`` is what ranks must agree on at entry, as ``(name, value)``
    pairs; ``None`` turns the agreement check off. ``skew_warn_threshold`` is
    the number of shadow rounds after which a joined rank warns once about input
    skew (torch: 1000).
    """

    rank: int
    throw_on_early_termination: bool = False
    signature: tuple[tuple[str, Any], ...] | None = None
    skew_warn_threshold: int = SKEW_WARN_THRESHOLD
    fused_heartbeat: bool = False

    def __attrs_post_init__(self) -> None:
        if self.fused_heartbeat and self.throw_on_early_termination:
            raise ValueError("a fused heartbeat cannot carry throw mode's termination check")


@attrs.frozen(kw_only=True, slots=False)
class JoinState:
    """One rank's protocol state. Counters and times feed the join report.

    ``heartbeats`` is the number of inputs this rank processed (heartbeats sent),
    which is also the round at which it joined; ``shadow_rounds`` counts the
    main-hook rounds it ran after leaving its loop. ``failure`` is this rank's
    own failure; ``failure_seen`` whether some count showed a failed rank;
    ``stopped_early`` whether the loop ended because a peer failed (PeerAborted)
    rather than because its inputs ran out; ``peer_failures`` the other ranks'
    failures, from the exchange.
    """

    phase: Phase
    config: MachineConfig
    heartbeats: int = 0
    shadow_rounds: int = 0
    is_last_joiner: bool = True
    warned_skew: bool = False
    failure: Failure | None = None
    failure_seen: bool = False
    stopped_early: bool = False
    peer_failures: tuple[Failure, ...] = ()
    entered_at: float | None = None
    joined_at: float | None = None
    all_joined_at: float | None = None
    done_at: float | None = None
    error: JoinError | None = None


def _evolve(state: JoinState, **changes: Any) -> JoinState:
    """``attrs.evolve`` for the hot path: copy the instance dict, then change it.

    JoinState has no validators or converters, so this is equivalent, and it
    costs a fraction of evolve's per-field rebuild (the core's ``step`` must
    stay within ~2 us).
    """
    new = object.__new__(JoinState)
    fields = new.__dict__
    fields.update(state.__dict__)
    fields.update(changes)
    return new


def initial_state(config: MachineConfig) -> JoinState:
    """The state of a machine that has been built but not entered."""
    return JoinState(phase=Phase.IDLE, config=config)


@attrs.frozen(kw_only=True)
class JoinReport:
    """What one rank did in one Join (``join.report``).

    Attributes:
        rank: this rank.
        inputs: inputs processed (heartbeats sent) before leaving the loop.
        joined_at_round: the round at which it joined because its inputs ran
            out (``None`` if it failed, was stopped early or never left its loop).
        shadow_rounds: main-hook rounds run after leaving the loop.
        seconds_shadowing: from leaving the loop until every rank had joined.
        is_last_joiner: whether it was among the last to join (never after a
            failure: no post hooks ran).
        phase: the machine's final phase name.
        failure: this rank's own failure, if any.
        stopped_early: whether it left its loop before its inputs ran out:
            a peer failed (``PeerAborted``) or, in throw mode, a peer ran out
            (its ``inputs`` are then not its share of the data).
        stopped_by: the ranks whose failure ended this Join for this rank, as
            the failure exchange reported them (empty without a failure).
    """

    rank: int
    inputs: int
    joined_at_round: int | None
    shadow_rounds: int
    seconds_shadowing: float
    is_last_joiner: bool
    phase: str
    failure: Failure | None = None
    stopped_early: bool = False
    stopped_by: tuple[int, ...] = ()

    @property
    def outcome(self) -> str:
        """``"failed"``, ``"stopped early"``, ``"stopped"`` (it had joined when a
        peer failed), ``"joined"``, or ``"unfinished"`` (it never left its loop:
        interrupted, or the Join is still running)."""
        if self.failure is not None:
            return "failed"
        if self.stopped_early:
            return "stopped early"
        if self.stopped_by:
            return "stopped"
        return "joined" if self.joined_at_round is not None else "unfinished"

    def to_dict(self) -> dict[str, Any]:
        """This report as plain JSON-able data (``JoinReport.from_dict`` reads it back)."""
        data = attrs.asdict(self, recurse=True)
        data["stopped_by"] = list(self.stopped_by)
        return {"joinkit_report": REPORT_FORMAT, **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JoinReport:
        """Read back what :meth:`to_dict` wrote.

        Raises:
            ValueError: ``data`` is not a joinkit report (the message says what
                is missing or wrong).
        """
        if not isinstance(data, dict) or data.get("joinkit_report") != REPORT_FORMAT:
            raise ValueError(
                "not a joinkit join report: expected a JSON object with "
                f'"joinkit_report": {REPORT_FORMAT} (from JoinReport.to_dict()), got '
                f"{_preview(data)}"
            )
        fields = {f.name for f in attrs.fields(cls)}
        missing = fields - {"failure", "stopped_early", "stopped_by"} - set(data)
        if missing:
            raise ValueError(f"join report is missing {sorted(missing)}: {_preview(data)}")
        values = {name: data[name] for name in fields if name in data}
        failure = values.get("failure")
        if failure is not None:
            values["failure"] = Failure(**failure)
        values["stopped_by"] = tuple(values.get("stopped_by", ()))
        return cls(**values)


#: The version of :meth:`JoinReport.to_dict`'s format.
REPORT_FORMAT = 1


def _preview(data: Any) -> str:
    text = repr(data)
    return text if len(text) <= 200 else text[:197] + "..."


def report(state: JoinState) -> JoinReport:
    """Summarise a state as a :class:`JoinReport`."""
    failed = state.failure is not None
    joined = state.joined_at is not None and not failed and not state.stopped_early
    end = state.all_joined_at if state.all_joined_at is not None else state.done_at
    seconds = 0.0
    if state.joined_at is not None and end is not None:
        seconds = max(0.0, end - state.joined_at)
    stopped_by = () if failed else tuple(sorted({f.rank for f in state.peer_failures}))
    return JoinReport(
        rank=state.config.rank,
        inputs=state.heartbeats,
        joined_at_round=state.heartbeats if joined else None,
        shadow_rounds=state.shadow_rounds,
        seconds_shadowing=seconds,
        is_last_joiner=joined and state.is_last_joiner and not state.failure_seen,
        phase=state.phase.name,
        failure=state.failure,
        stopped_early=state.stopped_early,
        stopped_by=stopped_by,
    )


# -- observations -------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Entered:
    """The rank entered an enabled Join context."""

    now: float = 0.0


@attrs.frozen(kw_only=True)
class AgreementChecked:
    """Result of ``CheckAgreement``: every rank's signature, in rank order."""

    signatures: tuple[Any, ...]
    now: float = 0.0


@attrs.frozen(kw_only=True)
class Notified:
    """The first joinable called ``notify_join_context``: one more input."""

    now: float = 0.0


@attrs.frozen(kw_only=True)
class HeartbeatSeen:
    """The sum of an earlier heartbeat, read on an active rank."""

    total: float
    now: float = 0.0


@attrs.frozen(kw_only=True)
class TerminationChecked:
    """Result of ``CheckTermination``: the SUM over all ranks."""

    total: float
    now: float = 0.0


@attrs.frozen(kw_only=True)
class LoopExited:
    """The loop body left the context.

    ``failure`` is set with ``Outcome.FAILED``; ``iteration_open`` means the
    rank raised after its heartbeat and before any other collective of that
    iteration, so its peers still expect that iteration's collectives. (With a
    fused heartbeat, the heartbeat is the joinable's first collective: open
    means that collective happened and nothing after it.)
    """

    outcome: Outcome = Outcome.NORMAL
    failure: Failure | None = None
    iteration_open: bool = False
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


@attrs.frozen(kw_only=True)
class HookFailed:
    """A main or post hook raised; its round's collectives are incomplete."""

    failure: Failure
    now: float = 0.0


@attrs.frozen(kw_only=True)
class FailuresExchanged:
    """Result of ``ExchangeFailures``: each rank's ``Failure`` or ``None``."""

    failures: tuple[Failure | None, ...]
    now: float = 0.0


Observation: TypeAlias = (
    Entered
    | AgreementChecked
    | Notified
    | HeartbeatSeen
    | TerminationChecked
    | LoopExited
    | Counted
    | HooksDone
    | HookFailed
    | FailuresExchanged
)

# -- commands -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CheckAgreement:
    """All-gather ``signature``; answer with ``AgreementChecked``."""

    signature: tuple[tuple[str, Any], ...]


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
    """Blocking all-reduce shadowing the heartbeat; answer with ``Counted``.

    ``fused``: carry it out as the first joinable's shadow of its own first
    collective (a fused heartbeat), not as a separate all-reduce.
    """

    value: float = JOINED
    fused: bool = False


@attrs.frozen(kw_only=True)
class SignalTermination:
    """Blocking all-reduce contributing ``value`` to the active ranks' check."""

    value: float = ACTIVE


@attrs.frozen(kw_only=True)
class RunMainHooks:
    """Run every joinable's main hook once; answer with ``HooksDone``/``HookFailed``."""

    round: int


@attrs.frozen(kw_only=True)
class RunPostHooks:
    """Run every joinable's post hook; answer with ``HooksDone``/``HookFailed``."""

    is_last_joiner: bool


@attrs.frozen(kw_only=True)
class ExchangeFailures:
    """All-gather this rank's ``failure``; answer with ``FailuresExchanged``."""

    failure: Failure | None


@attrs.frozen(kw_only=True)
class AbortGroup:
    """Abort the process group where the backend can, so peers fail too."""

    message: str


@attrs.frozen(kw_only=True)
class WarnSkew:
    """Emit a ``UserWarning`` with ``message`` (once per Join)."""

    message: str


@attrs.frozen(kw_only=True)
class Raise:
    """Raise ``error`` on this rank."""

    error: JoinError


Command: TypeAlias = (
    CheckAgreement
    | SendHeartbeat
    | CheckTermination
    | CountNonjoined
    | SignalTermination
    | RunMainHooks
    | RunPostHooks
    | ExchangeFailures
    | AbortGroup
    | WarnSkew
    | Raise
)


@attrs.frozen
class Transition:
    state: JoinState
    commands: tuple[Command, ...] = ()


# -- transitions ------------------------------------------------------------------

_Handler: TypeAlias = Callable[[JoinState, Any], Transition]


def _go(s: JoinState, phase: Phase, *commands: Command, **fields: Any) -> Transition:
    return Transition(_evolve(s, phase=phase, **fields), commands)


def _raise(s: JoinState, phase: Phase, error: JoinError, **fields: Any) -> Transition:
    return _go(s, phase, Raise(error=error), error=error, **fields)


def _enter(s: JoinState, o: Entered) -> Transition:
    if s.config.signature is None:
        return _go(s, Phase.ACTIVE, entered_at=o.now)
    return _go(
        s, Phase.AGREEING, CheckAgreement(signature=s.config.signature), entered_at=o.now
    )


def _agreement_checked(s: JoinState, o: AgreementChecked) -> Transition:
    if all(signature == s.config.signature for signature in o.signatures):
        return _go(s, Phase.ACTIVE)
    names = [name for name, _ in s.config.signature or ()]
    rows = [f"  rank | {' | '.join(names)}"]
    for rank, signature in enumerate(o.signatures):
        values = dict(signature) if signature is not None else {}
        rows.append(f"  {rank:>4} | {' | '.join(repr(values.get(n)) for n in names)}")
    error = AgreementError(
        "ranks entered the Join with different settings; every rank must pass the "
        "same number of joinables and the same throw_on_early_termination, on the "
        "same backend:\n" + "\n".join(rows)
    )
    return _raise(s, Phase.DONE, error, done_at=o.now)


def _notify(s: JoinState, o: Notified) -> Transition:
    if s.config.fused_heartbeat:
        # The joinable's own collective carries ACTIVE; nothing to send.
        return Transition(_evolve(s, heartbeats=s.heartbeats + 1))
    if s.config.throw_on_early_termination:
        return _go(s, Phase.CHECKING, *_HEARTBEAT_AND_CHECK, heartbeats=s.heartbeats + 1)
    return Transition(_evolve(s, heartbeats=s.heartbeats + 1), _HEARTBEAT)


def _heartbeat_seen(s: JoinState, o: HeartbeatSeen) -> Transition:
    if not tally_has_failure(o.total):
        return Transition(s)
    error = PeerAborted(
        f"rank {s.config.rank} stopped: another rank failed inside the Join context; "
        "let this error leave the `with Join(...)` block, which then names the "
        "failing rank"
    )
    return _raise(s, Phase.ABORTING, error, failure_seen=True)


def _termination_checked(s: JoinState, o: TerminationChecked) -> Transition:
    active, failed = decode_tally(o.total)
    if failed:
        return _exchange(s, o.now)
    if active:
        return _raise(s, Phase.TERMINATED, EarlyTermination(ACTIVE_RANK_MESSAGE))
    return _go(s, Phase.ACTIVE)


def _loop_exited(s: JoinState, o: LoopExited) -> Transition:
    if o.outcome is Outcome.INTERRUPTED:
        return _go(s, Phase.DONE, done_at=o.now)
    if o.outcome is Outcome.FAILED and o.failure is not None:
        failure = attrs.evolve(o.failure, rank=s.config.rank)
        if o.iteration_open:
            # Peers are inside this iteration's collectives: match them first.
            return _go(
                s,
                Phase.SHADOWING,
                RunMainHooks(round=s.shadow_rounds),
                failure=failure,
                joined_at=o.now,
            )
        return _go(s, Phase.COUNTING, _count(s, FAILED), failure=failure, joined_at=o.now)
    if o.outcome is Outcome.NORMAL and s.phase is not Phase.CHECKING:
        return _go(s, Phase.COUNTING, _count(s, JOINED), joined_at=o.now)
    return _illegal(s, o)


def _terminated_loop_exited(s: JoinState, o: LoopExited) -> Transition:
    if o.outcome is not Outcome.NORMAL:
        # Throw mode (or a peer's failure seen by its check) ended the loop.
        return _go(s, Phase.DONE, done_at=o.now, stopped_early=True)
    error = LocalProtocolError(
        "the loop body swallowed the early-termination error that "
        "throw_on_early_termination=True raised inside the Join context; "
        "let it propagate out of the `with Join(...)` block (every other "
        "rank raised too)"
    )
    return _raise(s, Phase.ERRORED, error)


def _aborting_loop_exited(s: JoinState, o: LoopExited) -> Transition:
    # Whatever the body did with PeerAborted, this rank must now count with
    # the others so nobody is left waiting; the PeerFailure comes at the end.
    if o.outcome is Outcome.INTERRUPTED:
        return _go(s, Phase.DONE, done_at=o.now, stopped_early=True)
    if o.outcome is Outcome.FAILED and o.failure is not None:
        failure = attrs.evolve(o.failure, rank=s.config.rank)
        return _go(s, Phase.COUNTING, _count(s, FAILED), failure=failure, joined_at=o.now)
    return _go(s, Phase.COUNTING, _count(s, JOINED), joined_at=o.now, stopped_early=True)


def _counted(s: JoinState, o: Counted) -> Transition:
    active, failed = decode_tally(o.total)
    seen = s.failure_seen or failed > 0 or s.failure is not None
    if active == 0:
        if seen:
            return _exchange(_evolve(s, all_joined_at=o.now), o.now)
        return _go(
            s,
            Phase.POST_HOOKS,
            RunPostHooks(is_last_joiner=s.is_last_joiner),
            all_joined_at=o.now,
        )
    if s.config.throw_on_early_termination:
        if seen:
            signal = SignalTermination(value=FAILED if s.failure else ACTIVE)
            exchange = _exchange(_evolve(s, is_last_joiner=False), o.now)
            return Transition(exchange.state, (signal, *exchange.commands))
        error = EarlyTermination(joined_rank_message(s.config.rank))
        return Transition(
            _evolve(s, phase=Phase.DONE, is_last_joiner=False, error=error, done_at=o.now),
            (SignalTermination(), Raise(error=error)),
        )
    return _go(
        s,
        Phase.SHADOWING,
        RunMainHooks(round=s.shadow_rounds),
        is_last_joiner=False,
        failure_seen=seen,
    )


def _shadow_round_done(s: JoinState, o: HooksDone) -> Transition:
    rounds = s.shadow_rounds + 1
    count = _count(s, FAILED if s.failure else JOINED)
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
        return _go(s, Phase.COUNTING, warning, count, shadow_rounds=rounds, warned_skew=True)
    return _go(s, Phase.COUNTING, count, shadow_rounds=rounds)


def _hook_failed(s: JoinState, o: HookFailed) -> Transition:
    # A hook that raised left its round's collectives unmatched; nothing the
    # protocol can do keeps peers in step any more, so make them fail fast.
    failure = attrs.evolve(o.failure, rank=s.config.rank)
    message = (
        f"rank {failure.rank} failed in a join hook ({s.phase.name}) with "
        f"{failure.exc_type}: {failure.message}"
    )
    return _go(s, Phase.DONE, AbortGroup(message=message), failure=failure, done_at=o.now)


def _post_hooks_done(s: JoinState, o: HooksDone) -> Transition:
    return _go(s, Phase.DONE, done_at=o.now)


def _exchange(s: JoinState, now: float) -> Transition:
    return _go(s, Phase.EXCHANGING, ExchangeFailures(failure=s.failure), failure_seen=True)


def _failures_exchanged(s: JoinState, o: FailuresExchanged) -> Transition:
    failures = [f for f in o.failures if f is not None]
    peers = tuple(f for f in failures if f.rank != s.config.rank)
    if s.failure is not None:
        # The failing rank leaves with its own exception, which is in flight.
        return _go(s, Phase.DONE, done_at=o.now, peer_failures=peers)
    s = _evolve(s, peer_failures=peers)
    if not failures:
        error: PeerError = PeerError(
            "a count showed a failed rank, but no rank reported a failure"
        )
    else:
        first = failures[0]
        error = PeerFailure(first.rank, first.exc_type, first.message)
        error.failures = tuple(failures)  # type: ignore[attr-defined]
    if s.joined_at is None:
        # Raised inside the loop (throw mode's check): the body must exit next.
        return _raise(s, Phase.TERMINATED, error)
    return _raise(s, Phase.DONE, error, done_at=o.now)


def _illegal(s: JoinState, o: Any) -> Transition:
    error = LocalProtocolError(
        f"join state machine of rank {s.config.rank} cannot accept "
        f"{type(o).__name__} in phase {s.phase.name}"
    )
    return _raise(s, Phase.ERRORED, error)


def _still_errored(s: JoinState, o: Any) -> Transition:
    assert s.error is not None
    return Transition(s, (Raise(error=s.error),))


def _count(s: JoinState, value: float) -> CountNonjoined:
    return CountNonjoined(value=value, fused=s.config.fused_heartbeat)


_HEARTBEAT = (SendHeartbeat(),)
_HEARTBEAT_AND_CHECK = (SendHeartbeat(), CheckTermination())

#: (phase, observation type) -> handler. A pair missing here is illegal.
TRANSITIONS: dict[tuple[Phase, type], _Handler] = {
    (Phase.IDLE, Entered): _enter,
    (Phase.AGREEING, AgreementChecked): _agreement_checked,
    (Phase.ACTIVE, Notified): _notify,
    (Phase.ACTIVE, HeartbeatSeen): _heartbeat_seen,
    (Phase.ACTIVE, LoopExited): _loop_exited,
    (Phase.CHECKING, TerminationChecked): _termination_checked,
    (Phase.CHECKING, LoopExited): _loop_exited,
    (Phase.TERMINATED, LoopExited): _terminated_loop_exited,
    (Phase.ABORTING, LoopExited): _aborting_loop_exited,
    (Phase.COUNTING, Counted): _counted,
    (Phase.SHADOWING, HooksDone): _shadow_round_done,
    (Phase.SHADOWING, HookFailed): _hook_failed,
    (Phase.EXCHANGING, FailuresExchanged): _failures_exchanged,
    (Phase.POST_HOOKS, HooksDone): _post_hooks_done,
    (Phase.POST_HOOKS, HookFailed): _hook_failed,
}


@attrs.frozen(kw_only=True)
class Activity:
    """What the shell is blocked in (a join collective or hooks), since when."""

    what: str
    since: float


def stall_message(
    state: JoinState, activity: Activity | None, now: float, timeout: float
) -> str | None:
    """Describe a stall if ``activity`` has made no progress for ``timeout`` s.

    Pure: the watchdog passes the state snapshot and ``now`` in.

    Returns:
        The diagnostic (phase, round, progress so far), or ``None``.
    """
    if activity is None or now - activity.since < timeout:
        return None
    return (
        f"rank {state.config.rank} made no progress for {now - activity.since:.1f} s "
        f"(timeout {timeout:g} s) in phase {state.phase.name}, {activity.what}; "
        f"it had processed {state.heartbeats} inputs and run {state.shadow_rounds} "
        "shadow rounds"
    )


def notify_is_batchable(state: JoinState) -> bool:
    """Whether ``Notified`` now always yields the same transition.

    In ACTIVE without throw mode, ``Notified`` keeps the phase, adds one to
    ``heartbeats`` and commands one ``SendHeartbeat(ACTIVE)`` (nothing with a
    fused heartbeat). The shell may then
    send heartbeats without stepping the machine (the per-iteration path must be
    cheap) and fold them in with :func:`replay_notifies` before its next
    observation; the result equals stepping ``Notified`` that many times.
    (``HeartbeatSeen`` without a failure leaves the state unchanged, so the shell
    need only step it when :func:`tally_has_failure` says so.)
    """
    return state.phase is Phase.ACTIVE and not state.config.throw_on_early_termination


def replay_notifies(state: JoinState, count: int) -> JoinState:
    """The state after ``count`` batchable ``Notified`` observations."""
    assert notify_is_batchable(state), state.phase
    return _evolve(state, heartbeats=state.heartbeats + count)


def shadow_rounds_batchable(state: JoinState) -> int:
    """How many plain shadow rounds the shell may run without stepping the machine.

    A joined rank's drain is a loop of rounds: in COUNTING it counts
    (``CountNonjoined``), and a *plain* count (:func:`count_is_plain`: some
    rank active, none failed) moves it to SHADOWING with ``RunMainHooks(round)``;
    ``HooksDone`` brings it back to COUNTING with the same ``CountNonjoined``
    and one more shadow round. With no failure of its own or seen and without
    throw mode, those two transitions are always the same, so the shell may run
    the rounds itself and fold them in with :func:`replay_shadow_steps`, until
    a count is not plain or the skew warning falls due.

    Returns:
        0 if not batchable (another phase, a failure, throw mode); else how
        many rounds may complete before the skew warning's round.
    """
    if (
        state.phase is not Phase.COUNTING
        or state.failure is not None
        or state.failure_seen
        or state.config.throw_on_early_termination
    ):
        return 0
    if state.warned_skew:
        return sys.maxsize
    return max(0, state.config.skew_warn_threshold - state.shadow_rounds)


def count_is_plain(total: float) -> bool:
    """Whether a count's sum shows some rank active and none failed (cheap check).

    The same as ``decode_tally(total)`` giving ``active > 0`` and ``failed == 0``
    for every sum the join collectives can produce.
    """
    return 0.5 <= total < FAILED - 0.5


def replay_shadow_steps(state: JoinState, steps: int) -> JoinState:
    """The state after ``steps`` plain drain observations from a batchable state.

    The observations alternate, starting with a plain ``Counted`` and then
    ``HooksDone``; an odd ``steps`` ends in SHADOWING (the last round's main
    hooks running). The result equals stepping them one by one (tested), as
    long as ``steps // 2`` is within :func:`shadow_rounds_batchable`.
    """
    if steps == 0:
        return state
    assert shadow_rounds_batchable(state) >= steps // 2, (state.phase, steps)
    rounds, in_hooks = divmod(steps, 2)
    return _evolve(
        state,
        phase=Phase.SHADOWING if in_hooks else Phase.COUNTING,
        shadow_rounds=state.shadow_rounds + rounds,
        is_last_joiner=False,
    )


def shadow_activity(state: JoinState) -> str:
    """What a draining rank is blocked in, for the watchdog and the peers."""
    if state.phase is Phase.SHADOWING:
        return f"main hooks of shadow round {state.shadow_rounds}"
    return f"counting non-joined ranks (shadow round {state.shadow_rounds})"


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
