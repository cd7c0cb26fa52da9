"""Issue 18, part 5 on the threads backend: a first joinable that never notifies.

The cases live in ``tests/support/notify_cases.py`` (shared with the MPI program,
``tests/backends/mpi/programs/mpi_scenarios.py``; the gloo cases are in
``tests/adapters/torch/programs/eval_scenarios.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from support import expected_total
from support.notify_cases import check_rank, legitimate, silent_first

from joinkit.backends.threads import ThreadGroup, spawn

TIMEOUT = 20.0
COUNTS = {2: [[3, 5], [0, 4], [1, 1]], 3: [[3, 5, 4], [0, 4, 2], [2, 2, 2]]}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("options", [{}, {"check_agreement": False},
                                     {"throw_on_early_termination": True}])
@pytest.mark.parametrize("every", [0, 2])
def test_every_rank_gets_a_clear_error(world: int, options: dict[str, Any], every: int) -> None:
    for counts in COUNTS[world]:
        if every and max(counts) < 2:
            continue
        if options.get("throw_on_early_termination") and min(counts) == 0:
            continue  # a rank with no input ends a throw-mode Join first (EarlyTermination)

        def rank_fn(group: ThreadGroup, counts: list[int] = counts) -> Any:
            return silent_first(group, counts, every, **options)

        errors = spawn(rank_fn, world, timeout=TIMEOUT)
        for error in errors:
            check_rank(error)


@pytest.mark.parametrize("world", [2, 3])
def test_legitimate_patterns_are_quiet(world: int) -> None:
    for counts in COUNTS[world]:
        results = spawn(lambda group, counts=counts: legitimate(group, counts), world,
                        timeout=TIMEOUT)
        for rank, result in enumerate(results):
            total = expected_total(counts, rank)
            assert result == {"first": total, "twice": 2 * total, "in_hook": total}


@pytest.mark.parametrize("throw", [False, True])
def test_before_next_heartbeat_runs_once_before_the_first_joinables_notify(throw: bool) -> None:
    """A later joinable's check runs right before the next heartbeat, once; the
    heartbeats (and so the totals) are exactly those of a plain loop."""
    from support import AllReducer

    from joinkit import Join

    counts = [4, 4] if throw else [3, 5]

    def rank_fn(group: ThreadGroup) -> Any:
        first, later = AllReducer(group), AllReducer(group)
        events: list[str] = []
        with Join([first, later], throw_on_early_termination=throw) as join:
            for i in range(counts[group.rank]):
                events.append(f"notify {i}")
                first()
                later()
                assert join.before_next_heartbeat(lambda i=i: events.append(f"check {i}"))
        taken = join.before_next_heartbeat(lambda: None)  # after the loop: not taken
        return first.total, later.total, events, taken, join.state.heartbeats

    for rank, (first, later, events, taken, beats) in enumerate(
            spawn(rank_fn, 2, timeout=TIMEOUT)):
        n = counts[rank]
        assert first == later == expected_total(counts, rank)
        # "notify i" is logged before first() runs the check of iteration i - 1.
        expected = ["notify 0"] + [e for i in range(1, n) for e in (f"notify {i}",
                                                                     f"check {i - 1}")]
        assert events == expected
        assert taken is False and beats == n


class _FusedCounter:
    """examples/counter.py's Counter over a ThreadGroup: all-reduces [1, heartbeat]."""

    @staticmethod
    def make(group: ThreadGroup, events: list[str]) -> Any:
        import numpy as np

        from joinkit import Join, Joinable, JoinHook

        class Hook(JoinHook):
            def fused_shadow(self, heartbeat: float) -> float:
                t = np.array([0.0, heartbeat])
                group.all_reduce(t)
                return float(t[1])

        class FusedCounter(Joinable):
            join_fuses_heartbeat = True

            def __init__(self) -> None:
                super().__init__()
                self.count = 0.0

            def __call__(self) -> None:
                t = np.array([1.0, Join.fused_heartbeat(self)])
                events.append("collective")
                group.all_reduce(t)
                Join.record_heartbeat_total(self, float(t[1]))
                self.count += float(t[0])

            def join_hook(self, **kwargs: Any) -> JoinHook:
                return Hook()

            @property
            def join_device(self) -> Any:
                return group.device

            @property
            def join_process_group(self) -> Any:
                return group

        return FusedCounter()


@pytest.mark.parametrize("options", [{}, {"check_agreement": False}])
def test_before_next_heartbeat_runs_in_a_fused_heartbeat(options: dict[str, Any]) -> None:
    """With a first joinable that fuses its heartbeat, a waiting check runs in
    its Join.fused_heartbeat, before its collective, once; the counts are a
    plain loop's (the slot carries the right value while a check waits); a
    check that raises gives that rank its error and the peer PeerFailure."""
    from support import AllReducer

    from joinkit import Join, LocalProtocolError, PeerFailure

    counts = [3, 5]

    def rank_fn(group: ThreadGroup, fail: bool) -> Any:
        events: list[str] = []
        first, later = _FusedCounter.make(group, events), AllReducer(group)

        def check(i: int) -> None:
            events.append(f"check {i}")
            if fail and i == 1:
                raise LocalProtocolError("check 1 refused")

        try:
            with Join([first, later], **options) as join:
                for i in range(counts[group.rank]):
                    events.append(f"notify {i}")
                    first()
                    later()
                    assert join.before_next_heartbeat(lambda i=i: check(i))
        except (LocalProtocolError, PeerFailure) as error:
            return type(error).__name__, str(error)
        return first.count, later.total, events

    for rank, (count, total, events) in enumerate(
            spawn(lambda group: rank_fn(group, False), 2, timeout=TIMEOUT)):
        n = counts[rank]
        assert count == total == expected_total(counts, rank)
        expected = ["notify 0", "collective"] + [
            e for i in range(1, n) for e in (f"notify {i}", f"check {i - 1}", "collective")]
        assert events == expected
    for name, message in spawn(lambda group: rank_fn(group, True), 2, timeout=TIMEOUT):
        assert name in ("LocalProtocolError", "PeerFailure") and "check 1 refused" in message
