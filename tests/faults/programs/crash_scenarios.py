"""Scenarios that kill their own process, for the tests of the scenario-job harness.

Run as the other workers are (``support.run_scenarios``)::

    python crash_scenarios.py RANK WORLD STORE OUT [--die-at-start] [--with-torch] NAME...

No torch, no process group: a scenario's ranks meet at a *file barrier* in
``OUT`` (each rank touches a file, then waits up to 60 s for its peers'), which
stands for a collective. A rank that dies leaves its peers waiting at the next
barrier, as a crashed rank leaves its peers in their next collective: the
harness must end them (``support.DEATH_GRACE``), fail the scenario the rank
died in, and run the scenarios after it again in a fresh job.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Any

from support import Ctx, recording, scenario_registry

SCENARIOS, scenario = scenario_registry()
BARRIER_PATIENCE = 60.0  # far beyond the tests' deadlines: only the harness ends a wait


class Ranks(Ctx):
    def __init__(self, rank: int, world: int, out: Path) -> None:
        super().__init__(rank, world, None)
        self.out = out
        self.barriers = 0

    def barrier(self) -> None:
        """Every rank of this job gets here (the stand-in for a collective)."""
        self.barriers += 1
        mark = f"barrier{self.barriers}"
        (self.out / f"{mark}-rank{self.rank}").touch()
        deadline = time.monotonic() + BARRIER_PATIENCE
        while not all((self.out / f"{mark}-rank{r}").exists() for r in range(self.world)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mark}: a peer never came")
            time.sleep(0.01)


def _fine(ctx: Ranks) -> Any:
    ctx.barrier()
    return {"rank": ctx.rank, "pid": os.getpid()}


@scenario
def first(ctx: Ranks) -> Any:
    return _fine(ctx)


@scenario
def abort_on_1(ctx: Ranks) -> Any:
    """Rank 1 aborts (SIGABRT, as glibc does on a corrupted heap); the others
    wait at the next barrier."""
    ctx.barrier()
    if ctx.rank == 1:
        os.abort()
    ctx.barrier()


@scenario
def second(ctx: Ranks) -> Any:
    return _fine(ctx)


@scenario
def segfault_on_0(ctx: Ranks) -> Any:
    """Rank 0 reads address 0 (a real SIGSEGV); the others wait."""
    ctx.barrier()
    if ctx.rank == 0:
        ctypes.string_at(0)
    ctx.barrier()


@scenario
def third(ctx: Ranks) -> Any:
    return _fine(ctx)


@scenario
def hang_on_0(ctx: Ranks) -> Any:
    """Rank 0 never comes back: the job's deadline ends it."""
    if ctx.rank == 0:
        time.sleep(BARRIER_PATIENCE)
    ctx.barrier()


@scenario
def raises(ctx: Ranks) -> Any:
    """An ordinary exception: recorded as the scenario's error, no crash."""
    ctx.barrier()
    raise ValueError(f"an ordinary failure on rank {ctx.rank}")


def main(argv: list[str]) -> None:
    rank, world, _store, out_dir, *names = argv
    if "--die-at-start" in names:
        sys.exit(3)  # before any scenario: a job that cannot start
    if "--with-torch" in names:  # its native crash report (support.report_crashes)
        names.remove("--with-torch")
        import torch  # noqa: F401
    out = Path(out_dir)
    ctx = Ranks(int(rank), int(world), out)
    for name in names:
        with recording(out / f"rank{rank}.jsonl", name) as record:
            record["result"] = SCENARIOS[name](ctx)


if __name__ == "__main__":
    main(sys.argv[1:])
