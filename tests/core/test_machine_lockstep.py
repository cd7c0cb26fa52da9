"""Property: N machines stepped in lockstep against a fake all-reduce agree.

Each rank runs a tiny pure shell (a generator) around its machine: its loop
over ``inputs[rank]`` items notifies and then does one all-reduce per joinable;
after the loop it carries out the machine's commands, including the standing
heartbeat order and whole drains. Each collective is yielded as ``(kind,
value)``; the scheduler checks that every live rank asked for the same kind at
the same step (otherwise real ranks would hang or mix up collectives) and sends
back the sum. No threads, no backend.

Big worlds: each program may stand for ``weight`` identical ranks (the same
inputs, the same failure), so a handful of programs make a world of up to 2**24
ranks. The scheduler sums like the wire: float32, the identical ranks' part
exactly (``weight * value``), the programs in a random order.
"""

from __future__ import annotations

import random
from collections.abc import Generator
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from joinkit import EarlyTermination, PeerAborted, PeerError, PeerFailure
from joinkit import _machine as m

Collective = tuple[str, Any]
Program = Generator[Collective, Any, dict[str, Any]]


class Boom(ValueError):
    pass


def rank_program(
    rank: int,
    inputs: int,
    throw: bool,
    joinables: int,
    fail_at: int | None = None,
    fail_after_heartbeat: bool = False,
    fused: bool = False,
    world_size: int | None = None,
    reads_totals: bool = True,
) -> Program:
    """One rank: its loop over ``inputs`` items, then the machine's commands.

    With ``fail_at`` the loop body raises ``Boom`` in that iteration, before
    its heartbeat or (``fail_after_heartbeat``) right after it. With ``fused``
    joinable 0's all-reduce carries the heartbeat as a second element. Without
    ``reads_totals`` the rank never reads a heartbeat's sum (a backend without
    ``heartbeat_total``, a fused joinable that does not record it).
    """
    config = m.MachineConfig(
        rank=rank, throw_on_early_termination=throw, fused_heartbeat=fused,
        world_size=world_size,
    )
    state = m.initial_state(config)
    order: m.HeartbeatOrder | None = None
    beats = 0
    since: int | None = None  # collectives since the last heartbeat
    counts = [0.0] * joinables
    result: dict[str, Any] = {"error": None, "post_hooks": [], "main_rounds": 0}
    last_heartbeat: list[float] = []

    def main_hooks(first_shadowed: bool) -> Generator[Collective, Any, None]:
        for j in range(joinables):
            if fused and j == 0:
                if not first_shadowed:  # the fused slot of a joinable that is not a heartbeat
                    yield ("joinable0", (0.0, m.JOINED))
                continue
            yield (f"joinable{j}", 0.0)  # the shadow of its all-reduce
        result["main_rounds"] += 1

    def run(observation: m.Observation) -> Generator[Collective, Any, None]:
        nonlocal state, order, beats
        if beats and not isinstance(observation, m.Notified):
            count, beats = beats, 0
            yield from run(m.Notified(count=count))
        pending: m.Observation | None = observation
        while pending is not None:
            order = None  # a standing order ends with the next observation
            transition = m.step(state, pending)
            state, pending = transition.state, None
            for command in transition.commands:
                if isinstance(command, m.HeartbeatOrder):
                    order = command
                elif isinstance(command, m.SendHeartbeat):
                    last_heartbeat[:] = [(yield ("join", command.value))]
                elif isinstance(command, m.CheckTermination):
                    pending = m.TerminationChecked(total=(yield ("join", command.value)))
                elif isinstance(command, m.Drain):
                    value, rounds = command.first, 0
                    while True:
                        if command.fused:
                            _, total = yield ("joinable0", (0.0, value))
                        else:
                            total = yield ("join", value)
                        if total < command.until or rounds == command.limit:
                            pending = m.Drained(rounds=rounds, total=total)
                            break
                        value = command.value
                        yield from main_hooks(first_shadowed=command.fused)
                        rounds += 1
                elif isinstance(command, m.SignalTermination):
                    yield ("join", command.value)
                elif isinstance(command, m.RunMainHooks):
                    yield from main_hooks(command.first_shadowed)
                    pending = m.HooksDone()
                elif isinstance(command, m.RunPostHooks):
                    result["post_hooks"].append(command.is_last_joiner)
                    pending = m.HooksDone()
                elif isinstance(command, m.ExchangeFailures):
                    failures = yield ("exchange", command.failure)
                    pending = m.FailuresExchanged(failures=failures)
                elif isinstance(command, m.Raise):
                    raise command.error
                else:
                    raise AssertionError(command)

    exit_observation = m.LoopExited()
    try:
        yield from run(m.Entered())
        for i in range(inputs):
            if i == fail_at and not fail_after_heartbeat:
                raise Boom(f"rank {rank} before heartbeat {i}")
            # notify: under the standing order, read the previous heartbeat's
            # sum for an alarm, then send this iteration's heartbeat.
            if order is None:
                yield from run(m.Notified())
                since = 0
            else:
                if reads_totals and last_heartbeat and last_heartbeat[0] >= order.alarm:
                    yield from run(m.HeartbeatSeen(total=last_heartbeat[0]))
                beats += 1
                since = 0
                if not order.fused:
                    last_heartbeat[:] = [(yield ("join", order.value))]
            if i == fail_at and not fused:
                raise Boom(f"rank {rank} after heartbeat {i}")
            for j in range(joinables):
                if fused and j == 0:
                    payload, slot = yield ("joinable0", (1.0, m.ACTIVE))
                    counts[0] += payload
                    since += 1
                    if reads_totals:
                        last_heartbeat[:] = [slot]
                    if i == fail_at:  # the heartbeat went out with this collective
                        raise Boom(f"rank {rank} after heartbeat {i}")
                else:
                    counts[j] += yield (f"joinable{j}", 1.0)
                    since += 1
    except (EarlyTermination, PeerFailure) as error:
        result["error"] = error
        exit_observation = m.LoopExited(outcome=m.Outcome.FAILED, failure=_as_failure(error))
    except PeerAborted as error:
        result["error"] = error
        exit_observation = m.LoopExited(outcome=m.Outcome.ABORTED)
    except Boom as error:
        result["error"] = error
        exit_observation = m.LoopExited(
            outcome=m.Outcome.FAILED,
            failure=_as_failure(error),
            collectives_since_heartbeat=since,
        )
    try:
        yield from run(exit_observation)
    except (EarlyTermination, PeerError) as error:
        result["error"] = error
    result.update(counts=counts, state=state)
    return result


def _as_failure(error: BaseException) -> m.Failure:
    return m.Failure(rank=-1, exc_type=type(error).__name__, message=str(error))


def float32_sum(values: list[float], weights: list[int], rng: random.Random) -> float:
    """The wire's sum: each program's identical ranks exactly, then the programs
    one after another in a random order, all in float32."""
    parts = [np.float32(w) * np.float32(v) for v, w in zip(values, weights, strict=True)]
    rng.shuffle(parts)
    total = np.float32(0.0)
    for part in parts:
        total = np.float32(total + part)
    return float(total)


def run_lockstep(
    inputs: list[int],
    throw: bool,
    joinables: int,
    failures: dict[int, tuple[int, bool]] | None = None,
    fused: bool = False,
    weights: list[int] | None = None,
    reads_totals: bool = True,
    seed: int = 0,
) -> list[dict[str, Any]]:
    failures = failures or {}
    weights = weights or [1] * len(inputs)
    world_size = sum(weights)
    rng = random.Random(seed)
    programs = [
        rank_program(r, n, throw, joinables, *failures.get(r, (None, False)), fused=fused,
                     world_size=world_size, reads_totals=reads_totals)
        for r, n in enumerate(inputs)
    ]
    results: list[dict[str, Any] | None] = [None] * len(programs)
    requests: list[Collective | None] = [None] * len(programs)

    def advance(rank: int, value: Any) -> None:
        try:
            requests[rank] = programs[rank].send(value)
        except StopIteration as stop:
            requests[rank], results[rank] = None, stop.value

    for rank in range(len(programs)):
        advance(rank, None)
    steps = 0
    while any(request is not None for request in requests):
        steps += 1
        # Lockstep: either every rank is in a collective, or every rank is done.
        assert all(request is not None for request in requests), (steps, requests, results)
        kinds = {request[0] for request in requests if request}
        assert len(kinds) == 1, f"ranks disagree at step {steps}: {requests}"
        values = [request[1] for request in requests if request]
        if kinds == {"exchange"}:
            answer: Any = tuple(values)
        elif isinstance(values[0], tuple):  # a fused all-reduce: element-wise
            answer = tuple(float32_sum(list(column), weights, rng)
                           for column in zip(*values, strict=True))
        else:
            answer = float32_sum(values, weights, rng)
        for rank in range(len(programs)):
            advance(rank, answer)
    return [result for result in results if result is not None]


worlds = st.integers(1, 64).flatmap(
    lambda size: st.lists(st.integers(0, 12), min_size=size, max_size=size)
)
# A program's weight: how many identical ranks it stands for.
WEIGHTS = [1, 1, 1, 2, 4095, 4096, 5000, 16384, 100_000, 2**20, 2**24 - 3]


@st.composite
def weights_for(draw: Any, programs: int) -> list[int]:
    weights = draw(st.lists(st.sampled_from(WEIGHTS), min_size=programs, max_size=programs))
    while sum(weights) > m.MAX_WORLD_SIZE:  # at most 2**24 ranks in all
        weights[weights.index(max(weights))] = 1
    return weights


@settings(max_examples=150, deadline=None)
@given(inputs=worlds, joinables=st.integers(0, 3), fused=st.booleans(), data=st.data())
def test_all_ranks_finish_together_and_agree(
    inputs: list[int], joinables: int, fused: bool, data: st.DataObject
) -> None:
    fused = fused and joinables > 0  # the heartbeat needs a collective to ride in
    weights = data.draw(st.one_of(st.just([1] * len(inputs)), weights_for(len(inputs))))
    results = run_lockstep(inputs, throw=False, joinables=joinables, fused=fused,
                           weights=weights, seed=data.draw(st.integers(0, 99)))
    most = max(inputs)
    for rank, (n, result) in enumerate(zip(inputs, results, strict=True)):
        state = result["state"]
        assert state.phase is m.Phase.DONE and result["error"] is None
        assert state.heartbeats == n
        # A joined rank shadows every iteration it missed, once per round.
        assert state.shadow_rounds == result["main_rounds"] == most - n
        # is_last_joiner is true exactly for the ranks with the most inputs.
        assert result["post_hooks"] == [n == most]
        # Each joinable counted, per iteration before joining, the active ranks.
        expected = sum(sum(w for k, w in zip(inputs, weights, strict=True) if k > t)
                       for t in range(n))
        assert result["counts"] == [float(expected)] * joinables, rank


@settings(max_examples=150, deadline=None)
@given(inputs=worlds, joinables=st.integers(0, 3), data=st.data())
def test_throw_mode_raises_on_every_rank(
    inputs: list[int], joinables: int, data: st.DataObject
) -> None:
    weights = data.draw(st.one_of(st.just([1] * len(inputs)), weights_for(len(inputs))))
    results = run_lockstep(inputs, throw=True, joinables=joinables, weights=weights)
    fewest = min(inputs)
    if fewest == max(inputs):
        assert all(r["error"] is None and r["post_hooks"] == [True] for r in results)
        return
    for rank, (n, result) in enumerate(zip(inputs, results, strict=True)):
        assert result["post_hooks"] == []
        if n == fewest:
            assert str(result["error"]) == f"Rank {rank} exhausted all inputs."
        else:
            assert str(result["error"]) == (
                "Detected at least one rank that exhausted inputs. "
                "Throwing across all ranks."
            )
            assert result["state"].heartbeats == fewest + 1
        assert isinstance(result["error"], RuntimeError)


def test_one_rank_world() -> None:
    (result,) = run_lockstep([4], throw=True, joinables=2)
    assert result["post_hooks"] == [True] and result["counts"] == [4.0, 4.0]
    assert attrs.asdict(result["state"])["heartbeats"] == 4


@st.composite
def worlds_with_failures(draw: Any) -> tuple[list[int], dict[int, tuple[int, bool]]]:
    inputs = draw(st.lists(st.integers(0, 10), min_size=1, max_size=16))
    failing = draw(st.sets(st.integers(0, len(inputs) - 1), max_size=len(inputs)))
    failures = {
        rank: (draw(st.integers(0, 10)), draw(st.booleans())) for rank in sorted(failing)
    }
    return inputs, failures


def check_failure_results(inputs: list[int], failures: dict[int, tuple[int, bool]],
                          results: list[dict[str, Any]]) -> None:
    eligible = {r: at for r, (at, _) in failures.items() if at < inputs[r]}
    # A rank stopped by an earlier failure never reaches its own failing
    # iteration, but the earliest failures always happen.
    failed = sorted(r for r, result in enumerate(results) if isinstance(result["error"], Boom))
    if eligible:
        earliest = min(eligible.values())
        assert {r for r, at in eligible.items() if at == earliest} <= set(failed)
    assert set(failed) <= set(eligible)
    for rank, result in enumerate(results):
        state = result["state"]
        assert state.phase is m.Phase.DONE
        if not failed:
            assert result["error"] is None and len(result["post_hooks"]) == 1
            continue
        assert result["post_hooks"] == []  # post hooks never run after a failure
        if rank in failed:
            # The failing rank leaves with its own exception.
            assert state.failure is not None and state.failure.rank == rank
        else:
            error = result["error"]
            assert isinstance(error, PeerFailure), error
            assert error.rank == failed[0] and error.exc_type == "Boom"
            assert [f.rank for f in error.failures] == failed


@settings(max_examples=300, deadline=None)
@given(world=worlds_with_failures(), joinables=st.integers(0, 3), fused=st.booleans(),
       reads_totals=st.booleans(), data=st.data())
def test_a_failure_reaches_every_rank_and_nobody_hangs(
    world: tuple[list[int], dict[int, tuple[int, bool]]], joinables: int, fused: bool,
    reads_totals: bool, data: st.DataObject,
) -> None:
    inputs, failures = world
    fused = fused and joinables > 0
    weights = data.draw(st.one_of(st.just([1] * len(inputs)), weights_for(len(inputs))))
    # run_lockstep asserts that all ranks stay in step and finish together.
    results = run_lockstep(
        inputs, throw=False, joinables=joinables, failures=failures, fused=fused,
        weights=weights, reads_totals=reads_totals, seed=data.draw(st.integers(0, 99)),
    )
    check_failure_results(inputs, failures, results)
    if reads_totals:
        # Active ranks stop at the next notify after the first failure's alarm.
        eligible = {r: at for r, (at, _) in failures.items() if at < inputs[r]}
        if eligible:
            first = min(eligible.values())
            for rank, result in enumerate(results):
                assert result["state"].heartbeats <= first + 2, (rank, first)


@settings(max_examples=200, deadline=None)
@given(world=worlds_with_failures(), joinables=st.integers(0, 3), data=st.data())
def test_failures_in_throw_mode_stay_in_step(
    world: tuple[list[int], dict[int, tuple[int, bool]]], joinables: int, data: st.DataObject
) -> None:
    inputs, failures = world
    weights = data.draw(st.one_of(st.just([1] * len(inputs)), weights_for(len(inputs))))
    results = run_lockstep(inputs, throw=True, joinables=joinables, failures=failures,
                           weights=weights)
    errors = [result["error"] for result in results]
    assert all(result["state"].phase is m.Phase.DONE for result in results)
    if any(error is not None for error in errors):
        assert all(error is not None for error in errors)
        assert all(result["post_hooks"] == [] for result in results)
    peer_failures = [e for e in errors if isinstance(e, PeerFailure)]
    if peer_failures:
        # Everyone who did not fail learned the same failing rank.
        assert len({e.rank for e in peer_failures}) == 1
        assert all(isinstance(e, (PeerFailure, Boom)) for e in errors)


# -- the worlds of issue 10: 4095 to 2**24 ranks --------------------------------------

BIG_WORLDS = [4095, 4096, 5000, 16384, 100_000, 2**24]


@pytest.mark.parametrize("world", BIG_WORLDS)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("failing", ["none", "one", "many"])
def test_big_worlds_healthy_and_failing(world: int, fused: bool, failing: str) -> None:
    # Three programs: a crowd with the most inputs, one rank with fewer, and
    # a crowd that runs out first; with failures, one rank or a whole crowd
    # fails midway (after the heartbeat, so it completes its iteration).
    inputs = [6, 4, 2]
    weights = [world // 2, 1, world - world // 2 - 1]
    failures = {"none": {}, "one": {1: (3, True)}, "many": {0: (1, False)}}[failing]
    results = run_lockstep(inputs, throw=False, joinables=2, failures=failures, fused=fused,
                           weights=weights, seed=world)
    check_failure_results(inputs, failures, results)
    if failing == "none":
        for rank, result in enumerate(results):
            expected = sum(sum(w for k, w in zip(inputs, weights, strict=True) if k > t)
                           for t in range(inputs[rank]))
            assert result["counts"] == [float(expected)] * 2
    else:
        # Every rank learned of it (no rank went on to its last input).
        assert all(r["error"] is not None for r in results)


# -- the round heartbeat: DDP's heartbeat in its gradient all-reduce (issue 34) ------------


def round_program(
    rank: int,
    syncs: list[bool],
    buckets: int,
    fail: tuple[int, int] | None = None,
    world_size: int | None = None,
    reads_totals: bool = True,
) -> Program:
    """One rank whose first joinable carries the heartbeat in its rounds.

    Input ``i`` notifies (which sends nothing) and, where ``syncs[i]``, issues
    one round: ``buckets`` all-reduces ``("bucket{b}", (1.0, heartbeat))``, as
    DDP's backward all-reduces its buckets (``no_sync()`` or a forward without
    a backward issue none). ``fail = (i, b)`` raises ``Boom`` in input ``i``:
    before its notify (``b == -1``), or after ``b`` buckets of its round went
    out (``0 <= b < buckets``, midway through the round when ``b > 0``). A
    joined rank's count is bucket 0 from zeros, its main hook the rest.
    """
    config = m.MachineConfig(rank=rank, fused_heartbeat=True, round_heartbeat=True,
                             world_size=world_size)
    state = m.initial_state(config)
    order: m.HeartbeatOrder | None = None
    beats = 0
    value = m.ACTIVE  # the heartbeat of this rank's next round
    sent = 0  # buckets of the open round that went out
    owed: list[int] = []  # buckets a joined rank still owes in this round
    counts = [0.0] * buckets
    result: dict[str, Any] = {"error": None, "post_hooks": [], "main_rounds": 0,
                              "rounds": 0}
    last_total: list[float] = []

    def bucket(b: int, payload: float) -> Generator[Collective, Any, float]:
        got, total = yield (f"bucket{b}", (payload, value))
        if payload:
            counts[b] += got
        return float(total)

    def main_hooks() -> Generator[Collective, Any, None]:
        nonlocal sent, owed
        rest = list(range(sent, buckets)) if sent else owed
        sent, owed = 0, []
        for b in rest:
            yield from bucket(b, 0.0)
        result["main_rounds"] += 1

    def run(observation: m.Observation) -> Generator[Collective, Any, None]:
        nonlocal state, order, beats, value, owed
        if beats and not isinstance(observation, m.Notified):
            count, beats = beats, 0
            yield from run(m.Notified(count=count))
        pending: m.Observation | None = observation
        while pending is not None:
            order = None
            transition = m.step(state, pending)
            state, pending = transition.state, None
            for command in transition.commands:
                if isinstance(command, m.HeartbeatOrder):
                    assert command.fused
                    order = command
                elif isinstance(command, m.Drain):
                    assert command.fused
                    value, rounds = command.first, 0
                    while True:
                        total = yield from bucket(0, 0.0)  # the count: the round's first bucket
                        owed = list(range(1, buckets))
                        if total < command.until or rounds == command.limit:
                            pending = m.Drained(rounds=rounds, total=total)
                            break
                        yield from main_hooks()
                        value = command.value
                        rounds += 1
                elif isinstance(command, m.RunMainHooks):
                    assert command.first_shadowed
                    yield from main_hooks()
                    pending = m.HooksDone()
                elif isinstance(command, m.RunPostHooks):
                    result["post_hooks"].append(command.is_last_joiner)
                    pending = m.HooksDone()
                elif isinstance(command, m.ExchangeFailures):
                    failures = yield ("exchange", command.failure)
                    pending = m.FailuresExchanged(failures=failures)
                elif isinstance(command, m.Raise):
                    raise command.error
                else:
                    raise AssertionError(command)

    exit_observation = m.LoopExited()
    try:
        yield from run(m.Entered())
        for i, sync in enumerate(syncs):
            if fail == (i, -1):
                raise Boom(f"rank {rank} before input {i}")
            assert order is not None and order.fused
            if reads_totals and last_total and last_total[0] >= order.alarm:
                yield from run(m.HeartbeatSeen(total=last_total[0]))
            beats += 1
            value = order.value  # nothing is sent: the next round carries it
            if not sync:
                if fail is not None and fail[0] == i:
                    raise Boom(f"rank {rank} after input {i}'s forward")
                continue
            for b in range(buckets):
                if fail == (i, b):
                    raise Boom(f"rank {rank} after {b} buckets of input {i}")
                total = yield from bucket(b, 1.0)
                sent = 0 if b == buckets - 1 else b + 1
                if reads_totals:
                    last_total[:] = [total]
            result["rounds"] += 1
    except PeerFailure as error:  # pragma: no cover - no throw mode here
        result["error"] = error
        exit_observation = m.LoopExited(outcome=m.Outcome.FAILED, failure=_as_failure(error))
    except PeerAborted as error:
        result["error"] = error
        exit_observation = m.LoopExited(outcome=m.Outcome.ABORTED)
    except Boom as error:
        result["error"] = error
        exit_observation = m.LoopExited(outcome=m.Outcome.FAILED, failure=_as_failure(error),
                                        round_open=sent > 0)
    try:
        yield from run(exit_observation)
    except PeerError as error:
        result["error"] = error
    result.update(counts=counts, state=state)
    return result


def run_round_lockstep(syncs: list[list[bool]], buckets: int,
                       failures: dict[int, tuple[int, int]] | None = None,
                       weights: list[int] | None = None, reads_totals: bool = True,
                       seed: int = 0) -> list[dict[str, Any]]:
    failures = failures or {}
    weights = weights or [1] * len(syncs)
    world_size = sum(weights)
    programs = [round_program(r, pattern, buckets, failures.get(r), world_size, reads_totals)
                for r, pattern in enumerate(syncs)]
    return _schedule(programs, weights, random.Random(seed))


def _schedule(programs: list[Program], weights: list[int],
              rng: random.Random) -> list[dict[str, Any]]:
    """Step ``programs`` in lockstep (as run_lockstep) and return their results."""
    results: list[dict[str, Any] | None] = [None] * len(programs)
    requests: list[Collective | None] = [None] * len(programs)

    def advance(rank: int, value: Any) -> None:
        try:
            requests[rank] = programs[rank].send(value)
        except StopIteration as stop:
            requests[rank], results[rank] = None, stop.value

    for rank in range(len(programs)):
        advance(rank, None)
    steps = 0
    while any(request is not None for request in requests):
        steps += 1
        assert all(request is not None for request in requests), (steps, requests, results)
        kinds = {request[0] for request in requests if request}
        assert len(kinds) == 1, f"ranks disagree at step {steps}: {requests}"
        values = [request[1] for request in requests if request]
        if kinds == {"exchange"}:
            answer: Any = tuple(values)
        else:
            answer = tuple(float32_sum(list(column), weights, rng)
                           for column in zip(*values, strict=True))
        for rank in range(len(programs)):
            advance(rank, answer)
    return [result for result in results if result is not None]


round_worlds = st.integers(1, 12).flatmap(
    lambda size: st.lists(st.lists(st.booleans(), max_size=10), min_size=size, max_size=size))


@settings(max_examples=200, deadline=None)
@given(syncs=round_worlds, buckets=st.integers(1, 3), data=st.data())
def test_round_heartbeat_all_ranks_finish_together_and_agree(
    syncs: list[list[bool]], buckets: int, data: st.DataObject
) -> None:
    """Whatever each rank's pattern of syncing and non-syncing inputs, every
    rank issues the same rounds: a joined rank meets the active ranks' next
    round whenever it comes, and the last round (nobody active) ends the Join."""
    weights = data.draw(st.one_of(st.just([1] * len(syncs)), weights_for(len(syncs))))
    results = run_round_lockstep(syncs, buckets, weights=weights,
                                 seed=data.draw(st.integers(0, 99)))
    rounds = [sum(pattern) for pattern in syncs]
    most = max(rounds)
    for rank, (pattern, result) in enumerate(zip(syncs, results, strict=True)):
        state = result["state"]
        assert state.phase is m.Phase.DONE and result["error"] is None
        assert state.heartbeats == len(pattern)  # inputs, whatever the rounds
        # A shadow round is one round of the active ranks, not one input.
        assert state.shadow_rounds == result["main_rounds"] == most - rounds[rank]
        # The last joiners: every rank that left after the last round.
        assert result["post_hooks"] == [rounds[rank] == most]
        assert m.report(state).heartbeat == "round"
        # Each bucket summed, in each of this rank's rounds, the ranks in that round.
        expected = sum(sum(w for k, w in zip(rounds, weights, strict=True) if k > t)
                       for t in range(rounds[rank]))
        assert result["counts"] == [float(expected)] * buckets, rank


@st.composite
def round_worlds_with_failures(
        draw: Any) -> tuple[list[list[bool]], int, dict[int, tuple[int, int]]]:
    syncs = draw(st.lists(st.lists(st.booleans(), max_size=8), min_size=1, max_size=10))
    buckets = draw(st.integers(1, 3))
    failing = draw(st.sets(st.integers(0, len(syncs) - 1), max_size=len(syncs)))
    failures = {rank: (draw(st.integers(0, 8)), draw(st.integers(-1, buckets - 1)))
                for rank in sorted(failing)}
    return syncs, buckets, failures


@settings(max_examples=300, deadline=None)
@given(world=round_worlds_with_failures(), reads_totals=st.booleans(), data=st.data())
def test_round_heartbeat_a_failure_reaches_every_rank_and_nobody_hangs(
    world: tuple[list[list[bool]], int, dict[int, tuple[int, int]]], reads_totals: bool,
    data: st.DataObject,
) -> None:
    """A rank that fails before its input, after its forward, or midway through
    its round (it completes the round first): every rank leaves with an error
    naming the same failing ranks, in step (the scheduler checks every bucket)."""
    syncs, buckets, failures = world
    weights = data.draw(st.one_of(st.just([1] * len(syncs)), weights_for(len(syncs))))
    results = run_round_lockstep(syncs, buckets, failures, weights=weights,
                                 reads_totals=reads_totals, seed=data.draw(st.integers(0, 99)))
    # A failure that can happen: its input exists (in an input that does not
    # sync, any bucket number stands for "after its forward").
    eligible = {r for r, (i, _) in failures.items() if i < len(syncs[r])}
    failed = sorted(r for r, result in enumerate(results) if isinstance(result["error"], Boom))
    assert set(failed) <= eligible
    if eligible:
        assert failed  # the first failure in time cannot have been stopped
    for rank, result in enumerate(results):
        state = result["state"]
        assert state.phase is m.Phase.DONE
        if not failed:
            assert result["error"] is None and len(result["post_hooks"]) == 1
            continue
        assert result["post_hooks"] == []
        if rank in failed:
            assert state.failure is not None and state.failure.rank == rank
        else:
            error = result["error"]
            assert isinstance(error, PeerFailure), error
            assert error.rank == failed[0] and error.exc_type == "Boom"
            assert [f.rank for f in error.failures] == failed


def test_round_heartbeat_failing_midway_completes_the_round() -> None:
    """Rank 1 fails after one of three buckets of its second round: it sends the
    other two (from zeros) before it drains, so rank 0's round completes."""
    results = run_round_lockstep([[True] * 4, [True] * 4], 3, failures={1: (1, 1)})
    assert isinstance(results[1]["error"], Boom)
    assert isinstance(results[0]["error"], PeerFailure) and results[0]["error"].rank == 1
    # Rank 0's buckets: both ranks in round 1 (2, 2, 2); rank 1's bucket 0,
    # then its zeros in round 2 (2, 1, 1); rank 1's failing round 3 from zeros
    # (1, 1, 1). Then rank 0 saw the alarm at its next input and stopped.
    assert results[0]["counts"] == [5.0, 4.0, 4.0]
    assert results[0]["state"].heartbeats == 3 and results[0]["state"].stopped_early
