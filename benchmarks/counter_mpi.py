"""The tutorial's Counter on MPI: no Join, joinkit's classic and fused heartbeats.

    mpirun -n 2 python benchmarks/counter_mpi.py [iterations [repeats]]

Every variant runs the same loop: one ``MPIGroup.all_reduce`` per iteration on a
preallocated float32 array (the framework-agnostic API of
``examples/counter.py``). Variants:

- ``no Join``: the tutorial Counter (a 1-element all-reduce, and a
  ``notify_join_context`` that is a no-op outside a Join);
- ``joinkit classic``: that Counter inside joinkit's Join (a separate
  heartbeat ``Iallreduce`` per iteration);
- ``joinkit fused``: the Counter of ``examples/counter.py``, whose all-reduce
  has a second element carrying the heartbeat (one collective per iteration);
- ``no Join, 2 elements``: that 2-element all-reduce without any Join;
- ``joinkit fused, 1 element``: a fused Counter whose only element is the
  heartbeat slot (an active rank's input counts 1, as its heartbeat does; see
  ``counter_torch.py``).

torch's Join cannot run on MPI, so it has no variant here. The *drain*
variants give rank 0 no inputs, as in ``counter_torch.py``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import _bench
import numpy as np
from mpi4py import MPI

from joinkit import Join, Joinable, JoinHook
from joinkit.backends.mpi import MPIGroup


class TutorialCounter(Joinable):
    """The tutorial's Counter over an MPIGroup."""

    def __init__(self, group: MPIGroup) -> None:
        super().__init__()
        self.group = group
        self.arr = np.zeros(1, dtype=np.float32)
        self.count = 0.0

    def __call__(self) -> None:
        Join.notify_join_context(self)
        arr = self.arr
        arr[0] = 1.0
        self.group.all_reduce(arr)
        self.count += arr[0]

    def join_hook(self, **kwargs: Any) -> JoinHook:
        counter = self

        class Hook(JoinHook):
            def main_hook(self) -> None:
                counter.arr[0] = 0.0
                counter.group.all_reduce(counter.arr)

        return Hook()

    @property
    def join_device(self) -> str:
        return "cpu"

    @property
    def join_process_group(self) -> MPIGroup:
        return self.group


class FusedCounter(TutorialCounter):
    """The Counter of examples/counter.py: the heartbeat rides in a second element."""

    join_fuses_heartbeat = True

    def __init__(self, group: MPIGroup) -> None:
        super().__init__(group)
        self.arr = np.zeros(2, dtype=np.float32)

    def __call__(self) -> None:
        arr = self.arr
        arr[0] = 1.0
        arr[1] = Join.fused_heartbeat(self)
        self.group.all_reduce(arr)
        self.count += arr[0]
        Join.record_heartbeat_total(self, arr.item(1))

    def join_hook(self, **kwargs: Any) -> JoinHook:
        counter = self

        class Hook(JoinHook):
            def fused_shadow(self, heartbeat: float) -> float:
                arr = counter.arr
                arr[0] = 0.0
                arr[1] = heartbeat
                counter.group.all_reduce(arr)
                return arr.item(1)

        return Hook()


class SlotCounter(TutorialCounter):
    """A fused Counter whose one element is also the heartbeat slot."""

    join_fuses_heartbeat = True

    def __call__(self) -> None:
        arr = self.arr
        Join.fused_heartbeat(self)  # 1.0 inside the Join: the same as the input's 1
        arr[0] = 1.0
        self.group.all_reduce(arr)
        self.count += arr[0]
        Join.record_heartbeat_total(self, arr.item(0))

    def join_hook(self, **kwargs: Any) -> JoinHook:
        counter = self

        class Hook(JoinHook):
            def fused_shadow(self, heartbeat: float) -> float:
                counter.arr[0] = heartbeat  # a joined rank's 0: no input
                counter.group.all_reduce(counter.arr)
                return counter.arr.item(0)

        return Hook()


def main() -> None:
    iterations = _bench.int_arg(1, 20000)
    repeats = _bench.int_arg(2, 15)
    warnings.simplefilter("ignore")  # the drain's input-skew warning, by design
    comm = MPI.COMM_WORLD
    group = MPIGroup(comm)
    rank = comm.rank

    def slowest(seconds: float) -> float:
        return float(comm.allreduce(seconds, op=MPI.MAX))

    plain = TutorialCounter(group)
    pair = np.zeros(2, dtype=np.float32)

    def no_join(n: int) -> None:
        for _ in range(n):
            plain()

    def no_join_pair(n: int) -> None:
        count = 0.0
        for _ in range(n):
            pair[0] = 1.0
            pair[1] = 0.0
            group.all_reduce(pair)
            count += pair[0]

    def inside(counter: TutorialCounter, drain: bool = False) -> Callable[[int], float]:
        def loop(n: int) -> float:
            mine = 0 if drain and rank == 0 else n
            start = time.perf_counter()
            with Join([counter]):
                inner = time.perf_counter()
                for _ in range(mine):
                    counter()
                inner = time.perf_counter() - inner
            return time.perf_counter() - start if drain else inner
        return loop

    info = {"ranks": comm.size, "iterations": iterations, "repeats": repeats,
            "library": MPI.Get_library_version().split(",")[0].strip()}
    times = _bench.timed({
        "no Join": no_join,
        "joinkit classic": inside(TutorialCounter(group)),
        "joinkit fused": inside(FusedCounter(group)),
        "no Join, 2 elements": no_join_pair,
        "joinkit fused, 1 element": inside(SlotCounter(group)),
    }, iterations, repeats, slowest, comm.Barrier)
    if rank == 0:
        _bench.report("Counter, MPI", times, [
            ("joinkit fused", "no Join", 1.2),
            ("joinkit fused, 1 element", "no Join", 1.2),
            ("joinkit fused", "no Join, 2 elements", None),
            ("joinkit classic", "no Join", None),
        ], info)
    times = _bench.timed({
        "no Join (all ranks active)": no_join,
        "drain: joinkit classic": inside(TutorialCounter(group), True),
        "drain: joinkit fused": inside(FusedCounter(group), True),
        "drain: joinkit fused, 1 element": inside(SlotCounter(group), True),
    }, iterations, repeats, slowest, comm.Barrier)
    if rank == 0:
        _bench.report("Counter drain (rank 0 has no inputs), MPI", times, [
            ("drain: joinkit classic", "no Join (all ranks active)", None),
            ("drain: joinkit fused", "no Join (all ranks active)", None),
        ], info)


if __name__ == "__main__":
    main()
