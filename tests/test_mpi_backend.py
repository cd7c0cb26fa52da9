"""The MPI backend under a real ``mpirun`` with 2 and 4 ranks.

All scenarios (collectives x reduce ops x dtypes x NumPy/torch x sync/async,
buffer semantics, and the Join scenarios of torch's tests) run in one MPI
program per world size (``mpi_programs/scenarios.py``); each test here reads
its case's result from every rank. torch isn't imported here; torch cases may
only report "skip" where torch is not installed (the no-torch CI env).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from mpi_support import PROGRAMS, explain, run_mpi, tagged

sys.path.insert(0, str(PROGRAMS))
import scenarios  # noqa: E402  (pure at import: no mpi4py, no torch)

sys.path.pop(0)

pytest.importorskip("mpi4py", reason="the MPI backend needs mpi4py: pip install 'joinery[mpi]'")

WORLD_SIZES = (2, 4)
TIMEOUT = {2: 90.0, 4: 150.0}
HAVE_TORCH = importlib.util.find_spec("torch") is not None

_runs: dict[int, tuple[subprocess.CompletedProcess[str] | None, dict[str, list[dict[str, Any]]],
                       str]] = {}


def _results(world_size: int) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """Run the scenarios program once per world size; index its lines by case."""
    if world_size not in _runs:
        result: subprocess.CompletedProcess[str] | None = None
        problem = ""
        with tempfile.TemporaryDirectory() as out:
            try:
                result = run_mpi(PROGRAMS / "scenarios.py", world_size, "--out", out,
                                 timeout=TIMEOUT[world_size])
                if result.returncode != 0:
                    problem = explain(result)
            except subprocess.TimeoutExpired as exc:
                problem = f"timed out after {exc.timeout} s\n{exc.stderr!r:.3000}"
            written = "".join(path.read_text() for path in sorted(Path(out).iterdir()))
        by_case: dict[str, list[dict[str, Any]]] = {}
        for line in tagged(written, "JOINERY-CASE"):
            by_case.setdefault(line["case"], []).append(line)
        done = tagged(written, "JOINERY-DONE")
        if len(done) != world_size and not problem:
            problem = explain(result)
        _runs[world_size] = (result, by_case, problem)
    _, by_case, problem = _runs[world_size]
    return by_case, problem


def _check(world_size: int, case: str) -> None:
    by_case, problem = _results(world_size)
    lines = by_case.get(case, [])
    assert len(lines) == world_size, (
        f"{case}: {len(lines)} of {world_size} ranks reported it\n{problem}"
    )
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
