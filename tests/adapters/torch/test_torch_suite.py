"""torch's own DDP join tests, run with torch's Join and with joinkit's, on CPU/gloo.

``programs/torch_suite_runner.py`` (see its docstring for the shims) runs the
tests of torch's ``distributed_test.py`` and ``ddp_under_dist_autograd_test.py``
that use ``DistributedDataParallel.join()``. Each (mode, suite, world size) is
one launch of one process per rank that runs all its tests in a row; the tests
below assert on what every rank recorded. ``torch`` is the baseline;
``joinkit`` makes ``torch.nn.parallel.distributed.Join`` joinkit's ``Join``,
so ``DDP.join()`` builds it and DDP's forward notifies it, as for a user who
switches DDP over; each rank records which Join classes its tests entered.
The selected tests' launches run two at a time, in the order the tests read
them: one launch leaves about a third of two cores idle (its ranks wait on one
another).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support import launch_ranks, read_jsonl

pytest.importorskip("torch.distributed")

RUNNER = Path(__file__).parent / "programs" / "torch_suite_runner.py"
LAUNCH_TIMEOUT = 420.0  # one launch, all its tests (about a minute here)
# torch 2.13's gloo can deadlock at the end of torch's own ddp_under_dist_autograd
# tests (seen once in ~10 full runs, in torch's own Join mode): the main thread,
# holding the GIL, destroys a DDP Reducer's ProcessGroupGloo and joins its worker
# thread, while the worker, destroying a finished all-reduce's work, waits for the
# GIL to release a tensor (py-spy: ~ProcessGroupGloo <- Reducer dealloc on the
# main thread; ~AsyncAllreduceWork in gil_scoped_acquire on the worker). An rpc
# launch therefore has a shorter limit and, killed at it, is retried once, saying so.
RPC_LAUNCH_TIMEOUT = 240.0
RPC_ATTEMPTS = 2
pytestmark = [pytest.mark.needs_torch, pytest.mark.launches,
              pytest.mark.timeout(max(LAUNCH_TIMEOUT, RPC_ATTEMPTS * RPC_LAUNCH_TIMEOUT) + 60)]

MODES = ("torch", "joinkit")


def _in_this_torch(test: str) -> bool:
    """Whether this torch's ``distributed_test.py`` has ``test`` (torch 2.13 added
    test_ddp_join_respects_forward_sync_buffers_false; older releases run the rest)."""
    spec = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test")
    return spec is not None and spec.origin is not None and \
        f"def {test}(" in Path(spec.origin).read_text()


DDP_TESTS = tuple(test for test in (
    "test_ddp_uneven_inputs",
    "test_ddp_join_model_equivalence",
    "test_ddp_grad_div_uneven_inputs",
    "test_ddp_uneven_input_join_disable",
    "test_ddp_uneven_input_exception",
    "test_ddp_uneven_inputs_stop_iteration_sync_bn",
    "test_ddp_join_respects_forward_sync_buffers_false",
) if _in_this_torch(test))
# ddp_under_dist_autograd_test.py's uneven-input tests (RPC + dist autograd).
# Each RPC test gets processes of its own, as in torch's harness (the runner's
# docstring says why).
RPC_COMPARISON_TESTS = ("test_ddp_comparison_uneven_inputs",)
# The harness's own check of its SyncBatchNorm stand-in (not one of torch's tests).
SHIM_CHECK = "check_sync_batch_norm_stand_in"
RPC_TESTS = ("test_backward_ddp_outside_uneven_inputs",)
# (suite, world size) -> the tests of that launch. The rpc suite's world is its
# trainers (the DDP world) plus a remote worker and a master; its 16 examples
# must split evenly among the trainers, so 2 and its native 4 (not 3).
LAUNCHES = {
    ("ddp", 2): (SHIM_CHECK, *DDP_TESTS),
    ("ddp", 3): (SHIM_CHECK, *DDP_TESTS),
    ("rpc_comparison", 2): RPC_COMPARISON_TESTS,
    ("rpc_comparison", 3): RPC_COMPARISON_TESTS,
    ("rpc", 4): RPC_TESTS,
    ("rpc", 6): RPC_TESTS,
}
# Tests in which some rank runs out of inputs first, so joined ranks shadow.
UNEVEN = {
    "test_ddp_uneven_inputs",
    "test_ddp_join_model_equivalence",
    "test_ddp_grad_div_uneven_inputs",
    "test_ddp_join_respects_forward_sync_buffers_false",
    "test_ddp_comparison_uneven_inputs",
    "test_backward_ddp_outside_uneven_inputs",
}
JOIN_CLASS = {
    "torch": "torch.distributed.algorithms.join.Join",
    "joinkit": "joinkit._join.Join",
}

def launch(mode: str, suite: str, world: int, out: Path) -> dict[str, Any]:
    """Run one launch; return its records and logs."""
    rpc = suite.startswith("rpc")
    start = time.monotonic()
    for attempt in range(1, (RPC_ATTEMPTS if rpc else 1) + 1):
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        runs = launch_ranks(
            [[sys.executable, str(RUNNER), mode, suite, str(rank), str(world),
              str(out / "store"), str(out), *LAUNCHES[suite, world]] for rank in range(world)],
            RPC_LAUNCH_TIMEOUT if rpc else LAUNCH_TIMEOUT,
        )
        if not any("[test] killed after" in run.stdout for run in runs):
            break
        print(f"\n[torch suite] {mode} {suite} world {world}: attempt {attempt} killed at "
              "its limit (torch's gloo teardown deadlock, see RPC_LAUNCH_TIMEOUT)")
    logs = [run.stdout for run in runs]
    records = [{r["test"]: r for r in read_jsonl(out / f"rank{rank}.jsonl")}
               for rank in range(world)]
    result = {"records": records, "logs": logs, "seconds": time.monotonic() - start}
    print(f"\n[torch suite] {mode} {suite} world {world}: {result['seconds']:.1f} s")
    return result


#: The launches the anchor (torch's own Join) runs: the smallest world of each
#: suite. The anchor shows that the harness runs torch's tests as torch's own
#: harness does (they pass on torch's Join); joinkit runs every launch. The
#: larger worlds on torch's Join added nothing the smaller ones do not show,
#: for ~80 s of CI.
ANCHOR_LAUNCHES = {("ddp", 2), ("rpc_comparison", 2), ("rpc", 4)}


def _cases() -> list[Any]:
    return [
        pytest.param(mode, suite, world, test, id=f"{mode}-{suite}{world}-{test}")
        for mode in MODES
        for (suite, world), tests in LAUNCHES.items()
        if mode == "joinkit" or (suite, world) in ANCHOR_LAUNCHES
        for test in tests
        if test != SHIM_CHECK
    ]


Key = tuple[str, str, int]  # (mode, suite, world)


@pytest.fixture(scope="module")
def launches(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[Key, Future[dict[str, Any]]]]:
    """The selected tests' launches, started two at a time in the order the tests
    read them (each once): (mode, suite, world) -> its result."""
    order: list[Key] = []
    for item in request.session.items:
        params = getattr(item, "callspec", None)
        if item.module is not request.module or params is None:
            continue
        p = params.params
        key = ("joinkit", "ddp", p["world"]) if "mode" not in p else (
            p["mode"], p["suite"], p["world"])
        if key not in order:
            order.append(key)
    root = tmp_path_factory.getbasetemp()
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="torch-suite")
    started = {key: pool.submit(launch, *key, root / f"torch_suite_{key[0]}_{key[1]}{key[2]}")
               for key in order}
    yield started
    pool.shutdown(wait=True, cancel_futures=True)  # those not started, after a failure


def _records(
    launches: dict[Key, Future[dict[str, Any]]], mode: str, suite: str, world: int, test: str
) -> list[dict[str, Any]]:
    """Every rank's record of ``test``; fails with the logs if a rank has none."""
    result = launches[mode, suite, world].result()
    missing = [rank for rank, r in enumerate(result["records"]) if test not in r]
    if missing:
        logs = "\n".join(f"--- rank {rank}\n{log[-3000:]}" for rank, log in
                         enumerate(result["logs"]))
        pytest.fail(f"{test} did not finish on ranks {missing}:\n{logs}")
    return [r[test] for r in result["records"]]


def expected_sub_cases(world: int) -> int:
    """test_ddp_uneven_inputs: 7 models (no torchvision here) × 3 variants
    (plain, no_sync, throw) × 6 iteration mappings per number of early joiners
    (one; and two where the world has more than two ranks)."""
    return 7 * 3 * 6 * (1 if world == 2 else 2)


@pytest.mark.parametrize("world", [2, 3])
def test_the_sync_batch_norm_stand_in_is_batch_norm_over_the_world(
    launches: dict[Key, Future[dict[str, Any]]], world: int
) -> None:
    # The check runs first in either mode's launch; joinkit's has every world.
    records = _records(launches, "joinkit", "ddp", world, SHIM_CHECK)
    failures = [f"--- rank {rank}\n{r['error']}" for rank, r in enumerate(records) if not r["ok"]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(("mode", "suite", "world", "test"), _cases())
def test_torch_ddp_join_test(
    launches: dict[Key, Future[dict[str, Any]]], mode: str, suite: str, world: int, test: str
) -> None:
    records = _records(launches, mode, suite, world, test)
    failures = [
        f"--- rank {rank}\n{r['error']}" for rank, r in enumerate(records) if not r["ok"]
    ]
    assert not failures, f"{test} ({mode} Join, world {world}) failed:\n" + "\n".join(failures)
    if test == "test_ddp_uneven_inputs":
        assert [r["subcases"] for r in records] == [expected_sub_cases(world)] * world


@pytest.mark.parametrize(("mode", "suite", "world", "test"), _cases())
def test_the_join_of_the_mode_ran_in_every_rank(
    launches: dict[Key, Future[dict[str, Any]]], mode: str, suite: str, world: int, test: str
) -> None:
    """Every rank that trains entered only the mode's Join class, through DDP.join()."""
    records = _records(launches, mode, suite, world, test)
    trainers = records[: world - 2] if suite == "rpc" else records
    for rank, record in enumerate(trainers):
        assert record["entered"] == [mode], (rank, record)
        assert record["enters"] >= 1, (rank, record)
        assert record["join_class"] == JOIN_CLASS[mode], (rank, record)
    for record in records[len(trainers):]:  # the RPC suite's remote worker and master
        assert record["enters"] == 0
    shadowed = sum(r["shadow_rounds"] for r in records)
    if mode == "joinkit" and test in UNEVEN:
        assert shadowed > 0  # joined ranks shadowed through joinkit's machine
    if mode == "torch":
        assert shadowed == 0
