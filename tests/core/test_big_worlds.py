"""Worlds of 4095 to 2**24 ranks, through the shell (issue 10, part 3).

Rank 0 runs a real ``Join``; a fake backend plays the other ranks. Every join
collective returns what the wire would: the 1-element float32 SUM over all
``world`` ranks of rank 0's value and the crowd's (numpy sums the whole
array). The crowd has ``theirs`` inputs; optionally ``failing`` of them fail in
round ``fail_round``: they contribute FAILING then, FAILED after, and the rest
of the crowd, reading that round's alarm, stops at its next notify. Rank 0
must leave exactly as a rank of a real world would, classic and fused, and a
world above 2**24 ranks is refused at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from joinkit import Join, Joinable, JoinHook, PeerFailure, backends
from joinkit import _machine as m

pytestmark = pytest.mark.slow

WORLDS = [4095, 4096, 5000, 16384, 100_000, 2**24]


class _Handle:
    def __init__(self, total: float) -> None:
        self.total = total

    def wait(self) -> float:
        return self.total


class CrowdWorld:
    """Rank 0 of ``world`` ranks; the other ranks are a scripted crowd."""

    rank = 0
    device = "cpu"

    def __init__(self, world: int, theirs: int, failing: int = 0, fail_round: int = 0,
                 order: str = "pairwise") -> None:
        self.world_size = world
        self.theirs = theirs
        self.failing = failing
        self.fail_round = fail_round
        self.order = order
        self.round = 0  # join collectives so far (one per round)
        self.totals: list[float] = []

    # -- the wire ------------------------------------------------------------

    def _sum(self, mine: float) -> float:
        t, others = self.round, self.world_size - 1
        failing = self.failing
        healthy = others - failing
        if not failing:
            crowd = [(m.ACTIVE if t < self.theirs else m.JOINED, healthy)]
        elif t < self.fail_round:
            crowd = [(m.ACTIVE if t < self.theirs else m.JOINED, others)]
        else:
            weight = m.FAILING if t == self.fail_round else m.FAILED
            # The healthy crowd saw the alarm at its next notify and stopped.
            active = t == self.fail_round and t < self.theirs
            crowd = [(weight, failing), (m.ACTIVE if active else m.JOINED, healthy)]
        values = np.concatenate(
            [np.full(1, mine, np.float32)] + [np.full(n, v, np.float32) for v, n in crowd]
        )
        if self.order == "sequential":
            total = float(np.cumsum(values, dtype=np.float32)[-1])
        else:
            total = float(np.add.reduce(values, dtype=np.float32))
        self.round += 1
        self.totals.append(total)
        return total

    def heartbeat(self, value: float) -> _Handle:
        return _Handle(self._sum(value))

    def heartbeat_total(self, handle: _Handle) -> float:
        return handle.total

    def count(self, value: float) -> float:
        return self._sum(value)

    def all_agree(self, value: int) -> bool:
        return True  # the agreement check's digests: the crowd agrees

    def all_gather_object(self, obj: Any) -> list[Any]:
        if isinstance(obj, tuple):  # the agreement check: the crowd agrees
            return [obj] * self.world_size
        gathered: list[Any] = [None] * self.world_size
        gathered[0] = obj
        # Each failing rank's own Failure (beyond the first thousand, one shared
        # value: millions of objects would only test the test's memory).
        shared = m.Failure(rank=-1, exc_type="KeyError", message="bad shard")
        for rank in range(1, self.failing + 1):
            gathered[rank] = (m.Failure(rank=rank, exc_type="KeyError", message="bad shard")
                              if rank <= 1000 else shared)
        return gathered


backends.register(CrowdWorld, lambda group, device: group)


class Counter(Joinable):
    """Classic: notify, no collective of its own (the world models join collectives)."""

    def __init__(self, world: CrowdWorld) -> None:
        super().__init__()
        self.world = world
        self.hook_rounds = 0

    def __call__(self) -> None:
        Join.notify_join_context(self)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        counter = self

        class Hook(JoinHook):
            def main_hook(self) -> None:
                counter.hook_rounds += 1

            def fused_shadow(self, heartbeat: float) -> float:
                return counter.world.count(heartbeat)

        return Hook()

    @property
    def join_device(self) -> str:
        return "cpu"

    @property
    def join_process_group(self) -> CrowdWorld:
        return self.world


class FusedCounter(Counter):
    """Fused: the heartbeat rides in the joinable's one collective per iteration."""

    join_fuses_heartbeat = True

    def __call__(self) -> None:
        slot = Join.fused_heartbeat(self)
        Join.record_heartbeat_total(self, self.world.count(slot))


def run_rank0(world: CrowdWorld, counter_type: type[Counter], mine: int) -> dict[str, Any]:
    counter = counter_type(world)
    processed = 0
    error: BaseException | None = None
    join = Join([counter], timeout=None)
    try:
        with join:
            for _ in range(mine):
                counter()
                processed += 1
    except PeerFailure as caught:
        error = caught
    return {"processed": processed, "error": error, "report": join.report,
            "hook_rounds": counter.hook_rounds, "totals": world.totals}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("counter_type", [Counter, FusedCounter], ids=["classic", "fused"])
@pytest.mark.parametrize("mine, theirs", [(3, 6), (6, 3)], ids=["joins-first", "joins-last"])
def test_healthy_worlds(world: int, counter_type: type[Counter], mine: int,
                        theirs: int) -> None:
    result = run_rank0(CrowdWorld(world, theirs), counter_type, mine)
    report = result["report"]
    assert result["error"] is None and result["processed"] == mine
    assert report.shadow_rounds == result["hook_rounds"] == max(0, theirs - mine)
    assert report.is_last_joiner == (mine >= theirs)
    assert report.phase == "DONE" and report.failure is None
    # Every round counted the whole world's active ranks exactly.
    assert result["totals"][0] == float(world)
    assert result["totals"][-1] == 0.0


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("counter_type", [Counter, FusedCounter], ids=["classic", "fused"])
@pytest.mark.parametrize("failing", ["one", "many"])
@pytest.mark.parametrize("mine", [8, 1], ids=["rank0-active", "rank0-draining"])
def test_failures_in_worlds(world: int, counter_type: type[Counter], failing: str,
                            mine: int) -> None:
    count = 1 if failing == "one" else (world - 1) // 2
    fail_round = 3
    crowd = CrowdWorld(world, theirs=6, failing=count, fail_round=fail_round,
                       order="sequential" if world % 2 else "pairwise")
    result = run_rank0(crowd, counter_type, mine)
    error = result["error"]
    assert isinstance(error, PeerFailure), result
    # The exchange names every failing rank exactly, the first one first.
    assert error.rank == 1 and error.exc_type == "KeyError"
    assert len(error.failures) == count
    assert [f.rank for f in error.failures[:1000]] == list(range(1, min(count, 1000) + 1))
    totals = result["totals"]
    assert totals[fail_round] >= m.ALARM  # the failure's round: an alarm
    if mine > fail_round:
        # Active: it stopped at its next notify, which read the alarm.
        assert result["processed"] == fail_round + 1
        assert result["report"].shadow_rounds == 0
    else:
        # Draining: it shadowed the alarmed round too, then the final count
        # (nobody active, FAILED weights only) sent everyone to the exchange.
        assert result["processed"] == mine
        assert result["report"].shadow_rounds == fail_round + 1 - mine
    assert 0.0 < totals[-1] < m.NOBODY_ACTIVE_BELOW


def test_a_world_above_2_24_ranks_is_refused_at_join() -> None:
    world = CrowdWorld(2**24 + 1, theirs=1)
    with pytest.raises(ValueError, match=r"at most 2\*\*24 = 16777216 ranks"):
        Join([Counter(world)])
    Join([Counter(CrowdWorld(2**24, theirs=1))])  # the largest world is fine
