"""The pure join machine: every (phase x observation) pair, and its invariants."""

from __future__ import annotations

import itertools
import subprocess
import sys
from typing import Any

import attrs
import numpy as np
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
from joinkit import _messages as text
from joinkit import _wire as wire

FAILURE = m.Failure(rank=9, exc_type="ValueError", message="bad batch")
SIGNATURE = (("joinables", 1),)
ORDER = m.HeartbeatOrder(value=m.ACTIVE, fused=False, alarm=m.ALARM)
LOST = m.LostRank(rank=1, iterations=4, survivors=(0, 2, 3), detected="ERR_PROC_FAILED in test")
WARN_LOST = m.WarnRankLost(rank=1, message=text.lost_rank_message(LOST, None))

OBSERVATIONS = {
    m.Entered: m.Entered(now=1.0),
    m.SignaturesCompared: m.SignaturesCompared(same=True, now=1.0),
    m.AgreementChecked: m.AgreementChecked(signatures=(SIGNATURE, SIGNATURE), now=1.0),
    m.Notified: m.Notified(now=1.0),
    m.HeartbeatSeen: m.HeartbeatSeen(total=2.0, now=1.0),
    m.TerminationChecked: m.TerminationChecked(total=0.0, now=1.0),
    m.LoopExited: m.LoopExited(now=1.0),
    m.Drained: m.Drained(rounds=0, total=1.0, now=1.0),
    m.HooksDone: m.HooksDone(now=1.0),
    m.HookFailed: m.HookFailed(failure=FAILURE, now=1.0),
    m.FailuresExchanged: m.FailuresExchanged(failures=(None, FAILURE), now=1.0),
    m.RanksLost: m.RanksLost(lost=(LOST,), now=1.0),
}


def state(phase: m.Phase, *, throw: bool = False, fused: bool = False,
          threshold: int = m.SKEW_WARN_THRESHOLD, **fields: object) -> m.JoinState:
    config = m.MachineConfig(rank=3, throw_on_early_termination=throw, signature=SIGNATURE,
                             fused_heartbeat=fused, skew_warn_threshold=threshold)
    return attrs.evolve(m.initial_state(config), phase=phase, **fields)


def drain(first: float = m.JOINED, value: float = m.JOINED, *, fused: bool = False,
          limit: int | None = m.FIRST_DRAIN_BATCH) -> m.Drain:
    # A drain's first batch (the machine's module doc).
    return m.Drain(first=first, value=value, fused=fused, limit=limit,
                   until=m.NOBODY_ACTIVE_BELOW)


ABORT = m.AbortGroup(
    message="rank 3 failed in a join hook (HOOK) with ValueError: bad batch"
)

# The legal pairs with the sample observation above: (next phase, commands).
LEGAL: dict[tuple[m.Phase, type], tuple[m.Phase, Any]] = {
    (m.Phase.IDLE, m.Entered): (
        m.Phase.AGREEING,
        (m.CompareSignatures(digest=m.signature_digest(SIGNATURE)),),
    ),
    (m.Phase.AGREEING, m.SignaturesCompared): (m.Phase.ACTIVE, (ORDER,)),
    # Entering ACTIVE gives the standing heartbeat order...
    (m.Phase.AGREEING, m.AgreementChecked): (m.Phase.ACTIVE, (ORDER,)),
    # ...and every transition that stays there gives it again.
    (m.Phase.ACTIVE, m.Notified): (m.Phase.ACTIVE, (ORDER,)),
    (m.Phase.ACTIVE, m.HeartbeatSeen): (m.Phase.ACTIVE, (ORDER,)),
    (m.Phase.ACTIVE, m.LoopExited): (m.Phase.DRAINING, (drain(),)),
    (m.Phase.CHECKING, m.TerminationChecked): (m.Phase.ACTIVE, ()),
    # The loop left without an exception while a termination check was
    # outstanding: the shell never lets this happen, so it is illegal.
    (m.Phase.CHECKING, m.LoopExited): (m.Phase.ERRORED, "illegal"),
    (m.Phase.TERMINATED, m.LoopExited): (m.Phase.ERRORED, "swallowed"),
    (m.Phase.ABORTING, m.LoopExited): (m.Phase.DRAINING, (drain(),)),
    # The sample drain stopped at its limit with one rank active: that
    # round's hooks are the machine's to command.
    (m.Phase.DRAINING, m.Drained): (m.Phase.SHADOWING, (m.RunMainHooks(round=0),)),
    (m.Phase.SHADOWING, m.HooksDone): (m.Phase.DRAINING, (drain(),)),
    (m.Phase.SHADOWING, m.HookFailed): (m.Phase.DONE, "abort"),
    (m.Phase.EXCHANGING, m.FailuresExchanged): (m.Phase.TERMINATED, "peer failure"),
    (m.Phase.POST_HOOKS, m.HooksDone): (m.Phase.DONE, ()),
    (m.Phase.POST_HOOKS, m.HookFailed): (m.Phase.DONE, "abort"),
    # A rank loss is recorded and warned about; the phase (and the standing
    # order) stays. Read in ACTIVE and at the end only.
    (m.Phase.ACTIVE, m.RanksLost): (m.Phase.ACTIVE, (WARN_LOST, ORDER)),
    (m.Phase.ABORTING, m.RanksLost): (m.Phase.ABORTING, (WARN_LOST,)),
    (m.Phase.TERMINATED, m.RanksLost): (m.Phase.TERMINATED, (WARN_LOST,)),
    (m.Phase.DONE, m.RanksLost): (m.Phase.DONE, (WARN_LOST,)),
}


def test_legal_table_matches_the_machine() -> None:
    assert set(LEGAL) == set(m.TRANSITIONS)
    for key, (next_phase, _) in LEGAL.items():
        assert next_phase in m.TRANSITIONS[key][1], key


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
        hook = "post_hook" if phase is m.Phase.POST_HOOKS else "main_hook"
        assert transition.commands == (
            m.AbortGroup(message=ABORT.message.replace("HOOK", hook)),
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


# -- the round heartbeat (issue 34): the same table, the fused commands ----------------


def round_state(phase: m.Phase, **fields: object) -> m.JoinState:
    config = m.MachineConfig(rank=3, signature=SIGNATURE, fused_heartbeat=True,
                             round_heartbeat=True)
    return attrs.evolve(m.initial_state(config), phase=phase, **fields)


def _as_fused(command: Any) -> Any:
    """A classic transition's command as the round (a fused) heartbeat gives it."""
    if isinstance(command, m.HeartbeatOrder):
        return attrs.evolve(command, fused=True)
    if isinstance(command, m.Drain):
        return attrs.evolve(command, fused=True)
    if isinstance(command, m.RunMainHooks):
        return attrs.evolve(command, first_shadowed=True)
    if isinstance(command, m.Raise):
        return ("Raise", type(command.error), str(command.error))
    return command


@pytest.mark.parametrize(
    ("phase", "kind"),
    list(itertools.product(m.Phase, OBSERVATIONS)),
    ids=lambda v: getattr(v, "name", getattr(v, "__name__", str(v))),
)
def test_every_phase_and_observation_with_a_round_heartbeat(phase: m.Phase, kind: type) -> None:
    """The round heartbeat goes where the classic one goes, with the fused
    order, fused drains and rounds whose first collective the count shadowed;
    the failure branches that differ are tested below."""
    fields: dict[str, Any] = {}
    if phase is m.Phase.ERRORED:
        fields["error"] = LocalProtocolError("earlier")
    classic = m.step(state(phase, **fields), OBSERVATIONS[kind])
    ours = m.step(round_state(phase, **fields), OBSERVATIONS[kind])
    assert ours.state.phase is classic.state.phase
    assert [_as_fused(c) for c in ours.commands] == [_as_fused(c) for c in classic.commands]
    if ours.state.phase is m.Phase.ERRORED and phase is not m.Phase.ERRORED:
        (command,) = ours.commands
        assert isinstance(command, m.Raise) and isinstance(command.error, LocalProtocolError)


def test_a_round_heartbeat_is_a_fused_one() -> None:
    with pytest.raises(ValueError, match="round heartbeat is a fused heartbeat"):
        m.MachineConfig(rank=0, round_heartbeat=True)
    with pytest.raises(ValueError, match="throw mode"):
        m.MachineConfig(rank=0, fused_heartbeat=True, round_heartbeat=True,
                        throw_on_early_termination=True)
    entered = m.step(m.initial_state(m.MachineConfig(rank=0, fused_heartbeat=True,
                                                     round_heartbeat=True)), m.Entered())
    assert entered.commands == (m.HeartbeatOrder(fused=True),)


def test_a_failure_midway_through_a_round_completes_it_first() -> None:
    """round_open (the joinable's word) decides, not the collectives since the
    heartbeat: open -> one completion round of main hooks, then the drain with
    the failure's weight; closed -> the drain at once; unknown -> fail fast
    where the group can abort, else the drain."""
    failed = m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE, round_open=True,
                          collectives_since_heartbeat=5, now=2.0)
    t = m.step(round_state(m.Phase.ACTIVE, heartbeats=4), failed)
    assert t.state.phase is m.Phase.SHADOWING
    assert t.commands == (m.RunMainHooks(round=0, first_shadowed=True),)
    t = m.step(t.state, m.HooksDone(now=3.0))
    assert t.commands == (drain(m.FAILING, m.FAILED, fused=True),)
    closed = attrs.evolve(failed, round_open=False, collectives_since_heartbeat=1)
    t = m.step(round_state(m.Phase.ACTIVE, heartbeats=4), closed)
    assert t.state.phase is m.Phase.DRAINING
    assert t.commands == (drain(m.FAILING, m.FAILED, fused=True),)
    unknown = attrs.evolve(failed, round_open=None)
    s = round_state(m.Phase.ACTIVE, heartbeats=4)
    aborting = attrs.evolve(s, config=attrs.evolve(s.config, can_abort=True))
    t = m.step(aborting, unknown)
    assert t.state.phase is m.Phase.DONE and isinstance(t.commands[0], m.AbortGroup)
    assert m.step(s, unknown).commands == (drain(m.FAILING, m.FAILED, fused=True),)
    # Before any input nothing is open, whatever the joinable says.
    assert m.step(round_state(m.Phase.ACTIVE), unknown).state.phase is m.Phase.DRAINING


def test_the_report_says_how_the_heartbeat_travelled() -> None:
    configs = {"classic": m.MachineConfig(rank=0),
               "fused": m.MachineConfig(rank=0, fused_heartbeat=True),
               "round": m.MachineConfig(rank=0, fused_heartbeat=True, round_heartbeat=True)}
    for kind, config in configs.items():
        report = m.report(m.initial_state(config))
        assert report.heartbeat == kind
        assert m.JoinReport.from_dict(report.to_dict()) == report
    old = m.report(m.initial_state(configs["round"])).to_dict()
    del old["heartbeat"]  # a report written before the field existed
    assert m.JoinReport.from_dict(old).heartbeat == "classic"


def test_table_has_no_entry_for_errored_or_done() -> None:
    assert not any(phase is m.Phase.ERRORED for phase, _ in m.TRANSITIONS)
    # DONE records rank losses read at the end, nothing else.
    assert {kind for phase, kind in m.TRANSITIONS if phase is m.Phase.DONE} == {m.RanksLost}


# -- the table's target phases, over random states and observations ----------------

totals = st.one_of(
    st.sampled_from([0.0, m.FAILED, 3 * m.FAILED, 1.0, 2.0, float(2**24), m.FAILING,
                     m.FAILING + 5.0, 7 * m.FAILING]),
    st.floats(0.0, 2.0**80, allow_nan=False),
)
failures = st.one_of(st.none(), st.just(FAILURE))


@st.composite
def random_states(draw: Any) -> m.JoinState:
    throw = draw(st.booleans())
    fused = not throw and draw(st.booleans())
    config = m.MachineConfig(
        rank=draw(st.integers(0, 5)),
        throw_on_early_termination=throw,
        signature=draw(st.sampled_from([None, SIGNATURE])),
        skew_warn_threshold=draw(st.integers(0, 5)),
        fused_heartbeat=fused,
        round_heartbeat=fused and draw(st.booleans()),
        progress_interval=draw(st.sampled_from([0.0, 1.0, m.PROGRESS_INTERVAL])),
        can_abort=draw(st.booleans()),
    )
    return m.JoinState(
        phase=draw(st.sampled_from([p for p in m.Phase if p is not m.Phase.ERRORED])),
        config=config,
        heartbeats=draw(st.integers(0, 9)),
        shadow_rounds=draw(st.integers(0, 9)),
        is_last_joiner=draw(st.booleans()),
        warned_skew=draw(st.booleans()),
        failure=draw(failures),
        failure_announced=draw(st.booleans()),
        failure_seen=draw(st.booleans()),
        joined_at=draw(st.one_of(st.none(), st.floats(0, 10))),
        drain_batch=draw(st.integers(0, 64)),
        progress_at=draw(st.one_of(st.none(), st.floats(0, 10))),
    )


random_observations = st.one_of(
    st.builds(m.Entered),
    st.builds(m.SignaturesCompared, same=st.booleans()),
    st.builds(m.AgreementChecked, signatures=st.sampled_from([(SIGNATURE,), (SIGNATURE, None)])),
    st.builds(m.Notified, count=st.integers(1, 5)),
    st.builds(m.HeartbeatSeen, total=totals),
    st.builds(m.TerminationChecked, total=totals),
    st.builds(m.LoopExited, outcome=st.sampled_from(m.Outcome), failure=failures,
              collectives_since_heartbeat=st.one_of(st.none(), st.integers(0, 3)),
              round_open=st.one_of(st.none(), st.booleans())),
    st.builds(m.Drained, rounds=st.integers(0, 5), total=st.one_of(st.none(), totals),
              failure=failures, now=st.floats(0, 100)),
    st.builds(m.HooksDone, now=st.floats(0, 100)),
    st.builds(m.HookFailed, failure=st.just(FAILURE)),
    st.builds(m.FailuresExchanged, failures=st.sampled_from([(None,), (None, FAILURE)])),
    st.builds(m.RanksLost, lost=st.sampled_from([(), (LOST,)])),
)


def test_a_subnormal_clock_step_does_not_break_the_drain_batch() -> None:
    """Found by the property test below: a shadow round done a subnormal time
    after the join made the drain rate infinite (an OverflowError in
    ``math.ceil``); the batch then only doubles."""
    config = m.MachineConfig(rank=0, skew_warn_threshold=0, progress_interval=0.0)
    before = m.JoinState(phase=m.Phase.SHADOWING, config=config, drain_batch=1,
                         joined_at=0.0)
    transition = m.step(before, m.HooksDone(now=2.2250738585e-313))
    assert transition.state.phase is m.Phase.DRAINING
    assert transition.state.drain_batch == 2


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(before=random_states(), observation=random_observations)
def test_every_transition_goes_where_its_row_says(
    before: m.JoinState, observation: m.Observation
) -> None:
    transition = m.step(before, observation)
    row = m.TRANSITIONS.get((before.phase, type(observation)))
    if row is None:
        assert transition.state.phase is m.Phase.ERRORED
    else:
        assert transition.state.phase in row[1], (before.phase, observation)
    # Commands that produce a result come one at a time, and last.
    answered = (m.CompareSignatures, m.CheckAgreement, m.CheckTermination, m.Drain, m.RunMainHooks,
                m.RunPostHooks, m.ExchangeFailures)
    kinds = [type(c) for c in transition.commands]
    assert sum(kind in answered for kind in kinds) <= 1
    if any(kind in answered for kind in kinds):
        assert kinds[-1] in answered
    # The standing order is given exactly in ACTIVE outside throw mode.
    ordered = m.HeartbeatOrder in kinds
    if transition.state.phase is m.Phase.ACTIVE and before.phase is not m.Phase.CHECKING:
        assert ordered != before.config.throw_on_early_termination
    else:
        assert not ordered


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(before=random_states(), data=st.data())
def test_evolve_equals_attrs_evolve_over_every_field(
    before: m.JoinState, data: st.DataObject
) -> None:
    values = {
        "phase": st.sampled_from(m.Phase),
        "config": st.builds(m.MachineConfig, rank=st.integers(0, 3)),
        "heartbeats": st.integers(0, 100),
        "shadow_rounds": st.integers(0, 100),
        "is_last_joiner": st.booleans(),
        "warned_skew": st.booleans(),
        "failure": failures,
        "failure_announced": st.booleans(),
        "failure_seen": st.booleans(),
        "stopped_early": st.booleans(),
        "peer_failures": st.sampled_from([(), (FAILURE,)]),
        "drain_batch": st.integers(0, 100),
        "progress_at": st.one_of(st.none(), st.floats(0, 9)),
        "entered_at": st.one_of(st.none(), st.floats(0, 9)),
        "joined_at": st.one_of(st.none(), st.floats(0, 9)),
        "all_joined_at": st.one_of(st.none(), st.floats(0, 9)),
        "done_at": st.one_of(st.none(), st.floats(0, 9)),
        "error": st.one_of(st.none(), st.just(LocalProtocolError("x"))),
        "lost_ranks": st.sampled_from([(), (LOST,)]),
    }
    assert set(values) == {field.name for field in attrs.fields(m.JoinState)}
    names = data.draw(st.sets(st.sampled_from(sorted(values))))
    changes = {name: data.draw(values[name]) for name in names}
    evolved = m._evolve(before, **changes)
    assert type(evolved) is m.JoinState
    assert evolved == attrs.evolve(before, **changes)
    assert vars(evolved) == vars(attrs.evolve(before, **changes))
    assert vars(before) == vars(attrs.evolve(before))  # the original is untouched


# -- the branches the sample observations above do not take ----------------------


def test_without_signature_entering_goes_active_with_the_order() -> None:
    s = m.initial_state(m.MachineConfig(rank=0))
    t = m.step(s, m.Entered(now=4.0))
    assert t.state.phase is m.Phase.ACTIVE and t.commands == (ORDER,)
    assert t.state.entered_at == 4.0
    fused = m.step(m.initial_state(m.MachineConfig(rank=0, fused_heartbeat=True)), m.Entered())
    assert fused.commands == (m.HeartbeatOrder(fused=True),)
    throw = m.step(m.initial_state(m.MachineConfig(rank=0, throw_on_early_termination=True)),
                   m.Entered())
    assert throw.state.phase is m.Phase.ACTIVE and throw.commands == ()


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


def test_agreement_compares_digests_and_gathers_only_on_a_difference() -> None:
    s = m.initial_state(m.MachineConfig(rank=0, signature=SIGNATURE))
    t = m.step(s, m.Entered())
    assert t.state.phase is m.Phase.AGREEING
    assert t.commands == (m.CompareSignatures(digest=m.signature_digest(SIGNATURE)),)
    same = m.step(t.state, m.SignaturesCompared(same=True))
    assert same.state.phase is m.Phase.ACTIVE and same.commands == (ORDER,)
    differ = m.step(t.state, m.SignaturesCompared(same=False))
    assert differ.state.phase is m.Phase.AGREEING
    assert differ.commands == (m.CheckAgreement(signature=SIGNATURE),)
    # The table then names the difference, as before.
    other = (("joinables", 2),)
    error = m.step(differ.state, m.AgreementChecked(signatures=(SIGNATURE, other)))
    assert error.state.phase is m.Phase.DONE
    assert "     1 | 2" in str(error.commands[0].error)  # type: ignore[union-attr]


@pytest.mark.launches
def test_signature_digest_is_stable_and_fits_int64() -> None:
    # The same in every process (str hashes are salted per process).
    code = ("from joinkit import _machine as m; "
            "print(m.signature_digest((('joinables', 1), ('backend', 'TorchGroup'))))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=120).stdout for _ in range(2)}
    assert len(runs) == 1
    assert int(runs.pop()) == m.signature_digest((("joinables", 1), ("backend", "TorchGroup")))
    digests = {m.signature_digest(((name, value),)) for name in ("a", "b")
               for value in (1, 2, True, "x")}
    assert len(digests) == 8
    assert all(0 <= d < 2**63 for d in digests)


def test_heartbeats_sent_under_the_order_are_counted() -> None:
    s = state(m.Phase.ACTIVE)
    for count in (1, 5, 3):
        t = m.step(s, m.Notified(count=count))
        assert t.commands == (ORDER,)
        s = t.state
    assert s.heartbeats == 9


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


def test_throw_mode_joined_rank_counts_once_then_signals_and_raises_torch_message() -> None:
    t = m.step(state(m.Phase.ACTIVE, throw=True), m.LoopExited())
    assert t.commands == (drain(limit=0),)
    t = m.step(t.state, m.Drained(rounds=0, total=2.0))
    assert t.state.phase is m.Phase.DONE
    assert t.commands[0] == m.SignalTermination(value=1.0)
    assert str(t.commands[1].error) == "Rank 3 exhausted all inputs."
    assert not t.state.is_last_joiner


def test_throw_mode_last_joiner_runs_post_hooks() -> None:
    t = m.step(state(m.Phase.DRAINING, throw=True), m.Drained(rounds=0, total=0.0))
    assert t.commands == (m.RunPostHooks(is_last_joiner=True),)


def test_count_zero_runs_post_hooks_with_last_joiner_flag() -> None:
    first = m.step(state(m.Phase.DRAINING), m.Drained(rounds=0, total=0.0))
    assert first.state.phase is m.Phase.POST_HOOKS
    assert first.commands == (m.RunPostHooks(is_last_joiner=True),)
    later = m.step(state(m.Phase.DRAINING), m.Drained(rounds=2, total=0.0, now=3.0))
    assert later.commands == (m.RunPostHooks(is_last_joiner=False),)
    assert later.state.shadow_rounds == 2 and later.state.all_joined_at == 3.0


def test_loop_exception_propagates_without_collectives() -> None:
    for phase in (m.Phase.ACTIVE, m.Phase.CHECKING):
        t = m.step(state(phase), m.LoopExited(outcome=m.Outcome.INTERRUPTED, now=2.0))
        assert t.state.phase is m.Phase.DONE and t.commands == ()


def test_skew_warning_once_after_threshold() -> None:
    # A drain batch of 8 rounds (its 4th, at no known rate: it doubled).
    s = state(m.Phase.ACTIVE, threshold=3, drain_batch=4)
    t = m.step(s, m.LoopExited())
    # The warning's round caps the batch: 3 rounds; the count after them is the machine's.
    assert t.commands == (drain(limit=3),)
    t = m.step(t.state, m.Drained(rounds=3, total=1.0))
    assert t.commands == (m.RunMainHooks(round=3),)
    t = m.step(t.state, m.HooksDone())
    # torch's order: the warning after round threshold + 1, before the next count
    # (a batch that no warning caps any more).
    (warning, command) = t.commands
    assert isinstance(warning, m.WarnSkew) and command == drain(limit=16)
    assert "skew of greater than 3" in warning.message and "rank 3" in warning.message
    t = m.step(t.state, m.Drained(rounds=6, total=0.0))
    assert t.state.shadow_rounds == 10 and t.state.warned_skew
    assert t.commands == (m.RunPostHooks(is_last_joiner=False),)


def test_drain_batches_double_then_end_where_the_progress_line_is_due() -> None:
    t = m.step(state(m.Phase.ACTIVE), m.LoopExited(now=100.0))
    assert t.commands == (drain(limit=16),)  # the first batch
    t = m.step(t.state, m.Drained(rounds=16, total=1.0, now=101.6))
    assert t.commands == (m.RunMainHooks(round=16),)
    t = m.step(t.state, m.HooksDone(now=101.7))
    # 10 rounds a second: 283 more reach the line at 130 s, but a batch at most doubles.
    assert t.commands == (drain(limit=32),) and t.state.drain_batch == 32
    # Later, at the same rate: the batch ends when the line is due (200 rounds
    # at 10/s reach 30 s), whatever the doubling would allow.
    s = state(m.Phase.SHADOWING, joined_at=0.0, shadow_rounds=99, drain_batch=256)
    t = m.step(s, m.HooksDone(now=10.0))
    assert t.commands == (drain(limit=200),) and t.state.drain_batch == 200
    # Past due: one round, so the line comes at the next boundary.
    t = m.step(attrs.evolve(s, progress_at=0.0), m.HooksDone(now=31.0))
    assert t.commands == (drain(limit=1),)


def test_progress_line_once_per_interval_at_batch_boundaries() -> None:
    s = state(m.Phase.DRAINING, joined_at=0.0, heartbeats=1204, shadow_rounds=3000,
              drain_batch=128)
    t = m.step(s, m.Drained(rounds=118, total=2.0, now=29.9))
    assert t.commands == (m.RunMainHooks(round=3118),)  # not yet due
    t = m.step(s, m.Drained(rounds=118, total=2.0, now=42.0))
    progress = m.ReportProgress(rank=3, ended="joined", inputs=1204, seconds=42.0,
                                rounds=3118, active=2)
    assert t.commands == (progress, m.RunMainHooks(round=3118))
    assert t.state.progress_at == 42.0
    assert text.progress_message(progress, [3, 7]) == (
        "rank 3 joined after 1,204 inputs; shadowing rank(s) 3, 7 for 42 s (3,118 rounds)"
    )
    assert text.progress_message(progress, list(range(100))).startswith(
        "rank 3 joined after 1,204 inputs; shadowing rank(s) 0, 1, 2, 3, 4, 5, 6, 7 and 92 "
        "more for 42 s"
    )
    # Without the board's names: the count.
    for names in (None, []):
        assert text.progress_message(progress, names) == (
            "rank 3 joined after 1,204 inputs; shadowing 2 active rank(s) for 42 s "
            "(3,118 rounds)"
        )
    one = attrs.evolve(progress, rounds=1)
    assert text.progress_message(one, [3]).endswith("shadowing rank(s) 3 for 42 s (1 round)")
    # The next line is due one interval after this one.
    s = attrs.evolve(t.state, phase=m.Phase.DRAINING)
    assert m.step(s, m.Drained(rounds=1, total=2.0, now=71.9)).commands == (
        m.RunMainHooks(round=3119),
    )
    (later, _) = m.step(s, m.Drained(rounds=1, total=2.0, now=72.0)).commands
    assert isinstance(later, m.ReportProgress) and later.seconds == 72.0
    # A failing rank says so; a count that a failure's weight swamped has no number.
    failing = attrs.evolve(s, failure=FAILURE, failure_announced=True)
    (line, _) = m.step(failing, m.Drained(rounds=1, total=m.FAILING + 1, now=80.0)).commands
    assert isinstance(line, m.ReportProgress) and line.active is None
    assert text.progress_message(line).startswith("rank 3 failed after 1,204 inputs; shadowing "
                                               "possibly active ranks")


def test_the_progress_interval_can_be_zero() -> None:
    config = m.MachineConfig(rank=0, progress_interval=0.0)
    s = m.step(m.initial_state(config), m.Entered(now=0.0)).state
    s = m.step(s, m.LoopExited(now=0.0)).state
    t = m.step(s, m.Drained(rounds=1, total=1.0, now=0.0))
    assert isinstance(t.commands[0], m.ReportProgress)


def test_times_are_recorded_from_observations() -> None:
    s = m.initial_state(m.MachineConfig(rank=0))
    s = m.step(s, m.Entered(now=10.0)).state
    s = m.step(s, m.LoopExited(now=12.0)).state
    s = m.step(s, m.Drained(rounds=0, total=0.0, now=12.5)).state
    s = m.step(s, m.HooksDone(now=13.0)).state
    assert (s.entered_at, s.joined_at, s.all_joined_at, s.done_at) == (10.0, 12.0, 12.5, 13.0)


def test_values_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        m.SendHeartbeat().value = 2.0  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        drain().limit = 3  # type: ignore[misc]


@pytest.mark.launches
def test_importing_the_core_imports_no_framework() -> None:
    code = (
        "import sys, joinkit, joinkit._machine;"
        "bad = {'torch', 'numpy', 'mpi4py', 'joinkit.backends', 'joinkit.adapters'}"
        " & set(sys.modules);"
        "assert not bad, bad"
    )
    # From / so that the checkout's folders are not importable by accident.
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd="/")


def test_drain_activity_and_stall_message_name_the_round() -> None:
    s = state(m.Phase.DRAINING, heartbeats=4, shadow_rounds=2)
    assert text.drain_activity(s, 0) == "counting non-joined ranks (shadow round 2)"
    assert text.drain_activity(s, 1) == "main hooks of shadow round 2"
    assert text.drain_activity(s, 6) == "counting non-joined ranks (shadow round 5)"
    assert text.stall_message(s, "ignored in a drain", 7, 3.25, 2.0) == (
        "rank 3 made no progress for 3.2 s (timeout 2 s) in phase DRAINING, main hooks of "
        "shadow round 5; it had processed 4 inputs and run 5 shadow rounds"
    )
    post = state(m.Phase.POST_HOOKS, heartbeats=4, shadow_rounds=2)
    assert text.stall_message(post, "post hooks", 0, 9.0, 2.0).endswith(
        "in phase POST_HOOKS, post hooks; it had processed 4 inputs and run 2 shadow rounds"
    )


# -- the wire values: worlds up to 2**24 ranks ------------------------------------

WORLDS = [1, 2, 4095, 4096, 5000, 16384, 100_000, 2**24]


def float32_sum(counts: dict[float, int], order: str = "pairwise") -> float:
    """The 1-element float32 SUM of ``count`` ranks contributing each value."""
    parts = [np.full(count, value, dtype=np.float32) for value, count in counts.items() if count]
    values = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if order == "reversed":
        values = values[::-1].copy()
    if order == "sequential":  # one rank after another (a chain, as a ring reduce)
        return float(np.cumsum(values, dtype=np.float32)[-1]) if len(values) else 0.0
    return float(np.add.reduce(values, dtype=np.float32))  # pairwise (a tree)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("order", ["pairwise", "sequential", "reversed"])
def test_sums_of_worlds_up_to_2_24_ranks_decode(world: int, order: str) -> None:
    failing_counts = sorted({1, 2, world // 3, world - 1, world} - {0})
    # Healthy: the exact active count, no failure; all joined: zero.
    for active in sorted({world, world - 1, 1, 0}):
        total = float32_sum({m.ACTIVE: active, m.JOINED: world - active}, order)
        assert m.decode_tally(total) == (active, False), (world, active, total)
    for failing in failing_counts:
        rest = world - failing
        for active in sorted({rest, rest // 2, 1, 0} - {-1}):
            if active > rest:
                continue
            # The round a rank fails in: an alarm, the active count unknown.
            total = float32_sum({m.ACTIVE: active, m.FAILING: failing,
                                 m.JOINED: rest - active}, order)
            assert total >= m.ALARM and m.decode_tally(total) == (None, True), total
            # Later rounds: with some rank active, its exact count...
            total = float32_sum({m.ACTIVE: active, m.FAILED: failing,
                                 m.JOINED: rest - active}, order)
            if active:
                assert m.decode_tally(total) == (active, False), (world, failing, active)
            else:
                # ...and with nobody active, the failure shows to everyone.
                assert m.decode_tally(total) == (0, True), (world, failing, total)


def test_decode_tally_edges() -> None:
    assert m.decode_tally(0.0) == (0, False)
    assert m.decode_tally(m.FAILED) == (0, True)
    assert m.decode_tally(7.0) == (7, False)
    assert m.decode_tally(float(2**24)) == (2**24, False)
    assert m.decode_tally(m.ALARM) == (None, True)
    assert m.decode_tally(m.ALARM * 0.999) == (int(round(m.ALARM * 0.999)), False)
    assert float(np.float32(m.FAILING)) == m.FAILING and float(np.float32(m.FAILED)) == m.FAILED


def test_a_world_above_2_24_ranks_is_refused() -> None:
    m.MachineConfig(rank=0, world_size=2**24)
    with pytest.raises(ValueError, match=r"at most 2\*\*24 = 16777216 ranks.*has 16777217"):
        m.MachineConfig(rank=0, world_size=2**24 + 1)


def flagged_sum(counts: list[tuple[float, int]], order: str, seed: int = 0) -> float:
    """The float64 SUM of ``n`` ranks contributing ``v`` for each ``(v, n)``, in some order."""
    values = np.concatenate([np.full(n, v, np.float64) for v, n in counts] + [np.zeros(0)])
    if order == "reversed":
        values = values[::-1].copy()
    elif order == "shuffled":
        np.random.default_rng(seed).shuffle(values)
    elif order == "sorted":
        values = np.sort(values)
    elif order == "sorted-down":
        values = np.sort(values)[::-1].copy()
    if order == "pairwise":
        return float(np.add.reduce(values))
    if order == "tree":  # recursive halving, as recursive doubling computes it
        while len(values) > 1:
            if len(values) % 2:
                values = np.append(values, 0.0)
            values = values[0::2] + values[1::2]
        return float(values[0]) if len(values) else 0.0
    return float(np.cumsum(values)[-1]) if len(values) else 0.0


FLAG_ORDERS = ["sequential", "reversed", "pairwise", "tree", "shuffled", "sorted", "sorted-down"]


@pytest.mark.parametrize("order", FLAG_ORDERS)
@pytest.mark.parametrize("world", [2, 4096, 100_000, 2**20])
def test_flags_beside_the_heartbeat_stay_exact_in_a_float64_slot(world: int, order: str) -> None:
    rng = np.random.default_rng(world)
    for _ in range(6):
        failing = int(rng.integers(0, world + 1))
        announced = int(rng.integers(0, failing + 1))  # FAILED; the rest FAILING
        active = int(rng.integers(0, world - failing + 1))
        flagged = int(rng.integers(0, active + 1))
        joined = world - failing - active
        counts = [(m.ACTIVE + wire.HEARTBEAT_FLAG, flagged), (m.ACTIVE, active - flagged),
                  (m.FAILED, announced), (m.FAILING, failing - announced), (m.JOINED, joined)]
        total = flagged_sum(counts, order, seed=failing)
        heartbeat, flags = wire.split_heartbeat_flags(total)
        assert flags == flagged, (world, failing, announced, active, flagged, order)
        if failing > announced:
            assert m.decode_tally(heartbeat) == (None, True)
        elif active:
            assert m.decode_tally(heartbeat) == (active, False)
        else:
            assert m.decode_tally(heartbeat) == (0, failing > 0)


@pytest.mark.slow
def test_flags_at_2_24_ranks() -> None:
    world = 2**24
    cases = [  # (flagged, unflagged active, FAILING, FAILED)
        (world, 0, 0, 0), (0, world, 0, 0), (world - 1, 0, 1, 0), (0, world - 1, 1, 0),
        (world // 2, world // 4, world // 4, 0), (1, 0, world - 1, 0), (0, 0, world, 0),
        (3, 5, world // 2, world // 2 - 8), (0, 0, 0, world),
    ]
    for flagged, unflagged, failing, announced in cases:
        joined = world - flagged - unflagged - failing - announced
        counts = [(m.ACTIVE + wire.HEARTBEAT_FLAG, flagged), (m.ACTIVE, unflagged),
                  (m.FAILING, failing), (m.FAILED, announced), (m.JOINED, joined)]
        for total in (flagged_sum(counts, "pairwise"), flagged_sum(counts, "sequential"),
                      flagged_sum(counts, "reversed")):
            heartbeat, flags = wire.split_heartbeat_flags(total)
            assert flags == flagged, (flagged, unflagged, failing, announced)
            active = flagged + unflagged
            expected = (None, True) if failing else (active, False) if active else (
                0, announced > 0)
            assert m.decode_tally(heartbeat) == expected


# -- failures --------------------------------------------------------------------


def test_failing_rank_announces_once_then_counts_failed() -> None:
    t = m.step(
        state(m.Phase.ACTIVE, heartbeats=4),
        m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE, now=2.0),
    )
    assert t.state.phase is m.Phase.DRAINING
    assert t.commands == (drain(first=m.FAILING, value=m.FAILED),)
    assert t.state.failure == attrs.evolve(FAILURE, rank=3)  # its own rank
    # It shadows like a joined rank (its alarm made the first count huge)...
    t = m.step(t.state, m.Drained(rounds=1000, total=m.FAILING + 2))
    assert t.state.failure_announced
    assert t.commands == (m.RunMainHooks(round=1000),)
    t = m.step(t.state, m.HooksDone())
    # ...from now on with the FAILED weight only...
    assert t.commands[1] == drain(first=m.FAILED, value=m.FAILED, limit=32)
    # ...until nobody is active: no post hooks, an exchange of failures.
    t = m.step(t.state, m.Drained(rounds=3, total=m.FAILED))
    assert t.state.phase is m.Phase.EXCHANGING
    assert t.commands == (m.ExchangeFailures(failure=t.state.failure),)
    # It leaves with its own exception (in flight), so nothing is raised.
    t = m.step(t.state, m.FailuresExchanged(failures=(None, None, None, t.state.failure)))
    assert t.state.phase is m.Phase.DONE and t.commands == ()
    assert m.report(t.state).failure == t.state.failure
    assert m.report(t.state).shadow_rounds == 1004


@pytest.mark.parametrize("fused", [False, True])
def test_failure_right_after_heartbeat_first_completes_the_iteration(fused: bool) -> None:
    # Open: right after a separate heartbeat (nothing since), or right after
    # the fused heartbeat's own collective (one since).
    open_after = 1 if fused else 0
    for since, opened in ((None, False), (open_after, True), (open_after + 1, False)):
        t = m.step(
            state(m.Phase.ACTIVE, fused=fused),
            m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE,
                         collectives_since_heartbeat=since),
        )
        if not opened:
            assert t.commands == (drain(first=m.FAILING, value=m.FAILED, fused=fused),)
            continue
        assert t.state.phase is m.Phase.SHADOWING
        # The fused collective went out before the failure: no shadow of it.
        assert t.commands == (m.RunMainHooks(round=0, first_shadowed=fused),)
        t = m.step(t.state, m.HooksDone())
        assert t.commands == (drain(first=m.FAILING, value=m.FAILED, fused=fused),)


def unknown_place_config(**fields: Any) -> m.MachineConfig:
    return m.MachineConfig(rank=3, signature=SIGNATURE, **{"can_abort": True, **fields})


@pytest.mark.parametrize("throw", [False, True])
def test_failure_after_a_heartbeat_at_an_unknown_place_fails_fast(throw: bool) -> None:
    # No count of the collectives since the heartbeat (a raw communicator):
    # the peers may or may not be inside the iteration, so abort the group.
    config = unknown_place_config(throw_on_early_termination=throw, world_size=4)
    active = attrs.evolve(m.initial_state(config), phase=m.Phase.ACTIVE, heartbeats=2)
    t = m.step(active, m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE, now=5.0))
    assert t.state.phase is m.Phase.DONE and t.state.done_at == 5.0
    assert t.state.failure == attrs.evolve(FAILURE, rank=3)
    (command,) = t.commands
    assert isinstance(command, m.AbortGroup)
    assert command.message.startswith(
        "rank 3 failed inside the Join context with ValueError: bad batch; the Join "
        "cannot tell whether its peers wait in the collectives of that iteration"
    )
    assert m.report(t.state).failure == t.state.failure


@pytest.mark.parametrize(
    ("fields", "heartbeats", "why"),
    [
        ({}, 0, "no heartbeat yet: nothing is open"),
        ({"world_size": 1}, 2, "no peers"),
        ({"can_abort": False}, 2, "nothing to abort with: the best guess"),
    ],
)
def test_failure_at_an_unknown_place_drains_where_it_is_safe_or_nothing_can_abort(
    fields: dict[str, Any], heartbeats: int, why: str
) -> None:
    config = unknown_place_config(**fields)
    active = attrs.evolve(m.initial_state(config), phase=m.Phase.ACTIVE, heartbeats=heartbeats)
    t = m.step(active, m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE))
    assert t.commands == (drain(first=m.FAILING, value=m.FAILED),), why


def test_a_known_place_never_fails_fast() -> None:
    active = attrs.evolve(m.initial_state(unknown_place_config(world_size=4)),
                          phase=m.Phase.ACTIVE, heartbeats=2)
    for since in (0, 1):
        t = m.step(active, m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE,
                                        collectives_since_heartbeat=since))
        assert not any(isinstance(c, m.AbortGroup) for c in t.commands)


def test_messages_after_a_failure_name_it() -> None:
    own = attrs.evolve(FAILURE, rank=3)
    draining = state(m.Phase.DRAINING, heartbeats=2, failure=own, failure_announced=True)
    assert text.stall_message(draining, "", 0, 3.0, 2.0).endswith(
        "; rank 3 had failed inside the Join context with ValueError: bad batch"
    )
    hook = m.Failure(rank=3, exc_type="KeyError", message="'w'")
    t = m.step(draining, m.Drained(rounds=0, total=None, failure=hook))
    assert t.commands == (m.AbortGroup(
        message="rank 3 failed in a join hook (main_hook) with KeyError: 'w', after it "
                "failed inside the Join context with ValueError: bad batch"
    ),)


def test_active_rank_stops_only_at_an_alarm() -> None:
    for total in (1.0, 5000.0, float(2**24), m.FAILED, m.ALARM / 2):
        assert m.step(state(m.Phase.ACTIVE), m.HeartbeatSeen(total=total)).commands == (ORDER,)
    t = m.step(state(m.Phase.ACTIVE), m.HeartbeatSeen(total=m.FAILING + 3))
    assert t.state.phase is m.Phase.ABORTING
    (command,) = t.commands
    assert isinstance(command.error, PeerAborted)
    for outcome in (m.Outcome.ABORTED, m.Outcome.NORMAL):
        after = m.step(t.state, m.LoopExited(outcome=outcome))
        assert after.state.phase is m.Phase.DRAINING
        assert after.commands == (drain(),)
    # A different exception while leaving makes it a failing rank too.
    after = m.step(t.state, m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE))
    assert after.commands == (drain(first=m.FAILING, value=m.FAILED),)


def test_joined_rank_learns_of_a_failure_at_the_final_count() -> None:
    # Whether or not it saw an alarm on the way, the final count decides.
    t = m.step(state(m.Phase.DRAINING, joined_at=1.0), m.Drained(rounds=7, total=2 * m.FAILED))
    assert t.commands == (m.ExchangeFailures(failure=None),)
    t = m.step(t.state, m.FailuresExchanged(failures=(None, FAILURE)))
    assert t.state.phase is m.Phase.DONE
    assert isinstance(t.commands[0].error, PeerFailure)


def test_a_failing_rank_never_runs_post_hooks() -> None:
    t = m.step(state(m.Phase.DRAINING, failure=FAILURE, failure_announced=True),
               m.Drained(rounds=0, total=0.0))
    assert t.commands == (m.ExchangeFailures(failure=FAILURE),)


def test_a_hook_that_raises_in_a_drain_aborts_the_group() -> None:
    t = m.step(state(m.Phase.DRAINING, shadow_rounds=2),
               m.Drained(rounds=3, total=None, failure=FAILURE, now=4.0))
    assert t.state.phase is m.Phase.DONE and t.state.shadow_rounds == 5
    assert t.commands == (ABORT_MAIN,)
    assert m.step(state(m.Phase.DRAINING), m.Drained(rounds=0, total=None)).state.phase is (
        m.Phase.ERRORED)


ABORT_MAIN = m.AbortGroup(message=ABORT.message.replace("HOOK", "main_hook"))


def test_exchange_without_any_reported_failure_is_a_peer_error() -> None:
    t = m.step(
        state(m.Phase.EXCHANGING, joined_at=1.0), m.FailuresExchanged(failures=(None, None))
    )
    (command,) = t.commands
    assert type(command.error) is PeerError


def test_throw_mode_failure_is_exchanged_on_every_rank() -> None:
    # The active rank's check shows the failing rank's alarm (or, never
    # sent but handled, a FAILED weight with nobody signalling).
    for total in (m.FAILING, m.FAILING + 2.0, m.FAILED):
        t = m.step(state(m.Phase.CHECKING, throw=True), m.TerminationChecked(total=total))
        assert t.state.phase is m.Phase.EXCHANGING
        assert t.commands == (m.ExchangeFailures(failure=None),)
    # The failing rank counts with its alarm, signals with it, then exchanges.
    t = m.step(state(m.Phase.ACTIVE, throw=True),
               m.LoopExited(outcome=m.Outcome.FAILED, failure=FAILURE))
    assert t.commands == (drain(first=m.FAILING, value=m.FAILED, limit=0),)
    t = m.step(t.state, m.Drained(rounds=0, total=m.FAILING + 2))
    failure = attrs.evolve(FAILURE, rank=3)
    assert t.commands == (
        m.SignalTermination(value=m.FAILING),
        m.ExchangeFailures(failure=failure),
    )
    # A joined rank counting beside it signals too (whether or not any rank
    # is active, every counting rank does the same) and exchanges.
    t = m.step(state(m.Phase.DRAINING, throw=True), m.Drained(rounds=0, total=m.FAILING))
    assert t.commands == (m.SignalTermination(value=m.ACTIVE), m.ExchangeFailures(failure=None))


def test_interrupt_leaves_at_once() -> None:
    t = m.step(state(m.Phase.ACTIVE), m.LoopExited(outcome=m.Outcome.INTERRUPTED))
    assert t.state.phase is m.Phase.DONE and t.commands == ()


def test_report_of_a_joined_rank() -> None:
    s = state(m.Phase.DRAINING, heartbeats=5, joined_at=10.0)
    s = m.step(s, m.Drained(rounds=1, total=0.0, now=12.5)).state
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


def test_fused_heartbeat_orders_the_slot_value_and_drains_through_the_joinable() -> None:
    config = m.MachineConfig(rank=0, fused_heartbeat=True)
    t = m.step(m.initial_state(config), m.Entered())
    assert t.commands == (m.HeartbeatOrder(value=m.ACTIVE, fused=True),)
    t = m.step(t.state, m.Notified(count=2))
    assert t.commands == (m.HeartbeatOrder(value=m.ACTIVE, fused=True),)
    assert t.state.heartbeats == 2
    t = m.step(t.state, m.LoopExited())
    assert t.commands == (drain(fused=True),)
    t = m.step(t.state, m.Drained(rounds=1000, total=1.0))
    assert t.commands == (m.RunMainHooks(round=1000, first_shadowed=True),)


def test_fused_heartbeat_cannot_carry_throw_mode() -> None:
    with pytest.raises(ValueError, match="termination check"):
        m.MachineConfig(rank=0, fused_heartbeat=True, throw_on_early_termination=True)


def test_split_heartbeat_flags_with_a_smaller_unit_carries_counts() -> None:
    # 3 active ranks counting 5, 0 and 7 in units of 2**24, one rank failing.
    unit = 2.0**24
    total = 3 * m.ACTIVE + (5 + 0 + 7) * unit + m.FAILING
    heartbeat, counts = wire.split_heartbeat_flags(total, unit)
    assert counts == 12 and m.decode_tally(heartbeat) == (None, True)
    assert wire.split_heartbeat_flags(3 * m.ACTIVE + 12 * unit, unit) == (3.0, 12)
