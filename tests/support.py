"""What many tests share: rank processes with a deadline, their JSON lines.

- :func:`launch_ranks` starts one process per command, each in its own
  session, waits for all of them until one shared deadline and kills the
  process group of any that overruns, so a hung rank fails its test instead
  of stalling the suite;
- :func:`read_jsonl` reads the JSON lines a rank wrote;
- :func:`scenario_names` lists the ``@scenario`` functions of a worker file
  without importing it (importing would import torch into the test process).

This module imports neither torch nor mpi4py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def launch_ranks(
    commands: Sequence[Sequence[str]],
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    merge_stderr: bool = True,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``commands`` at once; wait for all until ``timeout`` seconds from now.

    A command still running at the deadline has its process group killed and
    ``[test] killed after ... s`` appended to its ``stderr`` (or to its
    ``stdout`` where ``merge_stderr``: then ``stderr`` is empty).

    Returns:
        One ``CompletedProcess`` per command, in order.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if env is None else env
    procs = [
        subprocess.Popen(
            list(command), env=env, cwd=cwd, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
            start_new_session=True,  # so a hung rank can be killed with its children
        )
        for command in commands
    ]
    deadline = time.monotonic() + timeout
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            note = f"\n[test] killed after {timeout} s"
            if merge_stderr:
                out += note
            else:
                err += note
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err or ""))
    return done


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one a line; none where it does not exist."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def scenario_names(worker: Path) -> list[str]:
    """The functions of ``worker`` decorated with a bare ``@scenario``, in order."""
    lines = worker.read_text().splitlines()
    return [
        line.split("def ", 1)[1].split("(", 1)[0]
        for previous, line in zip(lines, lines[1:], strict=False)
        if previous.strip() == "@scenario"
    ]
