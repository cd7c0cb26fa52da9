"""The scenario-job harness itself: one crash fails one test.

Many test modules run all their scenarios in one shared job of rank processes
(``support.run_scenarios``, ``mpi_support.run_mpi_scenarios``). A rank whose
process dies (a native crash) must fail only the scenario it died in; its
peers, left waiting for it, are ended at once; the scenarios after it run
again in a fresh job. ``programs/crash_scenarios.py`` kills its own process on
purpose (SIGABRT, SIGSEGV) or hangs, with no torch: a job costs the
interpreters' start-up and a few file barriers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import (
    DEATH_GRACE,
    read_jsonl,
    run_scenario_jobs,
    run_scenarios,
    scenario_records,
    selected_scenarios,
    started_path,
)

WORKER = Path(__file__).parent / "programs" / "crash_scenarios.py"
WORLD = 3
LAUNCH_TIMEOUT = 60.0  # far beyond a job here; a test that waits for it has failed

pytestmark = pytest.mark.timeout(120)


def failure(results: dict, name: str) -> str:
    with pytest.raises(pytest.fail.Exception) as failed:
        scenario_records(results, name)
    return str(failed.value)


@pytest.mark.launches
def test_a_crash_fails_only_its_scenario_and_the_rest_run_again(tmp_path: Path) -> None:
    names = ["first", "abort_on_1", "second", "segfault_on_0", "third"]
    results = run_scenarios(WORKER, WORLD, tmp_path, names, LAUNCH_TIMEOUT)
    # The scenarios no rank died in pass, each on every rank, ...
    pids = {}
    for name in ("first", "second", "third"):
        records = scenario_records(results, name)
        assert [r["result"]["rank"] for r in records] == list(range(WORLD))
        pids[name] = {r["result"]["pid"] for r in records}
    # ... "second" and "third" in fresh jobs (new processes), one after each death.
    assert len(pids["first"] | pids["second"] | pids["third"]) == 3 * WORLD
    assert [log["job"] for log in results["_logs"]] == [0] * WORLD + [1] * WORLD + [2] * WORLD
    # The scenario a rank died in fails, naming the signal; the dead rank's peers
    # were ended DEATH_GRACE s after it died, not left to their 60 s barrier.
    aborted = failure(results, "abort_on_1")
    assert "did not finish on every rank: its job ended in it" in aborted
    assert "rank 1: SIGABRT" in aborted
    assert f"killed {DEATH_GRACE} s after process 1 died (SIGABRT)" in aborted
    # The dead rank's crash report (support.report_crashes): where it died.
    assert "process 1 (SIGABRT), its crash report:\nFatal Python error: Aborted" in aborted
    assert 'in abort_on_1\n  File "' in aborted and "crash_scenarios.py" in aborted
    segfault = failure(results, "segfault_on_0")
    assert "rank 0: SIGSEGV" in segfault
    assert "Fatal Python error: Segmentation fault" in segfault
    assert not any(r["name"] == "second" for r in results["_failed"])


@pytest.mark.launches
def test_a_hung_job_fails_the_scenario_it_hung_in(tmp_path: Path) -> None:
    results = run_scenarios(WORKER, 2, tmp_path, ["first", "hang_on_0", "second"], 5.0)
    assert [r["result"]["rank"] for r in scenario_records(results, "first")] == [0, 1]
    assert [r["result"]["rank"] for r in scenario_records(results, "second")] == [0, 1]
    hung = failure(results, "hang_on_0")
    assert "killed after 5.0 s" in hung


@pytest.mark.launches
def test_an_ordinary_exception_is_the_scenarios_own_failure_in_the_same_job(
        tmp_path: Path) -> None:
    results = run_scenarios(WORKER, 2, tmp_path, ["first", "raises", "second"], LAUNCH_TIMEOUT)
    assert {log["job"] for log in results["_logs"]} == {0}  # no retry
    assert results["_failed"] == []
    scenario_records(results, "second")
    with pytest.raises(AssertionError, match="an ordinary failure on rank 1"):
        scenario_records(results, "raises")


@pytest.mark.launches
def test_a_job_that_cannot_start_fails_every_scenario_once(tmp_path: Path) -> None:
    results = run_scenarios(WORKER, 2, tmp_path, ["--die-at-start", "first", "second"],
                            LAUNCH_TIMEOUT)
    assert {log["job"] for log in results["_logs"]} == {0}  # no retry: it would end the same
    for name in ("first", "second"):
        assert "rank 0: exit code 3" in failure(results, name)


@pytest.mark.launches
def test_recording_notes_each_scenario_before_it_runs(tmp_path: Path) -> None:
    """The start notes are how the harness knows where a process died."""
    results = run_scenarios(WORKER, 2, tmp_path, ["first", "abort_on_1"], LAUNCH_TIMEOUT)
    assert (tmp_path / "rank1.started").read_text().split() == ["first", "abort_on_1"]
    assert started_path(tmp_path / "rank1.jsonl") == tmp_path / "rank1.started"
    assert [r["name"] for r in read_jsonl(tmp_path / "rank1.jsonl")] == ["first"]
    assert "SIGABRT" in failure(results, "abort_on_1")


def test_the_culprit_is_the_first_scenario_not_every_rank_finished(tmp_path: Path) -> None:
    """run_scenario_jobs on its own, with a job that only writes files: rank 1 died
    in "b" after rank 0 finished it and started "c" (as a survivor does)."""
    jobs = []

    def run_job(todo: list[str], out: Path) -> list[tuple[int | None, str]]:
        jobs.append(list(todo))
        for rank in (0, 1):
            done = todo if len(jobs) > 1 else {0: todo[:2], 1: todo[:1]}[rank]
            started = todo if len(jobs) > 1 else {0: todo[:3], 1: todo[:2]}[rank]
            (out / f"rank{rank}.started").write_text("".join(f"{n}\n" for n in started))
            (out / f"rank{rank}.jsonl").write_text("".join(
                json.dumps({"name": n, "ok": True, "result": n}) + "\n" for n in done))
        return [(None, "killed"), (-6, "double free or corruption (out)")]

    results = run_scenario_jobs(["a", "b", "c", "d"], 2, tmp_path, run_job)
    assert jobs == [["a", "b", "c", "d"], ["c", "d"]]
    assert [f["name"] for f in results["_failed"]] == ["b"]
    assert "rank 1: SIGABRT" in results["_failed"][0]["why"]
    assert "double free or corruption (out)" in results["_failed"][0]["why"]
    for name in ("a", "c", "d"):
        assert [r["result"] for r in scenario_records(results, name)] == [name, name]


@pytest.mark.launches
def test_a_crash_in_a_torch_process_reports_its_native_stacks(tmp_path: Path) -> None:
    """With torch imported, the report has every thread's native (C++) stack too:
    the backtrace a heap corruption needs (issue 30)."""
    results = run_scenarios(WORKER, 1, tmp_path, ["--with-torch", "segfault_on_0", "first"],
                            LAUNCH_TIMEOUT)
    report = failure(results, "segfault_on_0")
    assert "Fatal Python error: Segmentation fault" in report
    assert "SIGSEGV(11), PID:" in report and "c10::FatalSignalHandler" in report
    assert [r["result"]["rank"] for r in scenario_records(results, "first")] == [0]


def test_the_memcheck_summary_counts_errors_outside_the_loader(tmp_path: Path) -> None:
    """``benchmarks/memcheck_fsdp.py`` (issue 30) reads memcheck's log: an error
    anywhere but the dynamic loader counts, with its stack; the loader's known
    false positive is counted apart."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import memcheck_fsdp

    log = tmp_path / "memcheck_rank0.log"
    log.write_text(
        "==7== Memcheck, a memory error detector\n"
        "==7== Invalid read of size 8\n"
        "==7==    at 0x4023C6C: strncmp (strcmp-sse2.S:160)\n"
        "==7==    by 0x4004BEE: is_dst (dl-load.c:216)\n"
        "==7== \n"
        "==7== Invalid write of size 4\n"
        "==7==    at 0x1234: gloo::transport::tcp::Pair::read() (pair.cc:480)\n"
        "==7==    by 0x5678: gloo::transport::tcp::Loop::run() (loop.cc:90)\n"
        "==7==  Address 0x9abc is 0 bytes inside a block of size 64 free'd\n"
        "==7==    at 0x4845B2C: free (vg_replace_malloc.c:974)\n"
        "==7== \n"
        "==7== Invalid free() / delete / delete[] / realloc()\n"
        "==7==    at 0x4845B2C: free (vg_replace_malloc.c:974)\n"
        "==7== \n"
        "==7== ERROR SUMMARY: 3 errors from 3 contexts (suppressed: 0 from 0)\n")
    found, loader = memcheck_fsdp.errors(log)
    assert loader == 1
    assert len(found) == 2
    assert "Invalid write of size 4" in found[0] and "Pair::read()" in found[0]
    assert "free'd" in found[0]
    assert found[1].startswith("==7== Invalid free()")


def test_a_fixture_launches_only_what_the_selected_tests_read() -> None:
    """support.selected_scenarios: the scenarios of the selected tests' marks (or their
    ``name``/``spec`` parameter); every scenario once a selected test has no mark."""
    from types import SimpleNamespace

    module, other = object(), object()

    def item(marks: tuple[str, ...] | None, owner: object = module,
             **params: str) -> SimpleNamespace:
        mark = None if marks is None else SimpleNamespace(args=marks)
        return SimpleNamespace(module=owner, callspec=SimpleNamespace(params=params),
                               get_closest_marker=lambda name: mark)

    def request(*items: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(module=module, session=SimpleNamespace(items=list(items)))

    every = ["a", "b", "c", "d"]
    assert selected_scenarios(request(item(("c", "a")), item((), spec="b")), every) == \
        ["a", "b", "c"]
    assert selected_scenarios(request(item(("d",)), item(None, owner=other)), every) == ["d"]
    assert selected_scenarios(request(item(("d",)), item(None)), every) == every
