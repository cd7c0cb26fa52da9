"""Costs that grow with the world: entry, reports, failures and the stall diagnostic.

A rank's entry check, ``gather_report`` (off ``dst``) and failure exchange must
cost it O(1) collectives and bytes, not O(world size): a counting join backend
over the threads harness records what each rank called and how many pickled
bytes each call handed back to it. The stall diagnostic's summary is a pure
function, tested on its own.
"""

from __future__ import annotations

import collections
import pickle
from typing import Any

import pytest

from joinkit import AgreementError, Join, Joinable, JoinHook, PeerFailure, backends
from joinkit._reporting import MOST_RANK_RANGES, MOST_STATUS_LINES, peer_status_lines
from joinkit.backends.threads import ThreadGroup, spawn

TIMEOUT = 60.0


class Counting:
    """A join backend over a ThreadGroup that counts each rank's calls and the
    pickled bytes each call returned to it, without the optional object
    collectives (the fallback a third-party backend gets)."""

    def __init__(self, group: ThreadGroup) -> None:
        self.group = group
        self.rank = group.rank
        self.world_size = group.world_size
        self.calls: collections.Counter[str] = collections.Counter()
        self.received = 0

    def _note(self, name: str, result: Any) -> Any:
        self.calls[name] += 1
        self.received += len(pickle.dumps(result))
        return result

    def heartbeat(self, value: float) -> Any:
        self.calls["heartbeat"] += 1
        return self.group.heartbeat(value)

    def heartbeat_total(self, handle: Any) -> float:
        return self.group.heartbeat_total(handle)

    def count(self, value: float) -> float:
        return float(self._note("count", self.group.count(value)))

    def all_gather_object(self, obj: Any) -> list[Any]:
        return list(self._note("all_gather_object", self.group.all_gather_object(obj)))


class CountingFast(Counting):
    """``Counting`` with the optional members that keep a rank's costs O(1)."""

    def all_agree(self, value: int) -> bool:
        return bool(self._note("all_agree", self.group.all_agree(value)))

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None:
        return self._note("gather_object", self.group.gather_object(obj, dst))  # type: ignore[no-any-return]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return self._note("broadcast_object", self.group.broadcast_object(obj, src))


backends.register(Counting, lambda group, device: group)


class Step(Joinable):
    """A joinable whose iteration has no collective but the heartbeat."""

    def __init__(self, backend: Counting) -> None:
        super().__init__()
        self.backend = backend

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()

    @property
    def join_device(self) -> Any:
        return "cpu"

    @property
    def join_process_group(self) -> Any:
        return self.backend

    def step(self) -> None:
        Join.notify_join_context(self)


def run(world: int, fast: bool, *, throw_on_rank: int | None = None,
        fail_on_rank: int | None = None, dst: int = 0) -> list[dict[str, Any]]:
    """Each rank's Join over a counting backend: inputs rank % 3, then a report."""

    def rank_fn(group: ThreadGroup) -> dict[str, Any]:
        backend = (CountingFast if fast else Counting)(group)
        step = Step(backend)
        error: BaseException | None = None
        gathered: Any = None
        try:
            with Join([step], throw_on_early_termination=group.rank == throw_on_rank,
                      timeout=TIMEOUT) as join:
                for i in range(group.rank % 3):
                    if group.rank == fail_on_rank and i == 0:
                        raise ValueError(f"bad batch on rank {group.rank}")
                    step.step()
            gathered = join.gather_report(dst)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = exc
        return {"calls": dict(backend.calls), "received": backend.received,
                "error": error, "gathered": gathered}

    return spawn(rank_fn, world, timeout=TIMEOUT)  # type: ignore[no-any-return]


@pytest.mark.timeout(120)
def test_entry_and_report_cost_a_rank_one_small_collective_each() -> None:
    results = run(8, fast=True, dst=5)
    for rank, result in enumerate(results):
        assert result["error"] is None, result
        calls = result["calls"]
        assert "all_gather_object" not in calls, calls
        assert calls["all_agree"] == 1 and calls["gather_object"] == 1, calls
        if rank == 5:
            assert [r.rank for r in result["gathered"]] == list(range(8))
            assert [r.inputs for r in result["gathered"]] == [r % 3 for r in range(8)]
        else:
            assert result["gathered"] is None


def _facts(report: Any) -> tuple[Any, ...]:
    """A report without its timings."""
    return (report.rank, report.inputs, report.joined_at_round, report.shadow_rounds,
            report.is_last_joiner, report.outcome)


@pytest.mark.timeout(120)
def test_a_backend_without_the_fast_members_gets_the_same_answers() -> None:
    fast, bare = run(6, fast=True, dst=2), run(6, fast=False, dst=2)
    for rank in range(6):
        assert bare[rank]["error"] is None
        assert bare[rank]["calls"]["all_gather_object"] == 2  # entry and report
        if rank == 2:
            assert [_facts(r) for r in bare[rank]["gathered"]] == [
                _facts(r) for r in fast[rank]["gathered"]]
            assert [r.inputs for r in bare[rank]["gathered"]] == [r % 3 for r in range(6)]
        else:
            assert bare[rank]["gathered"] is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "bare"])
def test_a_disagreement_still_shows_the_table_on_every_rank(fast: bool) -> None:
    results = run(4, fast=fast, throw_on_rank=1)
    for result in results:
        error = result["error"]
        assert isinstance(error, AgreementError), result
        text = str(error)
        assert "rank | joinables | throw_on_early_termination" in text
        assert "     1 | 1 | True" in text and "     0 | 1 | False" in text
        # The digests differed, so the table was gathered (without all_agree,
        # the digests were all-gathered too).
        calls = result["calls"]
        assert calls["all_gather_object"] == (1 if fast else 2)
        assert calls.get("all_agree", 0) == (1 if fast else 0)


@pytest.mark.timeout(120)
def test_the_failure_exchange_gathers_and_broadcasts_only_the_failures() -> None:
    results = run(6, fast=True, fail_on_rank=4)
    for rank, result in enumerate(results):
        error = result["error"]
        calls = result["calls"]
        assert "all_gather_object" not in calls, calls
        assert calls["gather_object"] == 1 and calls["broadcast_object"] == 1, calls
        if rank == 4:
            assert isinstance(error, ValueError) and str(error) == "bad batch on rank 4"
        else:
            assert isinstance(error, PeerFailure), result
            assert (error.rank, error.exc_type) == (4, "ValueError")
            assert [f.rank for f in error.failures] == [4]  # type: ignore[attr-defined]


@pytest.mark.timeout(300)
def test_a_rank_off_dst_receives_the_same_bytes_in_any_world() -> None:
    # Entry, loop, drain and report: what a rank other than dst is handed
    # back does not grow with the world (it did, as an all-gather, twice).
    small, large = run(12, fast=True), run(300, fast=True)
    assert all(r["error"] is None for r in small + large)

    def received(results: list[dict[str, Any]]) -> set[int]:
        # Same inputs (rank % 3), so the same number of counts; compare like with like.
        return {r["received"] for rank, r in enumerate(results) if rank and rank % 3 == 0}

    assert received(small) == received(large)
    assert len(received(large)) == 1
    assert large[0]["received"] > 10 * small[0]["received"]  # dst gets every report


# -- the stall diagnostic's summary ----------------------------------------------


def test_ranks_in_one_state_share_a_line_with_the_span_of_their_ages() -> None:
    statuses = {rank: f"counting non-joined ranks (shadow round 3) ({rank / 10:.1f} s ago)"
                for rank in range(4096)}
    statuses[17] = "active: in its loop body (12.0 s ago)"
    assert peer_status_lines(statuses) == [
        "  ranks 0-16, 18-4095 (4095 ranks): counting non-joined ranks (shadow round 3) "
        "(0.0-409.5 s ago)",
        "  rank 17: active: in its loop body (12.0 s ago)",
    ]


def test_a_lone_rank_and_equal_ages_read_as_before() -> None:
    assert peer_status_lines({0: "a (1.0 s ago)", 1: "no status posted", 2: "a (1.0 s ago)"}) == [
        "  ranks 0, 2 (2 ranks): a (1.0 s ago)",
        "  rank 1: no status posted",
    ]
    assert peer_status_lines({3: "b; its Join: c (0.5 s ago)"}) == [
        "  rank 3: b; its Join: c (0.5 s ago)"
    ]


def test_many_states_and_scattered_ranks_are_capped() -> None:
    statuses = {rank: f"state {rank % 40}" for rank in range(400)}
    lines = peer_status_lines(statuses)
    assert len(lines) == MOST_STATUS_LINES + 1
    assert lines[-1] == (
        f"  ... and {400 - 10 * MOST_STATUS_LINES} more ranks in "
        f"{40 - MOST_STATUS_LINES} other states"
    )
    # Rank 0's state: ranks 0, 40, 80, ...: the first ranges, then "...".
    shown = ", ".join(str(40 * i) for i in range(MOST_RANK_RANGES))
    assert lines[0] == f"  ranks {shown}, ... (10 ranks): state 0"


# -- the threads backend's object collectives ---------------------------------------


@pytest.mark.timeout(60)
def test_thread_group_object_collectives() -> None:
    def rank_fn(group: ThreadGroup) -> dict[str, Any]:
        mine = {"rank": group.rank}
        out: dict[str, Any] = {
            "same": group.all_agree(2**62 + 1),
            "differ": group.all_agree(group.rank % 2),
            "gathered": group.gather_object(mine, 1),
            "broadcast": group.broadcast_object(mine if group.rank == 2 else None, 2),
        }
        out["copied"] = group.rank != 2 and out["broadcast"] is not mine
        for bad in (3, -1):
            try:
                group.gather_object(mine, bad)
            except ValueError as exc:
                out[f"bad {bad}"] = str(exc)
        return out

    results = spawn(rank_fn, 3, timeout=TIMEOUT)
    for rank, got in enumerate(results):
        assert got["same"] is True and got["differ"] is False
        assert got["gathered"] == ([{"rank": r} for r in range(3)] if rank == 1 else None)
        assert got["broadcast"] == {"rank": 2}
        assert got["copied"] == (rank != 2)
        assert got["bad 3"] == "gather_object: dst=3 is not a rank of this group (world size 3)"
        assert "dst=-1" in got["bad -1"]
