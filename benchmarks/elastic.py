"""Time from a rank's death to the survivors' next completed iteration on MPI (issue 20).

    python benchmarks/elastic.py [kills] [ranks]

The driver launches ``mpirun --with-ft ulfm -n ranks`` (default 3) ``kills``
times (default 7). In each launch every rank trains a small linear model
inside ``Join(..., on_rank_loss="finish")``, one all-reduce per iteration on
an ``MPIGroup`` (40 iterations); rank 1 SIGKILLs itself in its loop body
before its 20th. Each rank stamps the wall clock (the ranks share one host)
when each all-reduce completes; the victim stamps its death. A kill's figure is
the time from the death to the moment the *last* survivor completed its next
iteration: ULFM's detection (``ERR_PROC_FAILED``), the revoke, the shrink, the
agreement on the last completed collective and the reissued all-reduce. The
median over the kills is reported (target <= 1 s), next to the median time of
an iteration before the death (the elastic group's blocking, sequenced
collectives) and of one in the default ``on_rank_loss="raise"`` mode (three
more launches, nobody killed).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _bench
import numpy as np

ITERATIONS, DIES_AT, VICTIM = 40, 20, 1
HERE = Path(__file__).resolve().parent


def worker() -> None:
    from joinkit import Join, Joinable, JoinHook
    from joinkit.backends.mpi import MPIGroup, finalize_or_exit

    class Hook(JoinHook):
        def __init__(self, model: Model) -> None:
            self.model = model

        def main_hook(self) -> None:
            self.model.apply(np.zeros(8))

    class Model(Joinable):
        def __init__(self, group: MPIGroup) -> None:
            super().__init__()
            self.group = group
            self.w = np.zeros(8)
            self.ends: list[float] = []

        def apply(self, grad: np.ndarray) -> None:
            self.group.all_reduce(grad)
            self.w -= 0.01 * grad / 3
            self.ends.append(time.time())

        def join_hook(self, **kwargs: Any) -> JoinHook:
            return Hook(self)

        @property
        def join_device(self) -> Any:
            return "cpu"

        @property
        def join_process_group(self) -> Any:
            return self.group

    mode = sys.argv[2]  # "finish" (a rank dies), or "raise" (nobody does)
    group = MPIGroup()
    model = Model(group)
    rank = group.initial_rank
    with Join([model], on_rank_loss=mode):
        for i in range(1, ITERATIONS + 1):
            if rank == VICTIM and i == DIES_AT and mode == "finish":
                print(json.dumps({"death": time.time()}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            Join.notify_join_context(model)
            model.apply(np.full(8, float(i)))
    print(json.dumps({"rank": rank, "ends": model.ends}), flush=True)
    finalize_or_exit()


def launch(ranks: int, mode: str = "finish") -> tuple[float, float]:
    """One kill: (seconds from death to the survivors' next iteration, seconds per
    iteration before it); with ``mode="raise"`` nobody dies: (0, seconds per
    iteration of the plain group)."""
    mpirun = Path(sys.executable).with_name("mpirun")
    command = [str(mpirun if mpirun.exists() else "mpirun"), "--with-ft", "ulfm", "-n",
               str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable, __file__,
               "--worker", mode]
    env = {k: v for k, v in os.environ.items() if k != "JOINKIT_BENCH_OUT"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    survivors = [line["ends"] for line in lines if "rank" in line]
    if mode == "raise":
        ends = survivors[0][1:DIES_AT - 1]
        return 0.0, statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False))
    death = next(line["death"] for line in lines if "rank" not in line)
    if len(survivors) != ranks - 1:
        raise RuntimeError(f"expected {ranks - 1} survivors:\n{done.stdout}\n{done.stderr}")
    # Iteration DIES_AT is the first the victim never completed: its end on the
    # slowest survivor (an earlier one may end just after the death, without it).
    recovered = max(ends[DIES_AT - 1] for ends in survivors)
    before = [ends[1:DIES_AT - 1] for ends in survivors]
    steps = [b - a for ends in before for a, b in zip(ends, ends[1:], strict=False)]
    return recovered - death, statistics.median(steps)


def main() -> None:
    kills = _bench.int_arg(1, 7)
    ranks = _bench.int_arg(2, 3)
    results = [launch(ranks) for _ in range(kills)]
    recovery = [seconds * 1000 for seconds, _ in results]
    step = statistics.median(seconds * 1e6 for _, seconds in results)
    plain = statistics.median(launch(ranks, "raise")[1] * 1e6 for _ in range(3))
    info = {"ranks": ranks, "kills": kills, "each (ms)": ", ".join(f"{r:.0f}" for r in recovery)}
    bench = f"Elastic finish, MPI (ULFM), {ranks} ranks"
    _bench.record_value(bench, "death to the survivors' next completed iteration (median)",
                        statistics.median(recovery) / 1000, "s", target=1.0, info=info)
    _bench.record_value(bench, "iteration before the death (median), finish mode", step, "us")
    _bench.record_value(bench, "iteration, raise mode (median; no kill)", plain, "us")
    print(f"   each kill (ms): {info['each (ms)']}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker()
    else:
        main()
