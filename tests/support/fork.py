"""Fork the ranks of one elastic cell and reap them within a deadline.

Shared by ``tests/elastic/programs/elastic_torch_runner.py``,
``tests/elastic/programs/elastic_ddp_runner.py`` and
``tests/faults/programs/fault_runner.py`` (its ``--fork`` launcher):
the parent (which hosts the store, so it outlives every rank) forks ``world``
children, each in its own process group, runs ``run(rank)`` in each, and waits
for them; a child still running at the deadline is SIGKILLed with its process
group and recorded as ``"killed after deadline"``. A child that raised exits 1
after printing its traceback; a SIGKILLed one (the cells kill ranks on purpose)
gives ``-9``.

:func:`hosted_store` hosts the cells' ``TCPStore`` in a forked child of its
own, not in this process: a TCPStore server runs a thread, and a process that
forks while one of its threads holds a lock gives its children that lock held
forever (a rank then hung in its TCPStore client, 1 run in ~20 on a loaded
machine). With the server elsewhere, this process forks with no thread.

:func:`run_under_mpirun` runs each cell's ranks under ``mpirun --with-ft ulfm``
instead (ULFM keeps the survivors), over a store this process hosts.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class HostedStore:
    """A ``TCPStore`` server in a forked child process; ``port`` is where it listens.

    The child exits when :meth:`close` kills it, or by itself once this
    process is gone (it polls its parent), so it never outlives a test.
    """

    def __init__(self, timeout: float = 60.0) -> None:
        parent = os.getpid()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the store's process: host, say the port, wait for the parent
            code = 0
            try:
                os.close(read_end)
                import torch.distributed as dist

                server = dist.TCPStore("127.0.0.1", 0, 1, True,
                                       datetime.timedelta(seconds=timeout),
                                       wait_for_workers=False)
                os.write(write_end, f"{server.port}\n".encode())
                os.close(write_end)
                while os.getppid() == parent:
                    time.sleep(0.2)
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(write_end)
        with os.fdopen(read_end) as said:
            line = said.readline()
        if not line.strip():
            os.waitpid(pid, 0)
            raise RuntimeError("the store's process did not start (its traceback is above)")
        self.port = int(line)
        self._pid: int | None = pid

    def close(self) -> None:
        """Stop the store's process (idempotent)."""
        if self._pid is not None:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self._pid, 0)
            self._pid = None


def hosted_store(timeout: float = 60.0) -> HostedStore:
    """A :class:`HostedStore`, closed when this process exits normally."""
    import atexit

    store = HostedStore(timeout)
    atexit.register(store.close)
    return store


#: Modules the ranks would import on first use, imported once in the parent
#: before it forks them: DDP's constructor imports ``torch._dynamo`` (about
#: 4.5 s of CPU per forked rank on a 2-core machine, more than a whole cell's
#: training), ZeRO ``torch.distributed.optim``. Torch's only: importing them
#: adds no thread to the one that importing ``torch.distributed`` starts (a
#: thread holding a lock at the fork would hang the child, :func:`hosted_store`),
#: and joinkit itself is left to each rank, which reads its environment.
PRELOAD = ("torch.distributed", "torch._dynamo", "torch.nn.parallel",
           "torch.distributed.optim", "torch.distributed.fsdp")


def preload() -> None:
    """Import :data:`PRELOAD` in this process (the parent of forked ranks)."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)


def fork_ranks(world: int, seconds: float, run: Callable[[int], None],
               stop_after_death: float | None = None) -> dict[int, Any]:
    """Run ``run(rank)`` in ``world`` forked children; rank -> exit status (or why not).

    Args:
        world: how many ranks to fork.
        seconds: the deadline for all of them, from now.
        run: the rank's body, in the child.
        stop_after_death: once a child has died (a signal, or a non-zero
            status), the others get this many seconds more and are then
            killed (``"killed after deadline"``): they would wait for the dead
            one until their own timeouts. ``None`` (the elastic cells, which
            kill ranks on purpose): the survivors run on.

    Returns:
        Every rank's exit code (``os.waitstatus_to_exitcode``), or
        ``"killed after deadline"``.
    """
    started = time.monotonic()
    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.setpgid(0, 0)
                run(rank)
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    statuses: dict[int, Any] = {}
    deadline = started + seconds
    while children and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.005)
            continue
        code = statuses[children.pop(pid)] = os.waitstatus_to_exitcode(status)
        if code != 0 and stop_after_death is not None:
            deadline = min(deadline, time.monotonic() + stop_after_death)
    for pid, rank in children.items():
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        statuses[rank] = "killed after deadline"
    return statuses


def run_under_mpirun(script: str, out: Path, cells: list[str], deadline: float,
                     world_of: Callable[[str], int]) -> None:
    """Host the store; run each cell under ``mpirun --with-ft ulfm`` (gloo ranks).

    Open MPI's ULFM mode keeps the survivors of a dead process (torchrun's
    agent would kill them); the ranks never initialise MPI: ``script`` runs
    each with ``--as-rank PORT --cell N SPEC``, and it takes its rank from
    mpirun's environment and builds a gloo group over this process's TCPStore.
    Each cell's record (``mpirun``'s exit code, its stderr's tail) goes to
    ``out/cells.jsonl``.

    Args:
        script: the runner to launch per rank.
        out: the folder for the records.
        cells: the cells' specs.
        deadline: seconds per cell.
        world_of: a spec's world size.
    """
    out.mkdir(parents=True, exist_ok=True)
    server = hosted_store()
    mpirun = Path(sys.executable).with_name("mpirun")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "JOINKIT_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    for cell, spec in enumerate(cells):
        started = time.monotonic()
        command = [str(mpirun) if mpirun.exists() else "mpirun", "--with-ft", "ulfm",
                   "-n", str(world_of(spec)), "--oversubscribe", sys.executable, script,
                   "--out", str(out), "--as-rank", str(server.port), "--cell", str(cell), spec]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=deadline)
            code: Any = done.returncode
            errors = done.stderr[-3000:]
        except subprocess.TimeoutExpired:
            code, errors = "killed after deadline", ""
        record = {"cell": cell, "spec": spec, "seconds": time.monotonic() - started,
                  "mpirun": code, "stderr": errors}
        with (out / "cells.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def cells_main(script: str, parse: Callable[[str], tuple[int, Any, str]],
               run_rank: Callable[..., None], run_refusals: Callable[..., None]) -> None:
    """The command line of a model runner (DDP's, ZeRO's): every cell, forked or under mpirun.

    ``script --out DIR [--deadline S] [--mpirun] CELLS...``; a cell ``"W:refusals"``
    runs ``run_refusals(rank, world, port, cell, out)`` on each rank, any other
    ``run_rank(rank, world, kills, option, port, cell, out)`` (``parse`` gives
    the world, kills and option of a cell's spec). Each cell's record goes to
    ``out/cells.jsonl``.
    """
    import argparse
    import functools

    parser = argparse.ArgumentParser(description=f"the elastic cells of {Path(script).name}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=40.0)
    parser.add_argument("--mpirun", action="store_true",
                        help="run each cell under mpirun --with-ft ulfm")
    parser.add_argument("--as-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cell", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("cells", nargs="+")
    args = parser.parse_args()
    out = Path(args.out)
    if args.as_rank:  # one rank under mpirun: the port of the parent's store
        world, kills, option = parse(args.cells[0])
        run_rank(int(os.environ["OMPI_COMM_WORLD_RANK"]), world, kills, option,
                 args.as_rank, args.cell, out)
        return
    if args.mpirun:
        run_under_mpirun(script, out, args.cells, args.deadline, lambda spec: parse(spec)[0])
        return

    def one_rank(rank: int, *, spec: str, world: int, kills: Any, option: str, cell: int,
                 port: int) -> None:
        if spec.endswith(":refusals"):
            run_refusals(rank, world, port, cell, out)
        else:
            run_rank(rank, world, kills, option, port, cell, out)

    preload()  # once, before forking

    out.mkdir(parents=True, exist_ok=True)
    server = hosted_store()  # not a thread of this process: it forks
    for cell, spec in enumerate(args.cells):
        world, kills, option = parse(spec)
        started = time.monotonic()
        statuses = fork_ranks(world, args.deadline, functools.partial(
            one_rank, spec=spec, world=world, kills=kills, option=option, cell=cell,
            port=server.port))
        record = {"cell": cell, "spec": spec, "seconds": time.monotonic() - started,
                  "exit": {str(r): statuses[r] for r in sorted(statuses)}}
        with (out / "cells.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def run_runner(script: str, out: Path, cells: list[str], deadline: float, *,
               mpirun: bool = False) -> tuple[list[dict[str, Any]], str]:
    """Run a runner's ``cells`` (forked, or under mpirun); its records and stderr.

    The runner gives every cell ``deadline`` seconds (and kills what is left);
    this call is bounded too. Asserts the runner itself exited 0 and recorded
    every cell in order.
    """
    done = subprocess.run(
        [sys.executable, script, *(["--mpirun"] if mpirun else []), "--out", str(out),
         "--deadline", str(deadline), *cells],
        capture_output=True, text=True, timeout=(deadline + 30) * len(cells) + 60,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    assert [r["spec"] for r in records] == cells, records
    return records, done.stderr


def rank_results(out: Path, record: dict[str, Any]) -> dict[int, Any]:
    """Rank -> what that rank of ``record``'s cell wrote (the ranks that finished)."""
    ranks = {}
    for path in out.glob(f"cell{record['cell']}-rank*.json"):
        ranks[int(path.stem.rpartition("rank")[2])] = json.loads(path.read_text())
    return ranks


def parse_cell(cell: str, points: tuple[str, ...]) -> tuple[int, list[tuple[int, str, int]], str]:
    """A model runner's cell, ``WORLD:RANK/POINT/AT[+...][~OPTION]`` (or
    ``WORLD:refusals[~OPTION]``): the world, the kills (rank, point, input) and
    the option."""
    spec, _, option = cell.partition("~")
    world, _, kills = spec.partition(":")
    out = []
    if kills != "refusals":
        for item in filter(None, kills.split("+")):
            rank, point, at = item.split("/")
            assert point in points, point
            out.append((int(rank), point, int(at)))
    return int(world), out, option


def cell_results(runner_file: str, out: Path, cells: list[str], deadline: float
                 ) -> dict[str, Any]:
    """Run a model runner's cells (:func:`run_runner`); spec -> (record, the
    surviving ranks' results, the runner's stderr)."""
    records, stderr = run_runner(runner_file, out, cells, deadline)
    return {record["spec"]: (record, rank_results(out, record), stderr) for record in records}


def consumed_inputs(world: int, kills: list[tuple[int, str, int]], inputs: int
                    ) -> dict[int, int]:
    """Rank -> the inputs it consumed, rank r having ``inputs + r``: a rank killed
    in its loop body or after its heartbeat did not consume that input; one
    killed at its step did (its gradient unit completed: the survivors applied it)."""
    out = {r: inputs + r for r in range(world)}
    for rank, point, at in kills:
        if point in ("body", "beat"):
            out[rank] = at
        elif point == "step":
            out[rank] = at + 1
    return out


def survivors(results: dict[str, Any], spec: str,
              parse: Callable[[str], tuple[int, list[tuple[int, str, int]], str]]
              ) -> dict[int, Any]:
    """The surviving ranks' results of cell ``spec``, after checking that exactly
    the killed ranks died by SIGKILL and every other rank exited 0."""
    record, ranks, stderr = results[spec]
    world, kills, _ = parse(spec)
    killed = {r for r, _, _ in kills}
    for rank in range(world):
        expected = -9 if rank in killed else 0
        assert record["exit"][str(rank)] == expected, (spec, record, stderr[-3000:])
    assert set(ranks) == set(range(world)) - killed, (spec, stderr[-3000:])
    return ranks  # type: ignore[no-any-return]

