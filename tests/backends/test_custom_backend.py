"""examples/custom_backend.py: a backend joinkit does not ship, plugged in
through ``backends.register``, runs the tutorial's Counter in real processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.mpi import ROOT, child_env, explain

EXAMPLE = ROOT / "examples" / "custom_backend.py"


def expected_lines(world_size: int) -> list[str]:
    inputs = [5 + rank for rank in range(world_size)]
    lines = []
    for rank in range(world_size):
        before = sum(min(n, inputs[rank]) for n in inputs)
        lines += [f"{before} inputs processed before rank {rank} joined!",
                  f"{sum(inputs)} inputs processed across all ranks!"]
    return lines


def test_expected_lines_are_the_tutorials() -> None:
    assert expected_lines(2) == [
        "10 inputs processed before rank 0 joined!",
        "11 inputs processed across all ranks!",
        "11 inputs processed before rank 1 joined!",
        "11 inputs processed across all ranks!",
    ]


@pytest.mark.launches
@pytest.mark.timeout(90)
@pytest.mark.parametrize("ranks", [2, 3])
def test_pipe_backend_example(ranks: int) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--ranks", str(ranks)], capture_output=True,
        text=True, timeout=80, env=child_env(), cwd=ROOT,
    )
    assert result.returncode == 0, explain(result)
    assert result.stdout.splitlines() == expected_lines(ranks), explain(result)
