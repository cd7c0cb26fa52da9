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
