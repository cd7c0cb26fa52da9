"""The benchmarks still run: ``benchmarks/run.py --quick`` with tiny counts.

Not a measurement (``--quick`` starts every benchmark at once, so its numbers
mean nothing), only a guard against the scripts rotting: each one must launch
(under torchrun or mpirun where it needs to), finish, and report every variant.
The DDP benchmarks run under torchrun only here; under mpirun they are the same
scripts, and ``tests/backends/launch/test_launch_real.py`` covers that launch path.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launches

pytest.importorskip("torch.distributed")
pytest.importorskip("mpi4py")

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "run.py"

SECTIONS = [
    "### core",
    "### shell",
    "### Counter, gloo",
    "### Counter drain (rank 0 has no inputs), gloo",
    "### Counter, MPI",
    "### Counter drain (rank 0 has no inputs), MPI",
    "### DDP MLP 64-256-1, batch 32, gloo (torchrun)",
    "### DDP drain (rank 0 has no inputs), gloo (torchrun)",
    "### threads, 4 ranks x 20 iterations",
    "### FSDP2 MLP 128-512-512-1, batch 32, gloo (torchrun)",
    "### FSDP2 drain (rank 0 has no inputs), gloo (torchrun)",
    "### MPI heartbeat, 1 rank",
    "### world scale, threads",
    "### torchmetrics MeanSquaredError, dist_sync_on_step=True, gloo",
    "### Exact evaluation, gloo (torchrun)",
    "### Exact evaluation, MPI (mpirun)",
    "### Exact evaluation, gloo (torchrun), CPU time",
]
VARIANTS = ["| no Join |", "| torch Join |", "| joinkit classic |", "| joinkit fused |",
            "| no Join, 2 elements |", "| joinkit fused, 1 element |", "| joinkit Join |",
            "| joinkit, torch-compatible |", "| drain: joinkit fused |", "| FSDP alone |",
            "| drain: joinkit Join |", "| padded |", "| exact |", "| exact, no model |"]


@pytest.mark.timeout(300)
def test_every_benchmark_runs_and_reports(tmp_path: Path) -> None:
    output = tmp_path / "RESULTS.md"
    only = ["core step", "MPI heartbeat", "Counter", "DDP, gloo (torchrun)", "threads",
            "FSDP2", "world scale", "torchmetrics sync", "Exact evaluation"]
    command = [sys.executable, str(RUN), "--quick", "--output", str(output)]
    for name in only:
        command += ["--only", name]
    run = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = output.read_text()
    for heading in SECTIONS + ["## Machine", "## Targets", "## Runs"]:
        assert heading in text, heading
    for variant in VARIANTS:
        assert variant in text, variant
    for measurement in ("| entry, 128 ranks |", "| report, 128 ranks |",
                        "| diagnostic, 128 ranks |", "| entry, all_gather, 64 ranks |"):
        assert measurement in text, measurement


@pytest.mark.timeout(600)
def test_the_ddp_model_family_runs_and_reports(tmp_path: Path) -> None:
    """Issue 50's DDP shapes (1, 2, 24 and ~25 MB buckets): each launches under
    torchrun, finds the bucket count it promises, and reports joinkit's ratio."""
    output = tmp_path / "RESULTS.md"
    shapes = ["1 bucket", "2 buckets", "24 buckets", "25 MB buckets"]
    command = [sys.executable, str(RUN), "--quick", "--output", str(output)]
    for shape in shapes:
        command += ["--only", f"DDP {shape}, gloo (torchrun)"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=560, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = output.read_text()
    for shape in shapes:
        assert f"### DDP MLP, {shape}, gloo (torchrun)" in text, shape
    for variant in ("| no Join |", "| no Join, again |", "| no Join, Python comm hook |",
                    "| joinkit Join |", "| torch Join |"):
        assert variant in text, variant
