"""FSDP1 (``FullyShardedDataParallel``) under joinkit's Join, on real gloo groups,
against single-process float64 references.

One module fixture per world size (2 and 3) starts the ranks once; each runs
every scenario of ``programs/fsdp1_scenarios.py`` (see its docstring) and the
tests assert on what each rank recorded. Every scenario runs on a fresh gloo
group with a 30 s timeout, and the whole launch has a hard deadline. Float64
models equal the reference within 1e-12; float32 ones (FSDP1's own
``clip_grad_norm_`` computes in float32, mixed precision steps float32
parameters) within 1e-6, against references with the same casts. Where this torch
lacks a member of FSDP1's guard group, each test asserts joinkit's refusal instead
(``support.refusals``); a run of chosen tests (the matrix's edge) launches only the
scenarios they read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import run_scenarios, scenario_names, scenario_records, selected_scenarios
from support.refusals import fsdp1_refusal, scenario_refused
from support.refusals import fsdp1_scenarios as fsdp1

WORKER = Path(__file__).parent / "programs" / "fsdp1_scenarios.py"
LAUNCH_TIMEOUT = 150.0  # seconds, for all ranks of one world together

pytestmark = [pytest.mark.needs_torch, pytest.mark.launches,
              pytest.mark.timeout(LAUNCH_TIMEOUT + 60)]
FLOAT64 = 1e-12
FLOAT32 = 1e-6

Results = dict[str, list[dict[str, Any]]]


def launch(out: Path, world: int, names: list[str], *extra: str) -> Results:
    return run_scenarios(WORKER, world, out, [*extra, *names], LAUNCH_TIMEOUT)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    names = selected_scenarios(request, [n for n in scenario_names(WORKER)
                                         if not n.startswith("cuda_") and n != "fsdp1_hybrid"])
    return launch(tmp_path_factory.mktemp(f"fsdp1_{request.param}"), request.param, names)


def outcome(results: Results, name: str) -> list[Any]:
    """Each rank's result of scenario ``name``; every rank issued as many collectives."""
    records = scenario_records(results, name)
    assert len({r["collectives"] for r in records}) == 1, [r["collectives"] for r in records]
    return [r["result"] for r in records]


@fsdp1("fsdp1_reference")
def test_fsdp1_equals_the_reference(results: Results) -> None:
    """SGD and AdamW, nested (an auto-wrap policy) and flat units, use_orig_params,
    FULL_SHARD, SHARD_GRAD_OP and NO_SHARD; uneven counts with a rank that has none."""
    ranks = outcome(results, "fsdp1_reference")
    for config in ranks[0]:
        assert all(r[config]["deviation"] <= FLOAT64 for r in ranks), (config, ranks)
        assert all(r[config]["wrapped"] == "FullyShardedDataParallel" for r in ranks)
        assert all(r[config]["moved"] > 1e-3 for r in ranks)
        assert max(r[config]["shadow_rounds"] for r in ranks) > 0  # somebody shadowed


def test_fsdp1_hybrid_shard_equals_the_reference(tmp_path: Path) -> None:
    """HYBRID_SHARD on 4 ranks (2 shard groups of 2, 2 replicate groups of 2): the
    reduce-scatter and the replicate all-reduce, uneven counts with a rank that has none."""
    results = launch(tmp_path, 4, ["fsdp1_hybrid"])
    refusal = fsdp1_refusal()
    if refusal is not None:  # this torch lacks what FSDP1 needs: every rank was refused
        scenario_refused(results, "fsdp1_hybrid", refusal)
        return
    for rank in outcome(results, "fsdp1_hybrid"):
        for case in ("nested", "flat"):
            assert rank[case]["deviation"] <= FLOAT64 and rank[case]["moved"] > 1e-3, rank


@fsdp1("fsdp1_accumulate")
def test_fsdp1_gradient_accumulation_with_no_sync(results: Results) -> None:
    for rank in outcome(results, "fsdp1_accumulate"):
        assert all(value <= FLOAT64 for value in rank.values()), rank
        assert set(rank) == {"aligned", "mid-window", "aligned-orig", "mid-window-orig"}


@fsdp1("fsdp1_divide_by_active")
def test_fsdp1_divide_by_the_active_ranks(results: Results) -> None:
    for rank in outcome(results, "fsdp1_divide_by_active"):
        assert rank["deviation"] <= FLOAT64 and rank["after"] <= FLOAT64, rank


@fsdp1("fsdp1_clip_grad_norm")
def test_fsdp1_own_clip_grad_norm_through_shadow_step(results: Results) -> None:
    for rank in outcome(results, "fsdp1_clip_grad_norm"):
        for case in ("flat", "orig"):
            assert rank[case]["deviation"] <= FLOAT32, rank
            assert rank[case]["clipped"]  # the norm exceeded the limit: clipping mattered


@fsdp1("fsdp1_mixed_precision")
def test_fsdp1_mixed_precision_equals_the_reference_with_the_same_casts(
        results: Results) -> None:
    for rank in outcome(results, "fsdp1_mixed_precision"):
        for case in ("flat", "orig"):
            assert rank[case]["deviation"] <= FLOAT32, rank
            # bfloat16 mattered: plain float32 training ends elsewhere.
            assert rank[case]["from_float32"] > 100 * FLOAT32, rank


@fsdp1("fsdp1_eval")
def test_fsdp1_evaluation_loop(results: Results) -> None:
    ranks = outcome(results, "fsdp1_eval")
    assert all(r["change"] == 0.0 for r in ranks)
    assert sum(r["outputs"] for r in ranks) > 0


@fsdp1("fsdp1_gradients_given_back")
def test_fsdp1_gives_every_gradient_back(results: Results) -> None:
    for rank in outcome(results, "fsdp1_gradients_given_back"):
        for case, epochs in rank.items():
            assert epochs == [{"same_objects": True, "change": 0.0}] * 2, (case, rank)


@fsdp1("fsdp1_after_exit")
def test_fsdp1_sends_no_join_collectives_after_the_block(results: Results) -> None:
    for rank in outcome(results, "fsdp1_after_exit"):
        assert rank["after"] == rank["alone"]


@fsdp1("fsdp1_peer_failure")
def test_fsdp1_failure_propagation(results: Results) -> None:
    ranks = outcome(results, "fsdp1_peer_failure")
    assert ranks[1]["type"] == "ValueError"
    for rank, result in enumerate(ranks):
        if rank != 1:
            assert result["type"] == "PeerFailure", result
            assert "rank 1 failed" in result["message"]


@fsdp1("fsdp1_refusals")
def test_fsdp1_refusals_are_clear_and_before_any_collective(results: Results) -> None:
    for rank in outcome(results, "fsdp1_refusals"):
        assert "on_rank_loss='raise'" in rank["finish"], rank
        assert "communication hook" in rank["comm_hook"], rank
        assert "CPUOffload(offload_params=True)" in rank["offload"], rank
        # Shared accumulation windows mix rounds of different active counts.
        assert rank["shared_windows_divisor"].startswith("ValueError"), rank
        assert "shared_windows=True" in rank["shared_windows_divisor"], rank
        assert rank["collectives"] == {"finish": 0, "comm_hook": 0, "offload": 0,
                                       "shared_windows_divisor": 0}


def test_fsdp1_on_cuda_with_mixed_precision(tmp_path: Path) -> None:
    """FSDP1's CUDA path (its streams), bfloat16, no_sync, FSDP1's clip_grad_norm_."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("FSDP1's CUDA path needs CUDA")
    count = torch.cuda.device_count()
    world, extra = (2, ["--nccl"]) if count >= 2 else (2, [])  # gloo on one GPU
    for rank in outcome(launch(tmp_path, world, ["cuda_fsdp1_mixed_precision"], *extra),
                        "cuda_fsdp1_mixed_precision"):
        assert rank["deviation"] <= FLOAT32, rank
