"""Per-iteration cost of joinkit's heartbeat on MPI versus a raw ``Iallreduce``.

    mpirun -n 2 python benchmarks/mpi_heartbeat.py [iterations]

Every rank runs the same loop of one heartbeat per iteration, all ranks
active (the common case), in four variants:

- ``raw Iallreduce``: what a hand-written heartbeat costs at least: wait for
  the previous request, start a 1-element float32 SUM ``Iallreduce`` on
  preallocated buffers;
- ``MPIGroup.heartbeat``: the backend's method called directly;
- ``notify_join_context``: the whole per-iteration path of a joinable inside
  ``with Join(...)`` (notify -> Join's fast path -> heartbeat);
- ``notify, enable=False``: the same joinable in a disabled Join (the floor).

Rank 0 prints microseconds per iteration (best of several repeats). The loop
has no other communication, so with several ranks the numbers include the
heartbeat's latency (each iteration waits for the previous heartbeat) and are
noisy on a loaded machine; ``-n 1`` isolates joinkit's own CPU cost.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import _bench
import numpy as np
from mpi4py import MPI

from joinkit import Join, Joinable, JoinHook
from joinkit.backends.mpi import MPIGroup


class Beat(Joinable):
    """A joinable whose iteration is just the notify."""

    def __init__(self, group: MPIGroup) -> None:
        super().__init__()
        self.group = group

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()

    @property
    def join_device(self) -> str:
        return "cpu"

    @property
    def join_process_group(self) -> MPIGroup:
        return self.group


def timed(comm: MPI.Comm, loops: dict[str, Callable[[int], None]], iterations: int,
          repeats: int = 15) -> dict[str, float]:
    """Best time per iteration of each loop, in microseconds.

    The variants take turns within each repeat, so a noisy moment on a shared
    machine hits them alike; the best repeat is the least disturbed one.
    """
    best = dict.fromkeys(loops, float("inf"))
    for _ in range(repeats):
        for name, loop in loops.items():
            comm.Barrier()
            start = time.perf_counter()
            loop(iterations)
            # The slowest rank decides, as in training.
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            best[name] = min(best[name], elapsed)
    return {name: seconds / iterations * 1e6 for name, seconds in best.items()}


def main() -> None:
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    comm = MPI.COMM_WORLD
    group = MPIGroup(comm)

    send = np.ones(1, dtype=np.float32)
    recv = np.zeros(1, dtype=np.float32)

    def raw(n: int) -> None:
        request = MPI.REQUEST_NULL
        iallreduce = comm.Iallreduce
        for _ in range(n):
            request.Wait()
            request = iallreduce(send, recv, MPI.SUM)
        request.Wait()

    def heartbeat(n: int) -> None:
        beat = group.heartbeat
        for _ in range(n):
            beat(1.0)
        group.count(0.0)  # leaves no request pending (and shadows nothing)

    def notify(n: int, enable: bool = True) -> None:
        joinable = Beat(group)
        with Join([joinable], enable=enable):
            for _ in range(n):
                Join.notify_join_context(joinable)

    results = timed(comm, {
        "raw Iallreduce": raw,
        "MPIGroup.heartbeat": heartbeat,
        "notify_join_context": notify,
        "notify, enable=False": lambda n: notify(n, enable=False),
    }, iterations)
    if comm.rank == 0:
        print(f"{comm.size} ranks, {iterations} iterations, {MPI.Get_library_version()[:30]}")
        base = results["raw Iallreduce"]
        for name, micros in results.items():
            print(f"  {name:22} {micros:7.2f} us/iteration  ({micros - base:+.2f} vs raw)")
        # For benchmarks/run.py (a no-op unless JOINKIT_BENCH_OUT is set).
        bench = f"MPI heartbeat, {comm.size} rank{'s' if comm.size > 1 else ''}"
        for name, micros in results.items():
            _bench.record_value(bench, name, micros, "us", quiet=True)
        _bench.record_value(bench, "notify_join_context - MPIGroup.heartbeat",
                            results["notify_join_context"] - results["MPIGroup.heartbeat"],
                            "us", quiet=True)


if __name__ == "__main__":
    main()
