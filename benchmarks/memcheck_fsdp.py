"""Run the FSDP scenario job with every rank under Valgrind's memcheck (issue 30).

Not a timing and not in CI: one slow, exact look for memory errors where the
checking allocator and AddressSanitizer's interceptors see only the calls they
wrap. Memcheck checks every load, store and free of a rank's C and C++ code
(torch, gloo, NumPy, CPython with ``PYTHONMALLOC=malloc``)::

    python benchmarks/memcheck_fsdp.py --world 4 --out /tmp/memcheck
    python benchmarks/memcheck_fsdp.py --scenarios fsdp_epochs fsdp_throw --out /tmp/mc
    python benchmarks/memcheck_fsdp.py --elastic --out /tmp/mc  # the soak's kill cells

Each rank runs ``tests/adapters/torch/programs/fsdp_scenarios.py`` (by default every scenario of
``tests/adapters/torch/test_fsdp.py``'s job) with a 30-minute gloo timeout instead of the
worker's 30 s: a rank under memcheck runs 20 to 50 times slower (the 4-rank
job of every scenario took 25 min here, beside other work). ``--elastic``
runs ``benchmarks/soak_failure_paths.py``'s elastic kill cells under one
memcheck: the ranks are forked, and memcheck follows a fork. Needs
``valgrind`` on the PATH.

The loader's own reads (``strncmp`` in ``ld.so``'s ``is_dst`` while it loads
torch's libraries, a known false positive) are counted apart. The last line
printed is a JSON summary: the scenarios that ran, how every rank ended, and
the memory errors outside the loader, with the first one's stack;
``docs/reliability.md`` (issue 30) records the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from soak_failure_paths import ELASTIC_CELLS  # noqa: E402
from support import describe_exit, launch_ranks, program, programs_env, scenario_names  # noqa: E402

MEMCHECK = ["valgrind", "--tool=memcheck", "--undef-value-errors=no", "--fair-sched=yes",
            "--num-callers=40", "--error-limit=no"]
# The worker, with the gloo timeout a rank under memcheck needs.
WORKER = ("import datetime, sys; sys.path.insert(0, {folder!r}); import fsdp_scenarios as w; "
          "w.SCENARIO_TIMEOUT = datetime.timedelta(seconds=1800); w.main(sys.argv[1:])")
ERROR = re.compile(r"^==\d+== (Invalid|Mismatched|Source and destination|Syscall param)")
LOADER = "dl-load.c"


def rank_env() -> dict[str, str]:
    return programs_env({**os.environ, "PYTHONMALLOC": "malloc", "ATEN_CPU_CAPABILITY": "default",
                         "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})


def errors(log: Path) -> tuple[list[str], int]:
    """Memcheck's error blocks in ``log``: (those outside the loader, the loader's count)."""
    found: list[str] = []
    loader = 0
    block: list[str] | None = None
    for line in [*log.read_text(errors="replace").splitlines(), "==0== "]:
        if block is not None and re.match(r"^==\d+==\s+(at|by|Address) ", line):
            block.append(line)
            continue
        if block is not None:
            if any(LOADER in frame for frame in block):
                loader += 1
            else:
                found.append("\n".join(block))
            block = None
        if ERROR.match(line):
            block = [line]
    return found, loader


def scenario_job(args: argparse.Namespace) -> dict[str, object]:
    worker = WORKER.format(folder=str(program("fsdp_scenarios.py", args.tests).parent))
    runs = launch_ranks(
        [[*MEMCHECK, f"--log-file={args.out / f'memcheck_rank{rank}.log'}", sys.executable,
          "-c", worker, str(rank), str(args.world), str(args.out / "store"), str(args.out),
          *args.scenarios] for rank in range(args.world)],
        args.deadline, env=rank_env(), cwd=args.out, stop_after_death=60.0)
    records = [json.loads(line) for rank in range(args.world)
               if (args.out / f"rank{rank}.jsonl").exists()
               for line in (args.out / f"rank{rank}.jsonl").read_text().splitlines()]
    for rank, run in enumerate(runs):
        (args.out / f"output{rank}.txt").write_text(run.stdout)
    return {"ran": len(records), "expected": len(args.scenarios) * args.world,
            "scenario_errors": [(r["name"], r["error"][:300]) for r in records if not r["ok"]],
            "exits": [describe_exit(run.returncode) for run in runs]}


def elastic_job(args: argparse.Namespace) -> dict[str, object]:
    done = subprocess.run(
        [*MEMCHECK, f"--log-file={args.out / 'memcheck_%p.log'}", sys.executable,
         str(program("elastic_fsdp_runner.py", args.tests)), "--out", str(args.out),
         "--deadline", str(args.deadline), *ELASTIC_CELLS],
        capture_output=True, text=True, env=rank_env(), timeout=args.deadline * 5)
    (args.out / "output.txt").write_text(done.stdout + done.stderr)
    cells = [json.loads(line) for line in (args.out / "cells.jsonl").read_text().splitlines()] \
        if (args.out / "cells.jsonl").exists() else []
    return {"ran": len(cells), "expected": len(ELASTIC_CELLS),
            "exits": [cell["exit"] for cell in cells], "runner_exit": done.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--scenarios", nargs="+", default=None,
                        help="fsdp_scenarios.py's scenarios (default: test_fsdp.py's "
                             "job, every scenario without CUDA)")
    parser.add_argument("--elastic", action="store_true",
                        help="the elastic kill cells instead of the scenarios")
    parser.add_argument("--deadline", type=float, default=3600.0, help="seconds for the job")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tests", type=Path, default=ROOT / "tests")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not on the PATH: install it (apt-get install valgrind)")
    if args.scenarios is None:
        args.scenarios = [name for name in scenario_names(program("fsdp_scenarios.py", args.tests))
                          if not name.startswith(("nccl_", "cuda_"))]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    job = elastic_job(args) if args.elastic else scenario_job(args)
    found: list[str] = []
    loader = 0
    for log in sorted(args.out.glob("memcheck_*.log")):
        outside, inside = errors(log)
        found += outside
        loader += inside
    summary = {
        "date": time.strftime("%Y-%m-%d"), "what": "elastic cells" if args.elastic else
        "scenarios", "world": None if args.elastic else args.world,
        "scenarios": ELASTIC_CELLS if args.elastic else args.scenarios, **job,
        "processes": len(list(args.out.glob("memcheck_*.log"))),
        "memory_errors": len(found), "loader_false_positives": loader,
        "first_error": found[0] if found else None,
        "minutes": round((time.monotonic() - started) / 60, 1),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
