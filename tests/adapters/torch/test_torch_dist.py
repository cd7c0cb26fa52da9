"""joinkit's Join over real torch.distributed gloo groups, with torch's DDP and ZeRO.

One module fixture starts ``WORLD`` processes once; each runs every scenario of
``programs/torch_scenarios.py`` in order (see its docstring) and the tests below
assert on what each rank recorded. A scenario that deadlocks fails with gloo's
timeout inside its worker instead of hanging the suite, and the whole launch
has a hard deadline.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from support import run_scenarios, scenario_names, scenario_records

pytestmark = pytest.mark.launches

pytest.importorskip("torch.distributed")

WORLD = 3  # three ranks join at three different times
LAUNCH_TIMEOUT = 100.0
WORKER = Path(__file__).parent / "programs" / "torch_scenarios.py"

ACTIVE_MESSAGE = "Detected at least one rank that exhausted inputs. Throwing across all ranks."


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """scenario name -> one record per rank."""
    out = tmp_path_factory.mktemp("torch_scenarios")
    return run_scenarios(WORKER, WORLD, out, scenario_names(WORKER), LAUNCH_TIMEOUT)


def outcome(results: dict[str, list[dict[str, Any]]], name: str) -> list[Any]:
    """Each rank's result of scenario ``name``; fails with the ranks' errors."""
    return [r["result"] for r in scenario_records(results, name)]


def assert_identical(values: list[Any]) -> None:
    assert all(v == values[0] for v in values), values


# -- the tutorial -----------------------------------------------------------------------


def test_ddp_tutorial_loop(results: Any) -> None:
    ranks = outcome(results, "ddp_tutorial")
    assert [r["inputs"] for r in ranks] == [5 + rank for rank in range(WORLD)]
    assert_identical([r["params"] for r in ranks])


def test_a_torch_joinable_calling_joinkits_notify_is_routed(results: Any) -> None:
    ranks = outcome(results, "torch_joinable_notifies_joinkits_join")
    # Rank r has 5 + r inputs; each all-reduce of ones sums the active ranks.
    active = [sum(5 + r > i for r in range(WORLD)) for i in range(5 + WORLD - 1)]
    counts = [sum(active[: 5 + rank]) for rank in range(WORLD)]
    assert ranks == [
        {"outside": None, "count": counts[rank], "max_count": counts[-1], "inputs": 5 + rank}
        for rank in range(WORLD)
    ]


def test_a_long_drain_says_so_at_info_with_the_boards_names(results: Any) -> None:
    ranks = outcome(results, "progress_line")
    assert [r["shadow_rounds"] for r in ranks] == [98, 0, 0]
    lines = ranks[0]["lines"]
    # Before a peer's status reached the store, the line names only those
    # that did, or (none did) counts them.
    pattern = (r"rank 0 joined after 2 inputs; shadowing (rank\(s\) (1|2|1, 2)|2 active "
               r"rank\(s\)) for \d+ s \([\d,]+ rounds\)")
    assert lines and all(re.fullmatch(pattern, line) for line in lines), lines
    # Once the peers' statuses reached the store, the line names them.
    assert any("shadowing rank(s) 1, 2 for" in line for line in lines), lines
    assert ranks[1]["lines"] == ranks[2]["lines"] == []


def test_join_kwargs_reach_ddp_and_divide_by_active_ranks(results: Any) -> None:
    """divide_by_initial_world_size, per iteration: rank r has r + 1 inputs and
    gradient r + 1, so iteration i averages ranks i..W-1 over W or over W - i."""
    ranks = outcome(results, "ddp_divide")
    longest = ranks[-1]
    xs = [r + 1.0 for r in range(WORLD)]
    for divide in (True, False):
        got = longest[str(divide)]
        expected = [
            sum(xs[i:]) / (WORLD if divide else WORLD - i) for i in range(WORLD)
        ]
        assert got["grads"] == pytest.approx(expected)
        assert got["attribute"] is divide
        # One iteration after the block, every rank active: back to the world
        # size (the reducer must not keep the Join's last count of active ranks).
        assert [r[str(divide)]["after"] for r in ranks] == pytest.approx([sum(xs) / WORLD] * WORLD)


def test_ddp_zero_matches_a_single_process_reference(results: Any) -> None:
    ranks = outcome(results, "ddp_zero_reference")
    for key in ("joinkit", "joinkit_effective"):
        assert_identical([r[key]["params"] for r in ranks])
        assert max(r[key]["deviation"] for r in ranks) < 1e-5
    # torch's own combination steps a joined rank's shard with stale gradients;
    # its deviation is recorded in the results for the record, not asserted.


def _deviation(got: Any, want: Any) -> float:
    """The largest difference between two nests of floats; inf where their
    structure differs (a gradient where the other has none)."""
    if isinstance(got, dict) and isinstance(want, dict) and got.keys() == want.keys():
        return max((_deviation(got[k], want[k]) for k in got), default=0.0)
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        return max((_deviation(g, w) for g, w in zip(got, want, strict=True)), default=0.0)
    if isinstance(got, float) and isinstance(want, float):
        return abs(got - want)
    return 0.0 if got is None and want is None else float("inf")


def test_ddp_over_epochs_leaves_every_grad_as_torchs_join(results: Any) -> None:
    """Issue 10: a joined rank left the Join holding the averaged gradient of its
    shadow rounds, so the next epoch's first backward added it. Now every
    parameter's .grad after every Join, and the parameters after every epoch,
    are exactly torch's Join's, on every rank, and both match a single-process
    simulation of the replicas (optimizer states and all)."""
    ranks = outcome(results, "ddp_epochs")
    # 3 optimizers x 2 loop orders x (plain, no_sync), and two with the replay
    assert len(ranks[0]) == 14
    for case in ranks[0]:
        for rank, got in enumerate(ranks):
            run = got[case]
            assert run["joinkit"]["grads"] == run["torch"]["grads"], (case, rank)
            assert run["joinkit"]["params"] == run["torch"]["params"], (case, rank)
            assert _deviation(run["joinkit"], run["reference"]) < 1e-5, (case, rank)
            assert _deviation(run["torch"], run["reference"]) < 1e-5, (case, rank)


def test_ddp_zero_over_epochs_matches_the_reference(results: Any) -> None:
    """DDP + ZeRO: the shadow step uses the average but never leaves it in .grad."""
    ranks = outcome(results, "ddp_zero_epochs")
    # 3 optimizers x 2 loop orders, gradient_as_bucket_view, the replay (with and without)
    assert len(ranks[0]) == 9
    for case in ranks[0]:
        assert_identical([r[case]["joinkit"]["params"] for r in ranks])
        for rank, got in enumerate(ranks):
            run = got[case]
            assert _deviation(run["joinkit"]["params"], run["reference"]["params"]) < 1e-5, (
                case, rank)
            assert _deviation(run["joinkit"]["grads"], run["reference"]["grads"]) < 1e-6, (
                case, rank)
    # torch's own combination steps joined shards with stale gradients; its
    # results are recorded, not asserted.


def test_zero_alone_does_not_deadlock(results: Any) -> None:
    ranks = outcome(results, "zero_alone")
    assert [r["steps"] for r in ranks] == [2 + rank for rank in range(WORLD)]
    assert_identical([r["params"] for r in ranks])


def test_throw_mode_raises_torchs_messages(results: Any) -> None:
    ranks = outcome(results, "ddp_throw")
    assert ranks[0]["message"] == "Rank 0 exhausted all inputs."
    for rank in ranks[1:]:
        assert rank["message"] == ACTIVE_MESSAGE
    assert [r["iterations"] for r in ranks] == [5] * WORLD
    assert all(r["type"] == "EarlyTermination" for r in ranks)  # a RuntimeError


def test_enable_false_sends_no_join_collectives(results: Any) -> None:
    ranks = outcome(results, "ddp_disabled")
    for rank in ranks:
        assert rank["inside"] == rank["baseline"]
        assert rank["inside"]["all_reduce_calls"] == 0
    assert_identical([r["grad"] for r in ranks])


def test_ddp_sends_no_join_collectives_after_the_block(results: Any) -> None:
    for rank in outcome(results, "ddp_after_exit"):
        assert rank["joinkit"] == rank["baseline"]  # DDP's own bucket all-reduce only
        assert rank["config"] == [False, False, False]
        assert rank["router_removed"]
        # torch's Join leaves DDP paying a heartbeat and a grad-sync check.
        assert rank["torch"]["collectives"] > rank["baseline"]["collectives"]


def test_ddp_no_sync_with_uneven_inputs(results: Any) -> None:
    """Gradient accumulation: joined ranks shadow only the syncing rounds."""
    ranks = outcome(results, "ddp_no_sync")
    assert_identical([r["joinkit"]["params"] for r in ranks])
    assert_identical([r["one"]["params"] for r in ranks])
    for rank in ranks:
        assert rank["joinkit"]["params"] == pytest.approx(rank["torch"]["params"])
        assert rank["one"]["params"] == pytest.approx(rank["torch"]["params"])
    # One-collective path: the heartbeat rides in DDP's gradient-sync check:
    # one collective fewer per iteration (7), less joinkit's agreement check
    # (one all-reduce of a digest of the settings).
    # Default path: it rides in the gradient all-reduce: nothing per iteration
    # (7 fewer again), the last count being the last round's first bucket,
    # less the post hook's all-reduce of the inputs (torch's last joiners).
    for rank in ranks:
        assert rank["torch"]["collectives"] - rank["one"]["collectives"] == 7 - 1
        assert rank["one"]["collectives"] - rank["joinkit"]["collectives"] == 7 - 1


def test_ddp_find_unused_parameters(results: Any) -> None:
    assert_identical([r["params"] for r in outcome(results, "ddp_find_unused")])


def test_ddp_with_batchnorm_buffers(results: Any) -> None:
    assert_identical([r["params"] for r in outcome(results, "ddp_buffers")])


def test_ddp_buffers_come_from_torchs_source_rank_with_fewer_collectives(
        results: Any) -> None:
    ranks = outcome(results, "ddp_buffer_source")
    for rank in ranks:
        assert rank["joinkit"]["heartbeat"] == "fused"  # buffers rule the round path out
        # Every parameter and running statistic equals torch's Join's, bit for bit.
        assert rank["joinkit"]["state"] == rank["torch"]["state"]
        # torch asks once per round (5) and in its final-model sync; joinkit on
        # entry and when a rank joined (the sum went 3, 2, 1), and in that sync.
        assert rank["torch"]["calls"] == 5 + 1
        assert rank["joinkit"]["calls"] == 3 + 1
    assert_identical([r["joinkit"]["state"] for r in ranks])


def test_mixed_with_a_joinkit_joinable_in_either_order(results: Any) -> None:
    ranks = outcome(results, "mixed_joinables")
    inputs = [3 + rank for rank in range(WORLD)]
    for key in ("counter_first=True", "counter_first=False"):
        assert [r[key]["count"] for r in ranks] == [
            sum(min(n, inputs[rank]) for n in inputs) for rank in range(WORLD)
        ]
        assert_identical([r[key]["params"] for r in ranks])


def test_a_failing_rank_is_reported_to_its_peers(results: Any) -> None:
    ranks = outcome(results, "peer_failure")
    assert ranks[1]["type"] == "ValueError"
    for rank in (ranks[0], ranks[2]):
        assert rank["type"] == "PeerFailure"
        assert "rank 1" in rank["message"] and "bad batch on rank 1" in rank["message"]


def test_a_rank_failing_inside_ddp_forward_is_reported_to_its_peers(results: Any) -> None:
    ranks = outcome(results, "peer_failure_in_forward")
    assert ranks[1]["type"] == "ValueError"
    assert ranks[1]["iterations"] == 2
    for rank in (ranks[0], ranks[2]):
        assert rank["type"] == "PeerFailure"
        assert "bad forward on rank 1" in rank["message"]


# -- bad input ----------------------------------------------------------------------------


def test_bad_input_is_a_clear_error(results: Any) -> None:
    for rank in outcome(results, "bad_input"):
        assert rank["no_init"]["type"] == "LocalProtocolError"
        assert "Joinable.__init__" in rank["no_init"]["message"]
        assert rank["two_groups"]["type"] == "ValueError"
        assert "multiple process groups" in rank["two_groups"]["message"]
        assert rank["zero_before_ddp"]["type"] == "ValueError"
        assert rank["zero_before_ddp"]["message"].startswith(
            "Join lists the ZeroRedundancyOptimizer (joinable 0) before the "
            "DistributedDataParallel model (joinable 1): list the model first, "
            "Join([model, optimizer])")
        assert rank["destroyed"]["type"] == "LocalProtocolError"
        assert "not a live group" in rank["destroyed"]["message"]


def test_uninitialised_torch_distributed_is_a_clear_error(results: Any) -> None:
    for rank in outcome(results, "pre_init_uninitialised"):
        for key in ("join", "group"):
            assert rank[key]["type"] == "LocalProtocolError"
            assert "init_process_group" in rank[key]["message"]


def test_nested_join_over_one_ddp_is_refused(results: Any) -> None:
    for rank in outcome(results, "ddp_nested"):
        assert rank["type"] == "LocalProtocolError"
        assert "nested" in rank["message"]


# -- interoperability with torch's Join ------------------------------------------------------


def test_torch_join_and_joinkit_join_share_a_group(results: Any) -> None:
    """Rank 0 runs torch's Join, the others joinkit's; either side may have more inputs."""
    for rank in outcome(results, "interop_counter"):
        assert len(rank) == 4
        for case in rank.values():
            assert [case["count"], case["max_count"]] == case["expected"]


def test_a_torch_joinable_may_notify_joinkits_join(results: Any) -> None:
    for rank in outcome(results, "torch_joinable_notifies_joinkit_join"):
        assert rank["joinkit"] == rank["expected"]
        assert rank["torch"] == rank["expected"]
        assert rank["outside"] is None
        assert rank["foreign"]["type"] == "LocalProtocolError"
        assert "not joinkit's" in rank["foreign"]["message"]
        assert rank["fused"]["type"] == "LocalProtocolError"
        assert "Join.fused_heartbeat got JoinkitNamedCounter" in rank["fused"]["message"]


def test_torch_join_and_joinkit_join_share_a_ddp(results: Any) -> None:
    ranks = outcome(results, "interop_ddp")
    for key in ("rank0_fewest", "rank0_most"):
        assert_identical([r[key] for r in ranks])


# -- TorchGroup ------------------------------------------------------------------------------


def test_torch_group_collectives(results: Any) -> None:
    ranks = outcome(results, "torch_group_collectives")
    w = WORLD
    for r, got in enumerate(ranks):
        assert (got["rank"], got["world_size"]) == (r, w)
        assert got["sum_tensor"] == [w * (w + 1) / 2, 2.0 * w]
        assert got["sum_numpy"] == [w * (w + 1) / 2]
        assert got["prod_numpy"] == [6.0]  # 1 * 2 * 3
        assert (got["min_numpy"], got["max_numpy"]) == ([1.0], [float(w)])
        assert got["band_int"] == [1 & 2 & 3, 7]
        assert got["bor_int"] == [1 | 2 | 3, 7]
        assert got["bxor_int"] == [1 ^ 2 ^ 3, 7]
        assert got["sum_bool"] == [True, True, False]  # logical or
        assert got["band_bool"] == [False, True, False]
        assert got["bxor_bool"] == [True, True, False]  # one True at index 0, three at 1
        assert got["complex_sum"] == [[w, 2.0 * w], [0.0, w * (w - 1) / 2]]
        assert got["strided"] == [[0.0, 18.0], [6.0, 24.0], [12.0, 30.0]]
        assert got["async_all_reduce"] == [0.0 + 1.0 + 2.0]
        assert got["async_is_completed"] is True
        assert got["broadcast"] == [w - 1, w - 1]
        assert got["all_gather"] == [[k, 10 * k] for k in range(w)]
        assert got["all_gather_numpy_type"] == "ndarray"
        assert got["all_gather_into"] == [[[k + first] * 3 for k in range(w)] for first in (1, 5)] \
            + [[[k + 9] * 2 for k in range(w)]]
        assert got["gather"] == ([[k * 1.5] for k in range(w)] if r == 1 else None)
        assert got["reduce"] == ([float(w)] if r == 0 else [float(r + 1)])
        assert got["scatter"] == [float(r), float(r)]
        assert got["scatter_stacked"] == [2.0 * r, 2.0 * r + 1]
        assert got["objects"] == [{"rank": k} for k in range(w)]
        assert got["count"] == 1.0
        assert got["heartbeat_total"] == float(w)
        assert got["errors"] == {
            "bad_op": "ValueError",
            "bitwise_float": "TypeError",
            "bad_root": "ValueError",
            "bad_buffer": "TypeError",
        }
        assert got["equals_process_group"] is True
        assert got["protocols"] is True


def test_a_rebuilt_group_never_reads_a_late_collective_of_the_old_one(results: Any) -> None:
    # Heartbeats of 20 and 30 per rank on the new group (3 ranks), read before
    # and after the old group's pending collectives completed (1 + 1 + 5 each).
    ranks = outcome(results, "rebuilt_group_keeps_late_collectives_out")
    for r in ranks:
        assert r["before"] == [60.0, 90.0]
        assert r["after"] == r["before"]
        assert r["count"] == 300.0
        assert r["tensor"] == [6.0] * 4
        assert r["array"] == [9.0] * 4
    assert ranks[2]["old_totals"] == [7.0, 7.0, 7.0]


def test_object_collectives_and_long_waits(results: Any) -> None:
    ranks = outcome(results, "object_collectives_and_long_waits")
    for r, got in enumerate(ranks):
        assert got["agree_same"] is True and got["agree_differ"] is False
        if r == 1:
            assert got["gathered"] == [{"rank": k, "pad": "x" * 100 * k} for k in range(WORLD)]
        else:
            assert got["gathered"] is None
        assert got["broadcast"] == ["from", 2]  # a tuple, through JSON
        assert got["total"] == float(WORLD)
        assert got["helpers"] == 0  # the waits never started a store helper thread
        if r:  # its count waited for rank 0 for seconds: the watcher runs
            assert got["watcher"] is True
            assert got["aborted"] == "rank 0 aborted the process group: test abort"
            assert got["abort_seconds"] < 6.0
