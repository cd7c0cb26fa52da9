"""The fault matrix on torch.distributed gloo groups (world sizes 1, 2 and 4).

Most cells run under ``fault_runner.py --fork N``: one process per world size
imports torch once and forks the N ranks of each launch, which initialise a
gloo group over a fresh FileStore (a launch costs a fraction of a second, not
a torch import per rank). Cells that abort their group (a hook failure, a
stall) get a launch of their own, as they would need a fresh job in practice;
a stall cell whose watchdog fired at the entry, before its stall (a loaded
machine started a rank late), gets another (``again_while_entry_timed_out``).
SIGKILL needs the real launcher: each killed-rank cell is a ``torchrun``,
whose elastic agent must tear the job down and name the killed rank. torch is
imported only by the launched processes.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import fault_scenarios as fs
import pytest
from support.faults import (
    Launch,
    again_while_entry_timed_out,
    python,
    record_cell,
    run_all,
    runner_args,
    statuses_in,
    summarize,
    timed_out_at_entry,
)
from support.mpi import child_env

pytestmark = pytest.mark.launches

pytest.importorskip("torch.distributed")

WORLD_SIZES = (2, 4)
LAUNCH_TIMEOUT = 120.0  # hard limit per launcher process
DEADLINE = 45.0  # every cell's ranks must have left the Join within this
BATCH = ",".join([
    "before_heartbeat:0", "before_heartbeat:last", "after_heartbeat:0", "after_heartbeat:last",
    *(f"agreement:{variant}" for variant in fs.AGREEMENT_VARIANTS), "bad_inputs", "report",
])
ALONE = ("main_hook", "post_hook", "stall")  # a --fork launch each
_SCRIPT = Path(sys.executable).with_name("torchrun")
TORCHRUN = [str(_SCRIPT)] if _SCRIPT.exists() else [python(), "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Launch]:
    root = tmp_path_factory.mktemp("faults_torch")
    env = child_env({"OMP_NUM_THREADS": "1"})
    todo = []

    def fork(name: str, world_size: int, out: Path, *specs: str) -> Launch:
        command = [python(), str(fs_runner()), "--fork", str(world_size), "--out", str(out),
                   "--stall-timeout", "1", "--deadline", str(DEADLINE), *specs]
        return Launch(name, command, out, LAUNCH_TIMEOUT, env=env)

    for world_size in (1, *WORLD_SIZES):
        out = root / f"fork{world_size}"
        if world_size == 1:
            todo.append(fork("fork/1", 1, out, "before_heartbeat:0,bad_inputs,report"))
        else:
            todo.append(fork(f"fork/{world_size}", world_size, out, BATCH,
                             *(f"{case}:{failing}" for case in ALONE
                               for failing in (0, world_size - 1))))
    for world_size in WORLD_SIZES:
        for failing in (0, world_size - 1):
            out = root / f"kill{world_size}_{failing}"
            command = [*TORCHRUN, "--standalone", "--nproc-per-node", str(world_size),
                       *runner_args(out, f"kill:{failing}")]
            todo.append(Launch(f"kill/{world_size}/{failing}", command, out, LAUNCH_TIMEOUT,
                               env=env))
    done = run_all(todo)
    # A stall cell whose watchdog fired at the entry, before the stall, ran on
    # a machine too loaded for its short timeout: it gets a launch of its own.
    for world_size in WORLD_SIZES:
        for failing in (0, world_size - 1):
            cell = ("stall", str(failing))

            def entry_timed_out(launch: Launch, cell: tuple[str, str] = cell) -> bool:
                return timed_out_at_entry(launch.results.get(cell, {}).values())

            def stall_again(attempt: int, world_size: int = world_size,
                            failing: int = failing) -> Launch:
                return fork(f"stall/{world_size}/{failing}", world_size,
                            root / f"stall{world_size}_{failing}-try{attempt}",
                            f"stall:{failing}")

            done[f"stall/{world_size}/{failing}"] = again_while_entry_timed_out(
                done[f"fork/{world_size}"], entry_timed_out, stall_again)
    return done


def fs_runner() -> Path:
    return (Path(__file__).parent / "programs" / "fault_runner.py")


def _fork(launches: dict[str, Launch], world_size: int, cell: tuple[str, str]) -> Launch:
    """The ``--fork`` launcher of ``world_size``, checked for ``cell`` (kind, arg).

    A child that died fails only the cell it died in (its launch's
    ``culprit``; ``fault_runner.fork_launches`` ran the cells after it again);
    every launch that ran ``cell`` otherwise ended with every rank exiting by
    itself within the deadline.
    """
    # (a stall cell's own launch if its first timed out at the entry)
    launch = launches[f"stall/{world_size}/{cell[1]}" if cell[0] == "stall"
                      else f"fork/{world_size}"]
    assert launch.returncode == 0 and not launch.timed_out, launch.explain()
    for line in (launch.out / "launches.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("culprit") == list(cell):
            pytest.fail(f"cell {cell}: a rank of its launch died in it: {record}\n"
                        f"{launch.explain()}", pytrace=False)
        if list(cell) not in record["ran"] or "culprit" in record:
            continue  # not this cell's launch, or it finished before a later death
        # Every rank of the launch exited by itself, within the deadline.
        assert all(code == 0 for code in record["exit"].values()), (record, launch.explain())
        assert record["seconds"] < DEADLINE, record
    return launch


CELLS = [
    (case, world_size, failing)
    for case in ("before_heartbeat", "after_heartbeat", *ALONE, "kill")
    for world_size in WORLD_SIZES
    for failing in (0, world_size - 1)
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("case", "world_size", "failing"), CELLS)
def test_fault_matrix(launches: dict[str, Launch], case: str, world_size: int,
                      failing: int) -> None:
    if case == "kill":
        launch = launches[f"kill/{world_size}/{failing}"]
        assert not launch.timed_out and launch.seconds < DEADLINE + 30, launch.explain()
        assert launch.returncode != 0, launch.explain()
        # A peer either got SIGTERM from the agent or saw gloo's "Connection
        # closed by peer" first and left the Join with it; none went on normally.
        reported = launch.results.get(("kill", str(failing)), {})
        assert failing not in reported, launch.explain()
        for result in reported.values():
            assert result["error"] is not None, result
        # The elastic agent's report: the killed rank is the root cause.
        root_cause = launch.output.rpartition("Root Cause")[2]
        assert re.search(rf"rank\s*: {failing} \(local_rank: {failing}\)\s*\n\s*exitcode\s*: "
                         r"-9", root_cause), launch.explain()
        assert "Signal 9 (SIGKILL)" in root_cause, launch.explain()
        record_cell("gloo", case, world_size, failing,
                    f"torchrun exit {launch.returncode} after {launch.seconds:.1f} s, root "
                    f"cause rank {failing} SIGKILL; {len(reported)} peers left the Join "
                    "with gloo's error first, the rest got SIGTERM")
        return
    results = _fork(launches, world_size, (case, str(failing))).results[
        (case, str(failing))]
    if case == "stall":
        problems = fs.check_stall(failing, world_size, results, deadline=DEADLINE)
    else:
        problems = fs.check_case(case, failing, world_size, results, deadline=DEADLINE)
    assert not problems, "\n".join(problems)
    record_cell("gloo", case, world_size, failing, summarize(results, failing))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_hook_failure_reaches_peers_as_group_aborted(launches: dict[str, Launch],
                                                     world_size: int) -> None:
    """gloo's abort wakes nobody; the store's abort reason does (backends.torch_dist)."""
    failing = world_size - 1
    cell = ("main_hook", str(failing))
    results = _fork(launches, world_size, cell).results[cell]
    for rank in range(failing):
        error = results[rank]["error"]
        assert error["type"] == "GroupAborted", error
        assert error["message"] == (
            f"rank {failing} aborted the process group: rank {failing} failed in a join "
            f"hook (main_hook) with InjectedFault: injected main_hook fault on rank {failing}"
        )
        # Not gloo's timeout (60 s, fault_runner.GLOO_TIMEOUT): the store's abort
        # reason woke it. (The bound leaves room for a rank that a loaded
        # machine started late: the cell has no barrier before its Join.)
        assert results[rank]["seconds"] < 20.0, results[rank]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stall_diagnostic_reads_peers_from_the_store(launches: dict[str, Launch],
                                                     world_size: int) -> None:
    results = _fork(launches, world_size, ("stall", "0")).results[("stall", "0")]
    timeouts = [r["error"] for r in results.values() if r["error"]["type"] == "RankTimeout"]
    assert timeouts, results
    text = timeouts[0]["message"]
    assert "what the ranks were last seen doing:" in text
    statuses = statuses_in(text)  # ranks in one state share a line
    assert sorted(statuses) == list(range(world_size)), text
    assert statuses[0].startswith("active: in its loop body (")  # the staller's last status
    for rank in range(1, world_size):
        assert statuses[rank].startswith("shadowing from shadow round 0 on ("), text
    # One line per distinct status (the first aborter's says so: its own line).
    listing = text.partition("what the ranks were last seen doing:\n")[2]
    lines = [line for line in listing.splitlines() if line.startswith("  rank")]
    assert len(lines) == len(set(statuses.values())), text


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("variant", fs.AGREEMENT_VARIANTS)
def test_agreement_check(launches: dict[str, Launch], variant: str, world_size: int) -> None:
    cell = ("agreement", variant)
    results = _fork(launches, world_size, cell).results[cell]
    problems = fs.check_agreement(variant, world_size, results)
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, *WORLD_SIZES])
def test_bad_inputs(launches: dict[str, Launch], world_size: int) -> None:
    launch = _fork(launches, world_size, ("bad_inputs", ""))
    results = launch.results[("bad_inputs", "")]
    assert sorted(results) == list(range(world_size))
    for result in results.values():
        problems = fs.check_bad_inputs(result, world_size)
        assert not problems, "\n".join(problems)
        assert "not a live group" in result["dead_group"]["message"]
        assert "torch.cuda.is_available() is False" in result["unsupported_device"]["message"]
    # An uninitialised backend: a Join over the default group before init_process_group.
    for pre_init in launch.results[("pre_init", "")].values():
        assert pre_init["type"] == "LocalProtocolError"
        assert "torch.distributed is not initialized" in pre_init["message"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, *WORLD_SIZES])
def test_report(launches: dict[str, Launch], world_size: int) -> None:
    results = _fork(launches, world_size, ("report", "")).results[("report", "")]
    problems = fs.check_report(world_size, results)
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
def test_world_of_one(launches: dict[str, Launch]) -> None:
    cell = ("before_heartbeat", "0")
    results = _fork(launches, 1, cell).results[cell]
    problems = fs.check_case("before_heartbeat", 0, 1, results, deadline=DEADLINE)
    assert not problems, "\n".join(problems)
