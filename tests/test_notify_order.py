"""Issue 18, part 5 on the threads backend: a first joinable that never notifies.

The cases live in ``tests/notify_cases.py`` (shared with the MPI program,
``tests/mpi_programs/scenarios.py``; the gloo cases are in ``tests/eval_scenarios.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from notify_cases import check_rank, legitimate, silent_first
from support import expected_total

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
