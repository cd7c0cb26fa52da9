"""The pure join machine: every (phase x observation) pair, and its invariants."""

from __future__ import annotations

import itertools
import subprocess
import sys

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from joinkit import (
    AgreementError,
    EarlyTermination,
    LocalProtocolError,
    PeerAborted,
    PeerError,
    PeerFailure,
)
from joinkit import _machine as m

FAILURE = m.Failure(rank=9, exc_type="ValueError", message="bad batch")
SIGNATURE = (("joinables", 1),)

OBSERVATIONS = {
    m.Entered: m.Entered(now=1.0),
    m.AgreementChecked: m.AgreementChecked(signatures=(SIGNATURE, SIGNATURE), now=1.0),
    m.Notified: m.Notified(now=1.0),
    m.HeartbeatSeen: m.HeartbeatSeen(total=2.0, now=1.0),
    m.TerminationChecked: m.TerminationChecked(total=0.0, now=1.0),
    m.LoopExited: m.LoopExited(now=1.0),
    m.Counted: m.Counted(total=1.0, now=1.0),
    m.HooksDone: m.HooksDone(now=1.0),
    m.HookFailed: m.HookFailed(failure=FAILURE, now=1.0),
    m.FailuresExchanged: m.FailuresExchanged(failures=(None, FAILURE), now=1.0),
}


def state(phase: m.Phase, *, throw: bool = False, **fields: object) -> m.JoinState:
    config = m.MachineConfig(rank=3, throw_on_early_termination=throw, signature=SIGNATURE)
    return attrs.evolve(m.initial_state(config), phase=phase, **fields)


ABORT = m.AbortGroup(
    message="rank 3 failed in a join hook (PHASE) with ValueError: bad batch"
)

# The legal pairs with the sample observation above: (next phase, commands).
LEGAL = {
    (m.Phase.IDLE, m.Entered): (
        m.Phase.AGREEING,
        (m.CheckAgreement(signature=SIGNATURE),),
    ),
    (m.Phase.AGREEING, m.AgreementChecked): (m.Phase.ACTIVE, ()),
    (m.Phase.ACTIVE, m.Notified): (m.Phase.ACTIVE, (m.SendHeartbeat(value=1.0),)),
    (m.Phase.ACTIVE, m.HeartbeatSeen): (m.Phase.ACTIVE, ()),
    (m.Phase.ACTIVE, m.LoopExited): (m.Phase.COUNTING, (m.CountNonjoined(value=0.0),)),
    (m.Phase.CHECKING, m.TerminationChecked): (m.Phase.ACTIVE, ()),
    # The loop left without an exception while a termination check was
    # outstanding: the shell never lets this happen, so it is illegal.
    (m.Phase.CHECKING, m.LoopExited): (m.Phase.ERRORED, "illegal"),
    (m.Phase.TERMINATED, m.LoopExited): (m.Phase.ERRORED, "swallowed"),
    (m.Phase.ABORTING, m.LoopExited): (m.Phase.COUNTING, (m.CountNonjoined(value=0.0),)),
    (m.Phase.COUNTING, m.Counted): (m.Phase.SHADOWING, (m.RunMainHooks(round=0),)),
    (m.Phase.SHADOWING, m.HooksDone): (m.Phase.COUNTING, (m.CountNonjoined(),)),
    (m.Phase.SHADOWING, m.HookFailed): (m.Phase.DONE, "abort"),
    (m.Phase.EXCHANGING, m.FailuresExchanged): (m.Phase.TERMINATED, "peer failure"),
    (m.Phase.POST_HOOKS, m.HooksDone): (m.Phase.DONE, ()),
    (m.Phase.POST_HOOKS, m.HookFailed): (m.Phase.DONE, "abort"),
}


def test_legal_table_matches_the_machine() -> None:
    assert set(LEGAL) == set(m.TRANSITIONS)


@pytest.mark.parametrize(
    ("phase", "kind"),
    list(itertools.product(m.Phase, OBSERVATIONS)),
    ids=lambda v: getattr(v, "name", getattr(v, "__name__", str(v))),
)
def test_every_phase_and_observation(phase: m.Phase, kind: type) -> None:
    before = state(phase)
    if phase is m.Phase.ERRORED:
        before = attrs.evolve(before, error=LocalProtocolError("earlier"))
    transition = m.step(before, OBSERVATIONS[kind])
    expected = LEGAL.get((phase, kind))
    if phase is m.Phase.ERRORED:
        # Sticky: the same error again, the state unchanged.
        assert transition.state == before
        assert transition.commands == (m.Raise(error=before.error),)
    elif expected is None or expected[1] == "illegal":
        assert transition.state.phase is m.Phase.ERRORED
        (command,) = transition.commands
        assert isinstance(command, m.Raise)
        assert isinstance(command.error, LocalProtocolError)
        assert phase.name in str(command.error) and kind.__name__ in str(command.error)
        assert transition.state.error is command.error
        # ...and it stays errored whatever comes next.
        for later in OBSERVATIONS.values():
            again = m.step(transition.state, later)
            assert again.state.phase is m.Phase.ERRORED
            assert again.commands == (m.Raise(error=command.error),)
    elif expected[1] == "swallowed":
        assert transition.state.phase is m.Phase.ERRORED
        (command,) = transition.commands
        assert "swallowed the early-termination error" in str(command.error)
    elif expected[1] == "abort":
        assert transition.state.phase is m.Phase.DONE
        assert transition.commands == (
            m.AbortGroup(message=ABORT.message.replace("PHASE", phase.name)),
        )
        assert transition.state.failure == attrs.evolve(FAILURE, rank=3)
    elif expected[1] == "peer failure":
        # The sample state never left its loop (throw mode's in-loop exchange).
        assert transition.state.phase is m.Phase.TERMINATED
        (command,) = transition.commands
        assert isinstance(command.error, PeerFailure)
        assert (command.error.rank, command.error.exc_type) == (9, "ValueError")
        assert str(command.error) == (
            "rank 9 failed inside the Join context with ValueError: bad batch"
        )
    else:
        next_phase, commands = expected
        assert transition.state.phase is next_phase
        assert transition.commands == commands


def test_table_has_no_entry_for_errored_or_done() -> None:
    assert not any(phase in (m.Phase.DONE, m.Phase.ERRORED) for phase, _ in m.TRANSITIONS)


# -- the branches the sample observations above do not take ----------------------


def test_without_signature_entering_skips_the_agreement_check() -> None:
    s = m.initial_state(m.MachineConfig(rank=0))
    t = m.step(s, m.Entered(now=4.0))
    assert t.state.phase is m.Phase.ACTIVE and t.commands == ()
    assert t.state.entered_at == 4.0


def test_agreement_mismatch_raises_with_a_table() -> None:
    other = (("joinables", 2),)
    t = m.step(
        state(m.Phase.AGREEING), m.AgreementChecked(signatures=(SIGNATURE, other, SIGNATURE))
    )
    assert t.state.phase is m.Phase.DONE
    (command,) = t.commands
    assert isinstance(command.error, AgreementError)
    text = str(command.error)
    assert "rank | joinables" in text
    assert "     1 | 2" in text and "     0 | 1" in text


def test_notify_counts_inputs() -> None:
    s = state(m.Phase.ACTIVE)
    for _ in range(3):
        s = m.step(s, m.Notified()).state
    assert s.heartbeats == 3


def test_throw_mode_notify_checks_termination() -> None:
    t = m.step(state(m.Phase.ACTIVE, throw=True), m.Notified())
    assert t.state.phase is m.Phase.CHECKING
    assert t.commands == (m.SendHeartbeat(), m.CheckTermination())


def test_throw_mode_active_rank_raises_torch_message() -> None:
    t = m.step(state(m.Phase.CHECKING, throw=True), m.TerminationChecked(total=1.0))
    assert t.state.phase is m.Phase.TERMINATED
    (command,) = t.commands
    assert isinstance(command.error, EarlyTermination)
    assert isinstance(command.error, RuntimeError)
    assert str(command.error) == (
        "Detected at least one rank that exhausted inputs. Throwing across all ranks."
    )
    # The loop then exits with that error and the context is left.
    done = m.step(t.state, m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE, now=5.0)).state
    assert done.phase is m.Phase.DONE and done.done_at == 5.0


def test_throw_mode_joined_rank_signals_and_raises_torch_message() -> None:
    t = m.step(state(m.Phase.COUNTING, throw=True), m.Counted(total=2.0))
    assert t.state.phase is m.Phase.DONE
    assert t.commands[0] == m.SignalTermination(value=1.0)
    assert str(t.commands[1].error) == "Rank 3 exhausted all inputs."
    assert not t.state.is_last_joiner


def test_throw_mode_last_joiner_runs_post_hooks() -> None:
    t = m.step(state(m.Phase.COUNTING, throw=True), m.Counted(total=0.0))
    assert t.commands == (m.RunPostHooks(is_last_joiner=True),)


def test_count_zero_runs_post_hooks_with_last_joiner_flag() -> None:
    first = m.step(state(m.Phase.COUNTING), m.Counted(total=0.0))
    assert first.state.phase is m.Phase.POST_HOOKS
    assert first.commands == (m.RunPostHooks(is_last_joiner=True),)
    later = m.step(state(m.Phase.COUNTING, is_last_joiner=False), m.Counted(total=0.0))
    assert later.commands == (m.RunPostHooks(is_last_joiner=False),)


def test_loop_exception_propagates_without_collectives() -> None:
    for phase in (m.Phase.ACTIVE, m.Phase.CHECKING):
        t = m.step(state(phase), m.LoopExited(outcome=m.Outcome.INTERRUPTED, now=2.0))
        assert t.state.phase is m.Phase.DONE and t.commands == ()


def test_skew_warning_once_after_threshold() -> None:
    config = m.MachineConfig(rank=1, skew_warn_threshold=3)
    s = attrs.evolve(m.initial_state(config), phase=m.Phase.COUNTING)
    warnings = []
    for _ in range(10):
        t = m.step(s, m.Counted(total=1.0))
        assert t.commands == (m.RunMainHooks(round=t.state.shadow_rounds),)
        t = m.step(t.state, m.HooksDone())
        warnings += [c for c in t.commands if isinstance(c, m.WarnSkew)]
        assert t.commands[-1] == m.CountNonjoined()
        s = t.state
    assert s.shadow_rounds == 10
    (warning,) = warnings
    assert "skew of greater than 3" in warning.message and "rank 1" in warning.message


def test_times_are_recorded_from_observations() -> None:
    s = m.initial_state(m.MachineConfig(rank=0))
    s = m.step(s, m.Entered(now=10.0)).state
    s = m.step(s, m.LoopExited(now=12.0)).state
    s = m.step(s, m.Counted(total=0.0, now=12.5)).state
    s = m.step(s, m.HooksDone(now=13.0)).state
    assert (s.entered_at, s.joined_at, s.done_at) == (10.0, 12.0, 13.0)


def test_decode_tally() -> None:
    assert m.decode_tally(0.0) == (0, 0)
    assert m.decode_tally(7.0) == (7, 0)
    assert m.decode_tally(2 * m.FAILED + 5) == (5, 2)


def test_values_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        m.SendHeartbeat().value = 2.0  # type: ignore[misc]


def test_importing_the_core_imports_no_framework() -> None:
    code = (
        "import sys, joinkit, joinkit._machine;"
        "bad = {'torch', 'numpy', 'mpi4py', 'joinkit.backends', 'joinkit.adapters'}"
        " & set(sys.modules);"
        "assert not bad, bad"
    )
    # From / so that the checkout's folders are not importable by accident.
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd="/")


def test_replaying_batched_notifies_equals_stepping() -> None:
    s = state(m.Phase.ACTIVE)
    assert m.notify_is_batchable(s)
    stepped = s
    for _ in range(5):
        t = m.step(stepped, m.Notified())
        assert t.commands == (m.SendHeartbeat(value=m.ACTIVE),)
        stepped = t.state
    assert m.replay_notifies(s, 5) == stepped
    # Not batchable where Notified does more (throw mode) or is illegal.
    assert not m.notify_is_batchable(state(m.Phase.ACTIVE, throw=True))
    assert not any(
        m.notify_is_batchable(state(phase)) for phase in m.Phase if phase is not m.Phase.ACTIVE
    )


@settings(max_examples=300, deadline=None)
@given(
    rounds=st.integers(0, 12),
    threshold=st.integers(0, 12),
    warned=st.booleans(),
    fused=st.booleans(),
    joined_last=st.booleans(),
    data=st.data(),
)
def test_replaying_plain_shadow_steps_equals_stepping(
    rounds: int, threshold: int, warned: bool, fused: bool, joined_last: bool,
    data: st.DataObject,
) -> None:
    config = m.MachineConfig(rank=1, skew_warn_threshold=threshold, fused_heartbeat=fused)
    base = attrs.evolve(m.initial_state(config), phase=m.Phase.COUNTING, shadow_rounds=rounds,
                        warned_skew=warned, is_last_joiner=joined_last, heartbeats=4)
    limit = m.shadow_rounds_batchable(base)
    assert limit == (sys.maxsize if warned else max(0, threshold - rounds))
    steps = data.draw(st.integers(0, 2 * min(limit, 8) + (1 if limit else 0)))
    count = m.CountNonjoined(value=m.JOINED, fused=fused)
    stepped = base
    for index in range(steps):
        if index % 2 == 0:
            total = float(data.draw(st.integers(1, 64)))
            assert m.count_is_plain(total)
            t = m.step(stepped, m.Counted(total=total, now=float(index)))
            assert t.commands == (m.RunMainHooks(round=stepped.shadow_rounds),)
        else:
            t = m.step(stepped, m.HooksDone(now=float(index)))
            assert t.commands == (count,)  # no skew warning inside the batch
        stepped = t.state
        assert m.shadow_activity(stepped) == (
            f"main hooks of shadow round {stepped.shadow_rounds}" if index % 2 == 0
            else f"counting non-joined ranks (shadow round {stepped.shadow_rounds})")
    assert m.replay_shadow_steps(base, steps) == stepped


def test_count_is_plain_agrees_with_decode_tally() -> None:
    for active in range(0, 70):
        for failed in range(0, 3):
            total = float(active + failed * m.FAILED)
            assert m.count_is_plain(total) == (active > 0 and failed == 0), total


def test_shadow_rounds_are_not_batchable_around_failures_throw_mode_and_other_phases() -> None:
    failure = m.Failure(rank=3, exc_type="ValueError", message="x")
    assert m.shadow_rounds_batchable(state(m.Phase.COUNTING)) == m.SKEW_WARN_THRESHOLD
    assert m.shadow_rounds_batchable(state(m.Phase.COUNTING, failure=failure)) == 0
    assert m.shadow_rounds_batchable(state(m.Phase.COUNTING, failure_seen=True)) == 0
    assert m.shadow_rounds_batchable(state(m.Phase.COUNTING, throw=True)) == 0
    assert not any(m.shadow_rounds_batchable(state(phase))
                   for phase in m.Phase if phase is not m.Phase.COUNTING)
    # At the threshold the next round warns, so it is the machine's to run.
    at = state(m.Phase.COUNTING, shadow_rounds=m.SKEW_WARN_THRESHOLD)
    assert m.shadow_rounds_batchable(at) == 0
    assert m.shadow_rounds_batchable(attrs.evolve(at, warned_skew=True)) == sys.maxsize


# -- failures --------------------------------------------------------------------


def test_failing_rank_counts_with_the_failed_weight() -> None:
    t = m.step(
        state(m.Phase.ACTIVE, heartbeats=4),
        m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE, now=2.0),
    )
    assert t.state.phase is m.Phase.COUNTING
    assert t.commands == (m.CountNonjoined(value=m.FAILED),)
    assert t.state.failure == attrs.evolve(FAILURE, rank=3)  # its own rank
    # It shadows like a joined rank, still contributing FAILED...
    t = m.step(t.state, m.Counted(total=m.FAILED + 2))
    assert t.commands == (m.RunMainHooks(round=0),)
    t = m.step(t.state, m.HooksDone())
    assert t.commands == (m.CountNonjoined(value=m.FAILED),)
    # ...until nobody is active: no post hooks, an exchange of failures.
    t = m.step(t.state, m.Counted(total=m.FAILED))
    assert t.state.phase is m.Phase.EXCHANGING
    assert t.commands == (m.ExchangeFailures(failure=t.state.failure),)
    # It leaves with its own exception (in flight), so nothing is raised.
    t = m.step(t.state, m.FailuresExchanged(failures=(None, None, None, t.state.failure)))
    assert t.state.phase is m.Phase.DONE and t.commands == ()
    assert m.report(t.state).failure == t.state.failure


def test_failure_right_after_heartbeat_first_completes_the_iteration() -> None:
    t = m.step(
        state(m.Phase.ACTIVE),
        m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE, iteration_open=True),
    )
    assert t.state.phase is m.Phase.SHADOWING
    assert t.commands == (m.RunMainHooks(round=0),)
    t = m.step(t.state, m.HooksDone())
    assert t.commands == (m.CountNonjoined(value=m.FAILED),)


def test_active_rank_stops_when_a_heartbeat_shows_a_failure() -> None:
    t = m.step(state(m.Phase.ACTIVE), m.HeartbeatSeen(total=m.FAILED + 3))
    assert t.state.phase is m.Phase.ABORTING
    (command,) = t.commands
    assert isinstance(command.error, PeerAborted)
    for outcome in (m.Outcome.ABORTED, m.Outcome.NORMAL):
        after = m.step(t.state, m.LoopExited(outcome=outcome))
        assert after.state.phase is m.Phase.COUNTING
        assert after.commands == (m.CountNonjoined(value=m.JOINED),)
    # A different exception while leaving makes it a failing rank too.
    after = m.step(t.state, m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE))
    assert after.commands == (m.CountNonjoined(value=m.FAILED),)


def test_joined_rank_that_saw_a_failure_skips_post_hooks() -> None:
    t = m.step(state(m.Phase.COUNTING, joined_at=1.0), m.Counted(total=m.FAILED + 1))
    assert t.state.failure_seen and t.commands == (m.RunMainHooks(round=0),)
    t = m.step(m.step(t.state, m.HooksDone()).state, m.Counted(total=m.FAILED))
    assert t.commands == (m.ExchangeFailures(failure=None),)
    t = m.step(t.state, m.FailuresExchanged(failures=(None, FAILURE)))
    assert t.state.phase is m.Phase.DONE
    assert isinstance(t.commands[0].error, PeerFailure)


def test_exchange_without_any_reported_failure_is_a_peer_error() -> None:
    t = m.step(
        state(m.Phase.EXCHANGING, joined_at=1.0), m.FailuresExchanged(failures=(None, None))
    )
    (command,) = t.commands
    assert type(command.error) is PeerError


def test_throw_mode_failure_is_exchanged_on_every_rank() -> None:
    # The active rank's check shows a failed signaller.
    t = m.step(state(m.Phase.CHECKING, throw=True), m.TerminationChecked(total=m.FAILED))
    assert t.state.phase is m.Phase.EXCHANGING
    assert t.commands == (m.ExchangeFailures(failure=None),)
    # The failing rank signals with the failed weight, then exchanges.
    failing = state(m.Phase.COUNTING, throw=True, failure=FAILURE, joined_at=1.0)
    t = m.step(failing, m.Counted(total=m.FAILED + 2))
    assert t.commands == (
        m.SignalTermination(value=m.FAILED),
        m.ExchangeFailures(failure=FAILURE),
    )


def test_interrupt_leaves_at_once() -> None:
    t = m.step(state(m.Phase.ACTIVE), m.LoopExited(outcome=m.Outcome.INTERRUPTED))
    assert t.state.phase is m.Phase.DONE and t.commands == ()


def test_report_of_a_joined_rank() -> None:
    s = state(m.Phase.COUNTING, heartbeats=5, joined_at=10.0)
    s = m.step(s, m.Counted(total=1.0)).state
    s = m.step(s, m.HooksDone()).state
    s = m.step(s, m.Counted(total=0.0, now=12.5)).state
    s = m.step(s, m.HooksDone(now=13.0)).state
    r = m.report(s)
    assert (r.rank, r.inputs, r.joined_at_round, r.shadow_rounds) == (3, 5, 5, 1)
    assert r.seconds_shadowing == 2.5 and not r.is_last_joiner and r.phase == "DONE"


def test_peer_failure_pickles() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(PeerFailure(1, "ValueError", "x")))
    assert (error.rank, error.exc_type, error.exc_message) == (1, "ValueError", "x")
    assert str(error) == "rank 1 failed inside the Join context with ValueError: x"


# -- fused heartbeat -------------------------------------------------------------


def test_fused_heartbeat_sends_nothing_and_counts_through_the_joinable() -> None:
    config = m.MachineConfig(rank=0, fused_heartbeat=True)
    s = m.step(m.initial_state(config), m.Entered()).state
    t = m.step(s, m.Notified())
    assert t.commands == () and t.state.heartbeats == 1
    assert m.notify_is_batchable(t.state)
    assert m.replay_notifies(s, 1) == t.state
    t = m.step(t.state, m.LoopExited())
    assert t.commands == (m.CountNonjoined(value=m.JOINED, fused=True),)
    t = m.step(t.state, m.Counted(total=1.0))
    t = m.step(t.state, m.HooksDone())
    assert t.commands == (m.CountNonjoined(value=m.JOINED, fused=True),)


def test_fused_heartbeat_cannot_carry_throw_mode() -> None:
    with pytest.raises(ValueError, match="termination check"):
        m.MachineConfig(rank=0, fused_heartbeat=True, throw_on_early_termination=True)
