"""SideCollective on the threads backend: per-iteration side collectives in a Join.

Every scenario runs ranks as threads, whose harness turns a shadow that does
not match its active peers' collective into a ``CollectiveMismatch`` (and a
missing one into a ``RankTimeout``), so a passing run proves the rounds line
up; the numbers are checked against closed forms.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import Counter, expected_total

from joinkit import Join, LocalProtocolError, SideCollective
from joinkit.backends.threads import ThreadGroup, spawn

TIMEOUT = 20.0


def _summer(group: ThreadGroup, **kwargs: Any) -> SideCollective:
    """An all-reduce (sum) of one float64: a joined rank contributes 0."""

    def fn(value: float) -> float:
        buf = np.array([value], dtype=np.float64)
        group.all_reduce(buf)
        return float(buf[0])

    return SideCollective(fn, shadow=lambda: fn(0.0), **kwargs)


def _expected_sums(inputs: list[int], rank: int) -> list[float]:
    """What rank's all-reduces of ``rank + 1`` per iteration return, iteration by iteration."""
    return [float(sum(r + 1 for r, n in enumerate(inputs) if n > t)) for t in range(inputs[rank])]


@pytest.mark.parametrize("order", ["counter-first", "side-first", "side-alone", "two-sides"])
@pytest.mark.parametrize("inputs", [[3], [2, 5], [0, 4, 1], [6, 0, 0, 3]])
def test_lockstep_uneven_inputs(order: str, inputs: list[int]) -> None:
    def rank_fn(group: ThreadGroup) -> dict[str, Any]:
        counter = Counter(group)
        if order == "side-alone":
            side = _summer(group, process_group=group, name="loss")
            joinables: list[Any] = [side]
        else:
            side = _summer(group, name="loss")
            joinables = [side, counter] if order == "side-first" else [counter, side]
        barrier = SideCollective(group.barrier, name="barrier")
        if order == "two-sides":
            joinables.append(barrier)
        sums = []
        with Join(joinables) as join:
            for _ in range(inputs[group.rank]):
                if order == "side-first":
                    sums.append(side(group.rank + 1.0))
                    counter()
                else:
                    if order != "side-alone":
                        counter()
                    sums.append(side(group.rank + 1.0))
                if order == "two-sides":
                    barrier()
        return {"sums": sums, "count": counter.count, "side_rounds": side.shadow_rounds,
                "barrier_rounds": barrier.shadow_rounds, "state": join.state,
                "group": join.process_group is group}

    results = spawn(rank_fn, len(inputs), timeout=TIMEOUT)
    most = max(inputs)
    for rank, result in enumerate(results):
        assert result["sums"] == _expected_sums(inputs, rank)
        if order != "side-alone":
            assert result["count"] == expected_total(inputs, rank)
        rounds = most - inputs[rank]
        assert result["side_rounds"] == rounds
        assert result["barrier_rounds"] == (rounds if order == "two-sides" else 0)
        assert result["state"].shadow_rounds == rounds
        assert result["state"].heartbeats == inputs[rank]
        assert result["group"]


def test_the_first_side_collective_sends_the_heartbeat() -> None:
    def rank_fn(group: ThreadGroup) -> list[int]:
        seen = []
        side = _summer(group, process_group=group)
        # The only joinable: if it sent no heartbeat, the joined rank 1 would
        # count 0 active ranks at once and leave while rank 0 still iterates.
        with Join([side]) as join:
            for _ in range(3 if group.rank == 0 else 1):
                side(1.0)
                seen.append(join.state.heartbeats)
        return seen

    assert spawn(rank_fn, 2, timeout=TIMEOUT) == [[1, 2, 3], [1]]


def test_outside_any_join_it_just_calls_fn() -> None:
    side = SideCollective(lambda a, b=0: a + b, shadow=lambda: None, name="add")
    assert side(2, b=3) == 5
    assert repr(side) == "SideCollective('add')"
    assert side.join_process_group is None and side.join_device is None
    plain = SideCollective(len)
    assert plain.name == "len" and plain([1, 2]) == 2  # no Join: no shadow needed


def test_enable_false_just_calls_fn() -> None:
    def rank_fn(group: ThreadGroup) -> list[float]:
        side = _summer(group)
        with Join([Counter(group), side], enable=False):
            return [side(1.0)]

    assert spawn(rank_fn, 2, timeout=TIMEOUT) == [[2.0], [2.0]]


def test_called_inside_a_join_that_does_not_list_it_is_an_error() -> None:
    def rank_fn(group: ThreadGroup) -> None:
        counter, side = Counter(group), _summer(group, name="log_loss")
        with Join([counter]):
            counter()
            side(1.0)

    with pytest.raises(LocalProtocolError,
                       match=r"SideCollective\('log_loss'\) was called inside a `with "
                             r"Join\(...\)` block that does not list it.*Add it to the "
                             r"Join's list"):
        spawn(rank_fn, 2, timeout=TIMEOUT)


def test_arguments_without_a_shadow_are_an_error_before_any_collective() -> None:
    calls = []

    def rank_fn(group: ThreadGroup) -> None:
        side = SideCollective(lambda value: calls.append(value), name="report")
        with Join([Counter(group), side]):
            side(1.0)

    with pytest.raises(LocalProtocolError, match=r"called with arguments but has no shadow.*"
                                                 r"shadow="):
        spawn(rank_fn, 2, timeout=TIMEOUT)
    assert calls == []


def test_default_shadow_is_fn_without_arguments() -> None:
    inputs = [1, 4]

    def rank_fn(group: ThreadGroup) -> int:
        counter, barrier = Counter(group), SideCollective(group.barrier)
        with Join([counter, barrier]):
            for _ in range(inputs[group.rank]):
                counter()
                barrier()
        return barrier.shadow_rounds

    assert spawn(rank_fn, 2, timeout=TIMEOUT) == [3, 0]


def test_a_shadow_may_call_its_own_wrapper() -> None:
    inputs = [5, 2]

    def rank_fn(group: ThreadGroup) -> list[float]:
        sums: list[float] = []

        def fn(value: float) -> float:
            buf = np.array([value])
            group.all_reduce(buf)
            return float(buf[0])

        side: SideCollective = SideCollective(fn, shadow=lambda: side(0.0), process_group=group)
        with Join([side]):
            for _ in range(inputs[group.rank]):
                sums.append(side(1.0))
        return sums

    assert spawn(rank_fn, 2, timeout=TIMEOUT) == [[2.0, 2.0, 1.0, 1.0, 1.0], [2.0, 2.0]]


def test_alone_without_a_group_is_a_clear_error() -> None:
    side = SideCollective(lambda: None, name="sync")
    with pytest.raises(ValueError, match=r"SideCollective\('sync'\) follows the process group.*"
                                         r"process_group=group"):
        Join([side])


def test_its_own_group_must_be_the_joins() -> None:
    def rank_fn(group: ThreadGroup) -> None:
        other = object()
        with pytest.raises(ValueError, match="multiple process groups"):
            Join([Counter(group), _summer(group, process_group=other, name="x")])

    spawn(rank_fn, 2, timeout=TIMEOUT)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        SideCollective(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"shadow=\.\.\.\) must be callable"):
        SideCollective(len, shadow=3)  # type: ignore[arg-type]


def test_a_shadow_that_raises_fails_every_rank_without_a_hang() -> None:
    def rank_fn(group: ThreadGroup) -> None:
        def shadow() -> None:
            raise RuntimeError("shadow broke")

        side = SideCollective(group.barrier, shadow=shadow, process_group=group)
        with Join([side]):  # follows nobody: its own group
            for _ in range(2 if group.rank == 0 else 0):
                side()

    with pytest.raises(RuntimeError, match="shadow broke"):
        spawn(rank_fn, 2, timeout=TIMEOUT)


def test_the_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "side-collectives.md").read_text()
    block = page.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "docs/side-collectives.md", "exec"), {"__name__": "docs"})
    assert capsys.readouterr().out == "[[2.0, 2.0], [2.0, 2.0, 1.0, 1.0, 1.0], []]\n"
