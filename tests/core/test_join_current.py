"""``Join.current()``: the innermost enabled Join of this thread (what a data source reads)."""

from __future__ import annotations

from typing import Any

from support import Counter

from joinkit import Join
from joinkit.backends.threads import spawn


def _rank(group: Any) -> list[Any]:
    seen: list[Any] = [Join.current()]
    outer, inner = Counter(group), Counter(group)
    with Join([outer]) as join:
        seen.append(Join.current() is join)
        for _ in range(2):  # the same on every rank: the nested Join's entry lines up
            outer()
        seen.append(Join.current().report.inputs)  # type: ignore[union-attr]
        with Join([inner]) as nested:
            seen.append(Join.current() is nested)
            inner()
        seen.append(Join.current() is join)
        with Join([Counter(group)], enable=False):
            seen.append(Join.current() is join)  # a disabled Join is not one
    seen.append(Join.current())
    return seen


def test_current_is_the_innermost_enabled_join_of_the_thread() -> None:
    results = spawn(_rank, 2, timeout=60)
    for rank, seen in enumerate(results):
        assert seen == [None, True, 2, True, True, True, None], (rank, seen)
