"""The fault matrix under a real ``mpirun`` (world sizes 1, 2 and 4).

One launch per world size runs every cell that leaves the communicator usable
(faults before and after the heartbeat, first and last rank; the agreement
check; bad input; the report). A hook failure, a stall and a SIGKILL end the
MPI job by design (``MPIGroup.abort`` is ``MPI_Abort``; ``mpirun`` aborts a
job whose process was killed), and so does a failure on a raw communicator
(the ``raw_*`` cells: the Join cannot tell whether the peers wait in the
failing rank's last iteration, so it fails fast), so each of those cells has
a launch of its own, and the test asserts on how the launch ended: non-zero,
well within its timeout, with output naming the failing rank (and, where a
rank's exception ended the job, that exception). A stall cell whose watchdog
fired at the entry, before its stall (a loaded machine started a rank late), is
launched again (``fault_support.again_while_entry_timed_out``). torch is never
imported.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import fault_scenarios as fs
import pytest
from support.faults import (
    ENTRY_TIMEOUT,
    Launch,
    again_while_entry_timed_out,
    launch_of,
    python,
    record_cell,
    rerun_after_death,
    run_all,
    runner_args,
    statuses_in,
    summarize,
)
from support.mpi import child_env, is_open_mpi, mpirun

pytestmark = pytest.mark.launches

pytest.importorskip("mpi4py", reason="the MPI backend needs mpi4py: pip install 'joinkit[mpi]'")

WORLD_SIZES = (2, 4)
LAUNCH_TIMEOUT = 120.0  # hard limit per launch
DEADLINE = 45.0  # every launch (and every rank in it) must end within this
BATCH = ",".join([
    "before_heartbeat:0", "before_heartbeat:last", "after_heartbeat:0", "after_heartbeat:last",
    *(f"agreement:{variant}" for variant in fs.AGREEMENT_VARIANTS), "bad_inputs", "report",
])
ALONE = ("main_hook", "post_hook", "stall", "kill", *fs.RAW)  # one launch per cell
HOOKS = ("main_hook", "post_hook")
#: A failure on a raw communicator must end the job within this many seconds,
#: from the last rank starting the cell to mpirun's exit (its start-up and the
#: interpreters' do not count, nor how much later a loaded machine started one
#: rank than the others): well below the Join's watchdog (20 s), which the
#: cell also asserts did not fire.
RAW_DEADLINE = 15.0
#: The stall cells' Join timeout: 4 ranks share 2 cores, so a shorter one lets a
#: busy but healthy peer look silent (its beat is read as stale after half of it).
STALL_TIMEOUT = 2


def _command(ranks: int, out: Path, cells: str) -> list[str]:
    command = [mpirun(), "-n", str(ranks)]
    if ranks > (os.cpu_count() or 1) and is_open_mpi():
        command.append("--oversubscribe")
    return command + [python(), *runner_args(out, cells, "--stall-timeout", str(STALL_TIMEOUT))]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Launch]:
    root = tmp_path_factory.mktemp("faults_mpi")
    todo = []

    def add(name: str, ranks: int, cells: str) -> None:
        out = root / name.replace(":", "_")
        todo.append(Launch(name, _command(ranks, out, cells), out, LAUNCH_TIMEOUT,
                           env=child_env()))

    for world_size in WORLD_SIZES:
        add(f"batch/{world_size}", world_size, BATCH)
        for case in ALONE:
            for failing in (0, world_size - 1):
                add(f"{case}/{world_size}/{failing}", world_size, f"{case}:{failing}")
    add("batch/1", 1, BATCH_OF_ONE)
    done = run_all(todo)
    # One crash fails one cell: a batch whose rank died runs the rest again.
    for world_size in (1, *WORLD_SIZES):
        spec = BATCH_OF_ONE if world_size == 1 else BATCH

        def again(cells: str, out: Path, world_size: int = world_size) -> Launch:
            return Launch(f"batch/{world_size} (rerun)", _command(world_size, out, cells), out,
                          LAUNCH_TIMEOUT, env=child_env())

        rerun_after_death(done[f"batch/{world_size}"], spec, world_size, again)
    # A stall cell whose watchdog fired at the entry, before the stall, ran on
    # a machine too loaded for its short timeout: launch it again (_loaded).
    for world_size in WORLD_SIZES:
        for failing in (0, world_size - 1):
            name = f"stall/{world_size}/{failing}"

            def stall_again(attempt: int, name: str = name, world_size: int = world_size,
                            failing: int = failing) -> Launch:
                out = root / f"{name.replace('/', '_')}-try{attempt}"
                return Launch(name, _command(world_size, out, f"stall:{failing}"), out,
                              LAUNCH_TIMEOUT, env=child_env())

            done[name] = again_while_entry_timed_out(done[name], _loaded, stall_again)
    return done


BATCH_OF_ONE = "before_heartbeat:0,bad_inputs,report"


def _loaded(launch: Launch) -> bool:
    """Whether a stall cell's launch measured the machine: its watchdog fired at
    the entry, or a rank's listener thread (which answers while its rank sleeps
    or waits) got no CPU for the status query's 2 s."""
    return (ENTRY_TIMEOUT.search(launch.output) is not None
            or "no answer within" in launch.output)


def _batch(launches: dict[str, Launch], world_size: int, cell: tuple[str, str]) -> Launch:
    """The batch launch of ``world_size`` in which ``cell`` ran (``launch_of``)."""
    launch = launch_of(launches[f"batch/{world_size}"], cell)
    if launch.culprit is None:  # (else cell finished before a rank died in a later one)
        assert launch.returncode == 0 and launch.done == set(range(world_size)), (
            launch.explain())
        assert launch.seconds < DEADLINE, launch.explain()
    return launch


CELLS = [
    (case, world_size, failing)
    for case in ("before_heartbeat", "after_heartbeat", *ALONE)
    for world_size in WORLD_SIZES
    for failing in (0, world_size - 1)
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("case", "world_size", "failing"), CELLS)
def test_fault_matrix(launches: dict[str, Launch], case: str, world_size: int,
                      failing: int) -> None:
    if case in fs.SURVIVABLE:
        launch = _batch(launches, world_size, (case, str(failing)))
        results = launch.results[(case, str(failing))]
        problems = fs.check_case(case, failing, world_size, results, deadline=DEADLINE)
        assert not problems, "\n".join(problems)
        record_cell("mpi", case, world_size, failing, summarize(results, failing))
        return
    launch = launches[f"{case}/{world_size}/{failing}"]
    assert not launch.timed_out and launch.seconds < DEADLINE, launch.explain()
    assert launch.returncode != 0, launch.explain()
    assert not launch.done, launch.explain()  # no rank went on as if nothing happened
    output = launch.output
    if case in HOOKS:
        said = (f"joinkit: rank {failing} aborts the MPI job: rank {failing} failed in a "
                f"join hook ({case}) with InjectedFault: injected {case} fault on "
                f"rank {failing}")
        assert said in output, launch.explain()
    elif case in fs.RAW:
        # Every rank's part of the job's output, mpirun's, carries the failing
        # rank's exception: its traceback and the abort's reason.
        fault = f"InjectedFault: {fs.fault_message(case, failing)}"
        said = (f"joinkit: rank {failing} aborts the MPI job: rank {failing} failed inside "
                f"the Join context with {fault}; the Join cannot tell whether its peers wait "
                "in the collectives of that iteration")
        # (mpirun interleaves the ranks' and its own lines: no line anchors)
        assert said in output and f"fault_scenarios.{fault}" in output, launch.explain()
        assert "made no progress" not in output, launch.explain()  # not the watchdog
        assert set(launch.started) == set(range(world_size)), launch.explain()
        job = launch.ended_at - max(launch.started.values())
        assert job <= RAW_DEADLINE, (job, launch.explain())
    elif case == "stall":
        aborted = re.findall(r"joinkit: rank (\d+) aborts the MPI job: rank \1 made no "
                             r"progress for [\d.]+ s \(timeout "
                             rf"{STALL_TIMEOUT} s\) in phase DRAINING", output)
        assert aborted and str(failing) not in aborted, launch.explain()
        # ... and says where every rank was: the peers' listener threads
        # answered while their ranks blocked in the count or slept in the loop.
        assert "what the ranks were last seen doing:" in output, launch.explain()
        statuses = statuses_in(output)  # ranks in one state share a line
        for rank in range(world_size):
            doing = ("active: in its loop body" if rank == failing
                     else "shadowing from shadow round 0 on (counting non-joined ranks, then "
                          "main hooks, round after round)")
            assert re.fullmatch(rf"{re.escape(doing)} \(\d+\.\d(-\d+\.\d)? s ago\)",
                                statuses.get(rank, "")), launch.explain()
    else:  # kill: mpirun's own report names the killed rank
        if is_open_mpi():
            assert re.search(rf"process rank {failing} with PID \d+ on node \S+ exited on\s+"
                             r"signal 9", output), launch.explain()
        else:  # MPICH's Hydra names the killed process's PID, not its rank
            assert re.search(r"KILLED BY SIGNAL: 9|Killed \(signal 9\)", output), (
                launch.explain())
    what = {"main_hook": "MPI_Abort by the failing rank", "post_hook":
            "MPI_Abort by the failing rank",
            "stall": ("a joined rank's watchdog: RankTimeout with every rank's status, "
                      "then MPI_Abort"),
            "kill": "mpirun names the killed rank",
            **dict.fromkeys(fs.RAW, "the failing rank's MPI_Abort prints its exception "
                                    "(rank, type, message, traceback)")}[case]
    job = "" if launch.job_seconds is None else f" ({launch.job_seconds:.1f} s after entry)"
    record_cell("mpi", case, world_size, failing,
                f"job ends: exit {launch.returncode} after {launch.seconds:.1f} s{job}; "
                f"{what}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("variant", fs.AGREEMENT_VARIANTS)
def test_agreement_check(launches: dict[str, Launch], variant: str, world_size: int) -> None:
    cell = ("agreement", variant)
    results = _batch(launches, world_size, cell).results[cell]
    problems = fs.check_agreement(variant, world_size, results)
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, *WORLD_SIZES])
def test_bad_inputs(launches: dict[str, Launch], world_size: int) -> None:
    results = _batch(launches, world_size, ("bad_inputs", "")).results[("bad_inputs", "")]
    assert sorted(results) == list(range(world_size))
    for result in results.values():
        problems = fs.check_bad_inputs(result, world_size)
        assert not problems, "\n".join(problems)
        assert "MPI.COMM_NULL: the communicator was freed" in result["dead_group"]["message"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, *WORLD_SIZES])
def test_report(launches: dict[str, Launch], world_size: int) -> None:
    results = _batch(launches, world_size, ("report", "")).results[("report", "")]
    problems = fs.check_report(world_size, results)
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
def test_world_of_one(launches: dict[str, Launch]) -> None:
    cell = ("before_heartbeat", "0")
    results = _batch(launches, 1, cell).results[cell]
    problems = fs.check_case("before_heartbeat", 0, 1, results, deadline=DEADLINE)
    assert not problems, "\n".join(problems)
