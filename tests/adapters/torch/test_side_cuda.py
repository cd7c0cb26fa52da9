"""The side collectives' layouts with CUDA tensors: a strided column, a transposed
``like`` and an ``expand()``ed tensor, on gloo (two ranks on one GPU, the bytes
through the CPU) and on nccl; only where CUDA is (``.ci/gpu_check.sh``).

Two processes on nccl need two GPUs (nccl refuses two ranks on one device): with
one GPU the nccl test runs one rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from side_scenarios import INPUTS, check_layouts
from support import run_scenarios, scenario_records

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.launches,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WORKER = Path(__file__).parent / "programs" / "side_scenarios.py"
LAUNCH_TIMEOUT = 150.0


def _run(backend: str, world: int, out: Path) -> list[Any]:
    records = run_scenarios(WORKER, world, out, ["cuda_layouts"], LAUNCH_TIMEOUT,
                            before=[backend])
    return [r["result"] for r in scenario_records(records, "cuda_layouts")]


def _check(results: list[Any]) -> None:
    inputs = INPUTS[: len(results)]
    for rank, got in enumerate(results):
        check_layouts(got, rank, inputs)
        if inputs[rank]:
            assert got["devices"] == [f"cuda:{rank % torch.cuda.device_count()}"]
        assert got["group_refused"].startswith(
            "all_reduce: the buffer's elements share memory (shape (3,), strides (0,)")


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_cuda_layouts_on_gloo(tmp_path: Path) -> None:
    """Two ranks on the first GPU, rank 1 with no input: it shadows every step."""
    _check(_run("gloo", 2, tmp_path))


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_cuda_layouts_on_nccl(tmp_path: Path) -> None:
    world = 2 if torch.cuda.device_count() >= 2 else 1
    _check(_run("nccl", world, tmp_path))
