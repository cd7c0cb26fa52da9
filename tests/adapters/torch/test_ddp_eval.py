"""Evaluation loops with DDP under Join, a silent first joinable, the divisor (issue 18, 4-6).

Each launch runs every scenario of ``programs/eval_scenarios.py`` (see its docstring)
on real gloo process groups, worlds 2 and 3; one more under a real ``mpirun``
(DDP over gloo from ``joinkit.backends.init_torch()``), and one over nccl where
CUDA is available. Before the fix, ``ddp_eval_only`` killed rank 0 with gloo's C++
abort (a joined rank shadowed a gradient all-reduce no active rank sent).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import run_scenarios, scenario_names, scenario_records, selected_scenarios
from support.refusals import fsdp2_scenarios as fsdp2

pytestmark = pytest.mark.launches

torch = pytest.importorskip("torch")

WORKER = Path(__file__).parent / "programs" / "eval_scenarios.py"
LAUNCH_TIMEOUT = 240.0
SILENT = "the Join's first joinable, Silent, must call Join.notify_join_context(self)"
NO_BACKWARD = "ran a forward with gradients enabled and no backward"
COUNTS_3_5 = {2: [3, 5], 3: [3, 5, 4]}  # eval_scenarios.COUNTS[world][0]


@pytest.fixture(scope="module", params=[2, 3])
def results(request: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp(f"eval{request.param}")
    # The scenarios the selected tests read (support.selected_scenarios): all, for the module.
    return run_scenarios(WORKER, request.param, out,
                         selected_scenarios(request, scenario_names(WORKER)), LAUNCH_TIMEOUT)


def ranks_of(results: dict[str, Any], name: str) -> list[Any]:
    return [r["result"] for r in scenario_records(results, name)]


def check_eval(results: dict[str, Any]) -> None:
    for rank in ranks_of(results, "ddp_eval_only"):
        assert rank["cases"] == 54 and rank["worst"] < 1e-6, rank
    for name in ("ddp_train_eval_mixed", "ddp_train_then_eval_epochs"):
        ranks = ranks_of(results, name)
        assert all(r["worst"] < 1e-5 for r in ranks), [r["worst"] for r in ranks]
        assert all(r["finals"] == ranks[0]["finals"] for r in ranks)  # ranks agree


@pytest.mark.scenarios("ddp_eval_only", "ddp_train_eval_mixed", "ddp_train_then_eval_epochs",
                       "ddp_eval_throw_mode")
def test_eval_loops_match_one_process(results: dict[str, Any]) -> None:
    check_eval(results)
    world = results["_world"][0]["world"]
    for rank in ranks_of(results, "ddp_eval_throw_mode"):
        assert rank["worst"] < 1e-6
        assert rank[str([4] * world)] is None  # even: finished
        assert len([v for v in rank.values() if v == "EarlyTermination"]) == 1


def check_errors(results: dict[str, Any]) -> None:
    world = results["_world"][0]["world"]
    ranks = ranks_of(results, "ddp_grad_forward_without_backward")
    for case in ranks[0]:
        counts = json.loads(case.split("-")[0])
        for rank, result in enumerate(ranks):
            error = result[case]
            assert error is not None, (case, rank)
            if counts[rank] >= 2 or (counts[rank] == 1 and max(counts) == 1):
                assert error["type"] == "LocalProtocolError" and NO_BACKWARD in error["message"]
            else:  # a joined rank, or one that failed before: a clear error either way
                assert error["type"] in ("PeerFailure", "LocalProtocolError"), error
                assert NO_BACKWARD in error["message"], error
    ranks = ranks_of(results, "first_joinable_never_notifies")
    for case in ranks[0]:
        for rank, result in enumerate(ranks):
            error = result[case]
            assert error is not None and SILENT in error["message"], (case, rank, error)
            assert error["type"] in ("LocalProtocolError", "PeerFailure")
            assert ("DistributedDataParallel" if case.startswith("ddp") else "Ticker") in \
                error["message"]
    accumulated = ranks_of(results, "later_joinables_with_accumulation")
    assert all(r["params"] == accumulated[0]["params"] for r in accumulated)
    assert len(accumulated) == world


def test_misuse_gives_every_rank_a_clear_error(results: dict[str, Any]) -> None:
    check_errors(results)


def test_divisor_applies_wherever_ddp_stands(results: dict[str, Any]) -> None:
    for rank in ranks_of(results, "ddp_divisor_positions"):
        assert rank["worst"] < 1e-6, rank
    for rank in ranks_of(results, "ddp_divisor_refused_after_a_fused_joinable"):
        assert rank["enabled"] is False
        assert rank["error"] and "divide_by_initial_world_size=False" in rank["error"]
        assert "List the model first" in rank["error"]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)  # its mpirun may take LAUNCH_TIMEOUT (default: 120)
def test_under_mpirun(tmp_path: Path) -> None:
    from support.mpi import run_mpi_scenarios

    names = ["ddp_eval_only", "ddp_train_eval_mixed", "ddp_grad_forward_without_backward",
             "first_joinable_never_notifies", "ddp_divisor_positions"]
    records = run_mpi_scenarios(WORKER, 2, tmp_path, names, LAUNCH_TIMEOUT, "mpi")
    for rank in ranks_of(records, "ddp_eval_only"):
        assert rank["worst"] < 1e-6
    for rank in ranks_of(records, "ddp_divisor_positions"):
        assert rank["worst"] < 1e-6
    assert all(r["worst"] < 1e-5 for r in ranks_of(records, "ddp_train_eval_mixed"))
    for rank in ranks_of(records, "ddp_grad_forward_without_backward"):
        assert all(e is not None and NO_BACKWARD in e["message"] for e in rank.values())
    for rank in ranks_of(records, "first_joinable_never_notifies"):
        assert all(e is not None and SILENT in e["message"] for e in rank.values())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (nccl, one rank per GPU)")
def test_over_nccl(tmp_path: Path) -> None:
    world = 2
    names = ["ddp_eval_only", "ddp_train_eval_mixed", "ddp_train_then_eval_epochs",
             "ddp_divisor_positions"]
    records = run_scenarios(WORKER, world, tmp_path, ["--nccl", *names], LAUNCH_TIMEOUT)
    for rank in ranks_of(records, "ddp_eval_only"):
        assert rank["worst"] < 1e-5
    for name in ("ddp_train_eval_mixed", "ddp_train_then_eval_epochs", "ddp_divisor_positions"):
        assert all(r["worst"] < 1e-4 for r in ranks_of(records, name)), name


@fsdp2("fsdp_eval_only", "fsdp_train_eval_mixed", "fsdp_divisor_positions")
def test_fsdp2_eval_mixed_and_divisor(results: dict[str, Any]) -> None:
    """FSDP2: forward-only loops (no_grad, inference_mode, eval(); resharding after
    forward or not; first or after a Ticker), a no_grad forward after every step,
    and divide_by_initial_world_size in both positions, against one process."""
    for rank in ranks_of(results, "fsdp_eval_only"):
        assert rank == {"worst": 0.0, "cases": 24}, rank
    for name in ("fsdp_train_eval_mixed", "fsdp_divisor_positions"):
        assert all(r["worst"] < 1e-6 for r in ranks_of(results, name)), name


def test_ddp_after_a_fused_first_joinable(results: dict[str, Any]) -> None:
    """Join([Gather, ddp]) / Join([FusedCounter, ddp]): the no-backward check runs
    in the first joinable's fused_heartbeat, before its collective; every rank
    leaves with a clear error, and no_grad evaluation and training are exact."""
    for rank in ranks_of(results, "ddp_after_fused_first"):
        assert rank["worst"] < 1e-5 and rank["cases"] == 12, rank
    ranks = ranks_of(results, "ddp_after_fused_first")
    for case in ranks[0]["errors"]:
        counts = json.loads(case.split("-")[0])
        for rank, result in enumerate(ranks):
            error = result["errors"][case]
            assert error is not None, (case, rank)
            assert NO_BACKWARD in error["message"], (case, rank, error)
            if counts[rank] >= 2:
                assert error["type"] == "LocalProtocolError", (case, rank, error)
            else:
                assert error["type"] in ("PeerFailure", "LocalProtocolError"), error


@fsdp2("fsdp_grad_forward_without_backward")
def test_fsdp2_grad_forward_without_backward(results: dict[str, Any]) -> None:
    """FSDP2 in eval() with gradients and no backward (first, after a Ticker,
    after a fused Gather; 3 vs 5, 0 vs 4, 0 vs 1 batches): the rank that made
    the mistake raises LocalProtocolError (after running the backward the
    joined ranks replay, from zeros), the others get PeerFailure; no hang."""
    ranks = ranks_of(results, "fsdp_grad_forward_without_backward")
    assert len(ranks[0]["errors"]) == 12
    for rank, result in enumerate(ranks):  # training holds no outputs after backward
        assert result["held"] == [0] * COUNTS_3_5[results["_world"][0]["world"]][rank], result
    for case in ranks[0]["errors"]:
        counts = json.loads(case.split("-")[0])
        for rank, result in enumerate(ranks):
            error = result["errors"][case]
            assert error is not None and NO_BACKWARD in error["message"], (case, rank, error)
            assert "FSDP model" in error["message"] and "torch.no_grad()" in error["message"]
            if counts[rank] >= 2 or (counts[rank] == 1 and max(counts) == 1):
                assert error["type"] == "LocalProtocolError", (case, rank, error)
            else:
                assert error["type"] == "PeerFailure", (case, rank, error)
