"""Fork the ranks of one elastic cell and reap them within a deadline.

Shared by ``tests/elastic_torch_runner.py`` and ``tests/elastic_ddp_runner.py``:
the parent (which hosts the store, so it outlives every rank) forks ``world``
children, each in its own process group, runs ``run(rank)`` in each, and waits
for them; a child still running at the deadline is SIGKILLed with its process
group and recorded as ``"killed after deadline"``. A child that raised exits 1
after printing its traceback; a SIGKILLed one (the cells kill ranks on purpose)
gives ``-9``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any


def fork_ranks(world: int, seconds: float, run: Callable[[int], None]) -> dict[int, Any]:
    """Run ``run(rank)`` in ``world`` forked children; rank -> exit status (or why not).

    Args:
        world: how many ranks to fork.
        seconds: the deadline for all of them, from now.
        run: the rank's body, in the child.

    Returns:
        Every rank's exit code (``os.waitstatus_to_exitcode``), or
        ``"killed after deadline"``.
    """
    started = time.monotonic()
    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.setpgid(0, 0)
                run(rank)
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    statuses: dict[int, Any] = {}
    deadline = started + seconds
    while children and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.005)
            continue
        statuses[children.pop(pid)] = os.waitstatus_to_exitcode(status)
    for pid, rank in children.items():
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        statuses[rank] = "killed after deadline"
    return statuses
