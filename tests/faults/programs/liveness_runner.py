"""The watchdog's liveness cells (issue 12) in real processes.

Theory of operation
-------------------
One rank program, three ways to start it::

    python liveness_runner.py --spawn N --out DIR SCENARIO [--sleep S] [--timeout T]
    torchrun --standalone --nproc-per-node N liveness_runner.py --out DIR SCENARIO
    mpirun -n N python liveness_runner.py --out DIR SCENARIO

``--spawn N`` starts ``N`` ranks itself with torchrun's variables (so
``backends.init()`` gives a gloo ``TorchGroup`` over a ``TCPStore`` that rank 0
serves), waits for every rank but a frozen one (up to ``--deadline``), then
kills what is left and writes ``DIR/launch.json``: each rank's exit status
and when it ended. Under a launcher each rank takes ``backends.init()``'s
group. Every rank writes ``DIR/rank{R}.json`` when it leaves the Join: its
error, its seconds in the Join and the joinkit log lines at INFO and above.

The scenarios (rank 1 is the odd one out; the others have ``FAIL_AT`` inputs
for ``slow``, so they join and count while it works):

==========  =====================================================================
``slow``    rank 1 spends ``--sleep`` s in one iteration (its loop body), healthy
``freeze``  rank 1 stops itself (SIGSTOP) at iteration ``FAIL_AT``; everyone else
            is in its loop body and blocks in its next collective
``kill``    rank 1 SIGKILLs itself at iteration ``FAIL_AT``, the others active
``gil``     rank 1 holds the GIL for ``--sleep`` s at iteration ``FAIL_AT`` (libc's
            ``sleep`` called through ``ctypes.PyDLL``, which never releases the
            GIL, so no other thread of the process runs), the others active
==========  =====================================================================

The Join's timeout is the default one unless ``--timeout`` is given; the
default's seconds come from the environment's ``JOINKIT_DEFAULT_TIMEOUT``
(docs/reliability.md), which the tests set to scale it down.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FAIL_AT = 2
INPUTS = 6
#: Iterations of the ranks that do not misbehave in ``freeze`` and ``kill``:
#: more than they can run before the watchdog or the launcher ends them.
MANY = 100_000


def rank_main(args: argparse.Namespace) -> None:
    from fault_scenarios import Counter, describe_error  # noqa: PLC0415 - path set below

    from joinkit import Join, backends

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    faulthandler.register(signal.SIGUSR1)  # a stack dump of a hung rank, on demand
    logger = logging.getLogger("joinkit")
    logger.addHandler(Collect(logging.INFO))
    logger.addHandler(logging.StreamHandler())  # stderr, for the launcher's log
    logger.setLevel(logging.INFO)
    group = backends.init()
    rank = group.rank
    counter = Counter(group)
    odd = rank == 1
    if args.scenario == "slow":
        inputs = INPUTS if odd else FAIL_AT
    else:
        inputs = MANY
    kwargs: dict[str, Any] = {} if args.timeout is None else {"timeout": args.timeout}
    error: BaseException | None = None
    started = time.monotonic()
    try:
        with Join([counter], **kwargs):
            for i in range(inputs):
                if odd and i == FAIL_AT:
                    if args.scenario == "slow":
                        time.sleep(args.sleep)
                    elif args.scenario == "freeze":
                        os.kill(os.getpid(), signal.SIGSTOP)
                    elif args.scenario == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    elif args.scenario == "gil":
                        hold_the_gil(args.sleep)
                counter.heartbeat()
                counter.collective()
                if args.scenario != "slow":
                    time.sleep(0.01)  # an iteration's work
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        error = exc
    seconds = time.monotonic() - started
    result = {"rank": rank, "error": describe_error(error), "seconds": round(seconds, 2),
              "count": counter.count, "log": lines,
              "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    path = Path(args.out) / f"rank{rank}.json"
    path.write_text(json.dumps(result))
    if error is not None:
        raise SystemExit(1)


def hold_the_gil(seconds: float) -> None:
    """Block in C for ``seconds`` without releasing the GIL (a stuck C extension).

    One call: between two calls the interpreter would hand the GIL over.
    """
    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
    libc.sleep.argtypes = [ctypes.c_uint]
    libc.sleep(math.ceil(seconds))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(args: argparse.Namespace) -> None:
    """Start ``--spawn`` ranks with torchrun's variables; wait; record how they ended."""
    out = Path(args.out)
    world_size = args.spawn
    port = _free_port()
    started = time.monotonic()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    argv = [sys.executable, __file__, "--out", str(out), args.scenario, "--sleep",
            str(args.sleep)]
    if args.timeout is not None:
        argv += ["--timeout", str(args.timeout)]
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_RUN_ID="liveness")
        with (out / f"rank{rank}.err").open("wb") as err:
            procs[rank] = subprocess.Popen(argv, env=env, stdout=err, stderr=err)
    frozen = {1} if args.scenario == "freeze" else set()
    ended: dict[int, Any] = {}
    deadline = started + args.deadline
    while set(procs) - set(ended) - frozen and time.monotonic() < deadline:
        for rank, proc in procs.items():
            if rank not in ended and proc.poll() is not None:
                ended[rank] = {"exit": proc.returncode,
                               "seconds": round(time.monotonic() - started, 2)}
        time.sleep(0.05)
    for rank, proc in procs.items():
        if rank not in ended:
            proc.kill()
            proc.wait()
            ended[rank] = {"exit": "frozen, killed" if rank in frozen else "hung, killed",
                           "seconds": round(time.monotonic() - started, 2)}
    (out / "launch.json").write_text(json.dumps({str(r): e for r, e in sorted(ended.items())}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("scenario", choices=("slow", "freeze", "kill", "gil"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--spawn", type=int, default=0, help="start this many gloo ranks")
    parser.add_argument("--sleep", type=float, default=0.0, help="slow, gil: seconds of rank 1")
    parser.add_argument("--timeout", type=float, default=None,
                        help="an explicit Join timeout (default: the default one)")
    parser.add_argument("--deadline", type=float, default=600.0,
                        help="--spawn: seconds before the ranks left are killed")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.spawn:
        spawn(args)
    else:
        rank_main(args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
