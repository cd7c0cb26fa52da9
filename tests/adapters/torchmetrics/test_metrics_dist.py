"""torchmetrics under joinkit's Join, over real gloo process groups.

One launch per world size (2 and 3) runs every scenario of
``programs/metrics_scenarios.py`` (see its docstring); the tests compare each
per-step value on the active ranks and every rank's final ``compute()`` with a
single-process torchmetrics computation over the union of the batches: exactly,
except MeanSquaredError, whose float32 sum of squared errors is added in
another order (per rank, then across ranks) and is compared to 1e-6 relative.
A third, short launch runs the naive loop (no Join) and shows it fails.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from support import launch_ranks, records_by_name, run_scenarios, scenario_names, scenario_records

pytest.importorskip("torchmetrics")

pytestmark = [pytest.mark.needs_torch, pytest.mark.launches]

LAUNCH_TIMEOUT = 110.0
WORKER = Path(__file__).parent / "programs" / "metrics_scenarios.py"


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp(f"metrics_world{request.param}")
    return run_scenarios(WORKER, request.param, out, scenario_names(WORKER), LAUNCH_TIMEOUT)


def outcome(results: dict[str, list[dict[str, Any]]], name: str) -> list[Any]:
    return [r["result"] for r in scenario_records(results, name)]


def same(a: Any, b: Any, exact: bool) -> bool:
    """Equal values (nested dicts and lists of floats); NaN equals NaN."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            same(a[k], b[k], exact) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(
            same(x, y, exact) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b if exact else math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def assert_matches(case: dict[str, Any], exact: bool, where: str) -> None:
    assert same(case["steps"], case["ref_steps"], exact), (where, case)
    assert same(case["final"], case["ref_final"], exact), (where, case)


def test_every_metric_matches_one_process_per_step_and_at_compute(results: Any) -> None:
    ranks = outcome(results, "matrix")
    assert ranks[0], "no case ran"
    for rank, cases in enumerate(ranks):
        for key, case in cases.items():
            assert_matches(case, exact=not key.startswith("mse"), where=f"rank {rank} {key}")
            counts = json.loads(key.rsplit("/", 1)[1])
            assert len(case["steps"]) == counts[rank]
    # Every rank's final value is the same number.
    for key in ranks[0]:
        assert all(same(r[key]["final"], ranks[0][key]["final"], True) for r in ranks), key


def test_with_ddp_first(results: Any) -> None:
    """Join([ddp, metric]): DDP sends the heartbeat (one per input), the metric's
    per-step values and compute() are the single-process ones."""
    for rank, cases in enumerate(outcome(results, "with_ddp")):
        for key, case in cases.items():
            assert case["heartbeats"] == case["inputs"]
            assert_matches(case, exact=True, where=f"rank {rank} sync_on_step={key}")


def test_one_heartbeat_per_forward(results: Any) -> None:
    for rank in outcome(results, "heartbeat_per_forward"):
        assert rank["metric"] == rank["inputs"]
        assert rank["collection"] == rank["inputs"]  # one per collection forward


def test_errors_are_clear_and_raised_before_a_collective(results: Any) -> None:
    ranks = outcome(results, "errors")
    # After the failed Join, compute() works and every rank gets the same value.
    assert all(same(rank["after"], ranks[0]["after"], exact=True) for rank in ranks)
    for rank in ranks:
        assert "call compute() after the `with Join(...)` block" in rank["compute_inside"]
        assert "is reduced with None, not cat" in rank["list_none"]
        assert "dist_sync_on_step=False" in rank["list_none"]
        assert "different process group" in rank["other_group"] or \
            "multiple process groups" in rank["other_group"]
        assert "twice" in rank["twice"]
        assert "wraps the metric BinaryAccuracy" in rank["composed"]


# -- torchmetrics' own distributed tests, ported ----------------------------------------


def test_ported_ddp_sum_cat(results: Any) -> None:
    for rank in outcome(results, "ported_ddp_sum_cat"):
        assert rank["steps"] == rank["expected"]
        assert rank["final"] == rank["final_ref"]


def test_ported_empty_and_unequal_lists(results: Any) -> None:
    ranks = outcome(results, "ported_empty_and_unequal_lists")
    world = len(ranks)
    assert ranks[0]["steps"] == [[0.0, 0.0], [0.0, 0.0]]
    for r, rank in enumerate(ranks):
        assert rank["final"] == [0.0] * 4
        # Step i gathers (q + 1, 2) rows from each rank q still active (q >= i).
        assert rank["shapes"] == [[sum(q + 1 for q in range(i, world)), 2]
                                  for i in range(r + 1)]
        assert rank["multi_final"] == [sum((q + 1) ** 2 for q in range(world)), 2]


def test_ported_state_dict_is_synced(results: Any) -> None:
    for rank in outcome(results, "ported_state_dict_is_synced"):
        assert rank["local"] == rank["local_ref"]
        assert rank["synced"] == rank["synced_ref"]
        assert rank["in_context"] == rank["synced_ref"][:2]
        assert rank["after"] == rank["local_ref"]


def test_ported_non_contiguous_and_autograd(results: Any) -> None:
    ranks = outcome(results, "ported_non_contiguous_and_autograd")
    for rank in ranks:
        assert rank["cat"] == rank["cat_ref"]
        assert rank["shapes"] == [[q + 1, 2] for q in range(len(ranks))]
        assert rank["grad_ok"]


def test_ported_class_test(results: Any) -> None:
    for rank, cases in enumerate(outcome(results, "ported_class_test")):
        for key, case in cases.items():
            assert_matches(case, exact=not key.startswith("mse"), where=f"rank {rank} {key}")


def test_ported_compositional(results: Any) -> None:
    for rank in outcome(results, "ported_compositional"):
        assert rank["value"] == rank["ref"]


# -- the naive way, side by side --------------------------------------------------------


NAIVE = ("naive_mse", "naive_auroc_empty")


@pytest.fixture(scope="module")
def naive(tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, tuple[list[Any], list[dict[str, Any]]]]:
    """Each naive scenario on 2 ranks in its own processes, all launched at once with one
    60 s deadline: name -> (the runs, the records)."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in NAIVE}
    commands = [[sys.executable, str(WORKER), str(r), "2", str(dirs[name] / "store"),
                 str(dirs[name]), name] for name in NAIVE for r in range(2)]
    runs = launch_ranks(commands, timeout=60.0)
    return {name: (runs[2 * i: 2 * i + 2], records_by_name(dirs[name], 2).get(name, []))
            for i, name in enumerate(NAIVE)}


def test_the_naive_loop_fails_or_is_wrong(naive: Any) -> None:
    """3 vs 5 batches, dist_sync_on_step=True, no Join (the issue's report): a rank
    errs, aborts, is killed at the deadline, or computes a wrong value."""
    runs, records = naive["naive_mse"]
    finished = [r for r in records if r["ok"]]
    wrong = [r for r in finished
             if not same(r["result"]["final"], r["result"]["ref_final"], exact=False)]
    failed = len(finished) < 2 or any(run.returncode != 0 for run in runs)
    assert failed or wrong, records
    assert failed, "one rank was expected to fail after its peer left"


def test_a_rank_without_data_breaks_the_naive_compute(naive: Any) -> None:
    """0 vs 4 batches, BinaryAUROC syncing at compute(), no Join: torchmetrics' gather
    mismatches (the same case passes inside Join: the matrix's auroc/compute/[0, 4])."""
    runs, records = naive["naive_auroc_empty"]
    finished = [r for r in records if r["ok"]]
    assert len(finished) < 2 or any(run.returncode != 0 for run in runs), records


# -- the docs' example ----------------------------------------------------------------------


def test_the_docs_example_prints_the_single_process_accuracy(tmp_path: Path) -> None:
    """docs/metrics.md's example under torchrun: both ranks print the accuracy of one
    process over all 8 batches."""
    import re

    import torch
    from torchmetrics.classification import MulticlassAccuracy

    text = (Path(__file__).parents[3] / "docs" / "metrics.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "example.py"
    script.write_text(code)
    torchrun = Path(sys.executable).with_name("torchrun")
    (run,) = launch_ranks([[str(torchrun), "--standalone", "--nproc-per-node", "2",
                            str(script)]], timeout=100.0)
    assert run.returncode == 0, run.stdout[-3000:]
    printed = dict(re.findall(r"rank (\d): accuracy ([0-9.]+)", run.stdout))
    reference = MulticlassAccuracy(num_classes=3)
    for rank in range(2):
        generator = torch.Generator().manual_seed(rank)
        for _ in range(3 + 2 * rank):
            reference.update(torch.randn(4, 3, generator=generator),
                             torch.randint(3, (4,), generator=generator))
    expected = f"{float(reference.compute()):.6f}"
    assert printed == {"0": expected, "1": expected}, run.stdout[-2000:]
