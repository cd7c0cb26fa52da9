"""The join protocol as a pure state machine, one per rank.

Theory of operation
-------------------
Every rank runs the same loop over its own inputs inside ``with Join(...)``.
Each iteration the first joinable calls ``notify_join_context``, which sends a
*heartbeat*: a 1-element float32 SUM all-reduce to which an active rank
contributes 1. A rank whose inputs run out *joins*: in ``__exit__`` it
*drains*: it repeatedly *counts* the non-joined ranks with an all-reduce that
shadows the heartbeat (it contributes 0) and, while the count is non-zero,
runs every joinable's main hook, which shadows the collectives of one training
iteration (a *shadow round*). When the count is zero every rank has joined;
each runs the post hooks, passing ``is_last_joiner`` (true when its very first
count was already zero, i.e. it was among the ranks with the most inputs).
This is torch's protocol, value for value, so joinkit ranks and torch ranks
can share one process group.

With ``throw_on_early_termination`` an active rank follows its heartbeat with a
*termination check* (a blocking all-reduce to which it contributes 0); a joined
rank that sees active ranks *signals termination* on that same all-reduce
(contributing 1) and raises; the active ranks see a non-zero check and raise.

Failures ride on the same collectives, as *wire values* (``_wire``: ACTIVE 1,
JOINED 0, a failed rank's FAILING 2**53 once and FAILED 2**-100 after; a sum
is read by ``decode_tally``). What the protocol does with them:

- *A sum of at least* ``ALARM`` says that a rank failed in this round (the
  active count is then unknown). Active ranks read each heartbeat's sum at
  their next notify: seeing the alarm they stop (``PeerAborted`` inside the
  loop) and drain like joined ranks. Draining ranks take an alarmed count for
  "some rank may be active" and shadow one more round; all of them do the
  same, so collectives match whether or not anyone was active.
- *With some rank active* the sum is the exact active count; *with none* it
  is 0, or a positive sum below 0.5 if some ranks failed. A failing rank
  keeps counting to the end, so the final count tells every rank, including
  one that never saw the alarm, whether to run the post hooks or to
  *exchange failures* (one all-gather of ``Failure`` values, which names them
  exactly): every rank then raises ``PeerFailure`` naming the failing rank,
  except the failing ranks, which re-raise their own exception. Post hooks
  never run after a failure.

A rank whose loop body raised right after its heartbeat, before any other
collective of that iteration, first runs one *completion round* of main hooks
so that its peers' iteration is matched; then it drains like a joined rank. A
draining rank in throw mode counts once: a FAILING weight there makes every
counting rank signal (so active ranks, if any, see the alarm in their check)
and exchange. Where the shell cannot tell how many collectives the rank issued
since its heartbeat (``LoopExited.collectives_since_heartbeat`` is ``None``: the
backend does not count the joinables' collectives, e.g. they go to a raw
communicator) the peers may or may not wait in that iteration's collectives,
and neither a drain nor a completion round is safe: where the backend can
abort (``MachineConfig.can_abort``) the rank *fails fast*, aborting the group
with its exception in the message (``AbortGroup``), instead of leaving its
peers blocked until a watchdog fires. Before its first heartbeat (or alone in
its world) nothing is open, and it drains.

A *fused* heartbeat (``MachineConfig.fused_heartbeat``) rides inside the first
joinable's own first collective of each iteration (one extra element), so an
active iteration costs no extra collective; a drain's counts are then that
joinable's shadow of the same collective (``Drain(fused=True)``), which stops
the joined ranks before any other side effect of the round. Throw mode needs
its separate check and so never fuses. A float64 slot can carry one more
per-rank flag beside the heartbeat (``_wire.split_heartbeat_flags``; DDP's fused
gradient-sync check).

A *round* heartbeat (``MachineConfig.round_heartbeat``, a kind of fused one)
rides in every collective of the first joinable's *rounds* instead: a round is
the collectives of one synchronising step (DDP: one gradient all-reduce per
bucket), which an active rank issues after one input, after several
(``no_sync()`` accumulation) or not at all (a forward without a backward). A
notify counts the input and sends nothing; the joinable puts the order's value
into its next round. A joined rank's round is the same collectives from zeros:
its count is its shadow of the round's first collective, and while the count
shows some rank active its main hook issues the rest; so it meets the active
ranks' next round whenever that comes, and when every rank has joined, all of
them issue that round's first collective, read a sum with nobody active and
stop (one collective per Join, at its end). A shadow round is then one round
of the active ranks, not one input: ``shadow_rounds`` counts rounds, and
``is_last_joiner`` holds for every rank that left after the last round. A rank
that failed midway through a round (some of its collectives out, not all:
``LoopExited.round_open``, which the joinable tells) completes it first with one
completion round of main hooks; before or after a whole round nothing is open,
and it drains.

On entry, ranks may first *check agreement* on their ``signature`` (number of
joinables, throw mode, backend): they *compare signatures* by a stable digest
(``_wire.signature_digest``), one collective that costs every rank O(1) where the
backend can (``CompareSignatures``; e.g. a MAX all-reduce of the digest and its
negation). Only if the digests differ do they all-gather the signatures
themselves (``CheckAgreement``), whose per-rank table the ``AgreementError``
then shows on every rank instead of a later hang.

*Rank loss* (``MachineConfig.on_rank_loss == "finish"``): a backend that can
rebuild its group after a rank dies (MPI with ULFM, a gloo group over a store)
does so inside its own collectives and keeps a list of ``LostRank`` values;
the shell reads it after each heartbeat and at the end and hands new ones to
the machine as ``RanksLost``. The machine records them (``JoinState.lost_ranks``,
``JoinReport.lost_ranks``) and emits one ``WarnRankLost`` per loss. Nothing
else changes: a dead rank contributes nothing to a heartbeat or a count, just
as a joined rank contributes ``JOINED``, so the survivors' sums already treat
it as joined, and the phase stays what it was.

Phases (``Phase``)::

    IDLE        built, not entered
    AGREEING    entered, waiting for the agreement check's results (the digest
                comparison, then on a difference the table of signatures)
    ACTIVE      inside the loop body, sending heartbeats
    CHECKING    active, waiting for the termination check's result (throw mode)
    TERMINATED  active, the early-termination error (or, in throw mode, a
                PeerFailure) was raised inside the loop; the body must exit
    ABORTING    active, a heartbeat showed a failed peer and PeerAborted was
                raised inside the loop; the loop body must now exit
    DRAINING    out of the loop: counting and shadowing, round after round
    SHADOWING   out of the loop, running one round of main hooks (a failing
                rank's completion round, or the round whose count ended a
                drain batch)
    EXCHANGING  a failure was seen; waiting for the exchange of failures
    POST_HOOKS  everyone joined, running the post hooks
    DONE        finished; the shell leaves the context
    ERRORED     an illegal observation arrived; sticky: every later
                observation re-raises the same error

Observations are what the shell saw; each carries ``now``, a time the shell
read from its clock, because the core never reads one. Commands are what the
shell must do next, in order. A command that produces a result (a check, a
drain, an exchange, hooks that run) is answered by exactly one observation.

Where the next steps are always the same, one command stands for all of them,
so the shell executes and never decides:

- ``HeartbeatOrder`` (a *standing order* in ACTIVE, without throw mode): on
  every notify, read the previous heartbeat's sum where the backend can and
  report it (``HeartbeatSeen``) if it is at least ``alarm``; otherwise send
  the heartbeat and count it. The order stands until the shell's next
  observation; it reports the heartbeats sent under it as ``Notified(count)``
  before that observation, and every transition that stays in ACTIVE issues
  the order again.
- ``Drain``: count, and while the sum shows some rank possibly active run
  the main hooks, up to ``limit`` rounds; answered by one
  ``Drained(rounds, total, failure)``.

A drain runs in *batches*: each ``Drain``'s ``limit`` ends it after a batch of
rounds (or at the skew warning's round, whichever comes first), and the round
whose count ended it runs as ``RunMainHooks`` (phase SHADOWING) before the next
``Drain``; the collectives are the same wherever a batch ends. A batch boundary
is where the machine sees a time (``now``) while draining, so its rate-limited
decisions are taken there and the rounds inside a batch cost nothing extra:
when ``progress_interval`` seconds passed since the rank joined (or since its
last progress line), it emits ``ReportProgress`` (an INFO line: inputs, the
active ranks, seconds and rounds shadowing). The first batch is
``FIRST_DRAIN_BATCH`` rounds (a short drain has no boundary) and each next one
at most doubles; from the rounds per second so far each is sized to end about
when the next progress line is due, so a drain of N rounds has about
log2(N / 16) boundaries plus about one per ``progress_interval``.

The table ``TRANSITIONS`` lists, per (phase, observation), the handler and the
phases it may lead to; a pair missing there is illegal.

Invariants:
- every rank issues the same sequence of join collectives, so the SUM of one
  round is the same number on every rank and all ranks make the same decision;
- a rank's ``is_last_joiner`` is true iff its first count was zero;
- a failing rank contributes FAILING to exactly one count (in throw mode, to
  its count and its termination signal) and FAILED to every later one;
- after a failure, post hooks never run and every rank leaves with an error;
- the machine never raises: an illegal (phase, observation) pair moves it to
  ERRORED and emits ``Raise(LocalProtocolError(...))``.

Rules of this room: this module decides, and only this module. Phases,
observations, commands and the transition table live here; the wire values are
``_wire``, the reported values (``Failure``, ``LostRank``, ``JoinReport``) are
``_reports`` and every message's words are ``_messages``: this module chooses
which, those say how. Standard library and attrs only; no clock, no I/O.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any, TypeAlias

import attrs

from . import _messages as text
from ._errors import (
    AgreementError,
    EarlyTermination,
    JoinError,
    LocalProtocolError,
    PeerAborted,
    PeerError,
    PeerFailure,
)
from ._reports import Failure, JoinReport, LostRank
from ._wire import (
    ACTIVE,
    ALARM,
    FAILED,
    FAILING,
    JOINED,
    MAX_WORLD_SIZE,
    NOBODY_ACTIVE_BELOW,
    decode_tally,
    signature_digest,
)

__all__ = [
    "RanksLost",
    "WarnRankLost",
    "ON_RANK_LOSS",
    "check_on_rank_loss",
    "Phase",
    "Outcome",
    "MachineConfig",
    "JoinState",
    "Transition",
    "Entered",
    "SignaturesCompared",
    "AgreementChecked",
    "Notified",
    "HeartbeatSeen",
    "TerminationChecked",
    "LoopExited",
    "Drained",
    "HooksDone",
    "HookFailed",
    "FailuresExchanged",
    "CompareSignatures",
    "CheckAgreement",
    "HeartbeatOrder",
    "SendHeartbeat",
    "CheckTermination",
    "Drain",
    "SignalTermination",
    "RunMainHooks",
    "RunPostHooks",
    "ExchangeFailures",
    "AbortGroup",
    "WarnSkew",
    "ReportProgress",
    "Raise",
    "initial_state",
    "step",
    "report",
    "TRANSITIONS",
    "SKEW_WARN_THRESHOLD",
    "PROGRESS_INTERVAL",
    "FIRST_DRAIN_BATCH",
]

SKEW_WARN_THRESHOLD = 1000
#: Seconds between a draining rank's progress lines (``ReportProgress``, logged
#: at INFO): the first comes this long after the rank joined, then one per
#: interval, at the first drain batch boundary after it is due. The shell passes
#: it as ``MachineConfig.progress_interval`` when a Join is built (tests set it
#: to 0 for a line at every boundary).
PROGRESS_INTERVAL = 30.0
#: Rounds in a drain's first batch (module doc): a boundary costs about two
#: ``step`` calls, so a short drain has none; the first progress line comes
#: after this many rounds at the earliest.
FIRST_DRAIN_BATCH = 16
#: The choices of ``Join(on_rank_loss=...)``.
ON_RANK_LOSS = ("raise", "finish")


def check_on_rank_loss(on_rank_loss: str, throw_on_early_termination: bool) -> None:
    """Refuse an ``on_rank_loss`` that is not a choice, or ``"finish"`` in throw mode.

    Raises:
        ValueError: saying which and what to pass instead.
    """
    if on_rank_loss not in ON_RANK_LOSS:
        raise ValueError(text.unknown_on_rank_loss_message(on_rank_loss))
    if on_rank_loss == "finish" and throw_on_early_termination:
        raise ValueError(text.finish_in_throw_mode_message())


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
    DRAINING = "draining"
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
class MachineConfig:
    """What a rank's machine needs to know about its Join.

    ``signature`` is what ranks must agree on at entry, as ``(name, value)``
    pairs; ``None`` turns the agreement check off. ``skew_warn_threshold`` is
    the number of shadow rounds after which a joined rank warns once about input
    skew (torch: 1000). ``progress_interval`` is the seconds between a draining
    rank's progress lines (``PROGRESS_INTERVAL``). ``world_size``, where known,
    must not exceed ``MAX_WORLD_SIZE``. ``on_rank_loss`` is ``Join``'s
    (``ON_RANK_LOSS``); ``"finish"`` excludes throw mode. ``round_heartbeat``:
    the fused heartbeat rides in the first joinable's rounds (module doc).
    ``can_abort``: whether the shell can abort the group (``AbortGroup`` makes
    the peers fail); with it, a failure whose place in the iteration is
    unknown fails fast instead of guessing.

    Raises:
        ValueError: a fused heartbeat in throw mode, a round heartbeat that
            is not fused, a world too large, an unknown ``on_rank_loss``, or
            ``"finish"`` in throw mode.
    """

    rank: int
    throw_on_early_termination: bool = False
    signature: tuple[tuple[str, Any], ...] | None = None
    skew_warn_threshold: int = SKEW_WARN_THRESHOLD
    fused_heartbeat: bool = False
    round_heartbeat: bool = False
    world_size: int | None = None
    can_abort: bool = False
    progress_interval: float = PROGRESS_INTERVAL
    on_rank_loss: str = "raise"

    def __attrs_post_init__(self) -> None:
        check_on_rank_loss(self.on_rank_loss, self.throw_on_early_termination)
        if self.fused_heartbeat and self.throw_on_early_termination:
            raise ValueError("a fused heartbeat cannot carry throw mode's termination check")
        if self.round_heartbeat and not self.fused_heartbeat:
            raise ValueError("a round heartbeat is a fused heartbeat: set fused_heartbeat too")
        if self.world_size is not None and self.world_size > MAX_WORLD_SIZE:
            raise ValueError(text.world_too_large_message(self.world_size, MAX_WORLD_SIZE))


@attrs.frozen(kw_only=True, slots=False)
class JoinState:
    """One rank's protocol state. Counters and times feed the join report.

    ``heartbeats`` is the number of inputs this rank processed (heartbeats sent),
    which is also the round at which it joined; ``shadow_rounds`` counts the
    main-hook rounds it ran after leaving its loop. ``failure`` is this rank's
    own failure; ``failure_announced`` whether its FAILING weight went out;
    ``failure_seen`` whether it learned of a failure (an alarm in a heartbeat's
    sum, or the count or check that sent it to the exchange); ``stopped_early``
    whether the loop ended because a peer failed (PeerAborted) rather than
    because its inputs ran out; ``peer_failures`` the other ranks' failures,
    from the exchange. ``drain_batch`` is the size of the latest drain batch
    (module doc; 0 before the first), ``progress_at`` when the latest progress
    line went out (``None``: none yet). ``lost_ranks``: the ranks lost so far
    (``RanksLost``), in order of loss.
    """

    phase: Phase
    config: MachineConfig
    heartbeats: int = 0
    shadow_rounds: int = 0
    is_last_joiner: bool = True
    warned_skew: bool = False
    failure: Failure | None = None
    failure_announced: bool = False
    failure_seen: bool = False
    stopped_early: bool = False
    peer_failures: tuple[Failure, ...] = ()
    drain_batch: int = 0
    progress_at: float | None = None
    lost_ranks: tuple[LostRank, ...] = ()
    entered_at: float | None = None
    joined_at: float | None = None
    all_joined_at: float | None = None
    done_at: float | None = None
    error: JoinError | None = None


def _evolve(state: JoinState, **changes: Any) -> JoinState:
    """``attrs.evolve`` for the hot path: copy the instance dict, then change it.

    JoinState has no validators or converters, so this is equivalent (tested
    against ``attrs.evolve`` over every field), and it costs a fraction of
    evolve's per-field rebuild (the core's ``step`` must stay within ~2 us).
    """
    new = object.__new__(JoinState)
    fields = new.__dict__
    fields.update(state.__dict__)
    fields.update(changes)
    return new


def initial_state(config: MachineConfig) -> JoinState:
    """The state of a machine that has been built but not entered."""
    return JoinState(phase=Phase.IDLE, config=config)


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
        lost_ranks=state.lost_ranks,
        heartbeat=_heartbeat_kind(state.config),
    )


def _heartbeat_kind(config: MachineConfig) -> str:
    """How the heartbeat travels: ``"round"``, ``"fused"`` or ``"classic"``."""
    if config.round_heartbeat:
        return "round"
    return "fused" if config.fused_heartbeat else "classic"


# -- observations -------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Entered:
    """The rank entered an enabled Join context."""

    now: float = 0.0


@attrs.frozen(kw_only=True)
class SignaturesCompared:
    """Result of ``CompareSignatures``: whether every rank passed the same digest."""

    same: bool
    now: float = 0.0


@attrs.frozen(kw_only=True)
class AgreementChecked:
    """Result of ``CheckAgreement``: every rank's signature, in rank order."""

    signatures: tuple[Any, ...]
    now: float = 0.0


@attrs.frozen(kw_only=True)
class Notified:
    """The first joinable called ``notify_join_context``: ``count`` more inputs.

    In throw mode, one per notify (the machine commands its heartbeat and
    check). Under a ``HeartbeatOrder``, the heartbeats the shell sent under the
    order, reported before its next observation.
    """

    count: int = 1
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

    ``failure`` is set with ``Outcome.FAILED``. ``collectives_since_heartbeat``
    is how many of the group's own collectives the rank issued since its last
    heartbeat (``None``: unknown, or no heartbeat yet); the machine tells from
    it whether the rank raised midway through an iteration its peers are still
    in (right after a separate heartbeat, or right after a fused heartbeat's
    own collective) and must first complete it. Unknown after a heartbeat, it
    fails fast where the group can be aborted (module doc). With a round
    heartbeat the joinable tells instead: ``round_open`` is whether the rank
    left midway through one of its rounds (``None``: it cannot tell).
    """

    outcome: Outcome = Outcome.NORMAL
    failure: Failure | None = None
    collectives_since_heartbeat: int | None = None
    round_open: bool | None = None
    now: float = 0.0


@attrs.frozen(kw_only=True)
class Drained:
    """Result of ``Drain``.

    ``rounds`` shadow rounds ran in full (count, then every main hook).
    ``total`` is the sum of the count that ended the drain, ``None`` when a
    main hook raised: then ``failure`` is that hook's exception, and the round
    it raised in is left incomplete.
    """

    rounds: int
    total: float | None
    failure: Failure | None = None
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
    """Result of ``ExchangeFailures``: the ranks' failures.

    Every failed rank's ``Failure``; ``None`` entries (ranks that did not
    fail, as an all-gather returns them) are allowed and ignored.
    """

    failures: tuple[Failure | None, ...]
    now: float = 0.0


@attrs.frozen(kw_only=True)
class RanksLost:
    """The backend's ``lost_ranks()``: every rank lost so far, in order of loss.

    The shell passes the whole tuple whenever it grew; the machine records
    the ones it has not seen (by rank).
    """

    lost: tuple[LostRank, ...]
    now: float = 0.0


Observation: TypeAlias = (
    Entered
    | SignaturesCompared
    | AgreementChecked
    | Notified
    | HeartbeatSeen
    | TerminationChecked
    | LoopExited
    | Drained
    | HooksDone
    | HookFailed
    | FailuresExchanged
    | RanksLost
)

# -- commands -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CompareSignatures:
    """Find whether every rank's signature digest equals ``digest`` (one
    collective); answer with ``SignaturesCompared``."""

    digest: int


@attrs.frozen(kw_only=True)
class CheckAgreement:
    """All-gather ``signature``; answer with ``AgreementChecked``."""

    signature: tuple[tuple[str, Any], ...]


@attrs.frozen(kw_only=True)
class HeartbeatOrder:
    """A standing order for every notify until the next observation (module doc).

    On each notify of the first joinable: read the previous heartbeat's sum
    where the backend can (``heartbeat_total``; with ``fused``, the sum the
    joinable recorded); if it is at least ``alarm``, answer ``HeartbeatSeen``.
    Otherwise send a heartbeat contributing ``value`` (with ``fused``, give
    ``value`` to the joinable for its slot instead) and count it; report the
    count as ``Notified(count)`` before the next observation.
    """

    value: float = ACTIVE
    fused: bool = False
    alarm: float = ALARM


@attrs.frozen(kw_only=True)
class SendHeartbeat:
    """Start the async heartbeat all-reduce, contributing ``value``."""

    value: float = ACTIVE


@attrs.frozen(kw_only=True)
class CheckTermination:
    """Blocking all-reduce contributing 0; answer with ``TerminationChecked``."""

    value: float = JOINED


@attrs.frozen(kw_only=True)
class Drain:
    """Count the non-joined ranks and shadow their rounds; answer with ``Drained``.

    Each round: a blocking all-reduce shadowing the heartbeat, contributing
    ``first`` the first time and ``value`` after (with ``fused``, it is the
    first joinable's ``fused_shadow`` of its own first collective, whose main
    hook then shadows only the rest); if the sum is below ``until`` (nobody
    active) or ``limit`` rounds already ran (``None``: no limit), stop and
    answer with that sum; else run every joinable's main hook (a joinable that
    fuses a heartbeat slot shadows its first collective with ``JOINED`` in it)
    and go on. A main hook that raises ends the drain at once.
    """

    first: float = JOINED
    value: float = JOINED
    fused: bool = False
    limit: int | None = None
    until: float = NOBODY_ACTIVE_BELOW


@attrs.frozen(kw_only=True)
class SignalTermination:
    """Blocking all-reduce contributing ``value`` to the active ranks' check."""

    value: float = ACTIVE


@attrs.frozen(kw_only=True)
class RunMainHooks:
    """Run every joinable's main hook once; answer with ``HooksDone``/``HookFailed``.

    ``first_shadowed``: the first joinable's first collective needs no shadow
    (a fused count shadowed it, or it went out before the rank failed).
    """

    round: int
    first_shadowed: bool = False


@attrs.frozen(kw_only=True)
class RunPostHooks:
    """Run every joinable's post hook; answer with ``HooksDone``/``HookFailed``."""

    is_last_joiner: bool


@attrs.frozen(kw_only=True)
class ExchangeFailures:
    """Give every rank every rank's ``failure`` (``None``: none); answer with
    ``FailuresExchanged``.

    An all-gather does it; so does a gather to one rank and a broadcast of the
    failures found, which costs the other ranks O(failures) instead of
    O(world size).
    """

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
class WarnRankLost:
    """Emit a ``UserWarning`` with ``message``: one per lost rank (``lost_rank_message``)."""

    rank: int
    message: str


@attrs.frozen(kw_only=True)
class ReportProgress:
    """Log at INFO that this draining rank is still shadowing (module doc).

    The shell reads the names of the still-active ranks from the backend's
    status board where it has one, and logs :func:`progress_message`.

    Attributes:
        rank: this rank.
        ended: how its loop ended: ``"joined"``, ``"failed"`` or ``"stopped"``.
        inputs: inputs processed before it left its loop.
        seconds: seconds since it left its loop.
        rounds: shadow rounds run so far.
        active: the active ranks in the latest count (``None``: a failure's
            weight hid the number).
    """

    rank: int
    ended: str
    inputs: int
    seconds: float
    rounds: int
    active: int | None


@attrs.frozen(kw_only=True)
class Raise:
    """Raise ``error`` on this rank."""

    error: JoinError


Command: TypeAlias = (
    CompareSignatures
    | CheckAgreement
    | HeartbeatOrder
    | SendHeartbeat
    | CheckTermination
    | Drain
    | SignalTermination
    | RunMainHooks
    | RunPostHooks
    | ExchangeFailures
    | AbortGroup
    | WarnSkew
    | WarnRankLost
    | ReportProgress
    | Raise
)


@attrs.frozen
class Transition:
    state: JoinState
    commands: tuple[Command, ...] = ()


# -- transitions ------------------------------------------------------------------

_Handler: TypeAlias = Callable[[JoinState, Any], Transition]

# The standing orders, one per kind of heartbeat (built once: step is hot).
_ORDERS = {False: (HeartbeatOrder(),), True: (HeartbeatOrder(fused=True),)}
_HEARTBEAT_AND_CHECK = (SendHeartbeat(), CheckTermination())


def _go(s: JoinState, phase: Phase, *commands: Command, **fields: Any) -> Transition:
    return Transition(_evolve(s, phase=phase, **fields), commands)


def _raise(s: JoinState, phase: Phase, error: JoinError, **fields: Any) -> Transition:
    return _go(s, phase, Raise(error=error), error=error, **fields)


def _orders(config: MachineConfig) -> tuple[Command, ...]:
    """The standing heartbeat order of ACTIVE (none in throw mode)."""
    return () if config.throw_on_early_termination else _ORDERS[config.fused_heartbeat]


def _active(s: JoinState, **fields: Any) -> Transition:
    """Enter ACTIVE, with its standing heartbeat order."""
    return Transition(_evolve(s, phase=Phase.ACTIVE, **fields), _orders(s.config))


def _enter(s: JoinState, o: Entered) -> Transition:
    signature = s.config.signature
    if signature is None:
        return _active(s, entered_at=o.now)
    command = CompareSignatures(digest=signature_digest(signature))
    return _go(s, Phase.AGREEING, command, entered_at=o.now)


def _signatures_compared(s: JoinState, o: SignaturesCompared) -> Transition:
    if o.same:
        return _active(s)
    # Some rank differs: fetch the table that says which and how.
    return _go(s, Phase.AGREEING, CheckAgreement(signature=s.config.signature or ()))


def _agreement_checked(s: JoinState, o: AgreementChecked) -> Transition:
    if all(signature == s.config.signature for signature in o.signatures):
        return _active(s)
    error = AgreementError(text.agreement_table(s.config.signature or (), o.signatures))
    return _raise(s, Phase.DONE, error, done_at=o.now)


def _notify(s: JoinState, o: Notified) -> Transition:
    config = s.config
    if config.throw_on_early_termination:
        return _go(s, Phase.CHECKING, *_HEARTBEAT_AND_CHECK, heartbeats=s.heartbeats + o.count)
    # Heartbeats sent under the standing order; it stands on.
    orders = _ORDERS[config.fused_heartbeat]
    return Transition(_evolve(s, heartbeats=s.heartbeats + o.count), orders)


def _heartbeat_seen(s: JoinState, o: HeartbeatSeen) -> Transition:
    if o.total < ALARM:
        return Transition(s, _orders(s.config))  # nothing changed; the order stands
    error = PeerAborted(text.peer_aborted_message(s.config.rank))
    return _raise(s, Phase.ABORTING, error, failure_seen=True)


def _termination_checked(s: JoinState, o: TerminationChecked) -> Transition:
    active, failure = decode_tally(o.total)
    if failure:
        return _exchange(s)
    if active:
        return _raise(s, Phase.TERMINATED, EarlyTermination(text.ACTIVE_RANK_MESSAGE))
    return _go(s, Phase.ACTIVE)


def _iteration_open(s: JoinState, o: LoopExited) -> bool | None:
    """Whether peers still expect collectives of the failing rank's last iteration.

    True right after its heartbeat went on the wire and before any other
    collective: a separate heartbeat with no collective since, or a fused
    heartbeat's own collective and nothing after it; with a round heartbeat,
    midway through a round (the joinable says). ``None`` when nobody can
    tell: a heartbeat went out to peers, but the shell does not know what
    the rank issued since.
    """
    config = s.config
    # A round heartbeat: open while some of the round's collectives went out
    # and not all, which only the joinable knows (module doc).
    since = o.round_open if config.round_heartbeat else o.collectives_since_heartbeat
    if since is None:
        return None if s.heartbeats and config.world_size != 1 else False
    if config.round_heartbeat:
        return bool(since)
    return since == (1 if config.fused_heartbeat else 0)


def _loop_exited(s: JoinState, o: LoopExited) -> Transition:
    if o.outcome is Outcome.INTERRUPTED:
        return _go(s, Phase.DONE, done_at=o.now)
    if o.outcome is Outcome.FAILED and o.failure is not None:
        failure = attrs.evolve(o.failure, rank=s.config.rank)
        failing = _evolve(s, failure=failure, joined_at=o.now)
        opened = _iteration_open(s, o)
        if opened is None and s.config.can_abort:
            return _fail_fast(failing, failure, o.now)
        if opened:
            # Peers are inside this iteration's collectives: match them first.
            command = RunMainHooks(round=s.shadow_rounds, first_shadowed=s.config.fused_heartbeat)
            return _go(failing, Phase.SHADOWING, command)
        # Nothing open (or, unknown where nothing can abort, the best guess:
        # right before a heartbeat, where a drain matches the peers).
        return _drain(failing, o.now)
    if o.outcome is Outcome.NORMAL and s.phase is not Phase.CHECKING:
        return _drain(_evolve(s, joined_at=o.now), o.now)
    return _illegal(s, o)


def _terminated_loop_exited(s: JoinState, o: LoopExited) -> Transition:
    if o.outcome is not Outcome.NORMAL:
        # Throw mode (or a peer's failure seen by its check) ended the loop.
        return _go(s, Phase.DONE, done_at=o.now, stopped_early=True)
    error = LocalProtocolError(text.swallowed_termination_message())
    return _raise(s, Phase.ERRORED, error)


def _aborting_loop_exited(s: JoinState, o: LoopExited) -> Transition:
    # Whatever the body did with PeerAborted, this rank must now count with
    # the others so nobody is left waiting; the PeerFailure comes at the end.
    if o.outcome is Outcome.INTERRUPTED:
        return _go(s, Phase.DONE, done_at=o.now, stopped_early=True)
    if o.outcome is Outcome.FAILED and o.failure is not None:
        failure = attrs.evolve(o.failure, rank=s.config.rank)
        return _drain(_evolve(s, failure=failure, joined_at=o.now), o.now)
    return _drain(_evolve(s, joined_at=o.now, stopped_early=True), o.now)


def _fail_fast(s: JoinState, failure: Failure, now: float) -> Transition:
    # Draining could meet the peers in their own collectives of the iteration
    # (a mismatch, or a hang until a watchdog); a completion round could meet
    # their next heartbeat. Ending the group now is the only safe move.
    return _go(s, Phase.DONE, AbortGroup(message=text.fail_fast_message(failure)), done_at=now)


def _drain(s: JoinState, now: float) -> Transition:
    """Go draining: count (FAILING first, for a failing rank that has not yet
    said so) and shadow, one batch (module doc; throw mode: count once)."""
    config = s.config
    if s.failure is None:
        first = value = JOINED
    else:
        first, value = (FAILED if s.failure_announced else FAILING), FAILED
    if config.throw_on_early_termination:
        command = Drain(first=first, value=value, limit=0)
        return _go(s, Phase.DRAINING, command)
    batch = _drain_batch(s, now)
    limit = batch
    if not s.warned_skew:
        limit = min(limit, max(0, config.skew_warn_threshold - s.shadow_rounds))
    command = Drain(first=first, value=value, fused=config.fused_heartbeat, limit=limit)
    return _go(s, Phase.DRAINING, command, drain_batch=batch)


def _drain_batch(s: JoinState, now: float) -> int:
    """The next drain batch's rounds: ``FIRST_DRAIN_BATCH``, then at most
    double, and once a rate is known aim at the next progress line's time."""
    previous = s.drain_batch
    if previous == 0:
        return FIRST_DRAIN_BATCH
    start = now if s.joined_at is None else s.joined_at
    elapsed = now - start
    if elapsed <= 0.0 or s.shadow_rounds == 0:
        return 2 * previous
    due = (start if s.progress_at is None else s.progress_at) + s.config.progress_interval
    rounds = s.shadow_rounds / elapsed * (due - now)
    if not math.isfinite(rounds):  # a clock step too small for a rate (a subnormal)
        return 2 * previous
    return min(2 * previous, max(1, math.ceil(rounds)))


def _progress(s: JoinState, active: int | None, now: float) -> tuple[ReportProgress, ...]:
    """A progress line, if one is due at this batch boundary (module doc)."""
    start = now if s.joined_at is None else s.joined_at
    last = start if s.progress_at is None else s.progress_at
    if now - last < s.config.progress_interval:
        return ()
    ended = "failed" if s.failure is not None else "stopped" if s.stopped_early else "joined"
    report = ReportProgress(
        rank=s.config.rank,
        ended=ended,
        inputs=s.heartbeats,
        seconds=now - start,
        rounds=s.shadow_rounds,
        active=active,
    )
    return (report,)


def _drained(s: JoinState, o: Drained) -> Transition:
    rounds = s.shadow_rounds + o.rounds
    total = o.total
    last = s.is_last_joiner and o.rounds == 0 and total is not None and total < NOBODY_ACTIVE_BELOW
    # Every count of the drain carried this rank's failure weight.
    s = _evolve(
        s, shadow_rounds=rounds, is_last_joiner=last, failure_announced=s.failure is not None
    )
    if o.failure is not None:
        return _hook_failed(s, o.failure, o.now)
    if total is None:
        return _illegal(s, o)
    active, failure_shows = decode_tally(total)
    if active == 0:
        s = _evolve(s, all_joined_at=o.now)
        if failure_shows or s.failure is not None:
            return _exchange(s)
        return _go(s, Phase.POST_HOOKS, RunPostHooks(is_last_joiner=last))
    if s.config.throw_on_early_termination:
        if failure_shows or s.failure is not None:
            # Active ranks (if any) see the alarm in their check; with none,
            # every counting rank signals alike, so the collectives match.
            signal = SignalTermination(value=FAILING if s.failure else ACTIVE)
            exchange = _exchange(s)
            return Transition(exchange.state, (signal, *exchange.commands))
        error = EarlyTermination(text.joined_rank_message(s.config.rank))
        return Transition(
            _evolve(s, phase=Phase.DONE, error=error, done_at=o.now),
            (SignalTermination(), Raise(error=error)),
        )
    # The batch ended at its limit, after a count showing some rank (possibly)
    # active: a progress line if one is due, that round's hooks, then (at
    # its threshold) the skew warning and the next batch.
    command = RunMainHooks(round=rounds, first_shadowed=s.config.fused_heartbeat)
    progress = _progress(s, active, o.now)
    if progress:
        s = _evolve(s, progress_at=o.now)
    return _go(s, Phase.SHADOWING, *progress, command)


def _shadow_round_done(s: JoinState, o: HooksDone) -> Transition:
    s = _evolve(s, shadow_rounds=s.shadow_rounds + 1)
    threshold = s.config.skew_warn_threshold
    if s.shadow_rounds > threshold and not s.warned_skew:
        warning = WarnSkew(message=text.skew_message(threshold, s.config.rank))
        drain = _drain(_evolve(s, warned_skew=True), o.now)
        return Transition(drain.state, (warning, *drain.commands))
    return _drain(s, o.now)


def _hooks_failed(s: JoinState, o: HookFailed) -> Transition:
    return _hook_failed(s, o.failure, o.now)


def _hook_failed(s: JoinState, failure: Failure, now: float) -> Transition:
    # A hook that raised left its round's collectives unmatched; nothing the
    # protocol can do keeps peers in step any more, so make them fail fast.
    failure = attrs.evolve(failure, rank=s.config.rank)
    hook = "post_hook" if s.phase is Phase.POST_HOOKS else "main_hook"
    # Shadowing after its own failure in the loop body: the message names that too.
    message = text.hook_failed_message(hook, failure, s.failure)
    return _go(s, Phase.DONE, AbortGroup(message=message), failure=failure, done_at=now)


def _post_hooks_done(s: JoinState, o: HooksDone) -> Transition:
    return _go(s, Phase.DONE, done_at=o.now)


def _exchange(s: JoinState) -> Transition:
    return _go(s, Phase.EXCHANGING, ExchangeFailures(failure=s.failure), failure_seen=True)


def _failures_exchanged(s: JoinState, o: FailuresExchanged) -> Transition:
    failures = [f for f in o.failures if f is not None]
    peers = tuple(f for f in failures if f.rank != s.config.rank)
    if s.failure is not None:
        # The failing rank leaves with its own exception, which is in flight.
        return _go(s, Phase.DONE, done_at=o.now, peer_failures=peers)
    s = _evolve(s, peer_failures=peers)
    if not failures:
        error: PeerError = PeerError(text.no_reported_failure_message())
    else:
        first = failures[0]
        error = PeerFailure(first.rank, first.exc_type, first.message)
        error.failures = tuple(failures)  # type: ignore[attr-defined]
    if s.joined_at is None:
        # Raised inside the loop (throw mode's check): the body must exit next.
        return _raise(s, Phase.TERMINATED, error)
    return _raise(s, Phase.DONE, error, done_at=o.now)


def _ranks_lost(s: JoinState, o: RanksLost) -> Transition:
    # Record the new losses, warn once each; the phase (and, in ACTIVE, the
    # standing order) stays: a dead rank already sums like a joined one.
    known = {lost.rank for lost in s.lost_ranks}
    new = tuple(lost for lost in o.lost if lost.rank not in known)
    warnings = tuple(
        WarnRankLost(rank=lost.rank, message=text.lost_rank_message(lost, s.config.world_size))
        for lost in new
    )
    orders = _orders(s.config) if s.phase is Phase.ACTIVE else ()
    return Transition(_evolve(s, lost_ranks=s.lost_ranks + new), (*warnings, *orders))


def _illegal(s: JoinState, o: Any) -> Transition:
    error = LocalProtocolError(
        text.illegal_message(s.config.rank, type(o).__name__, s.phase.name))
    return _raise(s, Phase.ERRORED, error)


def _still_errored(s: JoinState, o: Any) -> Transition:
    assert s.error is not None
    return Transition(s, (Raise(error=s.error),))


_P = Phase

#: The protocol: (phase, observation type) -> (handler, the phases it may lead
#: to). A pair missing here is illegal; ERRORED accepts nothing, DONE only ``RanksLost``.
TRANSITIONS: dict[tuple[Phase, type], tuple[_Handler, tuple[Phase, ...]]] = {
    # phase           observation           handler                  next phases
    (_P.IDLE,         Entered):            (_enter,                  (_P.AGREEING, _P.ACTIVE)),
    (_P.AGREEING,     SignaturesCompared): (_signatures_compared,    (_P.ACTIVE, _P.AGREEING)),
    (_P.AGREEING,     AgreementChecked):   (_agreement_checked,      (_P.ACTIVE, _P.DONE)),
    (_P.ACTIVE,       Notified):           (_notify,                 (_P.ACTIVE, _P.CHECKING)),
    (_P.ACTIVE,       HeartbeatSeen):      (_heartbeat_seen,         (_P.ACTIVE, _P.ABORTING)),
    (_P.ACTIVE,       LoopExited):         (_loop_exited,            (_P.DRAINING, _P.SHADOWING,
                                                                      _P.DONE, _P.ERRORED)),
    (_P.CHECKING,     TerminationChecked): (_termination_checked,    (_P.ACTIVE, _P.TERMINATED,
                                                                      _P.EXCHANGING)),
    (_P.CHECKING,     LoopExited):         (_loop_exited,            (_P.DRAINING, _P.SHADOWING,
                                                                      _P.DONE, _P.ERRORED)),
    (_P.TERMINATED,   LoopExited):         (_terminated_loop_exited, (_P.DONE, _P.ERRORED)),
    (_P.ABORTING,     LoopExited):         (_aborting_loop_exited,   (_P.DRAINING, _P.DONE)),
    (_P.DRAINING,     Drained):            (_drained,                (_P.SHADOWING, _P.POST_HOOKS,
                                                                      _P.EXCHANGING, _P.DONE,
                                                                      _P.ERRORED)),
    (_P.SHADOWING,    HooksDone):          (_shadow_round_done,      (_P.DRAINING,)),
    (_P.SHADOWING,    HookFailed):         (_hooks_failed,           (_P.DONE,)),
    (_P.EXCHANGING,   FailuresExchanged):  (_failures_exchanged,     (_P.TERMINATED, _P.DONE)),
    (_P.POST_HOOKS,   HooksDone):          (_post_hooks_done,        (_P.DONE,)),
    (_P.POST_HOOKS,   HookFailed):         (_hooks_failed,           (_P.DONE,)),
    # The shell reads the backend's losses after each heartbeat (ACTIVE) and
    # once the protocol is over (DONE, or a phase the loop body must leave).
    (_P.ACTIVE,       RanksLost):          (_ranks_lost,             (_P.ACTIVE,)),
    (_P.ABORTING,     RanksLost):          (_ranks_lost,             (_P.ABORTING,)),
    (_P.TERMINATED,   RanksLost):          (_ranks_lost,             (_P.TERMINATED,)),
    (_P.DONE,         RanksLost):          (_ranks_lost,             (_P.DONE,)),
}  # fmt: skip

# What step looks up (the handlers alone: one dict probe per observation).
_HANDLERS: dict[tuple[Phase, type], _Handler] = {
    key: handler for key, (handler, _) in TRANSITIONS.items()
}


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
    handler = _HANDLERS.get((state.phase, type(observation)), _illegal)
    return handler(state, observation)
