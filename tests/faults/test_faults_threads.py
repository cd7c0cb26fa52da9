"""The fault matrix, the agreement check and bad input on the threads backend.

The scenarios live in ``fault_scenarios.py`` (shared with the MPI and gloo
runs); here each cell is one ``spawn``, so a cell that aborts its world cannot
disturb the next one. Every spawn has a timeout, and every cell also asserts
that each rank left the Join within a deadline far below it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import fault_scenarios as fs
import pytest
from support.faults import STALL_TRIES, record_cell, summarize, timed_out_at_entry

from joinkit import Join, backends
from joinkit.backends.threads import ThreadGroup, spawn

JOIN_TIMEOUT = 20.0  # the Join watchdog's timeout in the fault cells
STALL_TIMEOUT = 0.5  # ... in the stall cells
SPAWN_TIMEOUT = 30.0  # the harness's own timeout: the Join must win
DEADLINE = 10.0  # seconds within which every rank must leave the Join

CELLS = [
    (case, world_size, failing_rank)
    for case in ("before_heartbeat", "after_heartbeat", "main_hook", "post_hook", "stall")
    for world_size in (2, 4)
    for failing_rank in (0, world_size - 1)
]


def _run(case: str, world_size: int, failing_rank: int) -> dict[int, dict[str, Any]]:
    for _ in range(STALL_TRIES):
        results = spawn(fs.run_case, world_size,
                        args=(case, failing_rank, world_size, JOIN_TIMEOUT, STALL_TIMEOUT),
                        timeout=SPAWN_TIMEOUT)
        # A stall cell whose watchdog fired at the entry, before the stall, ran
        # on a machine too loaded for its short timeout: run it again (as
        # fault_support.again_while_entry_timed_out does for launches).
        if not timed_out_at_entry(results):
            break
    return {r["rank"]: r for r in results}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "world_size", "failing_rank"), CELLS)
def test_fault_matrix(case: str, world_size: int, failing_rank: int) -> None:
    results = _run(case, world_size, failing_rank)
    if case == "stall":
        problems = fs.check_stall(failing_rank, world_size, results, deadline=DEADLINE)
    else:
        problems = fs.check_case(case, failing_rank, world_size, results, deadline=DEADLINE)
    assert not problems, "\n".join(problems)
    record_cell("threads", case, world_size, failing_rank, summarize(results, failing_rank))


@pytest.mark.timeout(60)
def test_hook_failures_reach_peers_as_the_harness_abort() -> None:
    """(c) on threads: the failing rank's abort names it, its phase and exception."""
    results = _run("main_hook", 4, 3)
    for rank in (0, 1, 2):
        error = results[rank]["error"]
        assert error["type"] == "SpawnAborted"
        assert error["message"].startswith(
            "rank 3 aborted the group: rank 3 failed in a join hook (main_hook) with "
            "InjectedFault: injected main_hook fault on rank 3"
        ), error["message"]
    # The failing rank's report names its own failure; nobody ran a post hook.
    assert results[3]["report"]["failure"]["exc_type"] == "InjectedFault"
    assert not any(r["post_hook_ran"] for r in results.values())


@pytest.mark.timeout(60)
def test_stall_diagnostic_names_phase_round_and_where_every_rank_was() -> None:
    results = _run("stall", 3, 2)
    timeouts = [r["error"] for r in results.values() if r["error"]["type"] == "RankTimeout"]
    assert timeouts, results
    text = timeouts[0]["message"]
    assert "in phase DRAINING, counting non-joined ranks (shadow round 0)" in text
    assert "it had processed 2 inputs" in text
    assert "what the ranks were last seen doing:" in text
    # The stalled rank's whereabouts: its last collective, in its loop body.
    assert "rank 2: last called collective" in text and "in collective" in text
    assert "its Join: shadowing from shadow round 0 on" in text  # a joined peer's status


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", fs.AGREEMENT_VARIANTS)
def test_agreement_check(variant: str, world_size: int) -> None:
    results = spawn(fs.run_agreement, world_size, args=(variant,), timeout=SPAWN_TIMEOUT)
    problems = fs.check_agreement(variant, world_size, {r["rank"]: r for r in results})
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(60)
def test_agreement_error_table_on_every_rank() -> None:
    results = spawn(fs.run_agreement, 3, args=("joinables",), timeout=SPAWN_TIMEOUT)
    for result in results:
        message = result["error"]["message"]
        assert "rank | joinables | throw_on_early_termination | backend" in message
        assert "     0 | 2 | False | 'ThreadGroup'" in message
        assert "     2 | 1 | False | 'ThreadGroup'" in message
        assert result["seconds"] < DEADLINE


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 3])
def test_bad_inputs_are_clear_errors_without_a_hang(world_size: int) -> None:
    # Groups of a spawn whose ranks all returned: a destroyed backend.
    dead = spawn(lambda group: group, world_size, timeout=SPAWN_TIMEOUT)

    def rank_fn(group: ThreadGroup) -> dict[str, Any]:
        return fs.run_bad_inputs(group, dead_group=dead[group.rank], device="cuda:0")

    started = time.monotonic()
    for result in spawn(rank_fn, world_size, timeout=SPAWN_TIMEOUT):
        problems = fs.check_bad_inputs(result, world_size)
        assert not problems, "\n".join(problems)
        assert "returned from fn" in result["dead_group"]["message"]
    assert time.monotonic() - started < DEADLINE


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 3])
def test_report_gathered_report_and_debug_log(world_size: int) -> None:
    results = spawn(fs.run_report, world_size, timeout=SPAWN_TIMEOUT)
    problems = fs.check_report(world_size, {r["rank"]: r for r in results})
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(60)
def test_world_of_one_failure_and_solo_group() -> None:
    """world_size == 1: a failure is the rank's own exception; backends.init()'s
    world of one runs a Join with no peers at all."""
    [result] = spawn(fs.run_case, 1, args=("before_heartbeat", 0, 1), timeout=SPAWN_TIMEOUT)
    assert not fs.check_case("before_heartbeat", 0, 1, {0: result}, deadline=DEADLINE)
    solo = backends.init("threads")
    problems = fs.check_report(1, {0: fs.run_report(solo)})
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(60)
def test_join_timeout_validation() -> None:
    group = backends.init("threads")
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            Join([fs.Counter(group)], timeout=bad)
    with Join([fs.Counter(group)], timeout=None) as join:  # watchdog off
        pass
    assert join.report is not None and join.report.phase == "DONE"


@pytest.mark.timeout(60)
def test_a_broken_last_heartbeat_does_not_replace_the_ranks_own_exception() -> None:
    """Rank 0 raises right after a heartbeat that rank 1 never matches (rank 1
    aborts the group): leaving the block must re-raise rank 0's own exception,
    with the abort as a note, and must not wait for that heartbeat, which
    never completes (a frozen peer's would block the rank for good)."""
    sent, aborted = threading.Event(), threading.Event()

    def rank_fn(group: ThreadGroup) -> BaseException | None:
        counter = fs.Counter(group)
        try:
            with Join([counter], timeout=JOIN_TIMEOUT):
                if group.rank == 0:
                    counter.heartbeat()  # still pending when rank 0 raises
                    sent.set()
                    aborted.wait(DEADLINE)
                    raise fs.InjectedFault("rank 0's own failure")
                sent.wait(DEADLINE)
                group.abort("rank 1 gave up")
                aborted.set()
                raise KeyError("rank 1")
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    own, _ = spawn(rank_fn, 2, timeout=SPAWN_TIMEOUT)
    assert isinstance(own, fs.InjectedFault), repr(own)
    assert any("could not finish shadowing" in note for note in own.__notes__), own.__notes__
    assert not any("settle the last heartbeat" in note for note in own.__notes__)


class UncountedCounter(fs.Counter):
    """A Counter that declares collectives its backend cannot count."""

    join_raw_collectives = True


def _run_uncounted(fault: str, failing: int, world_size: int,
                   fail_at: int = fs.FAIL_AT) -> dict[int, dict[str, Any]]:
    def rank_fn(group: ThreadGroup) -> dict[str, Any]:
        counter = UncountedCounter(group)
        message = fs.fault_message(fault, group.rank)
        started = time.monotonic()
        error: BaseException | None = None
        try:
            with Join([counter], timeout=JOIN_TIMEOUT):
                for i in range(fs.INPUTS + group.rank):
                    if group.rank == failing and i == fail_at and fault == "before_heartbeat":
                        raise fs.InjectedFault(message)
                    counter.heartbeat()
                    if group.rank == failing and i == fail_at and fault == "after_heartbeat":
                        raise fs.InjectedFault(message)
                    counter.collective()
        except Exception as exc:  # noqa: BLE001
            error = exc
        return {"error": fs.describe_error(error), "seconds": time.monotonic() - started,
                "post_hook_ran": counter.post_hook_ran}

    return dict(enumerate(spawn(rank_fn, world_size, timeout=SPAWN_TIMEOUT)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["before_heartbeat", "after_heartbeat"])
@pytest.mark.parametrize(("world_size", "failing"), [(2, 0), (2, 1), (4, 0), (4, 3)])
def test_a_failure_the_join_cannot_place_aborts_the_group_naming_it(
    fault: str, world_size: int, failing: int
) -> None:
    """``join_raw_collectives``: the Join cannot tell whether the peers wait in
    the failing rank's last iteration, so it aborts (fails fast) with the
    exception in the abort's message, which every peer's error carries."""
    results = _run_uncounted(fault, failing, world_size)
    said = (f"rank {failing} failed inside the Join context with InjectedFault: "
            f"{fs.fault_message(fault, failing)}; the Join cannot tell whether its peers wait")
    own = results[failing]["error"]
    assert own["type"] == "InjectedFault", own
    assert any(note.startswith(f"joinkit aborted the group after it: {said}")
               for note in own["notes"]), own
    for rank, result in results.items():
        assert result["seconds"] < DEADLINE and not result["post_hook_ran"], result
        if rank != failing:
            error = result["error"]
            assert error["type"] == "SpawnAborted", error
            assert error["message"].startswith(f"rank {failing} aborted the group: {said}"), error


@pytest.mark.timeout(60)
def test_an_uncounted_failure_before_the_first_heartbeat_leaves_the_group_usable() -> None:
    # Nothing of the iteration went out: the failing rank drains as usual.
    results = _run_uncounted("before_heartbeat", 1, 2, fail_at=0)
    assert results[1]["error"]["type"] == "InjectedFault"
    assert results[0]["error"]["type"] == "PeerFailure"
    assert results[0]["error"]["peer"]["rank"] == 1


@pytest.mark.timeout(60)
def test_after_its_failure_a_rank_posts_it_and_its_stall_message_names_it() -> None:
    """Rank 0 fails before its first heartbeat and drains; rank 1 then sleeps
    in its loop body past rank 0's timeout. Rank 0's posted statuses and its
    RankTimeout (a note on its own exception, and the abort that reaches rank
    1) name rank 0's own exception."""

    def rank_fn(group: ThreadGroup) -> tuple[list[str], dict[str, Any] | None]:
        posted: list[str] = []
        post = group.post_status
        group.post_status = lambda what: (posted.append(what), post(what))  # type: ignore[method-assign]
        counter = fs.Counter(group)
        error: BaseException | None = None
        try:
            with Join([counter], timeout=STALL_TIMEOUT):
                if group.rank == 0:
                    raise fs.InjectedFault("rank 0 broke")
                time.sleep(fs.STALL_FACTOR * STALL_TIMEOUT)
                counter.step()
        except Exception as exc:  # noqa: BLE001
            error = exc
        return posted, fs.describe_error(error)

    (posted, own), (_, peer) = spawn(rank_fn, 2, timeout=SPAWN_TIMEOUT)
    failure = "rank 0 had failed inside the Join context with InjectedFault: rank 0 broke"
    assert own is not None and own["type"] == "InjectedFault", own
    assert posted[-1] == f"left the Join; {failure}", posted
    assert any(p.startswith("shadowing from shadow round 0 on") and p.endswith(failure)
               for p in posted), posted
    [note] = [n for n in own["notes"] if "could not finish shadowing" in n]
    assert "made no progress" in note and failure in note, note
    assert peer is not None and peer["type"] == "SpawnAborted", peer
    assert "made no progress" in peer["message"] and failure in peer["message"], peer
