"""Elastic finish under ``python -m joinkit run``: death to the survivors' next iteration.

    python benchmarks/elastic_run.py [LAUNCHES]

Runs ``LAUNCHES`` (default 4) launches of ``python -m joinkit run --standalone
--nproc-per-node 4 tests/elastic/programs/elastic_run_program.py`` one after the other, each
with three cells over one elastic gloo group (worlds of 4, 3 and 2; in each, one
rank SIGKILLs itself in its loop body or after its heartbeat, the victim and
the point rotating), and reports the median time from a death (the victim's
clock just before its SIGKILL) to the slowest survivor's next all-reduce
completed without it. Target: <= 1 s. Beside it, the same measure with gloo
ranks under ``mpirun --with-ft ulfm`` (``tests/elastic/programs/elastic_torch_runner.py
--mpirun``, the store hosted by the runner), one launch per kill, as many kills.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "elastic" / "programs" / "elastic_run_program.py"
RUNNER = ROOT / "tests" / "elastic" / "programs" / "elastic_torch_runner.py"
TARGET_S = 1.0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONWARNINGS="ignore")
    env.pop("JOINKIT_BENCH_OUT", None)
    # The programs import the tests' support package.
    path = [str(ROOT / "tests"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def joinkit_run(launch: int) -> list[float]:
    """One launch of three cells; the seconds from each death to the next iteration."""
    points = ("body", "beat")
    cells, alive = [], [0, 1, 2, 3]
    for index in range(3):
        victim = alive[(launch + index) % len(alive)]
        cells.append(f"{victim}/{points[(launch + index) % 2]}/3")
        alive.remove(victim)
    out = Path(tempfile.mkdtemp(prefix="elastic_run_"))
    subprocess.run([sys.executable, "-m", "joinkit", "run", "--standalone", "--nproc-per-node",
                    "4", "--monitor-interval", "0.1", str(PROGRAM), str(out), *cells],
                   check=True, timeout=600, env=_env(), cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    seconds = []
    for path in out.glob("died-*.json"):
        death = json.loads(path.read_text())
        cell = death["cell"]
        after = []
        for data in ranks.values():
            result = data["cells"][cell]
            after.append(min(t for t, size in result["times"]
                             if t > death["time"] and size < result["world"]))
        seconds.append(max(after) - death["time"])
    return seconds


def mpirun(kills: int) -> list[float]:
    """``kills`` cells under mpirun --with-ft ulfm; the seconds from each death."""
    cells, plan = [], []
    for index in range(kills):
        world = 3 + index % 2
        victim = index % world
        cells.append(f"{world}:{victim}/{('body', 'beat')[index // 2 % 2]}/3")
        plan.append((world, victim))
    out = Path(tempfile.mkdtemp(prefix="elastic_mpirun_"))
    subprocess.run([sys.executable, str(RUNNER), "--mpirun", "--out", str(out), "--deadline",
                    "120", *cells], check=True, timeout=200 * kills, env=_env(),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = []
    for cell, (world, victim) in enumerate(plan):
        died = json.loads((out / f"cell{cell}-rank{victim}.json").read_text())["time"]
        after = []
        for rank in range(world):
            if rank == victim:
                continue
            times = json.loads((out / f"cell{cell}-rank{rank}.json").read_text())["times"]
            after.append(min(t for t, size in times if t > died and size < world))
        seconds.append(max(after) - died)
    return seconds


def main() -> None:
    launches = _bench.int_arg(1, 4)
    seconds = [s for launch in range(launches) for s in joinkit_run(launch)]
    median = statistics.median(seconds)
    print("   (joinkit run, each: " + ", ".join(f"{1000 * s:.0f} ms" for s in seconds) + ")")
    _bench.record_value(
        "elastic joinkit run", "death -> survivors' next completed iteration (median)",
        median, "s", TARGET_S,
        {"kills": len(seconds), "min": f"{min(seconds):.3f} s", "max": f"{max(seconds):.3f} s",
         "worlds": "4, 3, 2 (one launch each of 3 cells)"})
    beside = mpirun(len(seconds))
    print("   (mpirun --with-ft ulfm, each: " + ", ".join(f"{1000 * s:.0f} ms" for s in beside)
          + ")")
    _bench.record_value(
        "elastic joinkit run", "beside it: gloo ranks under mpirun --with-ft ulfm (median)",
        statistics.median(beside), "s", TARGET_S,
        {"kills": len(beside), "min": f"{min(beside):.3f} s", "max": f"{max(beside):.3f} s",
         "worlds": "3 and 4"})


if __name__ == "__main__":
    main()
