"""``backends.init()`` / ``init_torch()`` for real: under mpirun, torchrun, a
faked srun, and with no launcher (``programs/show_init.py`` prints what it got).

A faked launcher is its variables and nothing else, so mpi4py's MPI in such a
process is a singleton: a world of one, which ``init`` must catch when the
launcher's variables say the world is larger.

torch-specific tests ``importorskip`` torch inside the test, so the no-torch
CI env runs the rest; on the main env nothing is skipped.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.mpi import ROOT, child_env, explain, run_mpi, tagged

from joinkit.backends.launch._plan import _slurm_port

pytestmark = pytest.mark.launches

SHOW = Path(__file__).parent / "programs" / "show_init.py"
COUNTER = ROOT / "examples" / "counter.py"


def _run_tasks(script: Any, envs: list[dict[str, str]], *args: str,
               timeout: float = 100) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` once per environment, all at once (as a launcher would)."""
    procs = [subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for env in envs]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _srun_env(rank: int, tasks: int, job: int, extra: dict[str, str] | None = None
              ) -> dict[str, str]:
    """The variables srun gives task ``rank`` of a step without an MPI plugin."""
    return child_env({
        "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank), "SLURM_NTASKS": str(tasks),
        "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NODELIST": "localhost",
        "SLURM_LAUNCH_NODE_IPADDR": "10.255.255.1", **(extra or {}),
    })


def _free_slurm_job() -> int:
    """A job id whose derived rendezvous port is free here."""
    return next(job for job in range(4242, 4342) if _free(_slurm_port(str(job), "0")))


def _one_process(env: dict[str, str], mode: str = "init") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SHOW), mode], capture_output=True, text=True,
                          timeout=50, env=env, cwd=ROOT)


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
    job = _free_slurm_job()
    # mpi4py is installed here, so srun's natural choice would be MPI.
    envs = [_srun_env(rank, 2, job, {"JOINKIT_BACKEND": "torch"}) for rank in range(2)]
    results = _run_tasks(SHOW, envs)
    lines = []
    for result in results:
        assert result.returncode == 0, explain(result)
        lines += tagged(result.stdout, "JOINKIT-INIT")
    assert _summary(lines) == {("TorchGroup", 2, "srun", 3)}
    assert {line["env"]["MASTER_ADDR"] for line in lines} == {"localhost"}
    assert {line["env"]["MASTER_PORT"] for line in lines} == {str(_slurm_port(str(job), "0"))}


# -- no silent world of one -------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.needs_torch
def test_srun_without_pmi_falls_back_from_an_mpi_world_of_one_to_torch() -> None:
    pytest.importorskip("torch")
    # srun --mpi=none: mpi4py is installed (srun's natural choice is MPI), but
    # MPI is a singleton on each task. init() must see that it built a world
    # of 1 where Slurm started 2, and build torch's from the Slurm variables.
    job = _free_slurm_job()
    results = _run_tasks(SHOW, [_srun_env(rank, 2, job) for rank in range(2)])
    lines = []
    for result in results:
        assert result.returncode == 0, explain(result)
        lines += tagged(result.stdout, "JOINKIT-INIT")
    assert _summary(lines) == {("TorchGroup", 2, "srun", 3)}
    assert {line["env"]["MASTER_PORT"] for line in lines} == {str(_slurm_port(str(job), "0"))}
    # Said once, on task 0.
    warning = "RuntimeWarning: srun started 2 tasks (SLURM_STEP_NUM_TASKS=2), but MPI's " \
              "COMM_WORLD has 1 rank: MPI is not wired to Slurm"
    assert warning in results[0].stderr, explain(results[0])
    assert "RuntimeWarning" not in results[1].stderr, explain(results[1])


@pytest.mark.timeout(120)
@pytest.mark.needs_torch
def test_the_counter_under_srun_without_pmi_counts_every_task() -> None:
    pytest.importorskip("torch")
    # The issue's symptom: each task printed "5 inputs processed across all
    # ranks!" (a world of one each) and exited 0.
    job = _free_slurm_job()
    results = _run_tasks(COUNTER, [_srun_env(rank, 2, job) for rank in range(2)])
    out = []
    for result in results:
        assert result.returncode == 0, explain(result)
        out += result.stdout.splitlines()
    assert sorted(out) == sorted([
        "10 inputs processed before rank 0 joined!",
        "11 inputs processed across all ranks!",
        "11 inputs processed before rank 1 joined!",
        "11 inputs processed across all ranks!",
    ])


@pytest.mark.timeout(60)
def test_forced_mpi_under_srun_without_pmi_names_both_sizes_and_the_fix() -> None:
    # One task of two is enough: its MPI world of one disagrees with Slurm's 2.
    result = _one_process(_srun_env(0, 2, 4242, {"JOINKIT_BACKEND": "mpi"}))
    assert result.returncode != 0, explain(result)
    assert ("RuntimeError: JOINKIT_BACKEND=mpi: MPI's COMM_WORLD has 1 rank, but srun "
            "started 2 tasks (SLURM_STEP_NUM_TASKS=2): MPI is not wired to Slurm"
            in result.stderr), explain(result)
    assert "srun --mpi=pmix" in result.stderr and "JOINKIT_BACKEND=torch" in result.stderr
    assert "JOINKIT-INIT" not in result.stdout


@pytest.mark.timeout(60)
def test_forced_mpi_under_torchrun_names_both_sizes_and_the_fix() -> None:
    env = child_env({"TORCHELASTIC_RUN_ID": "none", "RANK": "1", "WORLD_SIZE": "2",
                     "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                     "JOINKIT_BACKEND": "mpi"})
    result = _one_process(env)
    assert result.returncode != 0, explain(result)
    assert ("RuntimeError: JOINKIT_BACKEND=mpi: MPI's COMM_WORLD has 1 rank, but torchrun "
            "started 2 processes (WORLD_SIZE=2): torchrun starts no MPI job"
            in result.stderr), explain(result)
    assert "JOINKIT-INIT" not in result.stdout


# What MPICH's (or Intel MPI's) mpiexec gives rank 1 of 2; mpi4py here is
# built on Open MPI, which does not read these, so it runs as a singleton.
def _hydra_env(rank: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    return child_env({"PMI_RANK": str(rank), "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2",
                      "MPI_LOCALRANKID": str(rank), **(extra or {})})


@pytest.mark.timeout(60)
def test_another_mpis_launcher_names_both_sizes_and_the_fix() -> None:
    result = _one_process(_hydra_env(1))
    assert result.returncode != 0, explain(result)
    assert ("RuntimeError: MPI's COMM_WORLD has 1 rank, but mpirun started 2 processes "
            "(PMI_SIZE=2): the MPI library mpi4py uses is not the one whose launcher "
            "started this process" in result.stderr), explain(result)


@pytest.mark.timeout(120)
@pytest.mark.needs_torch
def test_init_torch_under_another_mpis_launcher() -> None:
    pytest.importorskip("torch")
    # Without MASTER_ADDR/MASTER_PORT, only MPI could say where to meet: an error.
    result = _one_process(_hydra_env(1), "init_torch")
    assert result.returncode != 0, explain(result)
    assert ("RuntimeError: MPI's COMM_WORLD has 1 rank, but mpirun started 2 processes "
            "(PMI_SIZE=2): under mpirun torch's rendezvous takes rank and size from MPI"
            in result.stderr), \
        explain(result)
    assert "set MASTER_ADDR and MASTER_PORT" in result.stderr
    # With them, rank and size come from the launcher's variables: a world of 2.
    port = next(port for port in range(29650, 29750) if _free(port))
    extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    results = _run_tasks(SHOW, [_hydra_env(rank, extra) for rank in range(2)], "init_torch")
    lines = []
    for result in results:
        assert result.returncode == 0, explain(result)
        lines += tagged(result.stdout, "JOINKIT-INIT")
    assert _summary(lines) == {("TorchGroup", 2, "mpirun", 3)}
