"""on_rank_loss (issue 20), the core part: the pure machine, the shell over a
recording fake backend, and the clear entry error of a backend that cannot
rebuild its group (threads). The MPI/ULFM kill matrix is tests/elastic/test_elastic_mpi.py."""

from __future__ import annotations

import json
import warnings
from typing import Any

import attrs
import numpy as np
import pytest

import joinkit
from joinkit import Join, Joinable, JoinHook, JoinReport, LostRank, _ports, backends
from joinkit import _machine as m
from joinkit.backends.threads import spawn

LOST_1 = LostRank(rank=1, iterations=4, survivors=(0, 2), detected="ERR_PROC_FAILED in test")
LOST_2 = LostRank(rank=2, iterations=7, survivors=(0,), detected="ERR_REVOKED in test")


def finishing_state(phase: m.Phase = m.Phase.ACTIVE) -> m.JoinState:
    config = m.MachineConfig(rank=0, world_size=3, on_rank_loss="finish")
    return attrs.evolve(m.initial_state(config), phase=phase)


def test_lost_rank_is_exported_and_frozen() -> None:
    assert joinkit.LostRank is m.LostRank
    assert "LostRank" in joinkit.__all__
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        LOST_1.rank = 3  # type: ignore[misc]


def test_machine_records_each_loss_once_and_warns_once_each() -> None:
    s = finishing_state()
    first = m.step(s, m.RanksLost(lost=(LOST_1,), now=1.0))
    warn, order = first.commands
    assert isinstance(warn, m.WarnRankLost) and warn.rank == 1
    assert isinstance(order, m.HeartbeatOrder)  # the standing order stands
    text = warn.message
    for needle in ("rank 1", "after 4 iterations", "ERR_PROC_FAILED in test",
                   "remaining inputs were not seen", "initial world size (3)",
                   "ranks 0, 2"):
        assert needle in text, needle
    assert first.state.lost_ranks == (LOST_1,)
    # The shell passes the whole list each time it grows: only the new loss warns.
    second = m.step(first.state, m.RanksLost(lost=(LOST_1, LOST_2), now=2.0))
    assert [type(c) for c in second.commands] == [m.WarnRankLost, m.HeartbeatOrder]
    assert second.commands[0].rank == 2  # type: ignore[union-attr]
    assert second.state.lost_ranks == (LOST_1, LOST_2)
    again = m.step(second.state, m.RanksLost(lost=(LOST_1, LOST_2), now=3.0))
    assert [type(c) for c in again.commands] == [m.HeartbeatOrder]
    assert again.state.phase is m.Phase.ACTIVE


def test_losses_reach_the_report_and_survive_json() -> None:
    s = m.step(finishing_state(m.Phase.DONE), m.RanksLost(lost=(LOST_1, LOST_2))).state
    assert s.phase is m.Phase.DONE
    report = m.report(s)
    assert report.lost_ranks == (LOST_1, LOST_2)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["lost_ranks"][0]["survivors"] == [0, 2]
    assert JoinReport.from_dict(data) == report
    # A report written before lost_ranks existed still reads back.
    del data["lost_ranks"]
    assert JoinReport.from_dict(data).lost_ranks == ()


@pytest.mark.parametrize("phase", [m.Phase.DRAINING, m.Phase.SHADOWING, m.Phase.POST_HOOKS])
def test_a_loss_fed_while_a_command_is_outstanding_is_illegal(phase: m.Phase) -> None:
    t = m.step(finishing_state(phase), m.RanksLost(lost=(LOST_1,)))
    assert t.state.phase is m.Phase.ERRORED


def test_machine_config_refuses_bad_choices() -> None:
    with pytest.raises(ValueError, match="'raise'.*'finish'.*not 'ignore'"):
        m.MachineConfig(rank=0, on_rank_loss="ignore")
    with pytest.raises(ValueError, match="throw_on_early_termination"):
        m.MachineConfig(rank=0, on_rank_loss="finish", throw_on_early_termination=True)


# -- the shell over a recording fake backend --------------------------------------


class _Done:
    def __init__(self, value: float) -> None:
        self.value = value

    def wait(self) -> float:
        return self.value


class FakeElasticGroup:
    """One rank; records what the Join asks; losses are set by the test."""

    def __init__(self, can_recover: bool = True) -> None:
        self.rank, self.world_size = 0, 1
        self.calls: list[str] = []
        self.lost: tuple[LostRank, ...] = ()
        self.config: _ports.RankLossConfig | None = None
        if not can_recover:
            self.start_rank_loss_recovery = None  # type: ignore[assignment]

    def start_rank_loss_recovery(self, config: _ports.RankLossConfig) -> None:
        self.calls.append("start_rank_loss_recovery")
        self.config = config

    def lost_ranks(self) -> tuple[LostRank, ...]:
        return self.lost

    def heartbeat(self, value: float) -> _Done:
        self.calls.append("heartbeat")
        return _Done(value)

    def count(self, value: float) -> float:
        self.calls.append("count")
        return value

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.calls.append("all_gather_object")
        return [obj]

    def all_agree(self, value: int) -> bool:
        self.calls.append("all_agree")
        return True


class _NoRecovery:
    """A backend without start_rank_loss_recovery (the missing method)."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.calls = 0, 1, []

    def heartbeat(self, value: float) -> _Done:
        self.calls.append("heartbeat")
        return _Done(value)

    def count(self, value: float) -> float:
        self.calls.append("count")
        return value

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.calls.append("all_gather_object")
        return [obj]


backends.register(FakeElasticGroup, lambda group, device: group)
backends.register(_NoRecovery, lambda group, device: group)


class _Hook(JoinHook):
    def __init__(self, owner: Step) -> None:
        self.owner = owner

    def post_hook(self, is_last_joiner: bool) -> None:
        # A loss found while the post hooks run shows at the end.
        if self.owner.lose_in_post_hook is not None:
            self.owner.group.lost += (self.owner.lose_in_post_hook,)


class Step(Joinable):
    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.lose_in_post_hook: LostRank | None = None

    def __call__(self) -> None:
        Join.notify_join_context(self)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _Hook(self)

    @property
    def join_device(self) -> Any:
        return "cpu"

    @property
    def join_process_group(self) -> Any:
        return self.group


def test_shell_polls_after_heartbeats_and_at_the_end() -> None:
    group = FakeElasticGroup()
    step = Step(group)
    step.lose_in_post_hook = LOST_2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        join = Join([step], on_rank_loss="finish")
        with join:
            assert group.calls[0] == "start_rank_loss_recovery"  # before any collective
            for i in range(5):
                if i == 3:
                    group.lost = (LOST_1,)
                step()
    lost_warnings = [str(w.message) for w in caught if "was lost" in str(w.message)]
    assert len(lost_warnings) == 2
    assert "rank 1 was lost after 4 iterations" in lost_warnings[0]
    assert "rank 2 was lost after 7 iterations" in lost_warnings[1]
    # The warning points at the user's code, not joinkit's.
    assert all(w.filename == __file__ for w in caught if "was lost" in str(w.message))
    report = join.report
    assert report is not None
    assert report.lost_ranks == (LOST_1, LOST_2)
    assert report.inputs == 5 and report.outcome == "joined"
    assert join.state is not None
    assert ("on_rank_loss", "finish") in (join.state.config.signature or ())
    # The recovery's progress ticks the watchdog.
    assert group.config is not None and group.config.world_size == 1
    ticks = join._drive.watch.ticks
    group.config.progress()
    assert join._drive.watch.ticks == ticks + 1


def test_a_loss_note_ends_each_loss_warning_once() -> None:
    # A data source says what becomes of a lost rank's remaining inputs
    # (ShardSampler(take_over=True)): each note once, in order, on every loss.
    group = FakeElasticGroup()
    step = Step(group)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        join = Join([step], on_rank_loss="finish")
        with join:
            join.note_rank_loss("First note.")
            join.note_rank_loss("Second note.")
            join.note_rank_loss("First note.")
            for i in range(9):
                if i == 3:
                    group.lost = (LOST_1,)
                if i == 6:
                    group.lost = (LOST_1, LOST_2)
                step()
    lost_warnings = [str(w.message) for w in caught if "was lost" in str(w.message)]
    assert len(lost_warnings) == 2
    for text in lost_warnings:
        assert "remaining inputs were not seen" in text
        assert text.endswith("ranks that contributed each iteration. First note. Second note.")


def test_raise_mode_never_asks_the_backend() -> None:
    group = FakeElasticGroup()
    group.lost = (LOST_1,)  # would warn if read
    step = Step(group)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        join = Join([step])
        with join:
            step()
    assert "start_rank_loss_recovery" not in group.calls
    assert join.report is not None and join.report.lost_ranks == ()
    assert ("on_rank_loss", "raise") in (join.state.config.signature or ())  # type: ignore[union-attr]


def test_join_refuses_an_unknown_choice() -> None:
    with pytest.raises(ValueError, match="'raise'.*'finish'.*not 'restart'"):
        Join([Step(FakeElasticGroup())], on_rank_loss="restart")
    with pytest.raises(ValueError, match="throw_on_early_termination"):
        Join([Step(FakeElasticGroup())], throw_on_early_termination=True, on_rank_loss="finish")


def test_a_backend_without_recovery_is_refused_on_entry_before_any_collective() -> None:
    group = _NoRecovery()
    step = Step(group)
    join = Join([step], on_rank_loss="finish")
    with pytest.raises(ValueError, match="cannot.*start_rank_loss_recovery") as info:
        with join:
            step()
    assert "mpirun --with-ft ulfm" in str(info.value)
    assert group.calls == []
    # The joinable is usable again afterwards (nothing was entered).
    with Join([step]):
        step()


def _threads_rank(group: Any) -> str:
    counter = np.zeros(1)
    step = Step(group)
    try:
        with Join([step], on_rank_loss="finish"):
            group.all_reduce(counter)
    except ValueError as error:
        # Nothing was sent: the group still works, in step on every rank.
        group.all_reduce(counter)
        return str(error)
    return "entered"


def test_threads_cannot_recover_and_says_so_on_every_rank() -> None:
    messages = spawn(_threads_rank, 3, timeout=60)
    assert len(set(messages)) == 1
    (message,) = set(messages)
    assert "ThreadGroup cannot" in message and "mpirun --with-ft ulfm" in message


class _FusedHook(_Hook):
    def fused_shadow(self, heartbeat: float) -> float:
        return heartbeat


class FusedStep(Step):
    join_fuses_heartbeat = True

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _FusedHook(self)


def test_finish_mode_sends_the_classic_heartbeat_for_a_fused_joinable() -> None:
    step = FusedStep(FakeElasticGroup())
    assert Join([step]).fuses_heartbeat
    join = Join([step], on_rank_loss="finish")
    assert not join.fuses_heartbeat
    with join:
        for _ in range(3):
            assert Join.fused_heartbeat(step) == m.JOINED  # the heartbeat went out itself
    assert step.group.calls.count("heartbeat") == 3


def test_a_later_join_reports_only_its_own_losses() -> None:
    group = FakeElasticGroup()
    group.lost = (LOST_1,)  # lost during an earlier Join on the same group
    step = Step(group)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        join = Join([step], on_rank_loss="finish")
        with join:
            step()
            group.lost += (LOST_2,)
            step()
    assert join.report is not None and join.report.lost_ranks == (LOST_2,)
    assert [str(w.message).split(" was lost")[0] for w in caught
            if "was lost" in str(w.message)] == ["joinkit: rank 2"]
