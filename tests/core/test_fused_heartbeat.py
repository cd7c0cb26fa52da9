"""The fused heartbeat on the threads backend: one collective per iteration."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from joinkit import EarlyTermination, Join, PeerFailure
from joinkit.backends.threads import ThreadGroup, spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from counter import Counter, CounterJoinHook  # noqa: E402

sys.path.pop(0)

TIMEOUT = 20.0


class ClassicHook(CounterJoinHook):
    def main_hook(self) -> None:
        self.counter.group.all_reduce(np.zeros(1, dtype=np.float32))


class ClassicCounter(Counter):
    """The tutorial's Counter: a separate heartbeat all-reduce per iteration."""

    join_fuses_heartbeat = False

    def __call__(self) -> None:
        Join.notify_join_context(self)
        t = np.ones(1, dtype=np.float32)
        self.group.all_reduce(t)
        self.count += t

    def join_hook(self, **kwargs: Any) -> CounterJoinHook:
        return ClassicHook(self, kwargs.get("sync_max_count", False))


def run_counter(group: ThreadGroup, counter_type: type, inputs: list[int]) -> dict[str, Any]:
    counter = counter_type(group)
    with Join([counter], sync_max_count=True) as join:
        before = group._calls
        for _ in range(inputs[group.rank]):
            counter()
        in_loop = group._calls - before
    return {
        "count": float(counter.count[0]),
        "max": float(counter.max_count[0]),
        "in_loop": in_loop,
        "report": join.report,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fused_counter_matches_classic_with_half_the_collectives(world_size: int) -> None:
    inputs = [3 + 2 * r for r in range(world_size)]
    fused = spawn(run_counter, world_size, args=(Counter, inputs), timeout=TIMEOUT)
    classic = spawn(run_counter, world_size, args=(ClassicCounter, inputs), timeout=TIMEOUT)
    for rank in range(world_size):
        expected = sum(sum(1 for n in inputs if n > t) for t in range(inputs[rank]))
        assert fused[rank]["count"] == classic[rank]["count"] == expected
        assert fused[rank]["max"] == classic[rank]["max"] == sum(inputs)
        # One collective per iteration instead of two (heartbeat + all-reduce).
        assert fused[rank]["in_loop"] == inputs[rank]
        assert classic[rank]["in_loop"] == 2 * inputs[rank]
        assert fused[rank]["report"].inputs == inputs[rank]
        assert fused[rank]["report"].shadow_rounds == max(inputs) - inputs[rank]
        assert fused[rank]["report"].is_last_joiner == (inputs[rank] == max(inputs))


@pytest.mark.parametrize("after_collective", [False, True])
def test_fused_counter_failure_is_seen_at_the_next_iteration(after_collective: bool) -> None:
    def rank_fn(group: ThreadGroup) -> dict[str, Any]:
        counter = Counter(group)
        processed = 0
        try:
            with Join([counter]):
                for i in range(50):
                    if group.rank == 1 and i == 3 and not after_collective:
                        raise KeyError("bad shard")
                    counter()
                    processed += 1
                    if group.rank == 1 and i == 2 and after_collective:
                        raise KeyError("bad shard")
        except (PeerFailure, KeyError) as error:
            return {"error": error, "processed": processed}
        return {"error": None, "processed": processed}

    results = spawn(rank_fn, 3, timeout=TIMEOUT)
    assert isinstance(results[1]["error"], KeyError)
    for rank in (0, 2):
        error = results[rank]["error"]
        assert isinstance(error, PeerFailure)
        assert (error.rank, error.exc_type) == (1, "KeyError")
        # Rank 1 failed before input 3; its peers stopped at their next
        # iteration instead of running all 50 inputs.
        assert results[rank]["processed"] == 4


def test_fused_joinable_in_throw_mode_falls_back_to_the_classic_check() -> None:
    def rank_fn(group: ThreadGroup) -> str:
        counter = Counter(group)
        with pytest.raises(EarlyTermination) as caught:
            with Join([counter], throw_on_early_termination=True):
                for _ in range(2 + 3 * group.rank):
                    counter()
        return str(caught.value)

    assert spawn(rank_fn, 2, timeout=TIMEOUT) == [
        "Rank 0 exhausted all inputs.",
        "Detected at least one rank that exhausted inputs. Throwing across all ranks.",
    ]


def test_fused_flag_without_fused_shadow_is_rejected() -> None:
    class NoShadowHook(CounterJoinHook):
        fused_shadow = None  # type: ignore[assignment]

    class Broken(Counter):
        def join_hook(self, **kwargs: Any) -> CounterJoinHook:
            return NoShadowHook(self, False)

    def rank_fn(group: ThreadGroup) -> None:
        with pytest.raises(TypeError, match="has no fused_shadow"):
            Join([Broken(group)])

    spawn(rank_fn, 1, timeout=TIMEOUT)
