"""The MPI backend under a real ``mpirun`` with 2 and 4 ranks.

All scenarios (collectives x reduce ops x dtypes x NumPy/torch x sync/async,
buffer semantics, and the Join scenarios of torch's tests) run in one MPI
program per world size (``programs/mpi_scenarios.py``); each test here reads
its case's result from every rank. The status board's case, which waits for
listener threads on loaded machines, has a launch of its own (``ALONE``), so
that however it ends it cannot hold up the others. torch isn't imported here;
torch cases may only report "skip" where torch is not installed (the no-torch
CI env).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import mpi_scenarios as scenarios  # noqa: E402  (pure at import: no mpi4py, no torch)
import pytest
from support.mpi import explain, run_mpi, tagged

pytestmark = pytest.mark.launches

PROGRAMS = Path(__file__).parent / "programs"

pytest.importorskip("mpi4py", reason="the MPI backend needs mpi4py: pip install 'joinkit[mpi]'")

WORLD_SIZES = (2, 4)
TIMEOUT = {2: 90.0, 4: 150.0}
HAVE_TORCH = importlib.util.find_spec("torch") is not None

#: Cases with a launch of their own (per world size).
ALONE = ("buffers/status-board",)

# (world size, alone case) -> each case's lines, and why a case has none (by case).
_runs: dict[tuple[int, str | None], tuple[dict[str, list[dict[str, Any]]], dict[str, str]]] = {}


def _run_once(world_size: int, args: list[str]) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """One mpirun of the scenarios program with ``args`` (the cases, or ``--without
    CASE``): its lines by case, and its trouble ("" if every rank got to the end)."""
    result: subprocess.CompletedProcess[str] | None = None
    problem = ""
    with tempfile.TemporaryDirectory() as out:
        try:
            result = run_mpi(PROGRAMS / "mpi_scenarios.py", world_size, "--out", out, *args,
                             timeout=TIMEOUT[world_size])
            if result.returncode != 0:
                problem = explain(result)
        except subprocess.TimeoutExpired as exc:
            problem = f"timed out after {exc.timeout} s\n{exc.stderr!r:.3000}"
        written = "".join(path.read_text() for path in sorted(Path(out).iterdir()))
    by_case: dict[str, list[dict[str, Any]]] = {}
    for line in tagged(written, "JOINKIT-CASE"):
        by_case.setdefault(line["case"], []).append(line)
    if len(tagged(written, "JOINKIT-DONE")) != world_size and not problem:
        problem = explain(result)
    return by_case, problem


def _results(world_size: int, alone: str | None = None
             ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """Run the scenarios program per world size (and per ``ALONE`` case); index its
    lines by case.

    One crash fails one case: if a run ends early (a rank died, so mpirun ended
    the job, or it overran its timeout), the first case (in the program's
    order) that not every rank reported fails with the run's output, and the
    cases after it run again under a fresh mpirun.
    """
    key = (world_size, alone)
    if key not in _runs:
        todo = [alone] if alone else [c for c in scenarios.case_names() if c not in ALONE]
        by_case: dict[str, list[dict[str, Any]]] = {}
        failed: dict[str, str] = {}
        # The first run names what it leaves out, a rerun what it runs.
        args = [alone] if alone else [arg for case in ALONE for arg in ("--without", case)]
        while todo:
            lines, problem = _run_once(world_size, args)
            done = [case for case in todo if len(lines.get(case, [])) == world_size]
            by_case.update({case: lines[case] for case in done})
            left = [case for case in todo if case not in done]
            if not left:
                break
            failed[left[0]] = (f"the run ended in this case (the cases after it ran again "
                               f"under a fresh mpirun): {problem}")
            if not done:  # nothing ran: a retry would end the same way
                failed.update({case: failed[left[0]] for case in left})
                break
            todo = args = left[1:]
        _runs[key] = (by_case, failed)
    return _runs[key]


def _check(world_size: int, case: str) -> None:
    by_case, failed = _results(world_size, case if case in ALONE else None)
    if case in failed:
        pytest.fail(f"{case}: {failed[case]}", pytrace=False)
    lines = by_case.get(case, [])
    assert len(lines) == world_size, f"{case}: {len(lines)} of {world_size} ranks reported it"
    failures = [f"rank {line['rank']}: {line['detail']}" for line in lines
                if line["status"] == "fail"]
    assert not failures, "\n".join(failures)
    skipped = [line for line in lines if line["status"] == "skip"]
    if skipped:
        assert not HAVE_TORCH, f"{case} skipped although torch is installed: " + skipped[0][
            "detail"]
        pytest.skip(skipped[0]["detail"])
    assert all(line["status"] == "ok" for line in lines), lines


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", scenarios.collective_cases())
def test_collective(world_size: int, case: str) -> None:
    _check(world_size, case)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", [f"buffers/{name}" for name in scenarios.BUFFER_CASES])
def test_buffer_semantics(world_size: int, case: str) -> None:
    _check(world_size, case)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", [f"join/{name}" for name in scenarios.JOIN_CASES])
def test_join_on_mpi(world_size: int, case: str) -> None:
    _check(world_size, case)


def test_every_case_is_collected() -> None:
    collected = (
        set(scenarios.collective_cases())
        | {f"buffers/{name}" for name in scenarios.BUFFER_CASES}
        | {f"join/{name}" for name in scenarios.JOIN_CASES}
    )
    assert collected == set(scenarios.case_names())


EDGES = PROGRAMS / "status_board_edges.py"


@pytest.mark.timeout(120)
def test_status_board_below_thread_multiple_says_why() -> None:
    result = run_mpi(EDGES, 2, "funneled", timeout=90.0)
    output = result.stdout + result.stderr
    assert result.returncode != 0, explain(result)  # a watchdog aborted the job
    needs = "the status board's listener thread needs MPI_THREAD_MULTIPLE"
    refusals = tagged(result.stdout, "JOINKIT-EDGE")
    assert sorted(line["rank"] for line in refusals) == [0, 1], explain(result)
    assert all(needs in line["refused"] for line in refusals), refusals
    assert not any("left" in line for line in refusals), refusals
    # Rank 0's, in the stall; or rank 1's, at the entry, where a loaded machine
    # started rank 0 over 3 s late: either one's diagnostic says why it has
    # no peer status.
    assert re.search(r"joinkit: rank ([01]) aborts the MPI job: rank \1 made no progress",
                     output), explain(result)
    assert f"(peer status unavailable: RuntimeError(\"MPI was initialized with " \
           f"MPI_THREAD_FUNNELED, and {needs}" in output, explain(result)


@pytest.mark.timeout(120)
def test_status_board_listener_stops_at_an_explicit_finalize() -> None:
    result = run_mpi(EDGES, 2, "finalize", timeout=90.0)
    assert result.returncode == 0, explain(result)
    lines = sorted(tagged(result.stdout, "JOINKIT-EDGE"), key=lambda line: line["rank"])
    assert [line["rank"] for line in lines] == [0, 1], explain(result)
    for line in lines:
        assert line["finalized"] and not line["listening"], line
        assert [text.partition(" (")[0] for text in line["seen"].values()] == ["posted"] * 2
