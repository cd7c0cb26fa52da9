"""DistributedDataParallel in ``Join(..., on_rank_loss="finish")`` on gloo: the kill matrix.

One launch of ``elastic_ddp_runner.py`` runs every cell: the parent imports
torch once, hosts the TCPStore (it outlives any rank, as a launcher's would)
and forks each cell's ranks, which train ``DDP(Linear(4, 1))`` with SGD on
uneven inputs (rank ``r`` has ``INPUTS + r``); one rank SIGKILLs itself in its
loop body, between its forward's heartbeat and its backward's all-reduce, or
while draining (joined), in worlds of 3 and 4. Each cell checks that every
survivor left the Join normally, that the report names the dead rank with
the inputs it consumed, that every survivor's final parameters equal a
single-process float64 reference over exactly the consumed inputs (within
1e-6), and that the model goes on over the survivors after the Join. Also: no
death in finish mode equals the reference and the default mode; the divisor
``divide_by_initial_world_size=False``; the refusals, after which the group
still matches. And DDP's defaults with buffers (``broadcast_buffers=True``, a
BatchNorm model): on 2 and 3 ranks, a rank with no input, the highest active
rank (whose buffers DDP broadcasts) killed in its body and after its forward
(after the buffer unit, before the gradient unit); the survivors' parameters
and buffers (running mean and variance, batches tracked) against a float64
single-process run that does what DDP does, and finish mode without a death
equal to the default mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

import elastic_ddp_runner as runner  # noqa: E402
from support import selected_scenarios  # noqa: E402
from support.fork import (  # noqa: E402
    cell_results,
    consumed_inputs,
    rank_results,
    run_runner,
    survivors,
)

pytestmark = pytest.mark.launches

DEADLINE = 40.0  # per cell, enforced by the runner (it kills what is left)
# mpirun starts slower on a loaded machine: 4-rank cells under --with-ft ulfm ran past
# 70 s at load 15 on 2 cores (torch 2.10, 2026-11-29); the deadline only catches a hang.
MPIRUN_DEADLINE = DEADLINE + 110
KILL_CELLS = [
    "3:1/body/3", "3:0/beat/2", "3:0/drain/1",
    "4:3/body/2", "4:2/beat/4", "4:1/drain/1",
    "3:1/beat/3~count",  # the divisor: the ranks that contributed
    "4:1/body/2+2/beat/4",  # two deaths, at different iterations
]
#: The last joiner dies in the post hook: the survivors, all joined earlier, take
#: the model of rank 0 of the rebuilt group (a documented limit).
POST_CELL = "3:2/post/0"
#: DDP's defaults with buffers (a BatchNorm model, broadcast_buffers=True).
BN_KILL_CELLS = ["3:2/body/3~bn", "3:2/beat/2~bn", "2:1/beat/3~bn", "3:1/body/2~bn0",
                 "3:2/beat/4~bn0", "3:0/drain/1~bn0"]
BN_CELLS = ["3:~bn", "3:~bnraise", "2:~bn0", *BN_KILL_CELLS]
CELLS = ["3:", "3:~raise", "3:~count", *KILL_CELLS, POST_CELL, "3:refusals", *BN_CELLS]
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # The cells the selected tests read (support.selected_scenarios): all, for the module.
    return cell_results(runner.__file__, tmp_path_factory.mktemp("elastic_ddp"),
                        selected_scenarios(request, CELLS), DEADLINE)


def consumed(world: int, kills: list[tuple[int, str, int]]) -> dict[int, int]:
    return consumed_inputs(world, kills, runner.INPUTS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec", KILL_CELLS)
@pytest.mark.scenarios()
def test_kill(results: dict[str, Any], spec: str) -> None:
    ranks = survivors(results, spec, runner.parse)
    check_kill(spec, ranks)


def check_kill(spec: str, ranks: dict[int, Any]) -> None:
    """Every survivor: the report, the parameters against the reference, the group after."""
    world, kills, option = runner.parse(spec)
    used = consumed(world, kills)
    dead = {r for r, _, _ in kills}
    alive = sorted(ranks)
    init = ranks[alive[0]]["init"]
    want = runner.reference(init, world, used, divide_by_initial_world_size=option != "count")
    for rank, data in ranks.items():
        assert {x["rank"]: x["iterations"] for x in data["lost"]} == {
            r: used[r] for r in dead}, (spec, rank, data["lost"])
        assert data["lost"][-1]["survivors"] == alive, (spec, rank, data["lost"])
        np.testing.assert_allclose(data["final"], want, rtol=0, atol=TOLERANCE,
                                   err_msg=f"{spec} rank {rank}")
        # The model follows the rebuilt group after the Join.
        left = world - len(dead)
        assert data["size_after"] == left and data["probe"] == left, (spec, data)
        assert any("was lost after" in w for w in data["warnings"]), data["warnings"]


@pytest.mark.timeout(600)
@pytest.mark.scenarios("3:", "3:~raise", "3:~count")
def test_no_death_equals_reference_and_default_mode(results: dict[str, Any]) -> None:
    finish = survivors(results, "3:", runner.parse)
    default = survivors(results, "3:~raise", runner.parse)
    counted = survivors(results, "3:~count", runner.parse)
    used = consumed(3, [])
    init = finish[0]["init"]
    want = runner.reference(init, 3, used)
    want_count = runner.reference(init, 3, used, divide_by_initial_world_size=False)
    assert not np.allclose(want, want_count)  # the two divisors differ here
    for rank in range(3):
        assert finish[rank]["lost"] == [] and finish[rank]["size_after"] == 3
        np.testing.assert_allclose(finish[rank]["final"], want, rtol=0, atol=TOLERANCE)
        np.testing.assert_allclose(finish[rank]["final"], default[rank]["final"], rtol=0,
                                   atol=TOLERANCE)
        np.testing.assert_allclose(counted[rank]["final"], want_count, rtol=0,
                                   atol=TOLERANCE)


@pytest.mark.timeout(600)
def test_refusals(results: dict[str, Any]) -> None:
    ranks = survivors(results, "3:refusals", runner.parse)
    for data in ranks.values():
        found = data["refusals"]
        assert "_register_buffer_comm_hook" in found["buffer_hook"], found
        assert "find_unused_parameters=False" in found["unused"], found
        assert "already has a comm hook" in found["hook"], found
        assert "ZeroRedundancyOptimizer" in found["zero"], found
        assert data["after"] == "ok"  # the next Join's collectives matched
        # After finish mode's comm hook, dividing by the active ranks still works.
        grads = [1.0] * (1 + data["rank"])
        assert data["counted"] == {"round": {"grads": grads, "heartbeat": "round"},
                                   "one": {"grads": grads, "heartbeat": "fused"}}, data
    # No-grad forwards among trained ones: every rank ends with the same model.
    params = [np.array(data["params"]) for data in ranks.values()]
    for other in params[1:]:
        np.testing.assert_allclose(other, params[0], rtol=0, atol=TOLERANCE)
    # Finish mode after the heartbeat rode in the gradients: ranks agree again.
    again = [np.array(data["again"]) for data in ranks.values()]
    for other in again[1:]:
        np.testing.assert_allclose(other, again[0], rtol=0, atol=TOLERANCE)


#: Under ``mpirun --with-ft ulfm`` (a launcher that keeps the survivors): gloo
#: ranks that never initialise MPI, the store hosted by the runner.
MPIRUN_CELLS = ["3:1/beat/3", "4:1/drain/1"]


@pytest.mark.timeout(600)
def test_under_mpirun_with_ft_ulfm(tmp_path: Path) -> None:
    records, _ = run_runner(runner.__file__, tmp_path, MPIRUN_CELLS, MPIRUN_DEADLINE, mpirun=True)
    for record in records:
        assert record["mpirun"] != "killed after deadline", record
        world, kills, _ = runner.parse(record["spec"])
        killed = {r for r, _, _ in kills}
        ranks = rank_results(tmp_path, record)
        assert set(ranks) == set(range(world)) - killed, record
        check_kill(record["spec"], ranks)


@pytest.mark.timeout(600)
def test_last_joiner_dies_in_post_hook(results: dict[str, Any]) -> None:
    ranks = survivors(results, POST_CELL, runner.parse)
    init = ranks[0]["init"]
    # Rank 0's model: it joined after its INPUTS inputs, while every rank was active.
    want = runner.reference(init, 3, {r: runner.INPUTS for r in range(3)})
    for data in ranks.values():
        assert data["lost"] == [{"rank": 2, "iterations": runner.INPUTS + 2,
                                 "survivors": [0, 1]}], data["lost"]
        np.testing.assert_allclose(data["final"], want, rtol=0, atol=TOLERANCE)
        assert data["size_after"] == 2 and data["probe"] == 2


def check_bn(spec: str, ranks: dict[int, Any]) -> None:
    """Every survivor of a ``bn`` cell: parameters and buffers against the reference."""
    world, kills, option = runner.parse(spec)
    want = runner.bn_reference(world, option, kills)
    inputs = runner.bn_inputs(world, option)
    used = {r: min(n, inputs[r]) for r, n in consumed(world, kills).items()}
    dead = {r for r, _, _ in kills}
    for rank, data in ranks.items():
        assert {x["rank"]: x["iterations"] for x in data["lost"]} == {
            r: used[r] for r in dead}, (spec, rank, data["lost"])
        np.testing.assert_allclose(data["params"], want["params"], rtol=0, atol=TOLERANCE,
                                   err_msg=f"{spec} rank {rank}")
        assert set(data["buffers"]) == {"1.running_mean", "1.running_var",
                                        "1.num_batches_tracked"}
        for name, values in data["buffers"].items():
            np.testing.assert_allclose(values, want["buffers"][name], rtol=0, atol=TOLERANCE,
                                       err_msg=f"{spec} rank {rank} {name}")
        left = world - len(dead)
        assert data["size_after"] == left and data["probe"] == left, (spec, data)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec", BN_KILL_CELLS)
def test_kill_with_buffers_broadcast(results: dict[str, Any], spec: str) -> None:
    check_bn(spec, survivors(results, spec, runner.parse))


@pytest.mark.timeout(600)
def test_buffers_broadcast_without_a_death_equal_the_reference_and_default_mode(
        results: dict[str, Any]) -> None:
    finish = survivors(results, "3:~bn", runner.parse)
    default = survivors(results, "3:~bnraise", runner.parse)
    check_bn("3:~bn", finish)
    check_bn("2:~bn0", survivors(results, "2:~bn0", runner.parse))
    for rank in range(3):
        np.testing.assert_allclose(finish[rank]["params"], default[rank]["params"], rtol=0,
                                   atol=TOLERANCE)
        for name, values in finish[rank]["buffers"].items():
            np.testing.assert_allclose(values, default[rank]["buffers"][name], rtol=0,
                                       atol=TOLERANCE)
    # The buffers moved: the reference is not the initial state.
    assert finish[0]["buffers"]["1.num_batches_tracked"] == [runner.INPUTS + 2.0]
