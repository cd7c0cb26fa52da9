"""FSDP2, replayed DDP models and the rest of a training step under joinkit's Join,
on real gloo groups, against single-process references.

One module fixture per world size (2 and 4) starts the ranks once; each runs
every scenario of ``programs/fsdp_scenarios.py`` (see its docstring) and the tests
assert on what each rank recorded. Every scenario runs on a fresh gloo group
with a 30 s timeout, and the whole launch has a hard deadline, so a mismatch
fails instead of hanging the suite. Tolerance for "equals the reference":
1e-5 on every parameter (and buffer) of every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import run_scenarios, scenario_names, scenario_records, selected_scenarios
from support.refusals import fsdp2_scenarios as fsdp2
from support.refusals import fsdp_cpu_refusal

WORKER = Path(__file__).parent / "programs" / "fsdp_scenarios.py"
LAUNCH_TIMEOUT = 150.0  # seconds, for all ranks of one world together

# The first test of a world size starts its ranks (the module fixture): the
# default per-test timeout (pyproject.toml) is shorter than the launch's own.
pytestmark = [pytest.mark.needs_torch, pytest.mark.launches,
              pytest.mark.timeout(LAUNCH_TIMEOUT + 60)]
TOLERANCE = 1e-5
ACTIVE_MESSAGE = "Detected at least one rank that exhausted inputs. Throwing across all ranks."

Results = dict[str, list[dict[str, Any]]]


def launch(out: Path, world: int, names: list[str], *extra: str) -> Results:
    """Run ``names`` on ``world`` rank processes; scenario name -> one record per rank."""
    return run_scenarios(WORKER, world, out, [*extra, *names], LAUNCH_TIMEOUT)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    # The CUDA scenarios launch their own ranks, only where CUDA is (tests below).
    names = selected_scenarios(request, [n for n in scenario_names(WORKER)
                                         if not n.startswith(("nccl_", "cuda_"))])
    return launch(tmp_path_factory.mktemp(f"fsdp{request.param}"), request.param, names)


def outcome(results: Results, name: str) -> list[Any]:
    """Each rank's result of scenario ``name``; fails with the ranks' errors.

    Also checks that every rank issued the same number of collectives on the
    scenario's group (a shadow that missed or added one would differ).
    """
    records = scenario_records(results, name)
    assert len({r["collectives"] for r in records}) == 1, [r["collectives"] for r in records]
    return [r["result"] for r in records]


def within(value: float) -> bool:
    return value <= TOLERANCE


# -- FSDP2 ------------------------------------------------------------------------------
# Where this torch refuses FSDP2 over gloo, each test asserts the refusal (support.refusals).


@fsdp2("fsdp_reference")
def test_fsdp_equals_the_reference(results: Results) -> None:
    """SGD and AdamW, nested and flat units, reshard_after_forward True and False,
    uneven counts including a rank with no inputs."""
    ranks = outcome(results, "fsdp_reference")
    for config in ranks[0]:
        assert all(within(r[config]["deviation"]) for r in ranks), (config, ranks)
        # Somebody shadowed: the counts are uneven.
        assert max(r[config]["shadow_rounds"] for r in ranks) > 0


@fsdp2("hsdp_reference")
def test_hsdp_equals_the_reference(results: Results) -> None:
    """A 2-D (replicate, shard) mesh: reduce-scatter and all-reduce, with a
    gradient-accumulation window too."""
    for rank in outcome(results, "hsdp_reference"):
        assert within(rank["plain"]) and within(rank["accumulate"]), rank


@fsdp2("fsdp_divide_by_active")
def test_fsdp_divide_by_the_active_ranks(results: Results) -> None:
    for rank in outcome(results, "fsdp_divide_by_active"):
        assert within(rank["deviation"])
        assert within(rank["after"])  # back to FSDP's own averaging after the Join


@fsdp2("fsdp_accumulate")
def test_fsdp_gradient_accumulation(results: Results) -> None:
    for rank in outcome(results, "fsdp_accumulate"):
        assert within(rank["aligned"]) and within(rank["mid-window"]), rank


@fsdp2("fsdp_shadow_input")
def test_fsdp_shadow_input(results: Results) -> None:
    for rank in outcome(results, "fsdp_shadow_input"):
        assert within(rank["empty"]) and within(rank["zeros"]), rank


@fsdp2("fsdp_unfused")
def test_fsdp_without_a_fused_heartbeat(results: Results) -> None:
    assert all(within(r["deviation"]) for r in outcome(results, "fsdp_unfused"))


@fsdp2("fsdp_not_first")
def test_fsdp_model_that_is_not_the_first_joinable(results: Results) -> None:
    for rank in outcome(results, "fsdp_not_first"):
        assert within(rank["deviation"])
        assert rank["count"] == rank["expected_count"]


@fsdp2("fsdp_eval")
def test_fsdp_evaluation_loop(results: Results) -> None:
    ranks = outcome(results, "fsdp_eval")
    assert all(r["change"] == 0.0 for r in ranks)
    assert sum(r["outputs"] for r in ranks) > 0


@fsdp2("fsdp_paused_eval")
def test_fsdp_evaluation_inside_the_join_with_the_training_adapter_paused(
        results: Results) -> None:
    """FSDPJoinable.paused(): an uneven evaluation on every rank inside the training
    Join, in a Join of its own (a second adapter), is no training round: the
    collectives match on every rank and training ends at the reference."""
    ranks = outcome(results, "fsdp_paused_eval")
    assert all(within(r["deviation"]) for r in ranks), ranks
    assert sum(r["outputs"] for r in ranks) > 0


@fsdp2("fsdp_after_exit")
def test_fsdp_sends_no_join_collectives_after_the_block(results: Results) -> None:
    for rank in outcome(results, "fsdp_after_exit"):
        assert rank["after"] == rank["alone"]


@fsdp2("fsdp_throw")
def test_fsdp_throw_mode_raises_torchs_messages(results: Results) -> None:
    ranks = outcome(results, "fsdp_throw")
    assert ranks[0]["message"] == "Rank 0 exhausted all inputs."
    assert all(r["message"] == ACTIVE_MESSAGE for r in ranks[1:])
    assert all(r["type"] == "EarlyTermination" for r in ranks)
    assert [r["iterations"] for r in ranks] == [2] * len(ranks)


@pytest.mark.parametrize("name", ["fsdp_peer_failure", "fsdp_peer_failure_in_forward"])
@fsdp2()
def test_fsdp_failure_propagation(results: Results, name: str) -> None:
    """Rank 1 raises (between iterations, or in the root's forward right after the
    step check): it leaves with its own error, every other rank with PeerFailure."""
    ranks = outcome(results, name)
    assert ranks[1]["type"] == "ValueError"
    for rank, result in enumerate(ranks):
        if rank != 1:
            assert result["type"] == "PeerFailure", result
            assert "rank 1 failed" in result["message"]



@fsdp2("fsdp_epochs")
def test_fsdp_over_epochs_leaves_every_grad_as_the_loop_left_it(results: Results) -> None:
    """Three epochs, one Join each (SGD, AdamW; zero_grad first and last; windows
    of 1 and 2, aligned and mid-window; a GradScaler and an LR scheduler): after
    every epoch every rank equals the reference, and after every Join every
    gradient of every rank (each sharded .grad, and FSDP's unsharded accumulation)
    is the very object, with the very value, that its loop left."""
    ranks = outcome(results, "fsdp_epochs")
    for config in ranks[0]:
        for rank, result in enumerate(ranks):
            assert all(within(d) for d in result[config]["deviation"]), (config, rank, result)
            for epoch, grads in enumerate(result[config]["grads"]):
                assert grads == {"same_objects": True, "change": 0.0}, (config, rank, epoch)
        # Somebody shadowed in every epoch: the counts are uneven.
        assert all(sum(r[config]["shadow_rounds"][e] for r in ranks) > 0 for e in range(3))
    # The optimizer's, scheduler's and scaler's shadows: every rank's learning rate
    # follows the reference's epoch after epoch, and the scale is the same everywhere.
    scaled = [r["adamw/last/window1/scaler+scheduler"] for r in ranks]
    for result in scaled:
        assert result["lr"] == pytest.approx(result["reference_lr"], rel=1e-12)
        assert result["scale"] == scaled[0]["scale"] == [2.0**16] * 3
    assert scaled[0]["reference_lr"][-1] < scaled[0]["reference_lr"][0] < 0.02

# -- the rest of a training step --------------------------------------------------------


@fsdp2("fsdp_scheduler")
def test_fsdp_lr_scheduler(results: Results) -> None:
    for rank in outcome(results, "fsdp_scheduler"):
        assert within(rank["deviation"])
        assert rank["lr"] == pytest.approx(rank["expected_lr"])


@fsdp2("fsdp_clip_grad_norm")
def test_fsdp_gradient_clipping_through_shadow_step(results: Results) -> None:
    for rank in outcome(results, "fsdp_clip_grad_norm"):
        assert within(rank["deviation"])
        assert rank["clipped"]  # the norm exceeded the limit: clipping mattered


@fsdp2("fsdp_grad_scaler")
def test_fsdp_grad_scaler_agrees_on_inf(results: Results) -> None:
    ranks = outcome(results, "fsdp_grad_scaler")
    for rank in ranks:
        assert within(rank["deviation"])
        assert rank["scale"] == rank["reference_scales"][-1]
        # A rank's own steps follow the reference's scales, the overflow included.
        assert rank["scales"] == rank["reference_scales"][: len(rank["scales"])]
    scales = ranks[0]["reference_scales"]
    assert scales[3] == scales[2] / 2  # the overflow at step 3 halved the scale


@pytest.mark.scenarios("ddp_zero_scheduler")
def test_ddp_zero_lr_scheduler(results: Results) -> None:
    for rank in outcome(results, "ddp_zero_scheduler"):
        assert within(rank["deviation"])


@pytest.mark.scenarios("misuse")
def test_misuse_is_refused_with_a_clear_error(results: Results) -> None:
    rank = outcome(results, "misuse")[0]
    assert "Pass the model too" in rank["optimizer_alone"]
    assert "leave the optimizer out of Join" in rank["ddp_optimizer"]
    assert "ZeroRedundancyOptimizer" in rank["scaler_zero"]
    refusal = fsdp_cpu_refusal()
    fsdp_cases = ("optimizer_before_model", "scheduler_alone", "scheduler_first",
                  "scaler_alone", "plateau")
    if refusal is not None:  # this torch refuses FSDP2 on the CPU: every FSDP2 case meets it
        assert all(rank[case] == refusal for case in fsdp_cases), rank
        assert rank["refused"] == refusal and rank["warning"] == [], rank
        return
    assert "List the model first" in rank["optimizer_before_model"]
    assert "without its optimizer" in rank["scheduler_alone"]
    assert "before its optimizer" in rank["scheduler_first"]
    assert "no optimizer listed before it" in rank["scaler_alone"]
    assert "ReduceLROnPlateau" in rank["plateau"]
    assert len(rank["warning"]) == 1 and "Join([model, optimizer])" in rank["warning"][0]



# -- the torch internals the adapters rely on --------------------------------------------


@pytest.mark.parametrize(("case", "member"), [
    ("ddp_deleted", "DistributedDataParallel._match_all_reduce_for_bwd_pass is missing"),
    ("ddp_hook_renamed", "_DDPJoinHook.main_hook no longer calls _match_all_reduce_for_bwd_pass"),
    ("join_config_deleted", "torch.distributed.algorithms.join._JoinConfig is missing"),
    ("zero_moved", "zero_redundancy_optimizer.ZeroRedundancyOptimizer is missing"),
    ("zero_hook_renamed", "_ZeROJoinHook.main_hook no longer calls step"),
    ("fsdp_deleted", "FSDPModule._get_fsdp_state is missing"),
    ("fsdp_signature", "DeviceMesh._flatten has the parameters (self, mesh_dim_name, "
                       "backend_override), joinkit expects (self)"),
])
def test_a_changed_torch_internal_is_refused_by_name(results: Results, case: str,
                                                     member: str) -> None:
    """DDP, ZeRO and FSDP2 with one torch internal deleted or changed (as a torch
    upgrade might): Join(...) raises UnsupportedTorchError on every rank, naming
    the member, this torch's version and the torch versions joinkit supports."""
    for rank in outcome(results, "torch_guard"):
        message = rank[case]
        assert message is not None, case
        assert member in message
        assert f"this process runs torch {rank['torch']}" in message
        assert "joinkit 0.1.0 supports torch >=2.6 (tested with" in message


@pytest.mark.scenarios("torch_guard")
def test_the_torch_internals_are_checked_once_per_process(results: Results) -> None:
    """With torch as it is the same Joins build; after that, a member deleted
    goes unnoticed by later Joins of the same kinds: the check ran once."""
    ranks = outcome(results, "torch_guard")
    assert all(rank["cached"] for rank in ranks)
    # Where this torch refuses FSDP2 on the CPU: that refusal, after the check
    # passed, both times (not the deleted member's: the check did not run again).
    refusal = fsdp_cpu_refusal()
    assert all(rank["refused"] == ([] if refusal is None else [refusal] * 2) for rank in ranks)

# -- models with collectives in forward -------------------------------------------------


@pytest.mark.scenarios("ddp_sync_batch_norm")
def test_ddp_sync_batch_norm_equals_the_union_batch_reference(results: Results) -> None:
    for rank in outcome(results, "ddp_sync_batch_norm"):
        for key in ("plain", "no_sync", "zero", "unfused"):
            assert within(rank[key]["params"]) and within(rank[key]["buffers"]), (key, rank)
        # The control: replaying a non-empty batch would pollute the statistics.
        assert rank["nonempty_shadow"]["buffers"] > 1e-3


@pytest.mark.parametrize("world", [2, 4])
def test_real_sync_batch_norm_on_cuda(tmp_path: Path, world: int) -> None:
    """DDP + torch.nn.SyncBatchNorm, every rank on cuda:0 over gloo (one GPU is enough)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch.nn.SyncBatchNorm runs on CUDA only")
    for rank in outcome(launch(tmp_path, world, ["cuda_sync_batch_norm"]),
                        "cuda_sync_batch_norm"):
        for key in ("plain", "no_sync", "zero"):
            assert within(rank[key]["params"]) and within(rank[key]["buffers"]), (key, rank)


def test_fsdp_over_nccl(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("nccl needs CUDA")
    world = min(2, torch.cuda.device_count())
    names = [n for n in scenario_names(WORKER) if n.startswith("nccl_")]
    records = launch(tmp_path, world, names, "--nccl")
    for rank in outcome(records, "nccl_fsdp_reference"):
        assert within(rank["deviation"]), rank
