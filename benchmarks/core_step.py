"""The pure core's ``step`` and the shell's per-iteration path, without any I/O.

    python benchmarks/core_step.py [calls]

- ``step(ACTIVE, Notified)``: one transition of the machine (classic heartbeat:
  it returns one ``SendHeartbeat``); the target is at most 2 us;
- ``step(ACTIVE, HeartbeatSeen)``: the (rare) transition on a heartbeat sum;
- ``notify_join_context``: the shell's whole per-iteration path (fast path,
  machine not stepped) over a backend whose collectives do nothing, i.e.
  joinkit's own Python cost per iteration;
- ``fused_heartbeat + record_heartbeat_total``: the same for a fused joinable;
- ``notify, enable=False``: a disabled Join (the floor).

Best of 25 short repeats (the least disturbed), in microseconds per call.
"""

from __future__ import annotations

import timeit
from typing import Any

import _bench

from joinkit import Join, Joinable, JoinHook, backends
from joinkit import _machine as m

TARGET_STEP_US = 2.0


class _Handle:
    __slots__ = ()

    def wait(self) -> float:
        return 1.0


class NullBackend:
    """A world of one whose collectives cost nothing: the shell's cost alone."""

    rank = 0
    world_size = 1
    device = "cpu"
    collectives_issued = 0
    _handle = _Handle()

    def heartbeat(self, value: float) -> _Handle:
        return self._handle

    def heartbeat_total(self, handle: Any) -> float:
        return 1.0

    def count(self, value: float) -> float:
        return value

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


backends.register(NullBackend, lambda group, device: group)


class Beat(Joinable):
    """A joinable whose iteration is just the notify (classic or fused)."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.join_fuses_heartbeat = fused
        self.group = NullBackend()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        class Hook(JoinHook):
            def fused_shadow(self, heartbeat: float) -> float:
                return heartbeat

        return Hook()

    @property
    def join_device(self) -> str:
        return "cpu"

    @property
    def join_process_group(self) -> NullBackend:
        return self.group


def best_us(fn: Any, calls: int, repeats: int = 25) -> float:
    """Best of many short windows: on a shared machine some window is quiet."""
    return min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls * 1e6


def main() -> None:
    calls = _bench.int_arg(1, 50_000)
    state = m.step(m.initial_state(m.MachineConfig(rank=0)), m.Entered()).state
    notified = m.Notified(now=0.0)
    seen = m.HeartbeatSeen(total=1.0, now=0.0)
    step = m.step
    step_us = best_us(lambda: step(state, notified), calls)
    _bench.record_value("core", "step(ACTIVE, Notified)", step_us, "us", TARGET_STEP_US)
    _bench.record_value("core", "step(ACTIVE, HeartbeatSeen)",
                        best_us(lambda: step(state, seen), calls), "us")

    classic, fused = Beat(False), Beat(True)
    notify = Join.notify_join_context
    beat, record = Join.fused_heartbeat, Join.record_heartbeat_total
    with Join([classic]):
        us = best_us(lambda: notify(classic), calls)
    _bench.record_value("shell", "notify_join_context (no-op backend)", us, "us")

    def fused_iteration() -> None:
        beat(fused)
        record(fused, 1.0)

    with Join([fused]):
        us = best_us(fused_iteration, calls)
    _bench.record_value("shell", "fused_heartbeat + record_heartbeat_total", us, "us")
    with Join([classic], enable=False):
        us = best_us(lambda: notify(classic), calls)
    _bench.record_value("shell", "notify_join_context, enable=False", us, "us")


if __name__ == "__main__":
    main()
