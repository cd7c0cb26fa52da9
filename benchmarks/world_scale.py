"""What entering a Join, gathering its report and a stall diagnostic cost as the world grows.

    python benchmarks/world_scale.py [max ranks [repeats [max ranks of the fallback]]]

Threads backend (``backends.threads.spawn``), worlds of 64, 128, ... up to
``max ranks`` (default 4096). Per world:

- ``entry``: from a barrier until the last rank is inside ``with Join(...)``
  (the agreement check: one ``all_agree`` of a settings digest);
- ``report``: from a barrier until the last rank has returned from
  ``gather_report(0)`` (a gather to rank 0 only);
- ``diagnostic``: rank 0 formats the stall diagnostic's peer lines
  (``peer_status()`` and ``peer_status_lines``) once every rank has passed
  the report: the time, and how many lines it gave (one per distinct state;
  one per rank before).

``entry, all_gather`` and ``report, all_gather`` are the same through a join
backend without ``all_agree``/``gather_object`` (what the Join did before, and
what a third-party backend without them still gets): every rank unpickles
every rank's object, O(world size) per rank and O(world size**2) for the
threads backend, so they run up to ``max ranks of the fallback`` only
(default 1024). Figures are the medians over repeats (default 3), in ms.

Measured 2026-11-23 on the 2-core shared dev machine (load average 8-14,
other jobs running), ``python benchmarks/world_scale.py 4096 3 1024`` and
``... 4096 1 4096``; at 4096 ranks: entry 0.67 s (all_gather: 5.4 s), report
0.30 s (all_gather: 198 s), diagnostic 51 ms and 2 lines (was 4096 lines).
The table is in ``benchmarks/notes.md`` ("Costs that grow with the world").
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import _bench

from joinkit import Join, Joinable, JoinHook, backends
from joinkit._reporting import peer_status_lines
from joinkit.backends.threads import ThreadGroup, spawn

BENCH = "world scale, threads"


class Bare:
    """A join backend over a ThreadGroup without the optional object
    collectives: the Join falls back to ``all_gather_object``."""

    def __init__(self, group: ThreadGroup) -> None:
        self.group = group
        self.rank = group.rank
        self.world_size = group.world_size
        self.heartbeat = group.heartbeat
        self.heartbeat_total = group.heartbeat_total
        self.count = group.count
        self.all_gather_object = group.all_gather_object
        self.post_status = group.post_status


backends.register(Bare, lambda group, device: group)


class Step(Joinable):
    """A joinable with no collective of its own (the Join's costs alone)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()

    @property
    def join_device(self) -> str:
        return "cpu"

    @property
    def join_process_group(self) -> Any:
        return self.group


def one_world(group: ThreadGroup, fallback: bool, marks: dict[str, list[float]]) -> None:
    """Enter, leave, gather the report; rank 0 also formats a diagnostic."""
    rank = group.rank
    step = Step(Bare(group) if fallback else group)
    group.barrier()
    marks["entry start"][rank] = time.perf_counter()
    with Join([step], timeout=None) as join:
        marks["entry end"][rank] = time.perf_counter()
    group.barrier()
    marks["report start"][rank] = time.perf_counter()
    join.gather_report(0)
    marks["report end"][rank] = time.perf_counter()
    group.barrier()  # every rank has posted "done"-like statuses by now
    if rank == 0 and not fallback:
        start = time.perf_counter()
        lines = peer_status_lines(group.peer_status())
        marks["diagnostic"][0] = time.perf_counter() - start
        marks["lines"][0] = float(len(lines))


def measure(world: int, fallback: bool) -> dict[str, float]:
    marks = {name: [0.0] * world for name in ("entry start", "entry end", "report start",
                                             "report end", "diagnostic", "lines")}
    spawn(one_world, world, args=(fallback, marks), timeout=600.0)
    return {
        "entry": max(marks["entry end"]) - min(marks["entry start"]),
        "report": max(marks["report end"]) - min(marks["report start"]),
        "diagnostic": marks["diagnostic"][0],
        "lines": marks["lines"][0],
    }


def main() -> None:
    most = _bench.int_arg(1, 4096)
    repeats = _bench.int_arg(2, 3)
    most_fallback = _bench.int_arg(3, 1024)
    threading.stack_size(256 * 1024)  # thousands of rank threads
    worlds = [w for w in (64, 128, 256, 512, 1024, 2048, 4096, 8192) if w <= most]
    info = {"repeats": repeats, "fallback up to": most_fallback}
    for fallback in (False, True):  # warm-up (imports, first Join), not recorded
        measure(64, fallback)
    for world in worlds:
        variants = [False] + ([True] if world <= most_fallback else [])
        runs: dict[bool, list[dict[str, float]]] = {v: [] for v in variants}
        for round_ in range(repeats):
            for fallback in variants[round_ % len(variants):] + variants[:round_ % len(variants)]:
                runs[fallback].append(measure(world, fallback))
        for fallback, results in runs.items():
            suffix = ", all_gather" if fallback else ""
            for what in ("entry", "report") + (() if fallback else ("diagnostic",)):
                ms = statistics.median(r[what] for r in results) * 1e3
                _bench.record_value(BENCH, f"{what}{suffix}, {world} ranks", ms, "ms",
                                    info=info)
            if not fallback:
                _bench.record_value(BENCH, f"diagnostic lines, {world} ranks",
                                    results[0]["lines"], "lines", info=info)


if __name__ == "__main__":
    main()
