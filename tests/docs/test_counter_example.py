"""The Counter example and `make demo`'s output on the threads backend."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = sorted(
    [
        "10 inputs processed before rank 0 joined!",
        "11 inputs processed across all ranks!",
        "11 inputs processed before rank 1 joined!",
        "11 inputs processed across all ranks!",
    ]
)


@pytest.mark.launches
def test_counter_example_prints_the_tutorial_lines() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "counter.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    ).stdout
    assert sorted(out.splitlines()) == EXPECTED


def test_counter_worker_on_four_threads() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import counter
    finally:
        sys.path.pop(0)
    from joinkit.backends.threads import spawn

    lines = spawn(counter.worker, 4, timeout=20.0)
    # Rank r has 5 + r inputs: 4 ranks x 5 + 3 + 2 + 1 = 26 inputs in all.
    assert [line[1] for line in lines] == ["26 inputs processed across all ranks!"] * 4
    assert [line[0] for line in lines] == [
        "20 inputs processed before rank 0 joined!",
        "23 inputs processed before rank 1 joined!",
        "25 inputs processed before rank 2 joined!",
        "26 inputs processed before rank 3 joined!",
    ]
