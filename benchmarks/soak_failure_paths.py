"""Soak the failure paths: crashes per thousand runs, under CPU load (issue 30).

Not a timing, not in CI and not in ``benchmarks/run.py``: a long run that
counts *native crashes* (a rank process killed by a signal: glibc's ``double
free or corruption`` is a SIGABRT; or ended with a non-zero status) and hangs
(a job that overran its deadline) in the scenarios where ranks raise while
collectives may be in flight::

    python benchmarks/soak_failure_paths.py --runs 1000 --load 2 --out /tmp/soak

Each *job* starts ``--world`` rank processes of ``tests/adapters/torch/programs/fsdp_scenarios.py``
(one gloo group each, as ``tests/adapters/torch/test_fsdp.py`` does) that run the FSDP2
failure-path scenarios ``fsdp_throw``, ``fsdp_peer_failure`` and
``fsdp_peer_failure_in_forward`` (or the ``--scenarios`` named, e.g.
``fsdp_epochs``) ``--per-job`` times over; ``--elastic N`` adds
N rounds of ``tests/elastic/programs/elastic_fsdp_runner.py``'s kill cells (a rank SIGKILLed
on purpose, the survivors rebuild: a death there is expected, a crash of a
survivor is not). ``--load L`` starts ``L`` busy-loop processes for the whole
soak (the issue's crash came on a machine loaded by another benchmark). The
ranks run with ``MALLOC_CHECK_=3`` (glibc's checking allocator, preloaded:
glibc 2.34+ reads it only from ``libc_malloc_debug.so``), ``MALLOC_PERTURB_``
(freed memory is scribbled over, so a use after free shows), and
``PYTHONFAULTHANDLER=1``; ``--allocator plain`` leaves glibc's allocator as
the crashed job had it (its thread caches on, blocks reused as they come);
``--allocator pydebug`` leaves it so too, and turns on CPython's debug hooks
on its own allocator (``PYTHONMALLOC=pymalloc_debug``): a Python allocation
or free by a thread that does not hold the GIL (a native thread dropping the
last reference of a Python object), a write past either end of a Python
block, or a block freed through the wrong family is a fatal error there, not
a corruption found later. ``--allocator asan`` preloads AddressSanitizer's
allocator and interceptors (``libasan``) and
leaves ``pymalloc`` on: a ``free()`` of memory that no ``malloc`` returned
(a Python block freed by C code as if it were its own), double frees, and
reads, ``recv``s and copies into freed memory. The other modes leave
``pymalloc`` as it is; ``benchmarks/memcheck_fsdp.py`` replaces it with
``malloc``, which hides the first kind.
``--scenarios all`` runs every CPU scenario of ``tests/adapters/torch/test_fsdp.py``'s job,
in its order. A dead rank's output and its core file (where ``ulimit -c``
allows, in the job's folder) are kept in ``--out``.

A *run* is one scenario on one job (all its ranks). The last line printed is
a JSON summary: runs, crashes, hangs, crashes per thousand runs, the load and
the wall time; ``benchmarks/RESULTS.md`` ("Failure-path soak") records them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support import describe_exit, launch_ranks, program, programs_env, scenario_names  # noqa: E402

FAILURE_PATHS = ["fsdp_throw", "fsdp_peer_failure", "fsdp_peer_failure_in_forward"]
ELASTIC_CELLS = ["3:1/body/3", "3:0/beat/2", "4:2/beat/4", "4:1/body/2+2/beat/4"]
MALLOC_DEBUG = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
ASAN = "/usr/lib/x86_64-linux-gnu/libasan.so.8"


def rank_env(allocator: str = "checking") -> dict[str, str]:
    env = programs_env({**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
    if allocator == "checking":
        env.update(MALLOC_CHECK_="3", MALLOC_PERTURB_="165")
        if Path(MALLOC_DEBUG).exists():
            env["LD_PRELOAD"] = MALLOC_DEBUG
    elif allocator == "pydebug":
        env["PYTHONMALLOC"] = "pymalloc_debug"
    elif allocator == "asan":
        if not Path(ASAN).exists():
            raise SystemExit(f"--allocator asan needs {ASAN} (apt-get install libasan8)")
        env.update(LD_PRELOAD=ASAN, ASAN_OPTIONS="detect_leaks=0:halt_on_error=1")
    return env


def busy() -> None:  # pragma: no cover - a load process
    while True:
        pass


def fsdp_job(job: int, args: argparse.Namespace, out: Path) -> dict[str, object]:
    """One job of the FSDP failure paths; what it ran and how its ranks ended."""
    folder = out / f"fsdp{job}"
    folder.mkdir(parents=True)
    names = args.scenarios * args.per_job
    worker = program("fsdp_scenarios.py", args.tests)
    runs = launch_ranks(
        [[sys.executable, str(worker), str(rank), str(args.world), str(folder / "store"),
          str(folder), *names] for rank in range(args.world)],
        args.deadline, env=rank_env(args.allocator), cwd=folder, stop_after_death=5.0)
    codes = [run.returncode for run in runs]
    finished = min(
        (len((folder / f"rank{r}.jsonl").read_text().splitlines())
         if (folder / f"rank{r}.jsonl").exists() else 0) for r in range(args.world))
    crashed = any(code not in (0, -9) for code in codes)
    hung = not crashed and any(code == -9 for code in codes)
    bad = [json.loads(line) for r in range(args.world)
           if (folder / f"rank{r}.jsonl").exists()
           for line in (folder / f"rank{r}.jsonl").read_text().splitlines()
           if not json.loads(line)["ok"]]
    record = {"kind": "fsdp", "job": job, "runs": len(names), "finished": finished,
              "exits": [describe_exit(code) for code in codes], "crashed": crashed,
              "hung": hung, "scenario_errors": len(bad)}
    if crashed or hung or bad:
        for rank, run in enumerate(runs):
            (folder / f"output{rank}.txt").write_text(run.stdout)
    else:
        shutil.rmtree(folder)
    return record


def elastic_job(job: int, args: argparse.Namespace, out: Path) -> dict[str, object]:
    """One round of elastic FSDP kill cells (forked ranks, one killed on purpose)."""
    folder = out / f"elastic{job}"
    runner = program("elastic_fsdp_runner.py", args.tests)
    done = subprocess.run(
        [sys.executable, str(runner), "--out", str(folder), "--deadline", str(args.deadline),
         *ELASTIC_CELLS], capture_output=True, text=True, env=rank_env(args.allocator),
        timeout=(args.deadline + 30) * len(ELASTIC_CELLS) + 60)
    cells = [json.loads(line) for line in (folder / "cells.jsonl").read_text().splitlines()] \
        if (folder / "cells.jsonl").exists() else []
    crashed = done.returncode != 0 or len(cells) != len(ELASTIC_CELLS)
    hung = False
    for cell in cells:
        killed = {int(item.split("/")[0]) for item in cell["spec"].split(":")[1].split("+")}
        for rank, code in cell["exit"].items():
            expected = -9 if int(rank) in killed else 0
            if code == "killed after deadline":
                hung = True
            elif code != expected:
                crashed = True
    record = {"kind": "elastic", "job": job, "runs": len(ELASTIC_CELLS),
              "finished": len(cells), "exits": [c["exit"] for c in cells],
              "crashed": crashed, "hung": hung}
    if crashed or hung:
        (folder / "stderr.txt").write_text(done.stderr)
    else:
        shutil.rmtree(folder)
    return record


def out_of_time(started: float, minutes: float | None) -> bool:
    """Whether a soak given ``minutes`` (None: no limit) has used them up."""
    return minutes is not None and time.monotonic() - started >= 60 * minutes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000,
                        help="FSDP failure-path scenario runs in all (default 1000)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--per-job", type=int, default=10,
                        help="rounds of the scenarios per job")
    parser.add_argument("--scenarios", nargs="+", default=FAILURE_PATHS,
                        help="fsdp_scenarios.py's scenarios each round runs (default: "
                             "the three failure paths; issue 30's job most likely died in "
                             "fsdp_epochs; all: the CPU scenarios of test_fsdp.py's "
                             "job, in order)")
    parser.add_argument("--allocator", choices=["checking", "plain", "pydebug", "asan"],
                        default="checking",
                        help="checking: glibc's checking allocator and MALLOC_PERTURB_; "
                             "plain: glibc's allocator untouched, as the crashed job had it; "
                             "pydebug: plain, and CPython's allocator debug hooks (the GIL "
                             "held for every Python allocation and free, block bounds); "
                             "asan: AddressSanitizer preloaded, pymalloc left on")
    parser.add_argument("--elastic", type=int, default=0,
                        help="rounds of the elastic kill cells")
    parser.add_argument("--load", type=int, default=2, help="busy-loop processes beside")
    parser.add_argument("--deadline", type=float, default=300.0,
                        help="seconds per job (per elastic cell)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="start no job after this many minutes (the runs done so far "
                             "are the soak's)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tests", type=Path, default=ROOT / "tests",
                        help="where the workers are (an older checkout's tests/, to measure "
                             "it; its joinkit through PYTHONPATH)")
    args = parser.parse_args()
    if args.scenarios == ["all"]:  # as tests/adapters/torch/test_fsdp.py picks them
        args.scenarios = [name for name in scenario_names(program("fsdp_scenarios.py", args.tests))
                          if not name.startswith(("nccl_", "cuda_"))]
    args.out.mkdir(parents=True, exist_ok=True)
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    import multiprocessing

    burners = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
    for burner in burners:
        burner.start()
    started = time.monotonic()
    records = []
    try:
        job = 0
        while (sum(r["runs"] for r in records if r["kind"] == "fsdp") < args.runs
               and not out_of_time(started, args.minutes)):
            records.append(fsdp_job(job, args, args.out))
            print(json.dumps(records[-1]), flush=True)
            job += 1
        for round_ in range(args.elastic):
            records.append(elastic_job(round_, args, args.out))
            print(json.dumps(records[-1]), flush=True)
    finally:
        for burner in burners:
            burner.kill()
    runs = sum(int(r["runs"]) for r in records)
    crashes = sum(1 for r in records if r["crashed"])
    hangs = sum(1 for r in records if r["hung"])
    summary = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
        f"{os.cpu_count()} cores", "world": args.world, "load": args.load,
        "scenarios": args.scenarios, "allocator": args.allocator,
        "fsdp_runs": sum(int(r["runs"]) for r in records if r["kind"] == "fsdp"),
        "elastic_runs": sum(int(r["runs"]) for r in records if r["kind"] == "elastic"),
        "runs": runs, "crashes": crashes, "hangs": hangs,
        "crashes_per_1000_runs": round(1000 * crashes / runs, 2) if runs else None,
        "scenario_errors": sum(int(r.get("scenario_errors", 0)) for r in records),
        "minutes": round((time.monotonic() - started) / 60, 1),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
