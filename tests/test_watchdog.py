"""The watchdog on its own: the Watch's stall policy, the thread, and no Join in sight."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

from joinkit import _watchdog


def test_idle_runs_from_the_activity_or_the_last_tick_the_thread_saw() -> None:
    watch = _watchdog.Watch(2.0, lambda what, ticks, idle: None)
    assert watch.stalled(100.0) is None  # not blocked in anything
    watch.begin("exchanging failures", 10.0)
    assert watch.stalled(11.0) is None
    assert watch.stalled(12.5) == ("exchanging failures", 0, 2.5)
    # A drain: every tick the thread notices is progress, from when it noticed.
    watch.begin("counting non-joined ranks (shadow round 0)", 20.0)
    watch.ticks += 3  # before the thread's first look
    assert watch.stalled(30.0) is None  # progress, seen now
    assert watch.stalled(31.9) is None
    assert watch.stalled(32.0) == ("counting non-joined ranks (shadow round 0)", 3, 2.0)
    watch.ticks += 1
    assert watch.stalled(33.0) is None
    assert watch.stalled(36.0) == ("counting non-joined ranks (shadow round 0)", 4, 3.0)
    # A new activity starts afresh, its ticks too.
    watch.begin("post hooks", 40.0)
    assert watch.ticks == 0 and watch.stalled(41.0) is None
    watch.end()
    assert watch.stalled(99.0) is None


def test_the_thread_fires_once_and_forgets_unwatched() -> None:
    fired: list[tuple[str, int, float]] = []
    done = threading.Event()

    def on_stall(what: str, ticks: int, idle: float) -> None:
        fired.append((what, ticks, idle))
        done.set()

    watch = _watchdog.Watch(0.05, on_stall)
    watch.begin("the agreement check at entry", time.monotonic())
    _watchdog.watch(watch)
    try:
        assert done.wait(5.0)
        time.sleep(0.2)  # a second look must not fire again
    finally:
        _watchdog.unwatch(watch)
    assert len(fired) == 1 and watch.fired
    assert fired[0][0] == "the agreement check at entry" and fired[0][2] >= 0.05


def test_the_watchdog_imports_nothing_of_the_join() -> None:
    source = Path(_watchdog.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    allowed = {"__future__", "atexit", "threading", "time", "weakref", "collections.abc"}
    assert imported <= allowed, imported
