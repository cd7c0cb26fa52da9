"""Starting ``tests/faults/programs/fault_runner.py`` launches from the fault-matrix tests.

A :class:`Launch` is one command (an ``mpirun``, a ``torchrun``, a ``--fork``
runner) with its own output directory and a hard timeout. :func:`run_all`
runs a list of them, a few at a time (most of a launch is start-up or waiting,
so two at a time roughly halves the wall time on two cores), kills the process
group of a launch that overruns, and records exit code, output and duration.
:func:`read_results` collects the per-rank JSON lines the runner wrote. This
module imports neither torch nor mpi4py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.mpi import LAUNCHER_DID_NOT_START, LAUNCHER_TRIES

RUNNER = Path(__file__).resolve().parents[1] / "faults" / "programs" / "fault_runner.py"


@dataclass
class Launch:
    """One launcher invocation and, once run, how it ended."""

    name: str
    command: list[str]
    out: Path
    timeout: float
    env: dict[str, str] | None = None
    returncode: int | None = None
    output: str = ""
    seconds: float = 0.0
    timed_out: bool = False
    results: dict[tuple[str, str], dict[int, dict[str, Any]]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    #: rank -> wall-clock time its first cell started; when the launcher ended.
    started: dict[int, float] = field(default_factory=dict)
    ended_at: float = 0.0
    #: A batch whose rank died (:func:`rerun_after_death`): the cell it died
    #: in, and the launch that ran the cells after it again.
    culprit: tuple[str, str] | None = None
    rerun: Launch | None = None
    rerun_cells: list[tuple[str, str]] = field(default_factory=list)
    #: A stall cell's earlier launches that the machine's load spoiled
    #: (:func:`again_while_entry_timed_out`), oldest first.
    earlier: list[Launch] = field(default_factory=list)

    @property
    def job_seconds(self) -> float | None:
        """From the first rank starting its first cell to the launcher's end:
        the launch's time without the launcher's and interpreters' start-up."""
        return self.ended_at - min(self.started.values()) if self.started else None

    def explain(self, limit: int = 4000) -> str:
        tries = (f" (try {len(self.earlier) + 1}, after {len(self.earlier)} that the "
                 "machine's load spoiled)" if self.earlier else "")
        return (f"{self.name}{tries}: {' '.join(self.command)}\nexit {self.returncode}, "
                f"{self.seconds:.1f} s{' (TIMED OUT)' if self.timed_out else ''}\n"
                f"--- output (tail) ---\n{self.output[-limit:]}")


def _run(launch: Launch) -> Launch:
    for _ in range(LAUNCHER_TRIES):
        _run_once(launch)
        if launch.started or not any(s in launch.output for s in LAUNCHER_DID_NOT_START):
            break
    return launch


def _run_once(launch: Launch) -> Launch:
    launch.timed_out = False
    launch.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        launch.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        errors="replace", env=launch.env, start_new_session=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        launch.output, _ = proc.communicate(timeout=launch.timeout)
    except subprocess.TimeoutExpired:
        launch.timed_out = True
        _end_session(proc)
        launch.output, _ = proc.communicate()
    launch.returncode = proc.returncode
    launch.seconds = time.monotonic() - started
    launch.ended_at = time.time()
    launch.results, launch.done = read_results(launch.out)
    launch.started = read_starts(launch.out)
    return launch


def _end_session(proc: subprocess.Popen[str]) -> None:
    """Stop an overrunning launch and everything it started.

    The launch leads a session of its own (``start_new_session``). Its process
    group is not enough: Open MPI's prterun puts every rank in a process group
    of its own (same session), so killing the group would leave spinning
    ranks behind. So: SIGTERM the launcher (it cleans up its ranks), then
    SIGKILL whatever is still in the session.
    """
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 6 is the session id; the command (field 2) may hold spaces.
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 3 and int(fields[3]) == proc.pid:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_all(launches: Sequence[Launch], parallel: int = 2) -> dict[str, Launch]:
    """Run every launch (``parallel`` at a time); return them by name."""
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        finished = list(pool.map(_run, launches))
    return {launch.name: launch for launch in finished}


def read_results(
    out: Path,
) -> tuple[dict[tuple[str, str], dict[int, dict[str, Any]]], set[int]]:
    """``(kind, arg) -> rank -> result`` from the runner's per-rank files, and
    the ranks that finished every cell."""
    results: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    done: set[int] = set()
    for path in sorted(out.glob("launch*-rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if record["kind"] == "done":
                done.add(record["rank"])
                continue
            if record["kind"] == "started":
                continue
            key = (record["kind"], str(record.get("arg") or ""))
            results.setdefault(key, {})[record["rank"]] = record["result"]
    return results, done


def read_starts(out: Path) -> dict[int, float]:
    """rank -> the wall-clock time at which it started its first cell."""
    starts: dict[int, float] = {}
    for path in sorted(out.glob("launch*-rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record["kind"] == "started":
                rank = record["rank"]
                starts[rank] = min(starts.get(rank, record["time"]), record["time"])
    return starts


def parse_cells(spec: str, world_size: int) -> list[tuple[str, str]]:
    """A ``CELLS`` argument of the runner as ``(kind, arg)`` pairs (``last``: the last rank)."""
    cells = []
    for item in filter(None, spec.split(",")):
        kind, _, arg = item.partition(":")
        cells.append((kind, str(world_size - 1) if arg == "last" else arg))
    return cells


def spell_cells(cells: Sequence[tuple[str, str]]) -> str:
    """``cells`` as a ``CELLS`` argument (:func:`parse_cells` reads it back)."""
    return ",".join(f"{kind}:{arg}" if arg else kind for kind, arg in cells)


def finished_by_all(out: Path, launch: int, world_size: int) -> set[tuple[str, str]]:
    """The cells of launch number ``launch`` in ``out`` whose result every rank wrote."""
    counts: dict[tuple[str, str], int] = {}
    for rank in range(world_size):
        path = out / f"launch{launch}-rank{rank}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # cut short by the death
                continue
            if "result" in record and record["kind"] != "pre_init":
                key = (record["kind"], str(record.get("arg") or ""))
                counts[key] = counts.get(key, 0) + 1
    return {cell for cell, count in counts.items() if count == world_size}


def rerun_after_death(launch: Launch, spec: str, world_size: int,
                      again: Callable[[str, Path], Launch]) -> Launch:
    """One crash fails one cell: finish a batch launch whose rank died.

    If ``launch`` (a launcher running the cells of ``spec`` in order, one
    launch: its files are ``launch0-rank{R}.jsonl``) ended with a cell that
    not every rank finished, that cell is its :attr:`Launch.culprit`, and the
    cells after it run again in ``again(rest_spec, out)`` (a fresh launch in
    ``launch.out / "rerun"``), itself finished the same way.

    Returns:
        ``launch``, with ``culprit``, ``rerun`` and ``rerun_cells`` set.
    """
    cells = parse_cells(spec, world_size)
    done = finished_by_all(launch.out, 0, world_size)
    unfinished = [cell for cell in cells if cell not in done]
    if not unfinished:
        return launch
    launch.culprit = unfinished[0]
    rest = cells[cells.index(launch.culprit) + 1:]
    if rest:
        rerun = _run(again(spell_cells(rest), launch.out / "rerun"))
        launch.rerun = rerun_after_death(rerun, spell_cells(rest), world_size, again)
        launch.rerun_cells = rest
    return launch


def launch_of(launch: Launch, cell: tuple[str, str]) -> Launch:
    """The launch of a batch (:func:`rerun_after_death`) in which ``cell`` ran to its end.

    Fails the test (the launch's output) if a rank died in ``cell``.
    """
    import pytest

    if launch.culprit == cell:
        pytest.fail(f"cell {cell}: a rank of its launch died in it (the cells after it "
                    f"ran again in a fresh launch)\n{launch.explain()}", pytrace=False)
    if launch.rerun is not None and cell in launch.rerun_cells:
        return launch_of(launch.rerun, cell)
    return launch


#: A watchdog that fired at the agreement check at entry (its RankTimeout's text).
ENTRY_TIMEOUT = re.compile(r"made no progress for [\d.]+ s \(timeout [\d.]+ s\) in phase "
                           r"AGREEING")
#: How many launches a stall cell gets in all (:func:`again_while_entry_timed_out`).
STALL_TRIES = 3


def timed_out_at_entry(results: Iterable[dict[str, Any]]) -> bool:
    """Whether some rank's result (``fault_scenarios.run_case``'s) is a
    watchdog that fired at the entry (:data:`ENTRY_TIMEOUT`)."""
    return any(ENTRY_TIMEOUT.search(json.dumps(result["error"]))
               for result in results if result["error"] is not None)


def again_while_entry_timed_out(launch: Launch, entry_timed_out: Callable[[Launch], bool],
                                again: Callable[[int], Launch]) -> Launch:
    """A stall cell's launch, launched again while its watchdog fired at the entry.

    A stall cell gives its Join a short timeout (seconds) so that the stall
    it injects in the loop body is caught soon. Its ranks pass a barrier just
    before the Join, but on a loaded machine a rank can still reach the
    Join's agreement check at entry more than that timeout after its peers
    (CI once saw 6 s between two ranks leaving the same barrier and the
    later one's first status post, where 10 ms is usual). The peers'
    watchdogs then rightly fire there, before the stall, and the cell
    measured the machine, not the Join. Such a launch runs again (``again``),
    at most :data:`STALL_TRIES` launches in all, after the parallel ones, so
    with less load. A Join that timed out at the entry every time still
    fails the cell: the last launch is checked as any other. (The caller
    says what counts as such a launch: ``entry_timed_out``.)

    Args:
        launch: the cell's finished launch.
        entry_timed_out: whether a launch's watchdog fired at the entry.
        again: a fresh, unstarted launch of the same cell for the given try (2, 3, ...),
            with an output directory of its own.

    Returns:
        The last launch run, its :attr:`Launch.earlier` the ones before it.
    """
    earlier: list[Launch] = []
    while entry_timed_out(launch) and len(earlier) + 1 < STALL_TRIES:
        earlier.append(launch)
        launch = _run(again(len(earlier) + 1))
    launch.earlier = earlier
    return launch


def runner_args(out: Path, cells: str, *extra: str) -> list[str]:
    return [str(RUNNER), "--out", str(out), *extra, cells]


def python() -> str:
    return sys.executable


def summarize(results: dict[int, dict[str, Any]], failing: int) -> str:
    """One cell's per-rank outcome in a few words, for docs/reliability.md."""
    peers: dict[str, int] = {}
    for rank, result in sorted(results.items()):
        if rank == failing:
            continue
        error = result["error"]
        name = "no error" if error is None else error["type"]
        if error is not None and "peer" in error:
            name += f"(rank {error['peer']['rank']})"
        peers[name] = peers.get(name, 0) + 1
    own = results.get(failing, {}).get("error")
    slowest = max((r["seconds"] for r in results.values()), default=0.0)
    parts = [f"rank {failing}: {own['type'] if own else 'no error'}"]
    parts += [f"{count}x {name}" for name, count in peers.items()]
    return "; ".join(parts) + f"; all out in {slowest:.2f} s"


def record_cell(backend: str, case: str, world_size: int, failing: int, outcome: str) -> None:
    """Append a passed cell to ``$JOINKIT_FAULT_MATRIX`` (a JSON-lines file), if set."""
    path = os.environ.get("JOINKIT_FAULT_MATRIX")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"backend": backend, "case": case, "world_size": world_size,
                                "failing": failing, "outcome": outcome}) + "\n")


_STATUS_LINE = re.compile(r"^  ranks? ([\d, -]+?)(?: \(\d+ ranks\))?: (.*)$")


def statuses_in(text: str) -> dict[int, str]:
    """rank -> status, read back from a stall diagnostic's lines, which give
    ranks in one state one line (``  ranks 1-3 (3 ranks): ...``)."""
    _, _, listing = text.partition("what the ranks were last seen doing:\n")
    out = {}
    for line in listing.splitlines():
        match = _STATUS_LINE.match(line)
        if match is None:
            break
        for span in match.group(1).split(", "):
            first, _, last = span.partition("-")
            for rank in range(int(first), int(last or first) + 1):
                out[rank] = match.group(2)
    return out
