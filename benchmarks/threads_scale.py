"""The threads backend at scale: 64 ranks x 1000 iterations of the Counter.

    python benchmarks/threads_scale.py [ranks [iterations [repeats]]]

Each rank is a thread of this process (``backends.threads.spawn``); rank r has
``iterations`` inputs. Variants, taking turns:

- ``no Join``: the tutorial's loop of one 1-element all-reduce per iteration;
- ``joinkit fused``: the Counter of ``examples/counter.py`` inside a Join (its
  all-reduce carries the heartbeat);
- ``joinkit classic``: the tutorial Counter inside a Join (a separate
  heartbeat per iteration).

The figure is the wall time of the whole ``spawn`` (threads started, Join
entered and left), median over repeats; the target is well under 10 s for the
fused Counter.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import _bench
import numpy as np

from joinkit import Join, Joinable, JoinHook
from joinkit.backends.threads import spawn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from counter import Counter  # noqa: E402  (examples/ is not a package)

TARGET_SECONDS = 10.0


class TutorialCounter(Joinable):
    """The tutorial's Counter (classic heartbeat) over any joinkit group."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.count = 0.0

    def __call__(self) -> None:
        Join.notify_join_context(self)
        t = np.ones(1, dtype=np.float32)
        self.group.all_reduce(t)
        self.count += float(t[0])

    def join_hook(self, **kwargs: Any) -> JoinHook:
        group = self.group

        class Hook(JoinHook):
            def main_hook(self) -> None:
                group.all_reduce(np.zeros(1, dtype=np.float32))

        return Hook()

    @property
    def join_device(self) -> str:
        return "cpu"

    @property
    def join_process_group(self) -> Any:
        return self.group


def no_join(group: Any, iterations: int) -> float:
    count = 0.0
    for _ in range(iterations):
        t = np.ones(1, dtype=np.float32)
        group.all_reduce(t)
        count += float(t[0])
    return count


def fused(group: Any, iterations: int) -> float:
    counter = Counter(group)
    with Join([counter]):
        for _ in range(iterations):
            counter()
    return float(counter.count[0])


def classic(group: Any, iterations: int) -> float:
    counter = TutorialCounter(group)
    with Join([counter]):
        for _ in range(iterations):
            counter()
    return counter.count


def main() -> None:
    ranks = _bench.int_arg(1, 64)
    iterations = _bench.int_arg(2, 1000)
    repeats = _bench.int_arg(3, 3)
    variants = {"no Join": no_join, "joinkit fused": fused, "joinkit classic": classic}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeats):
        names = list(variants)
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            counts = spawn(variants[name], ranks, args=(iterations,), timeout=120.0)
            seconds[name].append(time.perf_counter() - start)
            expected = float(ranks * iterations)
            if any(count != expected for count in counts):
                raise AssertionError(f"{name}: counts {set(counts)}, expected {expected}")
    info = {"ranks": ranks, "iterations": iterations, "repeats": repeats}
    for name, values in seconds.items():
        target = TARGET_SECONDS if name == "joinkit fused" else None
        _bench.record_value(f"threads, {ranks} ranks x {iterations} iterations",
                            name, statistics.median(values), "s", target, info)


if __name__ == "__main__":
    main()
