"""DDP's fused check (heartbeat + gradient-sync flag in one float64) in big worlds.

A joined rank's half of the check (``_FusedCheck.shadow`` and ``check``) over a
fake process group whose all-reduce adds what a crowd of up to 2**24 ranks
contributes, summed in float64 in several orders: the heartbeat sum must read
as the core's float32 sum would, and the sync answer must be exact, failed
ranks included (issue 10, part 3).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from joinkit import HEARTBEAT_FLAG  # noqa: E402
from joinkit import _machine as m  # noqa: E402
from joinkit.adapters.torch._joinables import _FusedCheck  # noqa: E402

pytestmark = pytest.mark.slow


class _Work:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class CrowdGroup:
    """The other ranks of the world: ``(value, ranks)`` pairs, summed in ``order``."""

    def __init__(self, crowd: list[tuple[float, int]], order: str) -> None:
        self.crowd = crowd
        self.order = order

    def allreduce(self, tensors: list[Any], opts: Any) -> _Work:
        buf = tensors[0]
        values = np.concatenate([np.array([buf.item()])]
                                + [np.full(n, v, np.float64) for v, n in self.crowd])
        if self.order == "reversed":
            values = values[::-1].copy()
        total = (np.cumsum(values)[-1] if self.order != "pairwise"
                 else np.add.reduce(values))
        buf.fill_(float(total))
        return _Work()


class FakeDDP:
    join_device = "cpu"
    require_backward_grad_sync = True

    def __init__(self, group: CrowdGroup) -> None:
        self.process_group = group

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        raise AssertionError("no buffer broadcast in this test")


ORDERS = ["sequential", "reversed", "pairwise"]
CASES = [(world, order) for world in (4095, 4096, 5000, 16384, 100_000) for order in ORDERS]
CASES += [(2**24, "sequential"), (2**24, "pairwise")]  # (16M-element sums take a while)


@pytest.mark.parametrize(("world", "order"), CASES)
def test_a_joined_ranks_check_reads_heartbeats_and_syncs_exactly(world: int, order: str) -> None:
    others = world - 1
    cases = [  # (syncing, active without sync, FAILING, FAILED) among the others
        (others, 0, 0, 0), (0, others, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 0),
        (others - 1, 0, 1, 0), (0, others - 1, 1, 0), (1, 0, others - 1, 0),
        (others // 3, others // 3, others // 3, 0), (0, 0, 1, 0), (0, 0, 0, others),
        (2, 1, 0, others - 3), (0, 1, 0, others - 1),
    ]
    for syncing, plain, failing, failed in cases:
        for mine in (m.JOINED, m.FAILING, m.FAILED):  # what this joined rank contributes
            joined = others - syncing - plain - failing - failed
            crowd = [(m.ACTIVE + HEARTBEAT_FLAG, syncing), (m.ACTIVE, plain),
                     (m.FAILING, failing), (m.FAILED, failed), (m.JOINED, joined)]
            check = _FusedCheck(FakeDDP(CrowdGroup(crowd, order)), True)
            heartbeat = check.shadow(mine)
            assert check.check(True) == (syncing > 0), (world, syncing, plain, failing, mine)
            active = syncing + plain
            if failing or mine == m.FAILING:
                expected: tuple[int | None, bool] = (None, True)
            elif active:
                expected = (active, False)
            else:
                expected = (0, bool(failed) or mine == m.FAILED)
            assert m.decode_tally(heartbeat) == expected, (world, syncing, plain, failing, mine)
            check.close()
