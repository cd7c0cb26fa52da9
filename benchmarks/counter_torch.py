"""The tutorial's Counter on gloo: no Join, torch's Join, joinkit's Join.

    torchrun --standalone --nproc-per-node 2 benchmarks/counter_torch.py [iterations [repeats]]

Every variant runs the same loop: one ``dist.all_reduce`` per iteration on a
preallocated CPU tensor (written through a NumPy view, so no variant pays for
tensor allocation or indexing). Variants:

- ``no Join``: the tutorial Counter (a 1-element all-reduce, and a
  ``notify_join_context`` that is a no-op outside a Join);
- ``torch Join``: that Counter inside ``torch.distributed.algorithms.join.Join``
  (its notify sends torch's heartbeat, a second all-reduce);
- ``joinkit classic``: the same Counter inside joinkit's Join (torch-compatible
  heartbeat, a second all-reduce);
- ``joinkit fused``: the Counter of ``examples/counter.py``, whose all-reduce
  has a second element carrying the heartbeat (one collective per iteration);
- ``no Join, 2 elements``: that 2-element all-reduce without any Join (what
  the extra element costs on the wire, joinkit aside: gloo's ring all-reduce
  takes more steps for two elements than for one);
- ``joinkit fused, 1 element``: a fused Counter whose only element is the
  heartbeat slot: an active rank contributes 1 (an input, and "I am active"),
  a joined rank 0, so the count of inputs *is* the heartbeat sum and the
  collective is exactly the tutorial's.

The *drain* variants give rank 0 no inputs at all, so it shadows every
iteration of the others; their time is the whole ``with`` block on each rank
(the slowest decides) per iteration of the ranks that have inputs.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import _bench
import torch
import torch.distributed as dist
import torch.distributed.algorithms.join as torch_join

import joinkit
from joinkit import Join


class TutorialCounter(joinkit.Joinable, torch_join.Joinable):
    """The tutorial's Counter; ``notify`` is torch's or joinkit's notify_join_context."""

    def __init__(self, group: Any, notify: Callable[[Any], Any]) -> None:
        super().__init__()
        self.group = group
        self.notify = notify
        self.buf = torch.zeros(1)
        self.arr = self.buf.numpy()
        self.count = 0.0
        self.heartbeat: Any = None  # torch's Join never waits for its heartbeats

    def __call__(self) -> None:
        self.heartbeat = self.notify(self)
        arr = self.arr
        arr[0] = 1.0
        dist.all_reduce(self.buf, group=self.group)
        self.count += arr[0]

    def join_hook(self, **kwargs: Any) -> Any:
        counter = self

        class Hook(torch_join.JoinHook):
            def main_hook(self) -> None:
                counter.arr[0] = 0.0
                dist.all_reduce(counter.buf, group=counter.group)

        return Hook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.group


class SlotCounter(joinkit.Joinable):
    """A fused Counter whose one element is also the heartbeat slot.

    Its all-reduce sums 1 per rank that processed an input: exactly what the
    heartbeat slot must hold (1.0 per active rank, 0.0 per joined rank), so
    the Join reads the count of non-joined ranks from it directly.
    """

    join_fuses_heartbeat = True

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.buf = torch.zeros(1)
        self.arr = self.buf.numpy()
        self.count = 0.0

    def __call__(self) -> None:
        arr = self.arr
        Join.fused_heartbeat(self)  # 1.0 inside the Join: the same as the input's 1
        arr[0] = 1.0
        dist.all_reduce(self.buf, group=self.group)
        self.count += arr[0]
        Join.record_heartbeat_total(self, arr.item(0))

    def join_hook(self, **kwargs: Any) -> joinkit.JoinHook:
        counter = self

        class Hook(joinkit.JoinHook):
            def fused_shadow(self, heartbeat: float) -> float:
                counter.arr[0] = heartbeat  # a joined rank's 0: no input
                dist.all_reduce(counter.buf, group=counter.group)
                return counter.arr.item(0)

        return Hook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.group


class FusedCounter(joinkit.Joinable):
    """The Counter of examples/counter.py: the heartbeat rides in a second element."""

    join_fuses_heartbeat = True

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.buf = torch.zeros(2)
        self.arr = self.buf.numpy()
        self.count = 0.0

    def __call__(self) -> None:
        arr = self.arr
        arr[0] = 1.0
        arr[1] = Join.fused_heartbeat(self)
        dist.all_reduce(self.buf, group=self.group)
        self.count += arr[0]
        Join.record_heartbeat_total(self, arr.item(1))

    def join_hook(self, **kwargs: Any) -> joinkit.JoinHook:
        counter = self

        class Hook(joinkit.JoinHook):
            def fused_shadow(self, heartbeat: float) -> float:
                arr = counter.arr
                arr[0] = 0.0
                arr[1] = heartbeat
                dist.all_reduce(counter.buf, group=counter.group)
                return arr.item(1)

        return Hook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.group


def main() -> None:
    iterations = _bench.int_arg(1, 2000)
    repeats = _bench.int_arg(2, 15)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the drain's input-skew warning, by design
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    slowest = _bench.slowest_rank()

    def barrier() -> None:
        dist.barrier()

    plain = TutorialCounter(group, Join.notify_join_context)
    pair = torch.zeros(2)
    pair_view = pair.numpy()

    def no_join(n: int) -> None:
        for _ in range(n):
            plain()

    def no_join_pair(n: int) -> None:
        count = 0.0
        for _ in range(n):
            pair_view[0] = 1.0
            pair_view[1] = 0.0
            dist.all_reduce(pair, group=group)
            count += pair_view[0]

    def inside(make_join: Callable[[Any], Any], counter: Any, drain: bool = False
               ) -> Callable[[int], float]:
        def loop(n: int) -> float:
            mine = 0 if drain and rank == 0 else n
            start = time.perf_counter()
            with make_join(counter):
                inner = time.perf_counter()
                for _ in range(mine):
                    counter()
                inner = time.perf_counter() - inner
            elapsed = time.perf_counter() - start
            heartbeat, counter.heartbeat = getattr(counter, "heartbeat", None), None
            if heartbeat is not None:
                # gloo may abort at exit when work nobody waited for is torn
                # down; it completed long ago (the Join's count came after it).
                heartbeat.wait()
            # Steady state: the loop inside the block; drain: the whole block.
            return elapsed if drain else inner
        return loop

    def torch_join_of(counter: Any) -> Any:
        return torch_join.Join([counter])

    def joinkit_join_of(counter: Any) -> Any:
        return Join([counter])

    def torch_counter() -> TutorialCounter:
        return TutorialCounter(group, torch_join.Join.notify_join_context)

    def joinkit_counter() -> TutorialCounter:
        return TutorialCounter(group, Join.notify_join_context)

    variants: dict[str, Callable[[int], float | None]] = {
        "no Join": no_join,
        "torch Join": inside(torch_join_of, torch_counter()),
        "joinkit classic": inside(joinkit_join_of, joinkit_counter()),
        "joinkit fused": inside(joinkit_join_of, FusedCounter(group)),
        "no Join, 2 elements": no_join_pair,
        "joinkit fused, 1 element": inside(joinkit_join_of, SlotCounter(group)),
    }
    times = _bench.timed(variants, iterations, repeats, slowest, barrier)
    info = {"ranks": world, "iterations": iterations, "repeats": repeats}
    if rank == 0:
        _bench.report("Counter, gloo", times, [
            ("joinkit fused", "no Join", 1.05),
            ("joinkit fused, 1 element", "no Join", 1.05),
            ("joinkit classic", "torch Join", 1.0),
            ("joinkit fused", "no Join, 2 elements", None),
            ("no Join, 2 elements", "no Join", None),
            ("torch Join", "no Join", None),
            ("joinkit classic", "no Join", None),
        ], info)

    drains: dict[str, Callable[[int], float | None]] = {
        "no Join (all ranks active)": no_join,
        "drain: torch Join": inside(torch_join_of, torch_counter(), True),
        "drain: joinkit classic": inside(joinkit_join_of, joinkit_counter(), True),
        "drain: joinkit fused": inside(joinkit_join_of, FusedCounter(group), True),
        "drain: joinkit fused, 1 element": inside(joinkit_join_of, SlotCounter(group), True),
    }
    times = _bench.timed(drains, iterations, repeats, slowest, barrier)
    if rank == 0:
        _bench.report("Counter drain (rank 0 has no inputs), gloo", times, [
            ("drain: joinkit classic", "drain: torch Join", None),
            ("drain: joinkit fused", "drain: torch Join", None),
            ("drain: torch Join", "no Join (all ranks active)", None),
        ], info)
    dist.barrier()  # every rank's collectives have completed before teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
