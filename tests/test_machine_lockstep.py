"""Property: N machines stepped in lockstep against a fake all-reduce agree.

Each rank runs a tiny pure shell (a generator) around its machine: its loop
over ``inputs[rank]`` items notifies and then does one all-reduce per joinable;
after the loop it carries out the machine's commands. Each collective is
yielded as ``(kind, value)``; the scheduler checks that every live rank asked
for the same kind at the same step (otherwise real ranks would hang or mix
up collectives) and sends back the sum. No threads, no backend.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from join_core import EarlyTermination
from join_core import _machine as m

Collective = tuple[str, float]
Program = Generator[Collective, float, dict[str, Any]]


def rank_program(rank: int, inputs: int, throw: bool, joinables: int) -> Program:
    config = m.MachineConfig(rank=rank, throw_on_early_termination=throw)
    state = m.step(m.initial_state(config), m.Entered()).state
    counts = [0.0] * joinables
    result: dict[str, Any] = {"error": None, "post_hooks": [], "main_rounds": 0}

    def run(observation: m.Observation) -> Generator[Collective, float, None]:
        nonlocal state
        pending: m.Observation | None = observation
        while pending is not None:
            transition = m.step(state, pending)
            state, pending = transition.state, None
            for command in transition.commands:
                if isinstance(command, m.SendHeartbeat):
                    yield ("join", command.value)
                elif isinstance(command, (m.CheckTermination, m.CountNonjoined)):
                    total = yield ("join", command.value)
                    pending = (
                        m.TerminationChecked(total=total)
                        if isinstance(command, m.CheckTermination)
                        else m.Counted(total=total)
                    )
                elif isinstance(command, m.SignalTermination):
                    yield ("join", command.value)
                elif isinstance(command, m.RunMainHooks):
                    for j in range(joinables):
                        yield (f"joinable{j}", 0.0)  # the shadow of its all-reduce
                    result["main_rounds"] += 1
                    pending = m.HooksDone()
                elif isinstance(command, m.RunPostHooks):
                    result["post_hooks"].append(command.is_last_joiner)
                    pending = m.HooksDone()
                elif isinstance(command, m.Raise):
                    raise command.error
                else:
                    raise AssertionError(command)

    raised = False
    try:
        for _ in range(inputs):
            yield from run(m.Notified())
            for j in range(joinables):
                counts[j] += yield (f"joinable{j}", 1.0)
    except EarlyTermination as error:
        result["error"], raised = error, True
    try:
        yield from run(m.LoopExited(raised=raised))
    except EarlyTermination as error:
        result["error"] = error
    result.update(counts=counts, state=state)
    return result


def run_lockstep(inputs: list[int], throw: bool, joinables: int) -> list[dict[str, Any]]:
    programs = [rank_program(r, n, throw, joinables) for r, n in enumerate(inputs)]
    results: list[dict[str, Any] | None] = [None] * len(programs)
    requests: list[Collective | None] = [None] * len(programs)

    def advance(rank: int, value: float | None) -> None:
        try:
            requests[rank] = programs[rank].send(value)  # type: ignore[arg-type]
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
        total = sum(request[1] for request in requests if request)
        for rank in range(len(programs)):
            advance(rank, total)
    return [result for result in results if result is not None]


worlds = st.integers(1, 64).flatmap(
    lambda size: st.lists(st.integers(0, 12), min_size=size, max_size=size)
)


@settings(max_examples=150, deadline=None)
@given(inputs=worlds, joinables=st.integers(0, 3))
def test_all_ranks_finish_together_and_agree(inputs: list[int], joinables: int) -> None:
    results = run_lockstep(inputs, throw=False, joinables=joinables)
    most = max(inputs)
    for rank, (n, result) in enumerate(zip(inputs, results)):
        state = result["state"]
        assert state.phase is m.Phase.DONE and result["error"] is None
        assert state.heartbeats == n
        # A joined rank shadows every iteration it missed, once per round.
        assert state.shadow_rounds == result["main_rounds"] == most - n
        # is_last_joiner is true exactly for the ranks with the most inputs.
        assert result["post_hooks"] == [n == most]
        # Each joinable counted, per iteration before joining, the active ranks.
        expected = sum(sum(1 for k in inputs if k > t) for t in range(n))
        assert result["counts"] == [float(expected)] * joinables, rank


@settings(max_examples=150, deadline=None)
@given(inputs=worlds, joinables=st.integers(0, 3))
def test_throw_mode_raises_on_every_rank(inputs: list[int], joinables: int) -> None:
    results = run_lockstep(inputs, throw=True, joinables=joinables)
    fewest = min(inputs)
    if fewest == max(inputs):
        assert all(r["error"] is None and r["post_hooks"] == [True] for r in results)
        return
    for rank, (n, result) in enumerate(zip(inputs, results)):
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
