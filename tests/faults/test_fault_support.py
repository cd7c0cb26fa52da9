"""The fault-matrix harness's second launch for a stall cell timed out at the entry.

``fault_support.again_while_entry_timed_out`` launches a stall cell again when
its watchdog fired at the agreement check at entry (a loaded machine started
one rank late), never otherwise, and at most ``STALL_TRIES`` launches in all;
``ENTRY_TIMEOUT`` must match what a real Join says there, and nothing it says
about the stall itself.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import fault_scenarios as fs
import pytest
from support.faults import (
    ENTRY_TIMEOUT,
    STALL_TRIES,
    Launch,
    again_while_entry_timed_out,
    run_all,
    timed_out_at_entry,
)

from joinkit import Join
from joinkit.backends.threads import ThreadGroup, spawn

TIMEOUT = 0.3  # the Join timeout of the threads cells here


def _late_entry(group: ThreadGroup) -> dict[str, Any] | None:
    """Rank 1 enters its Join well after rank 0's timeout."""
    if group.rank == 1:
        time.sleep(6 * TIMEOUT)
    error: BaseException | None = None
    try:
        with Join([fs.Counter(group)], timeout=TIMEOUT):
            pass
    except Exception as exc:  # noqa: BLE001 - asserted on below
        error = exc
    return fs.describe_error(error)


@pytest.mark.timeout(60)
def test_the_pattern_matches_a_real_entry_timeout_and_not_a_stall() -> None:
    entry, _ = spawn(_late_entry, 2, timeout=30.0)
    assert entry is not None and entry["type"] == "RankTimeout", entry
    assert ENTRY_TIMEOUT.search(entry["message"]), entry["message"]
    for _ in range(STALL_TRIES):  # (as the stall cells do: the entry may time out)
        stall = spawn(fs.run_case, 2, args=("stall", 1, 2, 20.0, TIMEOUT), timeout=30.0)
        messages = [r["error"]["message"] for r in stall if r["error"] is not None]
        if not timed_out_at_entry(stall):
            break
    assert any("in phase DRAINING" in m for m in messages), messages
    assert not any(ENTRY_TIMEOUT.search(m) for m in messages), messages


ENTRY = ("rank 0 made no progress for 2.6 s (timeout 2 s) in phase AGREEING, the agreement "
         "check at entry")
STALL = "rank 0 made no progress for 2.1 s (timeout 2 s) in phase DRAINING"


def _says(text: str, out: Path) -> Launch:
    return Launch("stall/2/1", [sys.executable, "-c", f"print({text!r})"], out, 60.0)


def _entry_timed_out(launch: Launch) -> bool:
    return ENTRY_TIMEOUT.search(launch.output) is not None


@pytest.mark.launches
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("said", "launches"), [
    ([STALL], 1),  # the stall was timed: checked as it is
    ([ENTRY, STALL], 2),  # timed out at the entry once: the second launch counts
    ([ENTRY] * (STALL_TRIES + 2), STALL_TRIES),  # always: the last launch is checked, fails
])
def test_a_stall_cell_is_launched_again_only_while_it_timed_out_at_the_entry(
        tmp_path: Path, said: list[str], launches: int) -> None:
    ran: list[int] = []

    def again(attempt: int) -> Launch:
        ran.append(attempt)
        return _says(said[attempt - 1], tmp_path / f"try{attempt}")

    first = _says(said[0], tmp_path / "try1")
    last = again_while_entry_timed_out(run_all([first])[first.name], _entry_timed_out, again)
    assert ran == list(range(2, launches + 1))
    assert [launch.output.strip() for launch in [*last.earlier, last]] == said[:launches]
    assert last.output.strip() == said[launches - 1]
    if launches > 1:
        assert (f"try {launches}, after {launches - 1} that the machine's load spoiled"
                in last.explain())
