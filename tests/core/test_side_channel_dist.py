"""``SideChannel`` on gloo (3 ranks) and under ``mpirun`` (2 and 3 ranks).

One launch per backend and world size runs every case of
``side_channel_cases.py`` (``side_channel_worker.py``); each rank's result is
compared with what the inputs alone say. A case that fails raises on its rank
and the next case still runs, so one wrong case cannot hide the others.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import side_channel_cases as cases
from side_channel_worker import NOT_ON_MPI
from support import launch_ranks

WORKER = Path(__file__).parent / "programs" / "side_channel_worker.py"
LAUNCH_TIMEOUT = 180.0

pytestmark = [pytest.mark.timeout(2 * LAUNCH_TIMEOUT), pytest.mark.launches]


def _read(out: Path, world: int) -> dict[str, list[dict[str, Any]]]:
    by_case: dict[str, list[dict[str, Any]]] = {}
    for rank in range(world):
        path = out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            record = json.loads(line)
            by_case.setdefault(record["case"], []).append(record)
    return by_case


def _check(by_case: dict[str, list[dict[str, Any]]], log: str, name: str, world: int) -> None:
    records = by_case.get(name, [])
    assert len(records) == world, f"case {name} did not finish on every rank:\n{log[-3000:]}"
    errors = [r["error"] for r in records if not r["ok"]]
    assert not errors, "\n".join(errors)
    _, expected = cases.CASES[name]
    assert [r["result"] for r in records] == cases.normalize(
        [expected(world, rank) for rank in range(world)])


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("side_channel_gloo")
    world = 3
    runs = launch_ranks([[sys.executable, str(WORKER), "torch", str(rank), str(world),
                          str(out / "store"), str(out)] for rank in range(world)],
                        LAUNCH_TIMEOUT)
    return _read(out, world), "\n".join(run.stdout for run in runs)


@pytest.mark.needs_torch
@pytest.mark.parametrize("name", list(cases.CASES))
def test_case_on_gloo(gloo: tuple[Any, str], name: str) -> None:
    _check(*gloo, name, 3)


_mpi_runs: dict[int, tuple[Any, str]] = {}


def _mpi(world: int, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    if world not in _mpi_runs:
        pytest.importorskip("mpi4py")
        from support.mpi import explain, run_mpi

        out = tmp_path_factory.mktemp(f"side_channel_mpi{world}")
        result = run_mpi(WORKER, world, "mpi", str(out), timeout=LAUNCH_TIMEOUT)
        _mpi_runs[world] = (_read(out, world), explain(result))
    return _mpi_runs[world]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", [n for n in cases.CASES if n not in NOT_ON_MPI])
def test_case_under_mpirun(tmp_path_factory: pytest.TempPathFactory, world: int,
                           name: str) -> None:
    _check(*_mpi(world, tmp_path_factory), name, world)
