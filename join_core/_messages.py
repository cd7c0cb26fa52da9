"""The words of the protocol: every message the machine and the shell put into
an error, a warning or a log line.

Rules of this room: pure functions from values to text; no decisions (the
machine decides which message applies, this module only words it). The
standard library only. It sits below the machine, which imports it: the
machine's values it words (a state, a progress report) come in as the small
protocols below, which say what it reads of them; the report module's values
are imported for type checking alone.

torch's own texts (``ACTIVE_RANK_MESSAGE``, ``joined_rank_message``, the skew
warning) are kept word for word: code written for torch's Join matches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._reports import Failure, LostRank

__all__ = [
    "ACTIVE_RANK_MESSAGE",
    "joined_rank_message",
    "skew_message",
    "lost_rank_message",
    "progress_message",
    "drain_activity",
    "stall_message",
    "failure_text",
    "silence_message",
    "unknown_on_rank_loss_message",
    "finish_in_throw_mode_message",
    "agreement_table",
    "peer_aborted_message",
    "swallowed_termination_message",
    "fail_fast_message",
    "hook_failed_message",
    "no_reported_failure_message",
    "illegal_message",
    "world_too_large_message",
]


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class _Ranked(Protocol):
    @property
    def rank(self) -> int: ...


class StateView(Protocol):
    """What the words read of the machine's ``JoinState``."""

    @property
    def phase(self) -> _Named: ...
    @property
    def config(self) -> _Ranked: ...
    @property
    def heartbeats(self) -> int: ...
    @property
    def shadow_rounds(self) -> int: ...
    @property
    def failure(self) -> Failure | None: ...


class ProgressView(Protocol):
    """What the words read of the machine's ``ReportProgress`` command."""

    @property
    def rank(self) -> int: ...
    @property
    def ended(self) -> str: ...
    @property
    def inputs(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def rounds(self) -> int: ...
    @property
    def active(self) -> int | None: ...


def _draining(state: StateView) -> bool:
    # By name: this module sits below the machine and does not import it.
    return state.phase.name == "DRAINING"


ACTIVE_RANK_MESSAGE = (
    "Detected at least one rank that exhausted inputs. Throwing across all ranks."
)


def joined_rank_message(rank: int) -> str:
    """torch's message for the rank that exhausted its inputs in throw mode."""
    return f"Rank {rank} exhausted all inputs."


def lost_rank_message(lost: LostRank, world_size: int | None) -> str:
    """The warning for one loss: who, when, what was not seen, the divisor.

    Args:
        lost: the loss.
        world_size: the group's initial size, where known.

    Returns:
        One sentence for ``WarnRankLost``.
    """
    survivors = ", ".join(str(rank) for rank in lost.survivors)
    initial = "the initial world size" if world_size is None else (
        f"the initial world size ({world_size})")
    return (
        f"joinkit: rank {lost.rank} was lost after {lost.iterations} iterations "
        f"({lost.detected}); the Join goes on over ranks {survivors} and treats rank "
        f"{lost.rank} as joined: its remaining inputs were not seen. Gradients keep "
        f"being divided by {initial} where divide_by_initial_world_size=True (the "
        "default), else by the number of ranks that contributed each iteration"
    )


#: At most this many active ranks are named in a progress line (a big world's
#: line stays one short line).
_NAMED_RANKS = 8


def progress_message(command: ProgressView, active_ranks: Sequence[int] | None = None) -> str:
    """The progress line for ``command``, e.g. ``rank 0 joined after 1,204 inputs;
    shadowing rank(s) 3, 7 for 42 s (3,118 rounds)``.

    Args:
        command: what the machine reported.
        active_ranks: the ranks the backend's status board shows in their loop
            body (the first 8 are named); ``None`` or empty: unknown, and the
            line gives the count.
    """
    if active_ranks:
        who = "rank(s) " + ", ".join(str(rank) for rank in active_ranks[:_NAMED_RANKS])
        if len(active_ranks) > _NAMED_RANKS:
            who += f" and {len(active_ranks) - _NAMED_RANKS:,} more"
    elif command.active is None:
        who = "possibly active ranks (a count showed a failed rank)"
    else:
        who = f"{command.active} active rank(s)"
    return (
        f"rank {command.rank} {command.ended} after {command.inputs:,} inputs; "
        f"shadowing {who} for {command.seconds:.0f} s ({command.rounds:,} "
        f"{'round' if command.rounds == 1 else 'rounds'})"
    )


def drain_activity(state: StateView, ticks: int) -> str:
    """What a draining rank is blocked in, ``ticks`` steps into its drain.

    The shell counts a step when a count returns and when a round of main
    hooks finishes, so an even ``ticks`` means counting, an odd one hooks.
    """
    rounds = state.shadow_rounds + ticks // 2
    if ticks % 2:
        return f"main hooks of shadow round {rounds}"
    return f"counting non-joined ranks (shadow round {rounds})"


def stall_message(
    state: StateView, doing: str, ticks: int, idle: float, timeout: float
) -> str:
    """Describe a rank that made no progress for ``idle`` seconds.

    Pure: the shell passes the state, what it was blocked in (``doing``; in a
    drain the round comes from ``ticks``, see :func:`drain_activity`) and the
    idle time its watchdog measured.

    Returns:
        The diagnostic: phase, what it was doing, inputs and shadow rounds,
        and the rank's own failure if it had one (it was shadowing after it).
    """
    rounds = state.shadow_rounds
    if _draining(state):
        doing = drain_activity(state, ticks)
        rounds += ticks // 2
    message = (
        f"rank {state.config.rank} made no progress for {idle:.1f} s "
        f"(timeout {timeout:g} s) in phase {state.phase.name}, {doing}; "
        f"it had processed {state.heartbeats} inputs and run {rounds} "
        "shadow rounds"
    )
    if state.failure is not None:
        message += f"; {failure_text(state.failure)}"
    return message


def failure_text(failure: Failure) -> str:
    """A rank's own failure in words, for every message that follows it."""
    return (
        f"rank {failure.rank} had failed inside the Join context with "
        f"{failure.exc_type}: {failure.message}"
    )


def silence_message(
    state: StateView,
    doing: str | None,
    ticks: int,
    silent: tuple[tuple[int, float, str], ...],
    timeout: float,
    board_error: str | None = None,
) -> str:
    """Describe peers whose liveness beat stopped (dead, frozen, holding the GIL).

    Pure: the shell passes the state, what this rank was blocked in (``None``:
    its loop body), the silent peers as ``(rank, seconds silent, last status)``
    and why the last read of the status board failed, if it did.

    Returns:
        The diagnostic: the silent ranks first, then where this rank was.
    """
    ranks = ", ".join(str(rank) for rank, _, _ in silent)
    peers = "; ".join(
        f"rank {rank}: silent for {seconds:.1f} s, last seen {what!r}"
        for rank, seconds, what in silent
    )
    if doing is None:
        where = "in its loop body"
    elif _draining(state):
        where = drain_activity(state, ticks)
    else:
        where = doing
    message = (
        f"rank {state.config.rank} has seen no sign of life from rank{'s' * (len(silent) > 1)} "
        f"{ranks} on the status board within the timeout ({timeout:g} s): {peers}. "
        "A rank inside a Join beats on the board from its watchdog thread whatever "
        "its loop does, so a silent one is dead, frozen (e.g. SIGSTOP) or holding "
        f"the GIL. Rank {state.config.rank} was in phase {state.phase.name}, {where}; "
        f"it had processed {state.heartbeats} inputs"
    )
    if board_error is not None:
        message += f" (its last read of the status board failed: {board_error})"
    return message



def skew_message(threshold: int, rank: int) -> str:
    """torch's warning for a joined rank past ``threshold`` shadow rounds."""
    return (
        f"Detected uneven input skew of greater than {threshold}. "
        f"This means that rank {rank} has at least {threshold} "
        "fewer inputs than other currently-active ranks. This level of "
        "skew could lead to performance degradation during training."
    )


def unknown_on_rank_loss_message(on_rank_loss: str) -> str:
    """A ``Join(on_rank_loss=...)`` that is neither choice."""
    return (
        "on_rank_loss must be 'raise' (a dead rank ends the Join with an error "
        "naming it) or 'finish' (the survivors treat it as joined and finish), "
        f"not {on_rank_loss!r}"
    )


def finish_in_throw_mode_message() -> str:
    """``on_rank_loss="finish"`` with ``throw_on_early_termination=True``."""
    return (
        "on_rank_loss='finish' cannot be combined with "
        "throw_on_early_termination=True: a lost rank counts as joined, which "
        "throw mode would turn into an error on every rank; use one or the other"
    )


def world_too_large_message(world_size: int, most: int) -> str:
    """The refusal of a world whose active count a float32 sum cannot hold."""
    return (
        f"joinkit's Join supports worlds of at most 2**24 = {most} ranks, "
        f"and this process group has {world_size}: the heartbeat is a float32 "
        "sum, which counts active ranks exactly only up to 2**24 (as torch's Join's "
        "does); join a subgroup of at most 2**24 ranks"
    )


def agreement_table(
    signature: tuple[tuple[str, Any], ...], signatures: Sequence[Any]
) -> str:
    """The ``AgreementError`` text: what every rank passed, a row per rank.

    Args:
        signature: this rank's signature (its names head the columns).
        signatures: every rank's signature, in rank order (``None``: unknown).
    """
    names = [name for name, _ in signature]
    rows = [f"  rank | {' | '.join(names)}"]
    for rank, theirs in enumerate(signatures):
        values = dict(theirs) if theirs is not None else {}
        rows.append(f"  {rank:>4} | {' | '.join(repr(values.get(n)) for n in names)}")
    return (
        "ranks entered the Join with different settings; every rank must pass the "
        "same number of joinables and the same throw_on_early_termination, on the "
        "same backend (and the same joinables and options, which choose the "
        "heartbeat's path: Join.heartbeat):\n" + "\n".join(rows)
    )


def peer_aborted_message(rank: int) -> str:
    """What an active rank raises inside its loop when a heartbeat shows a failure."""
    return (
        f"rank {rank} stopped: another rank failed inside the Join context; "
        "let this error leave the `with Join(...)` block, which then names the "
        "failing rank"
    )


def swallowed_termination_message() -> str:
    """The loop body caught throw mode's early-termination error."""
    return (
        "the loop body swallowed the early-termination error that "
        "throw_on_early_termination=True raised inside the Join context; "
        "let it propagate out of the `with Join(...)` block (every other "
        "rank raised too)"
    )


def fail_fast_message(failure: Failure) -> str:
    """The abort's message when a failure's place in the iteration is unknown."""
    return (
        f"rank {failure.rank} failed inside the Join context with {failure.exc_type}: "
        f"{failure.message}; the Join cannot tell whether its peers wait in the "
        "collectives of that iteration (the backend does not count the joinables' "
        "own collectives, e.g. they go to a raw communicator), so it aborts the group "
        "rather than leave them waiting (issue them through the joinkit group, e.g. an "
        "MPIGroup, and a failure leaves the group usable)"
    )


def hook_failed_message(hook: str, failure: Failure, earlier: Failure | None) -> str:
    """The abort's message when a join hook raised.

    Args:
        hook: ``"main_hook"`` or ``"post_hook"``.
        failure: the hook's exception.
        earlier: the rank's own failure in the loop body, if it was shadowing after one.
    """
    message = (
        f"rank {failure.rank} failed in a join hook ({hook}) with "
        f"{failure.exc_type}: {failure.message}"
    )
    if earlier is not None:
        message += (
            f", after it failed inside the Join context with {earlier.exc_type}: "
            f"{earlier.message}"
        )
    return message


def no_reported_failure_message() -> str:
    """A count showed a failure that the exchange did not name."""
    return "a count showed a failed rank, but no rank reported a failure"


def illegal_message(rank: int, observation: str, phase: str) -> str:
    """A (phase, observation) pair missing from the transition table."""
    return (
        f"join state machine of rank {rank} cannot accept "
        f"{observation} in phase {phase}"
    )
