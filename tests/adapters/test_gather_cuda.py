"""``Gather`` with CUDA tensors: on an nccl group (the bytes stay on the GPU)
and on a gloo group (they travel through the CPU); only where CUDA is.

Two processes on nccl need two GPUs (nccl refuses two ranks on one device):
with one GPU the nccl test runs one rank, and the gloo test two ranks on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gather_scenarios import check
from support import run_scenarios, scenario_records

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.launches,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WORKER = Path(__file__).parent / "programs" / "gather_scenarios.py"
LAUNCH_TIMEOUT = 150.0


def _run(backend: str, world: int, out: Path, name: str = "cuda_tensors") -> list[Any]:
    records = run_scenarios(WORKER, world, out, [name], LAUNCH_TIMEOUT, before=[backend])
    return [r["result"] for r in scenario_records(records, name)]


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_cuda_tensors_on_nccl(tmp_path: Path) -> None:
    world = 2 if torch.cuda.device_count() >= 2 else 1
    check("cuda_tensors", _run("nccl", world, tmp_path), world)


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_cuda_tensors_on_gloo(tmp_path: Path) -> None:
    check("cuda_tensors", _run("gloo", 2, tmp_path), 2)


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_cpu_arrays_on_nccl(tmp_path: Path) -> None:
    """NumPy arrays and CPU tensors on an nccl group: the bytes go through the GPU
    (TorchGroup.all_gather_into falls back to all_gather there), results stay fresh."""
    world = 2 if torch.cuda.device_count() >= 2 else 1
    results = _run("nccl", world, tmp_path, "fresh_results")
    check("fresh_results", results, world)
    assert all(r["into"] for r in results)
