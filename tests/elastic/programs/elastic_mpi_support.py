"""What the elastic MPI tests, the example and the benchmark share (issue 20).

Theory of operation: a *cell* is one ``Join(..., on_rank_loss="finish")`` over
a small NumPy linear model whose gradient and a counter's slot travel in ONE
all-reduce per iteration (so an iteration is all-or-nothing for a rank that
dies). ``elastic_mpi_program.py`` runs a list of cells one after the
other on one ``MPIGroup`` under ``mpirun --with-ft ulfm`` (the survivors of a
cell go on to the next one, so one launch serves a world of 4 and then of 3)
and prints one JSON line per survivor and cell, and one per death. The test
compares the survivors' numbers with :func:`reference`, a single-process run
over exactly the inputs consumed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
PROGRAM = Path(__file__).with_name("elastic_mpi_program.py")

#: The model: y = x . W_TRUE + noise, fitted by SGD from zero.
DIM = 3
LR = 0.1
W_TRUE = np.array([0.5, -1.0, 2.0])


def sample(rank: int, i: int) -> tuple[np.ndarray, float]:
    """Input ``i`` (1-based) of original rank ``rank``: features and target."""
    rng = np.random.default_rng(1000 * rank + i)
    x = rng.normal(size=DIM)
    return x, float(x @ W_TRUE + 0.01 * rng.normal())


def gradient(w: np.ndarray, rank: int, i: int) -> np.ndarray:
    """The squared loss's gradient of one input at ``w``."""
    x, y = sample(rank, i)
    return (x @ w - y) * x  # type: ignore[no-any-return]


def reference(consumed: dict[int, int], world_size: int) -> tuple[np.ndarray, float]:
    """A single process over exactly the consumed inputs.

    Args:
        consumed: original rank -> the inputs it contributed (a survivor's
            all, a lost rank's ``iterations``).
        world_size: the divisor (the Join's initial world size).

    Returns:
        The final parameters and the counter's total.
    """
    w = np.zeros(DIM)
    for i in range(1, max(consumed.values(), default=0) + 1):
        total = np.zeros(DIM)
        for rank in sorted(consumed):
            if i <= consumed[rank]:
                total += gradient(w, rank, i)
        w = w - LR * total / world_size
    return w, float(sum(consumed.values()))


def mpirun() -> str:
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else "mpirun"


def launch(cells: Sequence[dict[str, Any]] | str, ranks: int, timeout: float = 90.0,
           script: Path = PROGRAM, extra: Sequence[str] = (), ulfm: bool = True,
           ) -> tuple[list[dict[str, Any]], str]:
    """Run ``script`` under ``mpirun --with-ft ulfm -n ranks`` with the cells
    (JSON; a string is passed as it is), without ``--with-ft ulfm`` if not ``ulfm``.

    Returns:
        The JSON lines it printed, and its whole output (for messages).

    Raises:
        AssertionError: past ``timeout`` (a hang fails the test, with the output).
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "JOINKIT_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    argument = cells if isinstance(cells, str) else json.dumps(list(cells))
    command = [mpirun(), *(["--with-ft", "ulfm"] if ulfm else []), "-n", str(ranks),
               "--oversubscribe", sys.executable, str(script), argument, *extra]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as error:
        def text(data: Any) -> str:
            return data.decode(errors="replace") if isinstance(data, bytes) else str(data)
        raise AssertionError(
            f"mpirun did not finish within {timeout:g} s:\n{text(error.stdout)}\n"
            f"{text(error.stderr)}") from None
    lines = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines, f"rc={done.returncode}\n{done.stdout}\n{done.stderr}"
