"""The threads backend with many ranks: it completes, and completes correctly.

No timing is asserted here (``benchmarks/threads_scale.py`` measures it); these
guard the relay that wakes a slot's waiting ranks one after another (see
``backends/threads/_world.py``): every rank must still wake, also when some of them
wait for an async call only later.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from joinkit import Join
from joinkit.backends.threads import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from counter import Counter  # noqa: E402  (examples/ is not a package)

pytestmark = pytest.mark.slow

RANKS = 64
INPUTS = 1000


def test_64_ranks_count_1000_inputs_inside_a_join() -> None:
    """Rank r has INPUTS - r inputs; the Counter's counts come out exact."""
    inputs = [INPUTS - rank for rank in range(RANKS)]

    def worker(group: Any) -> tuple[float, float]:
        counter = Counter(group)
        with Join([counter], sync_max_count=True):
            for _ in range(inputs[group.rank]):
                counter()
        return float(counter.count[0]), float(counter.max_count[0])

    results = spawn(worker, RANKS, timeout=120.0)
    for rank, (count, max_count) in enumerate(results):
        assert count == sum(min(n, inputs[rank]) for n in inputs)
        assert max_count == sum(inputs)


def test_a_rank_that_waits_for_an_async_call_later_holds_up_nobody() -> None:
    """Odd ranks start an all-reduce async and wait for it only after a barrier,
    which needs the even ranks, which block in that all-reduce: they must be
    woken without the odd ranks' help."""

    def worker(group: Any) -> list[float]:
        results = []
        for step in range(20):
            buf = np.full(2, float(group.rank + step), dtype=np.float32)
            if group.rank % 2:
                work = group.all_reduce(buf, async_op=True)
                group.barrier()
                work.wait()
            else:
                group.all_reduce(buf)
                group.barrier()
            results.append(float(buf[0]))
        return results

    size = 16
    for results in spawn(worker, size, timeout=30.0):
        assert results == [sum(range(size)) + size * step for step in range(20)]
