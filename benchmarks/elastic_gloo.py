"""Elastic finish on gloo: time from a rank's death to the survivors' next iteration.

    python benchmarks/elastic_gloo.py [KILLS] [INPUTS]

Runs ``tests/elastic/programs/elastic_torch_runner.py`` (ranks forked from a parent that hosts
the TCPStore; a Join with ``on_rank_loss="finish"`` over a Counter and a small
linear model, one gradient all-reduce per input) with ``KILLS`` cells (default
12) in worlds of 3 and 4, each SIGKILLing one rank in its loop body or between
its heartbeat and its all-reduce, and reports the median time from the death
(the victim's clock just before its SIGKILL) to the survivors' next completed
all-reduce (the slowest survivor's). Target: <= 1 s. It also times a plain loop
of ``INPUTS`` inputs (default 400) on 3 ranks with ``on_rank_loss="finish"``
and ``"raise"``: what elastic mode costs per iteration when nobody dies (its
units are synchronous: the heartbeat is waited for).
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
RUNNER = ROOT / "tests" / "elastic" / "programs" / "elastic_torch_runner.py"
TARGET_S = 1.0


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    """This environment, ``extra``, and the tests' folder on PYTHONPATH (the runner's
    support package)."""
    path = [str(ROOT / "tests"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, **(extra or {}), "PYTHONPATH": os.pathsep.join(path)}


def run(cells: list[str], env: dict[str, str] | None = None) -> Path:
    out = Path(tempfile.mkdtemp(prefix="elastic_gloo_"))
    subprocess.run([sys.executable, str(RUNNER), "--out", str(out), "--deadline", "60", *cells],
                   check=True, timeout=120 + 60 * len(cells), env=_env(env),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def recovery_seconds(out: Path, cell: int, world: int, victim: int) -> float:
    died = json.loads((out / f"cell{cell}-rank{victim}.json").read_text())["time"]
    after = []
    for rank in range(world):
        if rank == victim:
            continue
        times = json.loads((out / f"cell{cell}-rank{rank}.json").read_text())["times"]
        # The first all-reduce completed on the group rebuilt without it.
        after.append(min(t for t, size in times if t > died and size < world))
    return max(after) - died


def main() -> None:
    kills = _bench.int_arg(1, 12)
    inputs = _bench.int_arg(2, 400)
    cells, plan = [], []
    for index in range(kills):
        world = 3 + index % 2
        victim = index % world
        point = ("body", "beat")[index // 2 % 2]
        cells.append(f"{world}:{victim}/{point}/3")
        plan.append((world, victim))
    out = run(cells)
    seconds = [recovery_seconds(out, cell, world, victim)
               for cell, (world, victim) in enumerate(plan)]
    median = statistics.median(seconds)
    print(f"   ({len(seconds)} kills: min {min(seconds):.3f} s, max {max(seconds):.3f} s)")
    info = {"kills": kills, "min": f"{min(seconds):.3f} s", "max": f"{max(seconds):.3f} s",
            "worlds": "3 and 4"}
    _bench.record_value("elastic gloo", "death -> survivors' next completed iteration "
                        "(median)", median, "s", TARGET_S, info)
    per_input = {}
    for mode in ("finish", "raise"):
        out = run(["3:"] * 3, {"ELASTIC_INPUTS": str(inputs), "ELASTIC_MODE": mode})
        runs = []
        for cell in range(3):
            data = [json.loads((out / f"cell{cell}-rank{r}.json").read_text()) for r in range(3)]
            runs.append(max((d["times"][-1][0] - d["times"][0][0]) / (len(d["times"]) - 1)
                            for d in data))
        per_input[mode] = statistics.median(runs) * 1e6
        _bench.record_value("elastic gloo", f"per input, nobody dies, on_rank_loss={mode!r}",
                            per_input[mode], "us", None, {"inputs": inputs, "world": 3})
    _bench.record_value("elastic gloo", "per-input cost ratio finish/raise",
                        per_input["finish"] / per_input["raise"], "x", None, {})


if __name__ == "__main__":
    main()
