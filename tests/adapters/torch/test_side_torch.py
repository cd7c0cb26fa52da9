"""Side collectives beside torch's DDP on real gloo groups, against a single process.

One module fixture launches ``programs/side_scenarios.py`` on 3 ranks (inputs
4, 0 and 6 batches); the reference below trains the same model in this
process: at step t the ranks with a batch t contribute their gradient, DDP
divides by the world size, and the logged mean is over those ranks.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from support import run_scenarios, scenario_names, scenario_records, selected_scenarios

torch = pytest.importorskip("torch")

WORKER = Path(__file__).parent / "programs" / "side_scenarios.py"
WORLD = 3
INPUTS = [4, 0, 6]
LR = 0.1
LAUNCH_TIMEOUT = 110.0

pytestmark = [pytest.mark.timeout(2 * LAUNCH_TIMEOUT), pytest.mark.launches]


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("side_scenarios")
    # The scenarios the selected tests read (support.selected_scenarios): all, for the module.
    names = selected_scenarios(request, [n for n in scenario_names(WORKER)
                                         if not n.startswith("cuda_")])
    return run_scenarios(WORKER, WORLD, out, names, LAUNCH_TIMEOUT)


def outcome(results: dict[str, list[dict[str, Any]]], name: str) -> list[Any]:
    return [r["result"] for r in scenario_records(results, name)]


def reference() -> tuple[list[float], list[float]]:
    """The single-process run: final parameters and per-step mean loss."""
    import side_scenarios as s

    model = s.make_model()
    losses = []
    for step in range(max(INPUTS)):
        active = [r for r in range(WORLD) if INPUTS[r] > step]
        model.zero_grad()
        step_losses = []
        for rank in active:
            x, y = s.make_batch(rank, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / WORLD).backward()  # DDP averages over the whole world
            step_losses.append(float(loss.detach()))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        losses.append(sum(step_losses) / len(step_losses))
    return s.params(model), losses


@pytest.mark.parametrize("name", ["ddp_log_mean_and_barrier", "broadcast_first_then_ddp"])
@pytest.mark.scenarios()
def test_training_with_side_collectives_matches_a_single_process(results: Any, name: str) -> None:
    ranks = outcome(results, name)
    want_params, want_losses = reference()
    most = max(INPUTS)
    for rank, got in enumerate(ranks):
        assert got["params"] == pytest.approx(want_params, abs=1e-6)
        assert got["losses"] == pytest.approx(want_losses[: INPUTS[rank]], abs=1e-6)
        rounds = most - INPUTS[rank]
        assert got["rounds"] == [rounds, rounds, rounds if name.startswith("broadcast") else 0]
        if name.startswith("broadcast"):
            # Rank 0 sends 7 while it is active, and a joined rank 0 sends 0.
            assert got["flags"] == [7 if step < INPUTS[0] else 0 for step in range(INPUTS[rank])]


def test_a_following_side_collective_uses_the_joins_group(results: Any) -> None:
    ranks = outcome(results, "following_side_collective_with_a_lambda")
    for rank, got in enumerate(ranks):
        assert got["follows"]
        want = [[float(sum(1 for r in range(WORLD) if INPUTS[r] > t)),
                 float(sum(r for r in range(WORLD) if INPUTS[r] > t))]
                for t in range(INPUTS[rank])]
        assert got["sums"] == want


def test_a_side_collective_missing_from_the_join_is_an_error_not_a_hang(results: Any) -> None:
    ranks = outcome(results, "not_listed_is_an_error")
    for rank, got in enumerate(ranks):
        if INPUTS[rank]:
            assert got["type"] == "LocalProtocolError"
            assert "does not list it" in got["error"]
            assert "Add it to the Join's list" in got["error"]
        else:  # the rank with no input learns of its peers' failure
            assert got["type"] == "PeerFailure"


def test_a_tensor_unlike_like_is_refused_before_the_collective(results: Any) -> None:
    for got in outcome(results, "wrong_shape_is_an_error_before_the_collective"):
        shape, dtype, avg = got["messages"]
        assert "built for (2,) torch.float32" in shape and "got (3,)" in shape
        assert "torch.float64" in dtype
        assert "mean(like)" in avg
        assert got["after"] == [float(WORLD)] * 2


def test_all_reduce_ops_shadow_with_their_identity(results: Any) -> None:
    ranks = outcome(results, "all_reduce_ops_shadow_with_their_identity")
    for rank, got in enumerate(ranks):
        for op in ("sum", "product", "max", "min"):
            assert len(got[op]) == INPUTS[rank]
        for step in range(INPUTS[rank]):
            active = [r + 2.0 for r in range(WORLD) if INPUTS[r] > step]
            negated = [-a for a in active]
            assert got["sum"][step] == [sum(active), sum(negated)]
            assert got["product"][step] == [math.prod(active), math.prod(negated)]
            assert got["max"][step] == [max(active), max(negated)]
            assert got["min"][step] == [min(active), min(negated)]


def test_strided_transposed_and_expanded_tensors(results: Any) -> None:
    """Against the single-process sums: gloo itself, handed these tensors, is wrong or
    corrupts the heap (``docs/reliability.md``, "A heap corruption")."""
    import side_scenarios as s

    for rank, got in enumerate(outcome(results, "tensor_layouts")):
        s.check_layouts(got, rank, INPUTS)


