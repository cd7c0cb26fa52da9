"""The Join shell on the threads backend: the scenarios of torch's own Join tests.

``AllReducer`` (``tests/support``) all-reduces a 1 per iteration (a joined rank
shadows it with a 0), so after the loop its running total is known in closed form. Its post hook
broadcasts a constant from a last joiner.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
import time
import warnings
from typing import Any

import pytest
from support import AFTER, AllReducer, AllReducerJoinHook, expected_total

from joinkit import (
    EarlyTermination,
    Join,
    Joinable,
    JoinHook,
    JoinReport,
    LocalProtocolError,
    RankTimeout,
    _entry,
)
from joinkit import _machine as m
from joinkit.backends.threads import ThreadGroup, spawn

TIMEOUT = 20.0


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("num_joinables", [1, 3])
def test_uneven_inputs_main_and_post_hooks(world_size: int, num_joinables: int) -> None:
    inputs = [5 + 2 * r for r in range(world_size)]

    def rank_fn(group: ThreadGroup) -> dict[str, Any]:
        log: list[Any] = []
        joinables = [AllReducer(group, f"j{i}", log) for i in range(num_joinables)]
        with Join(joinables) as join:
            for _ in range(inputs[group.rank]):
                for joinable in joinables:
                    joinable()
        return {
            "totals": [j.total for j in joinables],
            "post": [j.post_value for j in joinables],
            "log": log,
            "state": join.state,
        }

    results = spawn(rank_fn, world_size, timeout=TIMEOUT)
    most = max(inputs)
    for rank, result in enumerate(results):
        assert result["totals"] == [expected_total(inputs, rank)] * num_joinables
        # The post hooks broadcast the last joiner's value to everyone.
        assert result["post"] == [AFTER] * num_joinables
        rounds = most - inputs[rank]
        # Main hooks run in the given order, once per shadow round; then the post hooks.
        assert result["log"] == ["main"] * num_joinables * rounds + [
            ("post", inputs[rank] == most)
        ] * num_joinables
        assert result["state"].shadow_rounds == rounds
        assert result["state"].heartbeats == inputs[rank]


def test_heartbeat_handle_only_for_first_joinable() -> None:
    def rank_fn(group: ThreadGroup) -> list[bool]:
        first, second = AllReducer(group), AllReducer(group)
        with Join([first, second]):
            handles = [first(), second()]
            for handle in handles:
                if handle is not None:
                    handle.wait()
        return [handle is not None for handle in handles]

    assert spawn(rank_fn, 2, timeout=TIMEOUT) == [[True, False]] * 2


@pytest.mark.parametrize("num_joinables", [1, 2])
def test_enable_false_with_even_inputs_is_vacuous(num_joinables: int) -> None:
    def rank_fn(group: ThreadGroup) -> tuple[list[float], list[Any], list[Any]]:
        log: list[Any] = []
        joinables = [AllReducer(group, log=log) for _ in range(num_joinables)]
        with Join(joinables, enable=False) as join:
            handles = [[j() for j in joinables] for _ in range(3)]
        assert join.state is None
        return [j.total for j in joinables], log, handles

    for totals, log, handles in spawn(rank_fn, 2, timeout=TIMEOUT):
        assert totals == [6.0] * num_joinables
        assert log == []  # no hooks ran
        assert all(h is None for row in handles for h in row)  # no heartbeat sent


@pytest.mark.parametrize("num_joinables", [1, 3])
def test_throw_on_early_termination(num_joinables: int) -> None:
    world_size, fewest = 4, 2
    inputs = [fewest if r == 1 else 6 for r in range(world_size)]

    def rank_fn(group: ThreadGroup) -> str:
        joinables = [AllReducer(group) for _ in range(num_joinables)]
        with pytest.raises(RuntimeError) as caught:
            with Join(joinables, throw_on_early_termination=True):
                for _ in range(inputs[group.rank]):
                    for joinable in joinables:
                        joinable()
        assert isinstance(caught.value, EarlyTermination)
        return str(caught.value)

    messages = spawn(rank_fn, world_size, timeout=TIMEOUT)
    assert messages[1] == "Rank 1 exhausted all inputs."
    for rank in (0, 2, 3):
        assert messages[rank] == (
            "Detected at least one rank that exhausted inputs. Throwing across all ranks."
        )


def test_throw_mode_with_even_inputs_finishes_normally() -> None:
    def rank_fn(group: ThreadGroup) -> float:
        joinable = AllReducer(group)
        with Join([joinable], throw_on_early_termination=True):
            for _ in range(4):
                joinable()
        return joinable.post_value

    assert spawn(rank_fn, 3, timeout=TIMEOUT) == [AFTER] * 3


def test_kwargs_are_forwarded_to_every_join_hook() -> None:
    def rank_fn(group: ThreadGroup) -> tuple[list[Any], list[float]]:
        joinables = [AllReducer(group) for _ in range(2)]
        with Join(joinables, num_allreduces=3, extra="x"):
            for _ in range(2 + group.rank):
                for joinable in joinables:
                    joinable(num_allreduces=3)
        return [j.kwargs for j in joinables], [j.total for j in joinables]

    inputs = [2, 3]
    for rank, (kwargs, totals) in enumerate(spawn(rank_fn, 2, timeout=TIMEOUT)):
        assert kwargs == [{"num_allreduces": 3, "extra": "x"}] * 2
        # The hooks shadowed three all-reduces per round, so nothing hung and
        # the totals are three times the closed form.
        assert totals == [expected_total(inputs, rank, per_iteration=3)] * 2


def test_enter_returns_join_and_exit_resets_configs() -> None:
    def rank_fn(group: ThreadGroup) -> None:
        joinable = AllReducer(group)
        join = Join([joinable])
        with join as entered:
            assert entered is join
            assert joinable._join_config.enable and joinable._join_config.is_first_joinable
            joinable()
        assert not joinable._join_config.enable
        assert Join.notify_join_context(joinable) is None  # vacuous again
        # The same joinable can enter a new Join afterwards.
        with Join([joinable]):
            joinable()

    spawn(rank_fn, 2, timeout=TIMEOUT)


def test_a_join_is_single_use_and_says_so_when_entered_again() -> None:
    inputs = [2, 3]

    def rank_fn(group: ThreadGroup) -> tuple[float, float, str]:
        joinable = AllReducer(group)
        join = Join([joinable])
        with join:  # the first use is unaffected
            with pytest.raises(LocalProtocolError, match="already entered.*single-use"):
                with join:
                    pass
            for _ in range(inputs[group.rank]):
                joinable()
        first = joinable.total
        with pytest.raises(LocalProtocolError, match="single-use.*new Join") as error:
            with join:
                joinable()
        assert "cannot accept" not in str(error.value)
        assert not joinable._join_config.enable  # nothing was entered
        # A new Join per loop is the way: it runs the protocol again.
        with Join([joinable]):
            for _ in range(inputs[group.rank]):
                joinable()
        assert join.state is not None
        return first, joinable.total - first, join.state.phase.name

    for rank, (first, second, phase) in enumerate(spawn(rank_fn, 2, timeout=TIMEOUT)):
        assert first == second == expected_total(inputs, rank)
        assert phase == "DONE"


def test_posted_statuses_follow_the_join_from_entry_to_exit() -> None:
    # What a peer's stall diagnostic reads of this rank (_drive.Drive.post).
    def rank_fn(group: ThreadGroup) -> list[str]:
        posted: list[str] = []
        post = group.post_status
        group.post_status = lambda what: (posted.append(what), post(what))  # type: ignore[method-assign]
        joinable = AllReducer(group)
        with Join([joinable]):
            for _ in range(1 + group.rank):
                joinable()
        return posted

    joined_first, joined_last = spawn(rank_fn, 2, timeout=TIMEOUT)
    entry = ["the agreement check at entry", "active: in its loop body"]
    drain = ("shadowing from shadow round 0 on (counting non-joined ranks, then main hooks, "
             "round after round)")  # one post for the whole batch of rounds
    assert joined_first == [*entry, drain, "post hooks", "left the Join"]
    assert joined_last == [*entry, drain, "post hooks", "left the Join"]


class SlowHook(AllReducerJoinHook):
    """Sleeps in its main hook of shadow round ``stall_round``."""

    def __init__(self, allreducer: AllReducer, stall_round: int | None) -> None:
        super().__init__(allreducer, 1)
        self.stall_round = stall_round
        self.rounds = 0

    def main_hook(self) -> None:
        if self.rounds == self.stall_round:
            time.sleep(2.0)
        self.rounds += 1
        super().main_hook()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stalls_in", ["count", "hook"])
def test_watchdog_names_the_round_a_drain_stalls_in(stalls_in: str) -> None:
    # Rank 0 has no inputs: it drains (one Drain command, one activity with a
    # tick per count and per round of hooks) while rank 1 runs 5 iterations,
    # then rank 1 stalls in its loop (rank 0 blocks in the count of round 5),
    # or rank 0's main hook stalls in round 3.
    def rank_fn(group: ThreadGroup) -> BaseException | None:
        joinable = AllReducer(group)
        hook_round = 3 if stalls_in == "hook" and group.rank == 0 else None
        joinable.join_hook = lambda **kwargs: SlowHook(joinable, hook_round)  # type: ignore[method-assign]
        try:
            with Join([joinable], timeout=0.5):
                for _ in range(5 if group.rank == 1 else 0):
                    joinable()
                if stalls_in == "count" and group.rank == 1:
                    time.sleep(2.0)
        except Exception as exc:  # noqa: BLE001 - asserted below
            return exc
        return None

    drained, _ = spawn(rank_fn, 2, timeout=TIMEOUT)
    assert isinstance(drained, RankTimeout), drained
    text = str(drained)
    if stalls_in == "count":
        assert ("in phase DRAINING, counting non-joined ranks (shadow round 5); it had "
                "processed 0 inputs and run 5 shadow rounds") in text, text
    else:
        assert ("in phase DRAINING, main hooks of shadow round 3; it had processed 0 "
                "inputs and run 3 shadow rounds") in text, text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inputs", [4, 2000])
def test_debug_logging_takes_the_same_path_and_summarises_the_drain(
    caplog: pytest.LogCaptureFixture, inputs: int
) -> None:
    # One interpreter: DEBUG logs each phase change, a whole drain (all its
    # batches) as one line, however many rounds it has, and changes nothing else.
    def rank_fn(group: ThreadGroup) -> tuple[JoinReport, int]:
        joinable = AllReducer(group)
        with Join([joinable]) as join:
            for _ in range(inputs if group.rank == 1 else 0):
                joinable()
        return join.report, group._calls

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skew warning of the long drain
        with caplog.at_level(logging.DEBUG, logger="joinkit"):
            logged = spawn(rank_fn, 2, timeout=60.0)
        rank0 = [re.sub(r" after \d+\.\d{3} s in ", " after T s in ", r.getMessage())
                 for r in caplog.records if r.getMessage().startswith("rank 0")]
        # Batches of 16, 32, 64, ... rounds (the skew warning's round ends one).
        found = re.search(r"in (\d+) drain batches", " ".join(rank0))
        assert found is not None, rank0
        batches = int(found[1])
        assert 1 <= batches <= 3 + math.log2(inputs / 16 + 1), rank0
        assert rank0 == [
            "rank 0: IDLE -> AGREEING on Entered",
            "rank 0: AGREEING -> ACTIVE on SignaturesCompared after T s in AGREEING",
            "rank 0: ACTIVE -> DRAINING on LoopExited (0 inputs) after T s in ACTIVE",
            f"rank 0: DRAINING -> POST_HOOKS on Drained ({inputs} shadow rounds in {batches} "
            "drain batches, then a count of 0) after T s in DRAINING",
            "rank 0: POST_HOOKS -> DONE on HooksDone after T s in POST_HOOKS",
        ], rank0
        assert all(r.levelno == logging.DEBUG for r in caplog.records)  # 30 s never passed
        caplog.clear()
        quiet = spawn(rank_fn, 2, timeout=60.0)
    assert [r.shadow_rounds for r, _ in logged] == [r.shadow_rounds for r, _ in quiet] == [
        inputs, 0]
    # The same collectives either way.
    assert [calls for _, calls in logged] == [calls for _, calls in quiet]


def test_configs_are_reset_even_when_the_loop_raises() -> None:
    def rank_fn(group: ThreadGroup) -> bool:
        joinable = AllReducer(group)
        with pytest.raises(KeyError):
            with Join([joinable]):
                raise KeyError("boom")
        return joinable._join_config.enable

    assert spawn(rank_fn, 1, timeout=TIMEOUT) == [False]


def test_skew_warning_after_1000_shadow_rounds_without_touching_filters() -> None:
    filters_before = list(warnings.filters)

    def rank_fn(group: ThreadGroup) -> None:
        joinable = AllReducer(group)
        with Join([joinable]):
            for _ in range(0 if group.rank == 0 else 1002):
                joinable()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spawn(rank_fn, 2, timeout=60.0)
    skew = [w for w in caught if "uneven input skew" in str(w.message)]
    assert len(skew) == 1  # once, from the joined rank 0 only
    assert "rank 0 has at least 1000 fewer inputs" in str(skew[0].message)
    # It points at the user's `with Join(...)` line, not at joinkit.
    lines, first = inspect.getsourcelines(rank_fn)
    with_line = first + next(i for i, line in enumerate(lines) if "with Join(" in line)
    assert (skew[0].filename, skew[0].lineno) == (__file__, with_line)
    assert warnings.filters == filters_before


def _progress_lines(caplog: pytest.LogCaptureFixture, rank: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.INFO and r.getMessage().startswith(f"rank {rank} joined")]


@pytest.mark.timeout(60)
def test_a_long_drain_says_so_at_info_naming_the_active_ranks(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The interval at 0 s: a line at every drain batch boundary.
    monkeypatch.setattr(m, "PROGRESS_INTERVAL", 0.0)
    inputs = [5, 40, 40]

    def rank_fn(group: ThreadGroup) -> JoinReport | None:
        joinable = AllReducer(group)
        with Join([joinable]) as join:
            for _ in range(inputs[group.rank]):
                joinable()
        return join.report

    with caplog.at_level(logging.INFO, logger="joinkit"):
        reports = spawn(rank_fn, 3, timeout=TIMEOUT)
    lines = _progress_lines(caplog, 0)
    # The first boundary comes after the first batch's rounds, while ranks 1
    # and 2 are in their loop (a joined rank shadows each of their iterations).
    assert re.fullmatch(
        r"rank 0 joined after 5 inputs; shadowing rank\(s\) 1, 2 for \d+ s \(16 rounds\)",
        lines[0],
    ), lines
    rounds = [int(re.search(r"\((\d+) rounds\)", line)[1]) for line in lines]  # type: ignore[index]
    assert rounds == sorted(rounds) and rounds[-1] < 35  # growing, within the drain
    assert len(lines) > 1
    # Ranks 1 and 2 join together and shadow nobody.
    assert _progress_lines(caplog, 1) == _progress_lines(caplog, 2) == []
    assert [r.shadow_rounds for r in reports if r is not None] == [35, 0, 0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("board", ["missing", "raising"])
def test_without_a_status_board_the_progress_line_counts_the_active_ranks(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, board: str
) -> None:
    monkeypatch.setattr(m, "PROGRESS_INTERVAL", 0.0)
    if board == "missing":
        monkeypatch.delattr(ThreadGroup, "peer_status")
    else:
        def broken(self: ThreadGroup) -> dict[int, str]:
            raise TimeoutError("the board did not answer")

        monkeypatch.setattr(ThreadGroup, "peer_status", broken)

    def rank_fn(group: ThreadGroup) -> int:
        joinable = AllReducer(group)
        with Join([joinable]) as join:
            for _ in range(0 if group.rank == 0 else 40):
                joinable()
        assert join.report is not None
        return join.report.shadow_rounds

    with caplog.at_level(logging.INFO, logger="joinkit"):
        assert spawn(rank_fn, 3, timeout=TIMEOUT) == [40, 0, 0]  # the drain went on
    lines = _progress_lines(caplog, 0)
    assert lines and lines[0].startswith(
        "rank 0 joined after 0 inputs; shadowing 2 active rank(s) for "
    ), lines


class _NoInit(Joinable):
    def __init__(self, group: ThreadGroup) -> None:  # skips Joinable.__init__
        self.group = group

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()

    @property
    def join_device(self) -> str:
        return "cpu"

    @property
    def join_process_group(self) -> ThreadGroup:
        return self.group


def test_bad_input_errors() -> None:
    with pytest.raises(ValueError, match="at least one joinable"):
        Join([])

    def rank_fn(group: ThreadGroup) -> None:
        with pytest.raises(TypeError, match="expects Joinable objects"):
            Join([object()])
        no_init = _NoInit(group)
        with pytest.raises(LocalProtocolError, match=r"call Joinable.__init__"):
            Join.notify_join_context(no_init)
        with pytest.raises(LocalProtocolError, match=r"call Joinable.__init__"):
            with Join([no_init]):
                pass
        joinable = AllReducer(group)
        with Join([joinable]):
            with pytest.raises(LocalProtocolError, match="cannot be nested"):
                with Join([joinable]):
                    pass
            joinable()

    spawn(rank_fn, 2, timeout=TIMEOUT)


def test_joinables_on_different_groups_are_rejected() -> None:
    def rank_fn(group: ThreadGroup, other: ThreadGroup) -> None:
        with pytest.raises(ValueError, match="multiple process groups"):
            Join([AllReducer(group), AllReducer(other)])

    def outer(group: ThreadGroup) -> None:
        # A second, distinct group object: compare by identity/equality.
        rank_fn(group, object())  # type: ignore[arg-type]

    spawn(outer, 2, timeout=TIMEOUT)


def test_hook_that_is_not_a_join_hook_is_rejected() -> None:
    class BadHook(AllReducer):
        def join_hook(self, **kwargs: Any) -> Any:
            return "not a hook"

    def rank_fn(group: ThreadGroup) -> None:
        with pytest.raises(TypeError, match="not a JoinHook"):
            Join([BadHook(group)])

    spawn(rank_fn, 1, timeout=TIMEOUT)


def test_notify_outside_any_join_does_nothing_but_inside_a_foreign_join_is_an_error() -> None:
    def rank_fn(group: ThreadGroup) -> None:
        member, stranger = AllReducer(group), AllReducer(group)
        assert stranger() is None  # outside any Join: vacuous, as in torch
        with Join([member]):
            member()
            with pytest.raises(LocalProtocolError, match="does not include it"):
                stranger()
        assert stranger() is None  # and vacuous again afterwards

    spawn(rank_fn, 2, timeout=TIMEOUT)


def test_notify_with_a_foreign_joinable_no_adapter_handles_is_a_clear_error() -> None:
    class ForeignConfig:  # another framework's config type (e.g. a namedtuple)
        enable, is_first_joinable = True, True

    class Foreign:
        _join_config = ForeignConfig()

    with pytest.raises(LocalProtocolError, match="no adapter handles.*register_adapter"):
        Join.notify_join_context(Foreign())
    with pytest.raises(LocalProtocolError, match="no adapter handles"):
        Join.fused_heartbeat(Foreign())  # type: ignore[arg-type]


def test_a_hook_that_declares_its_main_hook_local_leaves_the_round_path_open() -> None:
    """``JoinHook.main_hook_is_local``: only ``True`` itself counts as the declaration;
    an overridden main hook is otherwise taken to issue collectives."""
    class Shadowing(JoinHook):
        def main_hook(self) -> None:
            pass

    class Local(Shadowing):
        main_hook_is_local = True

    class Truthy(Shadowing):
        main_hook_is_local = 1  # type: ignore[assignment]

    assert JoinHook.main_hook_is_local is False
    assert _entry._quiet(JoinHook())
    assert not _entry._quiet(Shadowing())
    assert _entry._quiet(Local())
    assert not _entry._quiet(Truthy())
