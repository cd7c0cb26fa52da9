"""Every backend accepts and refuses the same collective calls, in the same words.

The case table is ``programs/backend_check_cases.py``; it runs once per backend
on 2 ranks: threads in this process, torch as 2 gloo processes, MPI under a
real ``mpirun``, each with a timeout. Per case, every rank of every backend
must have the table's outcome: the same result, or the same exception with
the same message, and the ranks still in step afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backend_check_cases import CASES, WORLD, run_cases
from support import launch_ranks
from support.mpi import explain, run_mpi

from joinkit.backends import shares_elements
from joinkit.backends.threads import spawn

PROGRAM = Path(__file__).parent / "programs" / "backend_check_cases.py"
LAUNCH_TIMEOUT = 120.0
BACKENDS = ("threads", "torch", "mpi")
_AVAILABLE = {
    "threads": True,
    "torch": importlib.util.find_spec("torch") is not None,
    "mpi": importlib.util.find_spec("mpi4py") is not None,
}

# backend -> (one outcome table per rank, what went wrong if a rank wrote none)
_runs: dict[str, tuple[list[dict[str, Any]], str]] = {}


def _read(out: Path, problem: str) -> tuple[list[dict[str, Any]], str]:
    tables = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    return tables, "" if len(tables) == WORLD else problem


def _outcomes(backend: str, tmp: Path) -> tuple[list[dict[str, Any]], str]:
    if backend in _runs:
        return _runs[backend]
    tmp.mkdir(parents=True, exist_ok=True)
    if backend == "threads":
        _runs[backend] = (spawn(run_cases, WORLD, timeout=60.0), "")
    elif backend == "torch":
        commands = [[sys.executable, str(PROGRAM), "torch", str(rank), str(WORLD),
                     str(tmp / "store"), str(tmp)] for rank in range(WORLD)]
        done = launch_ranks(commands, LAUNCH_TIMEOUT)
        _runs[backend] = _read(tmp, "\n".join(run.stdout[-3000:] for run in done))
    else:
        try:
            result = run_mpi(PROGRAM, WORLD, "mpi", str(tmp), timeout=LAUNCH_TIMEOUT)
            problem = explain(result)
        except Exception as exc:  # TimeoutExpired: the tables written so far still count
            problem = f"{type(exc).__name__}: {exc}"
        _runs[backend] = _read(tmp, problem)
    return _runs[backend]


def _torch_marked(values: list[str], needs_torch: dict[str, bool]) -> list[Any]:
    # Deselected where torch is missing (tests/conftest.py), not skipped.
    return [pytest.param(v, marks=pytest.mark.needs_torch) if needs_torch[v] else v
            for v in values]


@pytest.mark.launches
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize(
    "backend", _torch_marked(list(BACKENDS), {b: b == "torch" for b in BACKENDS}))
def test_the_table_runs_on_every_rank(backend: str, tmp_path: Path) -> None:
    if not _AVAILABLE[backend]:
        pytest.skip(f"{backend} is not installed")
    tables, problem = _outcomes(backend, tmp_path)
    assert len(tables) == WORLD, problem
    assert all(set(table) == set(CASES) for table in tables)


@pytest.mark.launches
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT)  # the first case may start every launch
@pytest.mark.parametrize(
    "name", _torch_marked(list(CASES), {n: c.needs_torch for n, c in CASES.items()}))
def test_every_backend_accepts_or_refuses_alike(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    seen = {}
    for backend in BACKENDS:
        if not _AVAILABLE[backend]:
            continue
        tables, problem = _outcomes(backend, tmp_path / backend)
        assert len(tables) == WORLD, f"{backend}: {problem}"
        for rank, table in enumerate(tables):
            got = dict(table[name])
            assert got.pop("in_step"), f"{backend} rank {rank}: ranks out of step after {name}"
            seen[f"{backend} rank {rank}"] = got
            if case.refused is not None:
                kind, words = case.refused
                assert got.get("outcome") == kind and words in got.get("message", ""), (
                    f"{backend} rank {rank}: expected {kind} saying {words!r}, got {got}"
                )
            else:
                expected = case.result[rank] if case.per_rank else case.result
                assert got == {"outcome": "ok", "result": expected}, f"{backend} rank {rank}"
    # Refused in the same words everywhere (the ranks a message names aside).
    messages = {who: re.sub(r"rank \d", "rank R", got.get("message", ""))
                for who, got in seen.items()}
    assert len(set(messages.values())) == 1, messages


def _strided(base: Any, shape: tuple[int, ...], strides: tuple[int, ...]) -> Any:
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides)


@pytest.mark.parametrize(("make", "shares"), [
    (lambda: np.zeros(3), False),
    (lambda: np.zeros((3, 2))[:, 0], False),  # a column
    (lambda: np.zeros((3, 2)).T, False),
    (lambda: np.zeros(5)[::-1], False),  # a negative stride
    (lambda: np.zeros((0, 3)), False),
    (lambda: np.zeros(()), False),
    (lambda: np.broadcast_to(np.zeros(1), (3,)), True),
    (lambda: _strided(np.zeros(3), (1, 3), (0, 8)), False),  # a stride of 0 on a size-1 dim
    (lambda: _strided(np.zeros(4), (3,), (4,)), True),  # shorter than an element
    (lambda: _strided(np.zeros(20), (3, 2), (16, 24)), False),  # interleaved, disjoint
    (lambda: _strided(np.zeros(20), (3, 2), (16, 16)), True),  # interleaved, one address twice
], ids=["contiguous", "column", "transposed", "reversed", "empty", "scalar", "broadcast",
        "size-1-stride-0", "short-stride", "interleaved", "interleaved-overlap"])
def test_shares_elements_on_arrays(make: Any, shares: bool) -> None:
    assert shares_elements(make()) is shares


def test_shares_elements_on_tensors() -> None:
    torch = pytest.importorskip("torch")
    cases = [
        (torch.ones(1).expand(4096), True),
        (torch.zeros(2, 1).expand(2, 5), True),
        (torch.zeros(1, 3).expand(1, 3), False),
        (torch.zeros(4, 2)[:, 1], False),
        (torch.zeros(2, 3, 4).permute(2, 0, 1), False),
        (torch.zeros(1, 3, 4, 4).to(memory_format=torch.channels_last), False),
        (torch.zeros(8).as_strided((3, 2), (2, 3)), False),
        (torch.zeros(8).as_strided((3, 2), (1, 2)), True),
        (torch.zeros(3, 0, 1).expand(3, 0, 5), False),
    ]
    assert [shares_elements(t) for t, _ in cases] == [want for _, want in cases]
