"""``joinkit.adapters.gather.Gather``: exact per-batch gathering inside a Join.

The scenarios live in ``programs/gather_scenarios.py`` (see its docstring): each
checks every call against a plain concatenation on its own rank and returns a
summary. Here they run on threads (worlds 1 to 3, plus a Hypothesis property
over random worlds, input counts, row counts, dst and joinable order), on real
gloo process groups (2 and 3 processes, one launch each) and under a real
``mpirun`` (2 and 3 ranks, one launch each); the tests compare what the ranks
returned.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import gather_scenarios as gs  # noqa: E402
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import Ctx, run_scenarios, scenario_records
from support.mpi import run_mpi_scenarios

from joinkit import Join  # noqa: E402
from joinkit.adapters.gather import Gather  # noqa: E402
from joinkit.backends.threads import spawn  # noqa: E402

pytest.importorskip("torch.distributed")

WORKER = Path(gs.__file__)
NAMES = [name for name in gs.SCENARIOS if name != "cuda_tensors"]  # test_gather_cuda.py
LAUNCH_TIMEOUT = 150.0


# -- what every backend must show ----------------------------------------------------------


# -- threads -----------------------------------------------------------------------------


def on_threads(name: str, world: int) -> list[Any]:
    def worker(group: Any) -> Any:
        return gs.SCENARIOS[name](Ctx(group.rank, group.world_size, group))

    return spawn(worker, world, timeout=60)


@pytest.mark.parametrize(("name", "world"), [
    (name, world) for name in NAMES for world in (1, 2, 3)
    if not (name == "mismatch" and world == 1)  # a mismatch needs two ranks
])
def test_threads(name: str, world: int) -> None:
    gs.check(name, on_threads(name, world), world)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), world=st.integers(1, 4))
def test_property_matches_a_plain_concatenation(data: st.DataObject, world: int) -> None:
    """Random worlds, input counts (0 included), rows per rank and call (0
    included), dst and joinable order: every call returns the concatenation of
    the active ranks' rows, in rank order."""
    inputs = data.draw(st.lists(st.integers(0, 4), min_size=world, max_size=world))
    table = data.draw(st.lists(st.lists(st.integers(0, 4), min_size=4, max_size=4),
                               min_size=world, max_size=world))
    dst = data.draw(st.one_of(st.none(), st.integers(0, world - 1)))
    first, keep = data.draw(st.booleans()), data.draw(st.booleans())

    def worker(group: Any) -> Any:
        return gs.run_gather_loop(group, inputs, dst=dst, first=first, keep=keep,
                                  rows=lambda r, c: table[r][c])

    results = spawn(worker, world, timeout=60)
    for rank, result in enumerate(results):
        receives = dst in (None, rank)
        kept = 1000 if keep and receives and any(inputs) else 0
        assert result["checked"] == (inputs[rank] if receives else 0) + kept
    assert len({r["capacity"] for r in results}) == 1  # the same on every rank


def test_one_collective_per_call_once_the_capacity_is_known() -> None:
    """As the first joinable, a call after the first is one all-gather (header,
    heartbeat and data), on active and joined ranks alike."""

    def worker(group: Any) -> Any:
        gather = Gather(group)
        issued = []
        with Join([gather]):
            for call in range(4 if group.rank else 0):
                before = group.collectives_issued
                gather(np.ones((3 if call < 3 else 2, 2)))
                issued.append(group.collectives_issued - before)
        return issued, group.collectives_issued

    (zero, total0), (ones, total1) = spawn(worker, 2)
    assert zero == [] and ones == [2, 1, 1, 1]
    assert total0 == total1  # the joined rank shadowed every one of them


def test_dst_receives_and_others_get_none() -> None:
    def worker(group: Any) -> Any:
        gather = Gather(group, dst=1)
        with Join([gather]):
            got = gather(np.full(group.rank + 1, group.rank))
        return None if got is None else got.tolist()

    assert spawn(worker, 3) == [None, [0, 1, 1, 2, 2, 2], None]


def test_a_joinable_that_is_not_in_the_join_is_refused() -> None:
    from joinkit import LocalProtocolError

    def worker(group: Any) -> Any:
        other, gather = Gather(group), Gather(group)
        with Join([other]):
            try:
                gather(np.zeros(1))
            except LocalProtocolError as exc:
                return str(exc)
        return None

    messages = spawn(worker, 2)
    assert all("does not include it" in m for m in messages)


def test_group_of_another_kind_is_refused() -> None:
    with pytest.raises(TypeError, match="got None"):
        Gather(None)
    with pytest.raises(TypeError, match="no backend"):
        Gather(object())


# -- real processes: gloo and mpirun ------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3])
def gloo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[int, dict[str, list[dict[str, Any]]]]:
    world = request.param
    out = tmp_path_factory.mktemp(f"gather_gloo{world}")
    return world, run_scenarios(WORKER, world, out, NAMES, LAUNCH_TIMEOUT, before=["gloo"])


@pytest.mark.launches
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize("name", NAMES)
def test_gloo(gloo: tuple[int, dict[str, list[dict[str, Any]]]], name: str) -> None:
    world, records = gloo
    results = [r["result"] for r in scenario_records(records, name)]
    gs.check(name, results, world)
    if name == "fresh_results":
        assert all(r["into"] for r in results)  # a TorchGroup has all_gather_into


@pytest.fixture(scope="module", params=[2, 3])
def mpi(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> tuple[int, dict[str, list[dict[str, Any]]]]:
    pytest.importorskip("mpi4py")
    world = request.param
    out = tmp_path_factory.mktemp(f"gather_mpi{world}")
    return world, run_mpi_scenarios(WORKER, world, out, NAMES, LAUNCH_TIMEOUT, "mpi")


@pytest.mark.launches
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize("name", NAMES)
def test_mpi(mpi: tuple[int, dict[str, list[dict[str, Any]]]], name: str) -> None:
    world, records = mpi
    results = [r["result"] for r in scenario_records(records, name)]
    gs.check(name, results, world)
    if name == "fresh_results":
        assert all(r["into"] for r in results)  # an MPIGroup has all_gather_into


def test_the_device_path_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path CUDA tensors take (bytes as a torch tensor on the group's device,
    headers read back with torch), forced for CPU tensors so it runs here too."""
    from joinkit.adapters import gather as gather_module

    check_layout = gather_module._check

    def on_device(arrays: Any, settings: Any) -> Any:
        layout = check_layout(arrays, settings)
        layout.wire_torch = layout.torch
        return layout

    monkeypatch.setattr(gather_module, "_check", on_device)

    def worker(group: Any) -> Any:
        return gs.run_gather_loop(group, [2, 4, 0], kind="torch", keep=True)

    results = spawn(worker, 3)
    assert [r["checked"] for r in results] == [1002, 1004, 1000]


@pytest.mark.launches
def test_the_docs_example_runs_and_prints_what_it_says() -> None:
    """docs/gather.md's code block, run as a program: it prints its comment."""
    import re
    import subprocess

    text = (Path(__file__).resolve().parents[2] / "docs" / "gather.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    said = re.search(r"print\(spawn\(evaluate, 2\)\)  # (.*)", code)
    assert said is not None
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == said.group(1)


def test_keep_a_call_of_zero_rows_is_the_same_everywhere() -> None:
    """Found by the property: a rank that made no call, beside one call of 0 rows,
    gets the same empty arrays (not None) from collected() as the caller."""

    def worker(group: Any) -> Any:
        return gs.run_gather_loop(group, [0, 1], first=False, keep=True,
                                  rows=lambda r, c: 0)

    assert [r["checked"] for r in spawn(worker, 2)] == [1000, 1001]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_keep_across_joins_and_epochs_returns_fresh_copies(kind: str) -> None:
    """keep=True over two Joins (the second with other dtypes' rows: a new
    layout) before one collected(), then a second epoch: each collected() has
    exactly its epoch's rows in call order, later epochs reuse the kept buffer
    without touching what an earlier collected() returned, and writing into a
    returned array changes nothing kept."""
    import torch

    def make(values: Any) -> Any:
        array = np.asarray(values, dtype=np.int64)
        return torch.from_numpy(array) if kind == "torch" else array

    def worker(group: Any) -> Any:
        rank = group.rank
        gather = Gather(group, keep=True)
        with Join([gather]):
            for call in range(2 + rank):  # rank 1 makes one call more
                got = gather(make([10 * rank + call] * (rank + 1)))
                got[:] = -1  # the caller's array is its own: collected() is unmoved
        with Join([gather]):
            for call in range(1 if rank else 2):
                gather(make([100 + 10 * rank + call]))
        first = gather.collected()
        snapshot = np.array(gs.as_numpy(first))
        with Join([gather]):
            for call in range(3 if rank == 0 else 1):
                gather(make([200 + 10 * rank + call] * 40000))  # grows the buffer
        second = gather.collected()
        return gs.as_numpy(first), snapshot, gs.as_numpy(second), gather.collected()

    results = spawn(worker, 2)
    want_first = [0, 10, 10, 1, 11, 11, 12, 12, 100, 110, 101]
    want_second = [200] * 40000 + [210] * 40000 + [201] * 40000 + [202] * 40000
    for first, snapshot, second, third in results:
        assert first.tolist() == want_first and snapshot.tolist() == want_first
        assert second.tolist() == want_second
        assert third is None  # nothing kept since the last collected()
