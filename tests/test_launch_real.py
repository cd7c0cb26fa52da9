"""``backends.init()`` / ``init_torch()`` for real: under mpirun, torchrun, a
faked srun, and with no launcher (``mpi_programs/show_init.py`` prints what it got).

torch-specific tests ``importorskip`` torch inside the test, so the no-torch
CI env runs the rest; on the main env nothing is skipped.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

import pytest
from mpi_support import PROGRAMS, ROOT, child_env, explain, run_mpi, tagged

from joinkit.backends._launch import _slurm_port

SHOW = PROGRAMS / "show_init.py"


def _lines(result: subprocess.CompletedProcess[str], ranks: int) -> list[dict[str, Any]]:
    assert result.returncode == 0, explain(result)
    lines = sorted(tagged(result.stdout, "JOINKIT-INIT"), key=lambda line: line["rank"])
    assert [line["rank"] for line in lines] == list(range(ranks)), explain(result)
    return lines


def _summary(lines: list[dict[str, Any]]) -> set[tuple[Any, ...]]:
    return {(line["type"], line["world_size"], line["launcher"], line["sum"]) for line in lines}


@pytest.mark.timeout(60)
def test_no_launcher_is_a_world_of_one() -> None:
    result = subprocess.run([sys.executable, str(SHOW)], capture_output=True, text=True,
                            timeout=50, env=child_env(), cwd=ROOT)
    assert _summary(_lines(result, 1)) == {("_SoloGroup", 1, None, 1)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks", [2, 4])
def test_mpirun_gives_an_mpi_group(ranks: int) -> None:
    lines = _lines(run_mpi(SHOW, ranks, timeout=50), ranks)
    total = ranks * (ranks + 1) // 2
    assert _summary(lines) == {("MPIGroup", ranks, "mpirun", total)}


@pytest.mark.timeout(60)
def test_an_unhandled_exception_ends_the_mpi_job() -> None:
    start = time.monotonic()
    result = run_mpi(SHOW, 2, "raise", timeout=50)
    assert result.returncode != 0, explain(result)
    assert "ValueError: injected failure on rank 1" in result.stderr, explain(result)
    assert "JOINKIT-INIT" not in result.stdout  # rank 0 never left its barrier
    assert time.monotonic() - start < 40


@pytest.mark.timeout(60)
def test_mpirun_with_threads_override_gives_worlds_of_one() -> None:
    result = run_mpi(SHOW, 2, env=child_env({"JOINKIT_BACKEND": "threads"}), timeout=50)
    lines = tagged(result.stdout, "JOINKIT-INIT")
    assert result.returncode == 0, explain(result)
    assert [(line["type"], line["rank"], line["world_size"]) for line in lines] == [
        ("_SoloGroup", 0, 1)] * 2


@pytest.mark.timeout(120)
@pytest.mark.needs_torch
def test_init_torch_under_mpirun_runs_ddp() -> None:
    pytest.importorskip("torch")
    # init_torch: rank and size from MPI, the rendezvous broadcast over MPI.
    result = run_mpi(SHOW, 2, "ddp", timeout=110)
    lines = _lines(result, 2)
    assert _summary(lines) == {("TorchGroup", 2, "mpirun", 3)}
    assert all(line["ddp_agree"] for line in lines)
    ports = {line["env"]["MASTER_PORT"] for line in lines}
    assert len(ports) == 1 and None not in ports
    assert [line["env"]["RANK"] for line in lines] == ["0", "1"]
    assert {line["env"]["MASTER_ADDR"] for line in lines} == {"127.0.0.1"}


@pytest.mark.timeout(120)
@pytest.mark.needs_torch
def test_torchrun_gives_a_torch_group() -> None:
    pytest.importorskip("torch")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(SHOW)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=110,
                            env=child_env(), cwd=ROOT)
    assert _summary(_lines(result, 2)) == {("TorchGroup", 2, "torchrun", 3)}


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.timeout(120)
@pytest.mark.needs_torch
def test_srun_without_mpi_initialises_torch_from_slurm_variables() -> None:
    pytest.importorskip("torch")
    # Two processes with the variables srun gives its tasks; no MASTER_* set,
    # so the address is the step's first node and the port comes from the ids.
    job = next(job for job in range(4242, 4342) if _free(_slurm_port(str(job), "0")))
    procs = []
    for rank in range(2):
        env = child_env({
            "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_LAUNCH_NODE_IPADDR": "10.255.255.1",
            # mpi4py is installed here, so srun's natural choice would be MPI.
            "JOINKIT_BACKEND": "torch",
        })
        procs.append(subprocess.Popen([sys.executable, str(SHOW)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT))
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=100)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    lines = []
    for result in results:
        assert result.returncode == 0, explain(result)
        lines += tagged(result.stdout, "JOINKIT-INIT")
    assert _summary(lines) == {("TorchGroup", 2, "srun", 3)}
    assert {line["env"]["MASTER_ADDR"] for line in lines} == {"localhost"}
    assert {line["env"]["MASTER_PORT"] for line in lines} == {str(_slurm_port(str(job), "0"))}
