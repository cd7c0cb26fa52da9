"""Run fault-matrix cells (``fault_scenarios.py``) in real processes.

Theory of operation
-------------------
Three ways to start the ranks, one program::

    mpirun -n N python fault_runner.py --out DIR CELLS        # MPI
    torchrun --standalone --nproc-per-node N fault_runner.py --out DIR CELLS
    python fault_runner.py --fork N --out DIR CELLS [CELLS ...] # gloo

Under a launcher each rank takes ``backends.init()``'s world group (an
``MPIGroup``, a ``TorchGroup``) and runs the cells of ``CELLS`` in order.
``--fork N`` is a torch launcher without torchrun's start-up cost: this process
imports torch once and, for each ``CELLS`` argument, forks ``N`` children that
initialise a gloo group over a fresh ``FileStore`` and run those cells; a cell
that aborts its group therefore gets a ``CELLS`` argument (a launch) of its
own. The parent gives each launch ``--deadline`` seconds, kills what is left
and records every child's exit status in ``DIR/launches.jsonl``. A child that
dies (a native crash) fails only the cell it died in: the cells after it run
again in a fresh launch (``fork_launches``).

``CELLS`` is a comma-separated list of ``case:failing_rank`` (a fault case;
``last`` means the last rank), ``agreement:variant``, ``bad_inputs``,
``report``. Each rank appends one JSON line per cell to
``DIR/launch{L}-rank{R}.jsonl`` when the cell starts (its wall-clock time) and
one as soon as the cell ends (per-rank files,
because MPICH's Hydra may interleave ranks' stdout), so the tests see how far
every rank got even when a launch is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fault_scenarios as fs  # noqa: E402
from support.faults import finished_by_all, parse_cells, spell_cells  # noqa: E402
from support.fork import fork_ranks, preload  # noqa: E402

#: The gloo groups' own timeout in --fork mode: far above every cell's, so a
#: cell that only ends through it shows up as too slow.
GLOO_TIMEOUT = 60.0


def run_cells(group: Any, cells: list[tuple[str, str]], out: Path, launch: int,
              timeout: float, stall_timeout: float, dead_group: Any = None,
              device: Any = "cuda:0") -> None:
    """Run ``cells`` on this rank; append one JSON line per cell."""
    path = out / f"launch{launch}-rank{group.rank}.jsonl"
    for kind, arg in cells:
        # When the cell began (wall clock, comparable across the ranks and the
        # test): a launch that ends by aborting is timed from here.
        with path.open("a") as f:
            f.write(json.dumps({"kind": "started", "arg": arg, "rank": group.rank,
                                "time": time.time()}) + "\n")
        if kind in fs.CASES:
            result = fs.run_case(group, kind, int(arg), group.world_size, timeout=timeout,
                                 stall_timeout=stall_timeout)
        elif kind == "agreement":
            result = fs.run_agreement(group, arg)
        elif kind == "bad_inputs":
            result = fs.run_bad_inputs(group, dead_group=dead_group, device=device)
        elif kind == "report":
            result = fs.run_report(group)
        else:
            raise SystemExit(f"unknown cell {kind}:{arg}")
        line = {"kind": kind, "arg": arg, "rank": group.rank,
                "world_size": group.world_size, "result": result}
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
    with path.open("a") as f:
        f.write(json.dumps({"kind": "done", "rank": group.rank}) + "\n")


# -- under a launcher (mpirun, torchrun) ------------------------------------------------


def dead_group_for(group: Any) -> Any:
    """A group of a destroyed backend, for the bad-input case."""
    if type(group).__name__ == "MPIGroup":
        comm = group.comm.Dup()
        comm.Free()  # now MPI.COMM_NULL
        return comm
    if type(group).__name__ == "TorchGroup":
        import torch.distributed as dist

        dead = dist.new_group(backend="gloo")
        dist.destroy_process_group(dead)
        return dead
    return None


def under_launcher(args: argparse.Namespace) -> None:
    from joinkit import backends

    group = backends.init()
    cells = parse_cells(args.cells[0], group.world_size)
    dead = dead_group_for(group) if any(k == "bad_inputs" for k, _ in cells) else None
    run_cells(group, cells, Path(args.out), 0, args.timeout, args.stall_timeout,
              dead_group=dead)


# -- --fork: a torch launcher that imports torch once ------------------------------------


def fork_child(rank: int, world_size: int, store: str, cells: list[tuple[str, str]],
               out: Path, launch: int, timeout: float, stall_timeout: float) -> None:
    import datetime

    import torch.distributed as dist

    from joinkit.backends.torch_dist import TorchGroup

    pre_init = None
    if any(k == "bad_inputs" for k, _ in cells):
        # An uninitialised backend: torch's default group before init_process_group.
        pre_init = fs.describe_error(_raises(lambda: fs.Join([fs._RawGroup(None)])))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT))
    group = TorchGroup()
    dead = dead_group_for(group) if pre_init is not None else None
    run_cells(group, cells, out, launch, timeout, stall_timeout, dead_group=dead)
    if pre_init is not None:
        with (out / f"launch{launch}-rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps({"kind": "pre_init", "rank": rank, "result": pre_init}) + "\n")


def _raises(fn: Any) -> BaseException | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


#: Seconds a launch's other children get once one died (fork_ranks).
DEATH_GRACE = 3.0


def fork_launches(args: argparse.Namespace) -> None:
    """Each ``CELLS`` argument as a launch of forked ranks (module doc).

    One crash fails one cell: if a child dies (a native crash: a signal or a
    non-zero status), the first cell of its launch that not every rank
    finished is recorded as the launch's ``culprit``, and the cells after it
    run again in a fresh launch (recorded as ``rerun``).
    """
    preload()  # once, before forking (elastic_fork.PRELOAD)

    out = Path(args.out)
    world_size = args.fork
    todo = [parse_cells(spec, world_size) for spec in args.cells]
    launch = 0
    while todo:
        cells = todo.pop(0)
        store = out / f"store{launch}"
        started = time.monotonic()

        def run(rank: int, cells: list[tuple[str, str]] = cells, launch: int = launch,
                store: Path = store) -> None:
            fork_child(rank, world_size, str(store), cells, out, launch, args.timeout,
                       args.stall_timeout)

        statuses = fork_ranks(world_size, args.deadline, run, stop_after_death=DEATH_GRACE)
        record: dict[str, Any] = {
            "launch": launch, "cells": spell_cells(cells), "world_size": world_size,
            "ran": [list(cell) for cell in cells], "seconds": time.monotonic() - started,
            "exit": {str(r): statuses[r] for r in sorted(statuses)}}
        if any(code != 0 for code in statuses.values()):
            unfinished = [cell for cell in cells
                          if cell not in finished_by_all(out, launch, world_size)]
            if unfinished:
                culprit = unfinished[0]
                record["culprit"] = list(culprit)
                rest = cells[cells.index(culprit) + 1:]
                if rest:
                    record["rerun"] = spell_cells(rest)
                    todo.insert(0, rest)
        with (out / "launches.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        launch += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--fork", type=int, default=0, help="world size of forked gloo ranks")
    parser.add_argument("--timeout", type=float, default=20.0, help="the Join timeout")
    parser.add_argument("--stall-timeout", type=float, default=1.0,
                        help="the Join timeout of the stall cells")
    parser.add_argument("--deadline", type=float, default=60.0,
                        help="--fork: seconds per launch before its children are killed")
    parser.add_argument("cells", nargs="+")
    args = parser.parse_args()
    if args.fork:
        fork_launches(args)
    else:
        under_launcher(args)


if __name__ == "__main__":
    main()
