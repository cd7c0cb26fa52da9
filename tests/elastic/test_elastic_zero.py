"""DDP + ZeroRedundancyOptimizer in ``Join(..., on_rank_loss="finish")`` on gloo: the kill matrix.

One launch of ``elastic_zero_runner.py`` runs every cell: the parent hosts the
TCPStore and forks each cell's ranks, which train ``DDP(Split())`` (a linear
model whose weight is three parameters, so each rank of a world of 4 owns a
shard) with ``ZeroRedundancyOptimizer`` over ``SGD`` (momentum 0 or 0.9) or
``Adam``, each with ``weight_decay``, in ``Join([model, zero],
on_rank_loss="finish")`` on uneven inputs; one rank SIGKILLs itself in its
loop body, between its forward's heartbeat and its backward's gradient unit,
between the gradient unit and ``zero.step()``, while draining (joined), or in
the post hook, in worlds of 3 and 4. Each cell checks that every survivor left
normally, that the report names the dead rank with the inputs it consumed,
that every survivor's parameters at the Join's exit equal a single-process
float64 reference over exactly the consumed inputs (within 1e-6), that the
survivors' shards of the optimizer state (Adam's moments and step, SGD's
momentum) cover every parameter once and equal the reference's state (within
the float32 rounding bound it derives for the momentum buffer), and
that ZeRO was rebuilt on the survivors with that state: two ZeRO steps after
the Join (its own broadcasts, on the rebuilt group; the second in a later
default-mode Join over that group) still equal the reference, parameters and
state. Also: no death equals the reference and the default mode, for each
optimizer; a rank that dies at the Join's entry before handing over its
shard of the state (every survivor refuses to start alike); the refusals
(``overlap_with_ddp``, bucket views, foreign parameters, other combinations),
after which the group still matches (with momentum switched on inside the
Join); and two cells under ``mpirun --with-ft ulfm``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

import elastic_zero_runner as runner  # noqa: E402
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
    "3:1/body/3", "3:0/beat/2", "3:2/step/4", "3:0/drain/1",
    "4:3/body/2", "4:1/step/3", "4:1/drain/1",
    # Stateful optimizers: the state is replicated for the Join (adapters._zero_elastic).
    "3:1/body/3~adam", "3:0/beat/2~adam", "4:1/step/3~adam", "4:1/drain/1~adam",
    "3:2/step/4~momentum", "4:3/body/2~momentum", "3:0/drain/1~momentum",
]
#: The last joiner dies in the post hook: every survivor joined earlier and
#: stepped every round since with the averaged gradient, so it holds the model
#: (and the optimizer state) of every consumed input.
POST_CELLS = ["3:2/post/0", "3:2/post/0~adam"]
NO_DEATH = ["sgd", "adam", "momentum"]
#: A rank dies at the Join's entry, before it handed over its shard of the state.
ENTRY_CELL = "3:1/entry/0~adam"
CELLS = [*(f"3:~{o}" for o in NO_DEATH), *(f"3:~{o},raise" for o in NO_DEATH),
         *KILL_CELLS, *POST_CELLS, ENTRY_CELL, "3:refusals"]
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # The cells the selected tests read (support.selected_scenarios): all, for the module.
    return cell_results(runner.__file__, tmp_path_factory.mktemp("elastic_zero"),
                        selected_scenarios(request, CELLS), DEADLINE)


def consumed(world: int, kills: list[tuple[int, str, int]]) -> dict[int, int]:
    return consumed_inputs(world, kills, runner.INPUTS)


def tolerance(name: str, bound: dict[str, Any], element: int, value: float) -> float:
    """How far a float32 run's state ``name`` may lie from the float64 reference's ``value``.

    SGD's momentum buffer: the rounding bound the reference derives (``runner.reference``),
    which grows with the magnitudes the buffer summed (|v| reaches ~8 here, where
    float32's spacing is 5e-7, while the buffer may end near 0). Adam's moments stay
    of the gradient's size and its step count is exact: ``TOLERANCE``, relative too.
    """
    if name in bound:
        return float(bound[name][element])
    return TOLERANCE * (1 + abs(value))


def check_state(spec: str, ranks: dict[int, Any], key: str, want: dict[str, Any],
                bound: dict[str, Any]) -> None:
    """The survivors' shards of the optimizer state: every element once, equal to ``want``
    within ``tolerance``."""
    merged: dict[int, dict[str, float]] = {}
    for data in ranks.values():
        for element, values in data[key].items():
            assert int(element) not in merged, (spec, key, element)
            merged[int(element)] = values
    if not want:  # SGD without momentum keeps no state
        assert merged == {}, (spec, key, merged)
        return
    assert sorted(merged) == list(range(5)), (spec, key, merged)
    for name, values in want.items():
        for i in range(5):
            assert abs(merged[i][name] - values[i]) <= tolerance(name, bound, i, values[i]), (
                spec, key, name, i, merged[i][name], values[i])


def check_kill(spec: str, ranks: dict[int, Any], used: dict[int, int] | None = None) -> None:
    """Every survivor: the report, the model and optimizer state at exit and after two ZeRO
    steps, ZeRO's group."""
    world, kills, option = runner.parse(spec)
    optimizer, _ = runner.options(option)
    dead = {r for r, _, _ in kills}
    if used is None:
        used = consumed(world, kills)
    alive = sorted(ranks)
    init = ranks[alive[0]]["init"]
    at_exit, final, state_at_exit, state_final, bound_at_exit, bound_final = runner.reference(
        init, world, used, alive, optimizer)
    lost_iterations = consumed(world, kills)
    for rank, data in ranks.items():
        assert data["optimizer"] == optimizer
        assert {x["rank"]: x["iterations"] for x in data["lost"]} == {
            r: lost_iterations[r] for r in dead}, (spec, rank, data["lost"])
        assert data["lost"][-1]["survivors"] == alive, (spec, rank, data["lost"])
        np.testing.assert_allclose(data["at_exit"], at_exit, rtol=0, atol=TOLERANCE,
                                   err_msg=f"{spec} rank {rank} at exit")
        # ZeRO after the Join: rebuilt on the survivors, its broadcasts on their group.
        np.testing.assert_allclose(data["final"], final, rtol=0, atol=TOLERANCE,
                                   err_msg=f"{spec} rank {rank} after the Join")
        assert data["zero_world"] == data["zero_group"] == len(alive), (spec, data)
        assert data["zero_rank"] == alive.index(rank), (spec, data)
        assert data["same_group"] and not data["left_patched"], (spec, data)
        assert any("was lost after" in w for w in data["warnings"]), data["warnings"]
    # The state moved with the rebuild: each survivor's new shard holds its
    # parameters' state, at exit and after two ZeRO steps on the survivors.
    check_state(spec, ranks, "state_at_exit", state_at_exit, bound_at_exit)
    check_state(spec, ranks, "state_final", state_final, bound_final)
    # One model on every survivor, bit for bit (DDP's post hook, then ZeRO's broadcasts).
    for key in ("at_exit", "final"):
        assert len({tuple(data[key]) for data in ranks.values()}) == 1, (spec, key)
    # The new partition covers every parameter (5 elements), once.
    assert sum(data["owned_after"] for data in ranks.values()) == 5, spec


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec", KILL_CELLS)
@pytest.mark.scenarios()
def test_kill(results: dict[str, Any], spec: str) -> None:
    check_kill(spec, survivors(results, spec, runner.parse))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", NO_DEATH)
def test_no_death_equals_reference_and_default_mode(results: dict[str, Any],
                                                    optimizer: str) -> None:
    finish = survivors(results, f"3:~{optimizer}", runner.parse)
    default = survivors(results, f"3:~{optimizer},raise", runner.parse)
    init = finish[0]["init"]
    at_exit, final, state_at_exit, state_final, bound_at_exit, bound_final = runner.reference(
        init, 3, consumed(3, []), [0, 1, 2], optimizer)
    bounds = {"state_at_exit": bound_at_exit, "state_final": bound_final}
    for rank in range(3):
        data = finish[rank]
        assert data["lost"] == [] and data["zero_world"] == 3 and data["zero_rank"] == rank
        assert not data["left_patched"] and data["owned_after"] == data["owned_before"]
        for key, want in (("at_exit", at_exit), ("final", final)):
            np.testing.assert_allclose(data[key], want, rtol=0, atol=TOLERANCE)
            # torch's ZeRO (owner steps, broadcasts) in joinkit's default mode.
            np.testing.assert_allclose(data[key], default[rank][key], rtol=0,
                                       atol=TOLERANCE)
        # Each rank's shard state went back to it: the shard it owned before.
        for key in ("state_at_exit", "state_final"):
            assert sorted(data[key]) == sorted(default[rank][key]), (optimizer, key)
            for element, values in data[key].items():
                for name, value in values.items():
                    other = default[rank][key][element][name]
                    # Two float32 runs, each within the tolerance of the reference.
                    assert abs(value - other) <= 2 * tolerance(
                        name, bounds[key], int(element), other), (optimizer, key, element, name)
    for key, want in (("state_at_exit", state_at_exit), ("state_final", state_final)):
        check_state(f"3:~{optimizer}", finish, key, want, bounds[key])
        check_state(f"3:~{optimizer},raise", default, key, want, bounds[key])
    # Every rank stepped every parameter: bitwise the same model on every rank.
    assert finish[1]["at_exit"] == finish[0]["at_exit"] == finish[2]["at_exit"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec", POST_CELLS)
def test_last_joiner_dies_in_post_hook(results: dict[str, Any], spec: str) -> None:
    # Every consumed input (the dead rank's too: it died after its last iteration).
    check_kill(spec, survivors(results, spec, runner.parse))


@pytest.mark.timeout(600)
def test_death_while_the_state_is_gathered_at_entry(results: dict[str, Any]) -> None:
    # Its shard of the optimizer state reached no survivor: every survivor's
    # Join refuses to start with the same error, and ZeRO is left as it was.
    ranks = survivors(results, ENTRY_CELL, runner.parse)
    for data in ranks.values():
        assert data["entry_error"].startswith("LocalProtocolError: "), data
        assert "rank(s) [1] died while every rank's shard" in data["entry_error"], data
        assert "Restart from a checkpoint" in data["entry_error"], data
        assert data["shard_back"] and not data["left_patched"] and data["state_kept"], data
        assert data["ddp_group"] == 2, data  # DDP followed the rebuilt group
    assert len({data["entry_error"] for data in ranks.values()}) == 1


def test_one_optimizer_over_every_parameter_steps_the_shards_bits() -> None:
    """torch on the CPU: stepping all parameters at once gives each shard's bits.

    What makes every rank's step (adapters._zero_elastic) equal the owner's
    sharded step: one optimizer over every parameter against one per shard, the
    same gradients, a few steps, bit for bit, for each optimizer of the cells.
    """
    import torch

    for optimizer in runner.OPTIMIZERS:
        torch.manual_seed(1)
        whole = [torch.randn(n, requires_grad=True) for n in (1, 1, 2, 1, 7)]
        shards = [p.detach().clone().requires_grad_() for p in whole]
        one = runner.optimizer_of(optimizer, whole)
        parts = [runner.optimizer_of(optimizer, shards[:2]),
                 runner.optimizer_of(optimizer, shards[2:])]
        for _ in range(4):
            for p, q in zip(whole, shards, strict=True):
                p.grad = torch.randn(p.shape)
                q.grad = p.grad.clone()
            one.step()
            for part in parts:
                part.step()
        for p, q in zip(whole, shards, strict=True):
            assert torch.equal(p, q), optimizer
            for key, value in one.state[p].items():
                part = parts[0] if any(q is r for r in shards[:2]) else parts[1]
                assert torch.equal(value, part.state[q][key]), (optimizer, key)


@pytest.mark.timeout(600)
def test_refusals(results: dict[str, Any]) -> None:
    ranks = survivors(results, "3:refusals", runner.parse)
    for data in ranks.values():
        found = data["refusals"]
        assert "overlap_with_ddp=False" in found["overlap"], found
        assert "parameters_as_bucket_view=False" in found["bucket_view"], found
        assert "does not hold" in found["foreign"], found
        # ZeRO alone: its raw group is not DDP's to rebuild (the backend says so first).
        assert "raw ProcessGroup" in found["alone"], found
        assert "Join([model, zero])" in found["alone"], found
        assert "only alone, or with its ZeroRedundancyOptimizer" in found["three"], found
        assert found["hooked_by_refusals"] is False  # refused before DDP registered anything
        assert data["after"] == "ok"  # the next Join's collectives matched
        # Inside: the optimizer over every parameter, with the scheduler's lr and
        # the momentum set in the Join; after: each shard kept its momentum buffers.
        assert found["inside"] == {"lr": runner.LR / 2, "momentum": 0.9, "params": 4}
        assert found["shard_state"] == data["owned_params"] > 0, (found, data)
    params = [np.array(data["params"]) for data in ranks.values()]
    for other in params[1:]:
        np.testing.assert_array_equal(other, params[0])


#: Under ``mpirun --with-ft ulfm`` (a launcher that keeps the survivors): gloo
#: ranks that never initialise MPI, the store hosted by the runner.
MPIRUN_CELLS = ["3:1/step/3~adam", "4:2/beat/4"]


@pytest.mark.timeout(600)
def test_under_mpirun_with_ft_ulfm(tmp_path: Path) -> None:
    records, _ = run_runner(runner.__file__, tmp_path, MPIRUN_CELLS, MPIRUN_DEADLINE, mpirun=True)
    for record in records:
        assert record["mpirun"] != "killed after deadline", record
        world, kills, _ = runner.parse(record["spec"])
        ranks = rank_results(tmp_path, record)
        assert set(ranks) == set(range(world)) - {r for r, _, _ in kills}, record
        check_kill(record["spec"], ranks)
