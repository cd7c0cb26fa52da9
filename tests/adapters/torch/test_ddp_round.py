"""DDP's heartbeat in its gradient all-reduce (issue 34), on real gloo groups.

One launch of three ranks runs every scenario of ``programs/ddp_round_scenarios.py``
(see its docstring): the default path against a float64 single-process
reference in many cells (divisor both ways, bucket layouts, ``no_sync()``
accumulation, evaluation forwards, a rank with no inputs), its collectives,
which configuration gets which path, one model through every path in turn,
and failures before, in and midway through a round. The machine's side is
``tests/core/test_machine.py`` and ``tests/core/test_machine_lockstep.py``; torch's own
DDP join tests (``test_torch_suite.py``) run it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import run_scenarios, scenario_names, scenario_records

pytestmark = pytest.mark.launches

torch = pytest.importorskip("torch")

WORLD = 3
WORKER = Path(__file__).parent / "programs" / "ddp_round_scenarios.py"
LAUNCH_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ddp_round")
    return run_scenarios(WORKER, WORLD, out, scenario_names(WORKER), LAUNCH_TIMEOUT)


def ranks_of(results: dict[str, Any], name: str) -> list[Any]:
    return [r["result"] for r in scenario_records(results, name)]


def test_the_default_path_matches_one_process(results: dict[str, Any]) -> None:
    for rank in ranks_of(results, "round_reference"):
        assert rank["cells"] == 120 and rank["worst"] < 1e-6, rank["worst"]
        for cell in rank["reports"]:
            # Every cell took the new path, and the report counts rounds.
            assert cell == {"cell": cell["cell"], "heartbeat": "round", "path": "round",
                            "inputs": True, "shadow_rounds": True, "last_joiner": True}, cell


def test_no_collective_of_joinkits_own_per_iteration(results: dict[str, Any]) -> None:
    for rank in ranks_of(results, "round_collectives"):
        assert rank["path"] == "round"
        # Plain DDP: one all-reduce per bucket (several buckets here).
        assert rank["inside"] == rank["plain"] == rank["after"] == rank["buckets"] > 1
        # The entry agreement, every round of the rank with the most inputs
        # (3 + 2), the last round's first bucket, the post hook's all-reduce of
        # the inputs (torch's last joiners) and DDP's final-model sync.
        assert rank["uneven"] == 1 + 5 * rank["buckets"] + 1 + 1 + rank["post_hook"], rank


PATHS = {
    "plain": "round", "quiet second": "round", "buffers not broadcast": "round",
    "local main hook second": "round", "side channel second": "round",
    "float64": "round", "heartbeat_in_gradients=False": "fused",
    "find_unused_parameters": "round", "static_graph": "fused", "buffers": "fused",
    "user comm hook": "fused", "zero": "fused", "counter second": "fused",
    "check_agreement=False": "classic",
}
WHY = {
    "heartbeat_in_gradients=False": "heartbeat_in_gradients=False",
    "static_graph": "static_graph=True", "buffers": "broadcast_buffers=True",
    "user comm hook": "allreduce_hook",
}


def test_each_configuration_gets_its_path(results: dict[str, Any]) -> None:
    for rank in ranks_of(results, "round_paths"):
        for name, path in PATHS.items():
            got = rank[name]
            assert (got["path"], got["report"]) == (path, path), (name, got)
            assert got["worst"] < 1e-6, (name, got)
            if name in WHY:
                assert WHY[name] in got["why"], (name, got)
            elif path == "round" or name in ("zero", "counter second"):
                assert got["why"] is None, (name, got)
        # A side channel beside DDP: the active ranks' sums, answered by the
        # joined ranks' service threads; a local main hook ran in shadow rounds.
        assert rank["side channel second"]["side"] is True, rank["side channel second"]
        rounds, shadowed = rank["local main hook second"]["rounds"]
        assert rounds == shadowed, rank["local main hook second"]
        # Ranks that disagree are told so on entry, with the table.
        assert rank["disagree"] is not None and "heartbeat" in rank["disagree"]
        assert "round" in rank["disagree"] and "fused" in rank["disagree"]


def test_find_unused_parameters_rides_in_the_gradients_as_torchs_join_trains(
        results: dict[str, Any]) -> None:
    for rank in ranks_of(results, "round_find_unused"):
        assert len(rank) == 4
        for counts, cell in rank.items():
            assert cell["path"] == "round", (counts, cell)
            assert cell["worst"] < 1e-6, (counts, cell)


def test_the_final_model_comes_from_torchs_last_joiners(results: dict[str, Any]) -> None:
    """Local steps under no_sync(): the ranks' models differ after the last round.
    The report's last joiners (who left after the last round) are not torch's
    (the ranks with the most inputs) in some cell: the counter-example to
    reading them off the rounds alone; DDP's final model still equals torch's
    Join's (the post hook asks for the most inputs)."""
    ranks = ranks_of(results, "round_local_steps")
    differs = False
    for rank in ranks:
        for cell in rank["cells"]:
            assert cell["same_as_torch"] < 1e-6, cell
            assert cell["round_last_joiner"] == cell["left_after_last_round"], cell
            differs |= cell["round_last_joiner"] != cell["most_inputs"]
    assert differs


def test_one_model_through_every_path(results: dict[str, Any]) -> None:
    for rank in ranks_of(results, "round_then_other_paths"):
        assert rank["paths"] == rank["expected"]
        assert rank["worst"] < 1e-6, rank["worst"]


def test_failures_reach_every_rank_and_nobody_hangs(results: dict[str, Any]) -> None:
    ranks = ranks_of(results, "round_failures")
    assert len(ranks[0]) == 12
    for case in ranks[0]:
        where = case.split("-")[0]
        one_joined = "[1," in case
        for rank, got in enumerate(ranks):
            error = got[case]["error"]
            assert error is not None, (case, rank)
            assert got[case]["path"] == "round", (case, rank)
            if rank == 1:
                said = "bad batch" if where == "body" else f"bad {where}"
                assert error["type"] == "ValueError" and said in error["message"], (case, error)
                assert got[case]["done"] == 3
            else:
                assert error["type"] == "PeerFailure" and error["rank"] == 1, (case, rank, error)
                assert "on rank 1" in error["message"], (case, rank, error)
                # Active ranks stop within a round of the failure.
                expected = 1 if rank == 0 and one_joined else None
                if expected is not None:
                    assert got[case]["done"] == expected, (case, rank)
                else:
                    assert 3 <= got[case]["done"] <= 5, (case, rank, got[case])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (nccl, one rank per GPU)")
def test_over_nccl(tmp_path: Path) -> None:
    """The path's CUDA branch (a coalesced all-reduce; off by default until it
    has run here): the reference cells, the paths, one model through every path."""
    import sys

    from support import launch_ranks, records_by_name

    world = 2
    names = ["round_reference", "round_then_other_paths", "round_failures"]
    launch_ranks([[sys.executable, str(WORKER), str(rank), str(world), str(tmp_path / "store"),
                   str(tmp_path), "--nccl", *names] for rank in range(world)], LAUNCH_TIMEOUT)
    records = records_by_name(tmp_path, world)
    records["_logs"] = [{"log": ""}]
    records["_world"] = [{"world": world}]
    for rank in ranks_of(records, "round_reference"):
        assert rank["worst"] < 1e-5
    for rank in ranks_of(records, "round_then_other_paths"):
        assert rank["worst"] < 1e-5
