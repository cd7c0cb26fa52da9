"""Tests of ``backends.threads``: the collectives, the join backend, the harness.

Expected values come from NumPy (bool reductions from the logical ufuncs, to
pin the documented OR/AND/XOR meaning). Every multi-rank test passes a small
``timeout`` to ``spawn`` so a regression fails fast instead of hanging.
"""

from __future__ import annotations

import functools
import math
import pickle
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import support
import torch
from support import Counter, count_inputs

from joinkit import (
    CollectiveMismatch,
    Join,
    PeerError,
    PeerFailure,
    RankTimeout,
    backends,
)
from joinkit.backends.threads import SpawnAborted, ThreadGroup, ThreadWork, spawn
from joinkit.backends.threads._world import _root_cause

TIMEOUT = 10.0
WORLD_SIZES = [1, 2, 4]
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.bool_]
THIS_FILE = Path(__file__).name
SUPPORT_FILE = Path(support.__file__).name


def lineno() -> int:
    """The caller's current line (to find a call site in an error table)."""
    return sys._getframe(1).f_lineno


def contribution(rank: int, dtype: Any, shape: tuple[int, ...] = (3, 2)) -> np.ndarray:
    """Rank ``rank``'s deterministic input."""
    rng = np.random.default_rng(1000 + rank)
    if dtype is np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-4, 5, shape).astype(dtype)
    return rng.uniform(0.5, 2.0, shape).astype(dtype)


_NUMERIC = {
    "sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}
# Bool buffers follow torch and MPI: sum/max/bor are OR, prod/min/band AND.
_LOGICAL = {
    "sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
    "prod": np.logical_and, "min": np.logical_and, "band": np.logical_and,
    "bxor": np.logical_xor,
}


def expected_reduction(op: str, dtype: Any, world_size: int) -> np.ndarray:
    ufunc = _LOGICAL[op] if dtype is np.bool_ else _NUMERIC[op]
    parts = [contribution(r, dtype) for r in range(world_size)]
    return np.asarray(functools.reduce(ufunc, parts), dtype=dtype)


def assert_same(actual: Any, expected: np.ndarray) -> None:
    if isinstance(actual, torch.Tensor):
        actual = actual.numpy()
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    if expected.dtype.kind == "f":
        np.testing.assert_allclose(actual, expected, rtol=1e-6)
    else:
        np.testing.assert_array_equal(actual, expected)


def valid_reductions() -> list[tuple[str, Any]]:
    return [
        (op, dtype)
        for dtype in DTYPES
        for op in backends.REDUCE_OPS
        if not (np.dtype(dtype).kind == "f" and op in ("band", "bor", "bxor"))
    ]


# -- collectives against NumPy ------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(("op", "dtype"), valid_reductions())
def test_all_reduce_and_reduce_match_numpy(world_size: int, op: str, dtype: Any) -> None:
    expected = expected_reduction(op, dtype, world_size)

    def rank_fn(group: ThreadGroup) -> None:
        mine = contribution(group.rank, dtype)
        buf = mine.copy()
        assert group.all_reduce(buf, op=op) is buf  # in place, returns buf
        assert_same(buf, expected)
        for dst in range(world_size):
            buf = mine.copy()
            assert group.reduce(buf, dst=dst, op=op) is buf
            # Only dst receives; the others keep their input.
            assert_same(buf, expected if group.rank == dst else mine)

    spawn(rank_fn, world_size, timeout=TIMEOUT)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_data_movement_matches_numpy(world_size: int, dtype: Any) -> None:
    everyone = [contribution(r, dtype) for r in range(world_size)]

    def rank_fn(group: ThreadGroup) -> None:
        rank = group.rank
        for src in range(world_size):
            buf = everyone[rank].copy()
            assert group.broadcast(buf, src=src) is buf
            assert_same(buf, everyone[src])

        gathered = group.all_gather(everyone[rank].copy())
        assert len(gathered) == world_size
        for got, want in zip(gathered, everyone, strict=True):
            assert_same(got, want)

        for dst in range(world_size):
            result = group.gather(everyone[rank].copy(), dst=dst)
            if rank == dst:
                assert len(result) == world_size
                for got, want in zip(result, everyone, strict=True):
                    assert_same(got, want)
            else:
                assert result is None

        for src in range(world_size):
            # chunks[r] for rank r, as a list and as one stacked buffer.
            chunks = [contribution(100 * src + r, dtype) for r in range(world_size)]
            for given in (chunks, np.stack(chunks)):
                buf = np.zeros_like(everyone[rank])
                sent = given if rank == src else None
                assert group.scatter(buf, src=src, chunks=sent) is buf
                assert_same(buf, chunks[rank])

    spawn(rank_fn, world_size, timeout=TIMEOUT)


def test_all_gather_returns_independent_buffers() -> None:
    def rank_fn(group: ThreadGroup) -> list[float]:
        parts = group.all_gather(np.full(2, group.rank, dtype=np.float64))
        parts[0][:] = -1.0  # must not leak into another rank's list
        group.barrier()
        return [float(p[0]) for p in parts]

    results = spawn(rank_fn, 3, timeout=TIMEOUT)
    for rank_result in results:
        assert rank_result == [-1.0, 1.0, 2.0]


@pytest.mark.parametrize("shape", [(), (0,), (2, 3, 4)])
def test_zero_dim_and_empty_buffers(shape: tuple[int, ...]) -> None:
    def rank_fn(group: ThreadGroup) -> np.ndarray:
        buf = np.full(shape, group.rank + 1, dtype=np.int64)
        group.all_reduce(buf, op="prod")
        return buf

    for buf in spawn(rank_fn, 3, timeout=TIMEOUT):
        assert buf.shape == shape
        np.testing.assert_array_equal(buf, np.full(shape, 6))


def test_non_contiguous_numpy_buffer_is_updated_in_place() -> None:
    def rank_fn(group: ThreadGroup) -> np.ndarray:
        base = np.zeros((4, 4), dtype=np.float32)
        view = base[::2, 1:3]  # strided view
        view[:] = group.rank + 1
        group.all_reduce(view)
        return base

    for base in spawn(rank_fn, 2, timeout=TIMEOUT):
        expected = np.zeros((4, 4), dtype=np.float32)
        expected[::2, 1:3] = 3.0
        np.testing.assert_array_equal(base, expected)


def test_barrier_waits_for_every_rank() -> None:
    arrived = [False] * 4

    def rank_fn(group: ThreadGroup) -> bool:
        if group.rank == 3:
            time.sleep(0.05)  # the last to arrive
        arrived[group.rank] = True
        group.barrier()
        return all(arrived)

    assert spawn(rank_fn, 4, timeout=TIMEOUT) == [True] * 4


# -- torch CPU tensors --------------------------------------------------------------


def test_torch_tensors_are_updated_in_place() -> None:
    def rank_fn(group: ThreadGroup) -> None:
        rank, size = group.rank, group.world_size
        t = torch.full((3,), float(rank + 1))
        before = t.data_ptr()
        assert group.all_reduce(t) is t
        assert t.data_ptr() == before
        assert torch.equal(t, torch.full((3,), float(sum(range(1, size + 1)))))

        # A view: the base tensor sees the result.
        base = torch.zeros(5, dtype=torch.int64)
        view = base[1:4]
        view.fill_(rank + 1)
        group.all_reduce(view, op="max")
        assert base.tolist() == [0, size, size, size, 0]

        # A leaf that requires grad stays a leaf that requires grad.
        p = torch.ones(2, requires_grad=True)
        group.all_reduce(p)
        assert p.requires_grad and p.is_leaf
        assert p.detach().tolist() == [float(size)] * 2

        b = torch.tensor([rank == 0, True])
        group.all_reduce(b, op="min")
        assert b.tolist() == [size == 1, True]

        src_value = torch.arange(4, dtype=torch.float64) * 10
        got = src_value.clone() if rank == 0 else torch.zeros(4, dtype=torch.float64)
        group.broadcast(got, src=0)
        assert torch.equal(got, src_value)

        parts = group.all_gather(torch.tensor([rank], dtype=torch.int32))
        assert all(isinstance(p, torch.Tensor) and p.dtype == torch.int32 for p in parts)
        assert [int(p) for p in parts] == list(range(size))

        gathered = group.gather(torch.tensor([rank * 2.0]), dst=size - 1)
        if rank == size - 1:
            assert [float(p) for p in gathered] == [2.0 * r for r in range(size)]
        else:
            assert gathered is None

        into = torch.zeros(2)
        chunks = [torch.full((2,), float(r)) for r in range(size)] if rank == 0 else None
        assert group.scatter(into, src=0, chunks=chunks) is into
        assert into.tolist() == [float(rank)] * 2

        acc = torch.full((2,), float(rank))
        work = group.reduce(acc, dst=0, async_op=True)
        assert work.wait() is acc
        if rank == 0:
            assert acc.tolist() == [float(sum(range(size)))] * 2

    spawn(rank_fn, 3, timeout=TIMEOUT)


def test_numpy_and_torch_ranks_interoperate() -> None:
    def rank_fn(group: ThreadGroup) -> list[float]:
        if group.rank == 0:
            buf: Any = np.array([1.0, 2.0], dtype=np.float32)
        else:
            buf = torch.tensor([10.0, 20.0], dtype=torch.float32)
        group.all_reduce(buf)
        return [float(x) for x in buf]

    assert spawn(rank_fn, 2, timeout=TIMEOUT) == [[11.0, 22.0]] * 2


# -- async handles ------------------------------------------------------------------


def test_async_contribution_is_snapshotted_at_call_time() -> None:
    def rank_fn(group: ThreadGroup) -> tuple[list[float], list[float]]:
        buf = np.ones(2, dtype=np.float64)
        work = group.all_reduce(buf, async_op=True)
        assert isinstance(work, ThreadWork)
        buf[:] = 1000.0  # reuse the buffer at once; the call already copied it
        assert work.wait() is buf
        first = buf.tolist()
        assert work.wait() is buf  # waiting again returns the same thing
        src = np.full(2, 7.0) if group.rank == 0 else np.zeros(2)
        work = group.broadcast(src, src=0, async_op=True)
        if group.rank == 0:
            src[:] = -1.0  # the source changes its buffer before everyone received
        work.wait()
        return first, src.tolist()

    for rank, (first, received) in enumerate(spawn(rank_fn, 3, timeout=TIMEOUT)):
        assert first == [3.0, 3.0]
        assert received == ([-1.0, -1.0] if rank == 0 else [7.0, 7.0])


def test_many_outstanding_handles_waited_in_any_order() -> None:
    def rank_fn(group: ThreadGroup) -> list[float]:
        bufs = [np.full(1, float(i + group.rank)) for i in range(6)]
        works = [group.all_reduce(b, async_op=True) for b in bufs]
        for work in reversed(works):
            work.wait()
        return [float(b[0]) for b in bufs]

    size = 4
    expected = [float(size * i + sum(range(size))) for i in range(6)]
    assert spawn(rank_fn, size, timeout=TIMEOUT) == [expected] * size


def test_async_wait_returns_what_the_blocking_call_returns() -> None:
    def rank_fn(group: ThreadGroup) -> None:
        rank = group.rank
        buf = np.full(2, rank, dtype=np.int32)
        assert group.all_reduce(buf, op="max", async_op=True).wait() is buf
        assert group.broadcast(buf, src=1, async_op=True).wait() is buf
        assert group.reduce(buf, dst=0, async_op=True).wait() is buf
        parts = group.all_gather(np.array([rank]), async_op=True).wait()
        assert [int(p[0]) for p in parts] == [0, 1]
        gathered = group.gather(np.array([rank]), dst=1, async_op=True).wait()
        assert (gathered is None) == (rank != 1)
        into = np.zeros(1)
        chunks = [np.array([5.0]), np.array([6.0])] if rank == 1 else None
        assert group.scatter(into, src=1, chunks=chunks, async_op=True).wait() is into
        assert into[0] == 5.0 + rank

    spawn(rank_fn, 2, timeout=TIMEOUT)


# -- the join backend ---------------------------------------------------------------


def test_heartbeat_and_count_are_float32_sums_that_match_each_other() -> None:
    def rank_fn(group: ThreadGroup) -> tuple[float, float, float, float]:
        total = group.count(float(group.rank))
        # An active rank's heartbeat is matched by a joined rank's count.
        if group.rank == 0:
            shadowed = group.heartbeat(1.0).wait()
        else:
            shadowed = group.count(0.0)
        # A failed rank's weights (joinkit._machine): its first one swamps the
        # active ranks, a later one rounds away beside them.
        failing = group.count(2.0**53 if group.rank == 1 else 1.0)
        failed = group.count(2.0**-100 if group.rank == 1 else 1.0)
        return total, shadowed, failing, failed

    results = spawn(rank_fn, 3, timeout=TIMEOUT)
    assert results == [(3.0, 1.0, 2.0**53, 2.0)] * 3
    assert all(isinstance(x, float) for row in results for x in row)


def test_all_gather_object_gives_each_rank_its_own_copies() -> None:
    def rank_fn(group: ThreadGroup) -> list[Any]:
        objects = group.all_gather_object({"rank": group.rank, "items": [group.rank]})
        objects[0]["items"].append("mine")  # must not leak into another rank's list
        group.barrier()
        return objects

    results = spawn(rank_fn, 3, timeout=TIMEOUT)
    for objects in results:
        assert [o["rank"] for o in objects] == [0, 1, 2]
        assert objects[0]["items"] == [0, "mine"]
        assert [o["items"] for o in objects[1:]] == [[1], [2]]


def test_all_gather_object_rejects_an_unpicklable_object_before_the_collective() -> None:
    def rank_fn(group: ThreadGroup) -> float:
        with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
            group.all_gather_object(lambda: None)  # would not cross a process either
        return group.count(1.0)

    assert spawn(rank_fn, 2, timeout=TIMEOUT) == [2.0, 2.0]


def test_heartbeat_total_and_collectives_issued() -> None:
    def rank_fn(group: ThreadGroup) -> tuple[float, list[int]]:
        issued = [group.collectives_issued]
        handle = group.heartbeat(1.0)
        group.count(0.0)
        group.all_gather_object(None)
        issued.append(group.collectives_issued)  # join collectives do not count
        group.all_reduce(np.ones(1), async_op=True).wait()
        group.barrier()
        group.broadcast(np.ones(1), src=0)
        issued.append(group.collectives_issued)
        return group.heartbeat_total(handle), issued

    assert spawn(rank_fn, 2, timeout=TIMEOUT) == [(2.0, [0, 0, 3])] * 2


def test_abort_releases_the_other_ranks_naming_the_aborting_rank() -> None:
    def rank_fn(group: ThreadGroup) -> None:
        if group.rank == 0:
            group.abort("a hook failed midway through a shadow round")
            raise ZeroDivisionError("in the hook")
        group.all_reduce(np.ones(2))

    start = time.monotonic()
    with pytest.raises(ZeroDivisionError, match="in the hook") as caught:
        spawn(rank_fn, 3, timeout=30.0)
    assert time.monotonic() - start < 15.0
    notes = getattr(caught.value, "__notes__", [])
    assert notes[0] == "raised on rank 0 (backends.threads.spawn)"
    assert "SpawnAborted on ranks 1, 2" in notes[1]

    def peer_fn(group: ThreadGroup) -> str:
        if group.rank == 0:
            group.abort("stop")
            return ""
        with pytest.raises(SpawnAborted) as info:
            group.barrier()
        return str(info.value)

    messages = spawn(peer_fn, 2, timeout=30.0)
    assert messages[1].startswith("rank 0 aborted the group: stop; rank 1 ")


def test_group_attributes_protocols_and_registry() -> None:
    def rank_fn(group: ThreadGroup) -> tuple[int, int, str, str]:
        assert isinstance(group, backends.CollectiveGroup)
        assert isinstance(group, backends.JoinBackend)
        assert backends.resolve(group) is group
        assert backends.resolve(group, "cpu") is group
        thread = threading.current_thread()
        assert thread.daemon
        return group.rank, group.world_size, group.device, thread.name

    results = spawn(rank_fn, 3, timeout=TIMEOUT)
    assert results == [(r, 3, "cpu", f"joinkit-rank-{r}") for r in range(3)]


def test_spawn_passes_args_and_returns_results_in_rank_order() -> None:
    def rank_fn(group: ThreadGroup, base: int, scale: int) -> int:
        time.sleep(0.01 * (group.world_size - group.rank))  # finish in reverse order
        return base + scale * group.rank

    assert spawn(rank_fn, 4, args=(100, 10), timeout=TIMEOUT) == [100, 110, 120, 130]


def test_spawn_accepts_an_infinite_timeout() -> None:
    def rank_fn(group: ThreadGroup) -> float:
        if group.rank == 0:
            time.sleep(0.05)  # rank 1 really waits
        return group.count(1.0)

    assert spawn(rank_fn, 2, timeout=math.inf) == [2.0, 2.0]


def test_spawn_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        spawn(lambda group: None, 0)
    for timeout in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match="timeout must be a positive"):
            spawn(lambda group: None, 1, timeout=timeout)
    with pytest.raises(TypeError, match="fn must be callable"):
        spawn("not a function", 1)  # type: ignore[arg-type]


@pytest.mark.launches
def test_importing_the_backend_does_not_import_torch() -> None:
    code = (
        "import sys, backends.threads; "
        "assert 'numpy' in sys.modules; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=Path(__file__).resolve().parents[3], timeout=60,
    )
    assert out.stdout.strip() == "False"


def test_a_failure_inside_join_is_reraised_not_the_peers_peer_failure() -> None:
    # The Join's own failure protocol makes the other ranks raise PeerFailure;
    # spawn must still report the original exception.
    def rank_fn(group: ThreadGroup) -> None:
        counter = Counter(group)
        with Join([counter]):
            for i in range(5):
                if group.rank == 1 and i == 2:
                    raise ValueError("bad batch")
                counter()

    with pytest.raises(ValueError, match="bad batch") as caught:
        spawn(rank_fn, 3, timeout=TIMEOUT)
    notes = getattr(caught.value, "__notes__", [])
    assert "raised on rank 1 (backends.threads.spawn)" in notes


def test_join_with_uneven_inputs_runs_on_the_group() -> None:
    def rank_fn(group: ThreadGroup) -> float:
        return count_inputs(group, 5 + group.rank)

    # Rank r processed 5 + r inputs; each iteration counts the active ranks.
    assert spawn(rank_fn, 3, timeout=TIMEOUT) == [15.0, 17.0, 18.0]


# -- local misuse -------------------------------------------------------------------


def _bfloat16() -> Any:
    return torch.zeros(2, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda g: g.all_reduce(np.ones(2), op="avg"), ValueError, "unknown reduce op 'avg'"),
        (lambda g: g.all_reduce(np.ones(2), op="band"), TypeError,
         "op 'band' is not defined for dtype float64: bitwise ops need an integer"),
        (lambda g: g.reduce(np.ones(2, np.complex64), dst=0, op="max"), TypeError,
         "op 'max' is not defined for dtype complex64: complex buffers reduce with 'sum' only"),
        (lambda g: g.all_reduce(np.array(["a"])), TypeError, "the buffer has dtype <U1"),
        (lambda g: g.all_reduce([1.0, 2.0]), TypeError,
         "buffers must be NumPy arrays or torch tensors, got builtins.list"),
        (lambda g: g.all_reduce(np.frombuffer(b"\0" * 16)), ValueError, "read-only"),
        (lambda g: g.broadcast(np.ones(2), src=2), ValueError, r"src=2 is not a rank"),
        (lambda g: g.gather(np.ones(2), dst=-1), ValueError, r"dst=-1 is not a rank"),
        (lambda g: g.broadcast(np.ones(2), src="0"), TypeError, "src must be an int rank"),
        (lambda g: g.all_reduce(_bfloat16()), TypeError, "dtype torch.bfloat16"),
        (lambda g: g.scatter(np.ones(2), src=g.rank), ValueError, "must pass chunks"),
        (lambda g: g.scatter(np.ones(2), src=g.rank, chunks=[np.ones(2)]), ValueError,
         "needs 2 chunks"),
        (lambda g: g.scatter(np.ones(2), src=g.rank, chunks=[np.ones(3)] * 2), ValueError,
         r"chunks\[0\] has shape \(3,\)"),
        (lambda g: g.scatter(np.ones(2), src=g.rank, chunks=np.ones((3, 2))), ValueError,
         r"must have shape \(2, 2\)"),
        (lambda g: g.scatter(np.ones(2), src=g.rank, chunks=[np.ones(2, np.int64)] * 2),
         TypeError, r"chunks\[0\] has dtype int64"),
    ],
)
def test_local_misuse_raises_before_the_collective(call: Any, error: type, match: str) -> None:
    def rank_fn(group: ThreadGroup) -> None:
        with pytest.raises(error, match=match):
            call(group)
        # Nothing was filed: the ranks still agree on their next collective.
        assert group.count(1.0) == 2.0

    spawn(rank_fn, 2, timeout=TIMEOUT)


def test_chunks_on_a_non_source_rank_are_rejected() -> None:
    def rank_fn(group: ThreadGroup) -> float:
        buf = np.zeros(1)
        chunks = [np.array([1.0]), np.array([2.0])]
        if group.rank == 1:
            with pytest.raises(ValueError, match="only the source rank 0 passes chunks"):
                group.scatter(buf, src=0, chunks=chunks)
        group.scatter(buf, src=0, chunks=chunks if group.rank == 0 else None)
        return float(buf[0])

    assert spawn(rank_fn, 2, timeout=TIMEOUT) == [1.0, 2.0]


# -- the harness: mismatches ----------------------------------------------------------


def _op_differs(group: ThreadGroup, sites: list[int]) -> None:
    buf = np.ones(4, dtype=np.float32)
    if group.rank == 1:
        sites.append(lineno() + 1)
        group.all_reduce(buf, op="max")
    else:
        sites.append(lineno() + 1)
        group.all_reduce(buf)


def _shape_differs(group: ThreadGroup, sites: list[int]) -> None:
    sites.append(lineno() + 1)
    group.all_reduce(np.ones(3 if group.rank == 1 else 4, dtype=np.float32))


def _dtype_differs(group: ThreadGroup, sites: list[int]) -> None:
    sites.append(lineno() + 1)
    group.all_reduce(np.ones(4, dtype=np.float64 if group.rank == 1 else np.float32))


def _kind_differs(group: ThreadGroup, sites: list[int]) -> None:
    buf = np.ones(4, dtype=np.float32)
    if group.rank == 1:
        sites.append(lineno() + 1)
        group.broadcast(buf, src=0)
    else:
        sites.append(lineno() + 1)
        group.all_reduce(buf)


def _root_differs(group: ThreadGroup, sites: list[int]) -> None:
    sites.append(lineno() + 1)
    group.broadcast(np.ones(4, dtype=np.float32), src=1 if group.rank == 1 else 0)


@pytest.mark.parametrize(
    ("scenario", "field", "rank1_cells"),
    [
        (_op_differs, "op", ["all_reduce", "max", "(4,)", "float32"]),
        (_shape_differs, "shape", ["all_reduce", "sum", "(3,)", "float32"]),
        (_dtype_differs, "dtype", ["all_reduce", "sum", "(4,)", "float64"]),
        (_kind_differs, "kind, op, root", ["broadcast", "-", "(4,)", "float32", "0"]),
        (_root_differs, "root", ["broadcast", "-", "(4,)", "float32", "1"]),
    ],
)
def test_mismatch_raises_on_every_rank_with_a_table(
    scenario: Any, field: str, rank1_cells: list[str]
) -> None:
    def rank_fn(group: ThreadGroup) -> tuple[str, int]:
        sites: list[int] = []
        with pytest.raises(CollectiveMismatch) as caught:
            scenario(group, sites)
        return str(caught.value), sites[0]

    start = time.monotonic()
    results = spawn(rank_fn, 3, timeout=TIMEOUT)
    assert time.monotonic() - start < TIMEOUT / 2  # reported, not timed out
    message = results[0][0]
    assert all(text == message for text, _ in results)  # the same table everywhere
    lines = message.splitlines()
    assert lines[0] == (
        f"collective #1 differs across the 3 ranks (they disagree on {field}):"
    )
    assert [c.strip() for c in lines[1].split("|")] == [
        "rank", "kind", "op", "shape", "dtype", "root", "call site"
    ]
    rows = {int(row.split("|")[0]): [c.strip() for c in row.split("|")] for row in lines[3:]}
    assert sorted(rows) == [0, 1, 2]
    assert rows[1][1:1 + len(rank1_cells)] == rank1_cells
    for rank, (_, site_line) in enumerate(results):
        # The call site is this file's line of the rank's own call.
        assert rows[rank][-1].split(" in ")[0].endswith(f"{THIS_FILE}:{site_line}")


def test_uncaught_mismatch_is_reraised_by_spawn_naming_a_rank() -> None:
    def rank_fn(group: ThreadGroup) -> None:
        group.all_reduce(np.ones(2), op="min" if group.rank == 0 else "max")

    with pytest.raises(CollectiveMismatch, match="disagree on op") as caught:
        spawn(rank_fn, 2, timeout=TIMEOUT)
    notes = getattr(caught.value, "__notes__", [])
    assert any(note.startswith("raised on rank ") for note in notes)


def test_mismatch_reaches_an_async_caller_at_its_next_collective() -> None:
    def rank_fn(group: ThreadGroup) -> str:
        if group.rank == 0:
            group.all_reduce(np.ones(2), async_op=True)  # never waited
            with pytest.raises(CollectiveMismatch) as caught:
                group.barrier()
        else:
            with pytest.raises(CollectiveMismatch) as caught:
                group.all_reduce(np.ones(2), op="max")
        return str(caught.value)

    first, second = spawn(rank_fn, 2, timeout=TIMEOUT)
    assert first == second
    assert "collective #1 differs" in first


def test_heartbeat_mismatch_names_the_notifying_code_not_join_core() -> None:
    notify_line = Counter.__call__.__code__.co_firstlineno + 1

    def rank_fn(group: ThreadGroup) -> None:
        counter = Counter(group)
        with Join([counter]):
            if group.rank == 0:
                counter()  # heartbeat first
            else:
                group.broadcast(np.zeros(2, dtype=np.float32), src=0)

    with pytest.raises(CollectiveMismatch) as caught:
        spawn(rank_fn, 2, timeout=TIMEOUT)
    message = str(caught.value)
    heartbeat_rows = [row for row in message.splitlines() if "(heartbeat)" in row]
    assert len(heartbeat_rows) == 1
    assert heartbeat_rows[0].startswith("0 ")
    assert f"{SUPPORT_FILE}:{notify_line} in __call__" in heartbeat_rows[0]
    assert "_join.py" not in message and "_drive.py" not in message  # the shell's modules


# -- the harness: join collectives match only join collectives ----------------------


def _count_vs_all_reduce(group: ThreadGroup, sites: list[int]) -> None:
    if group.rank == 0:
        sites.append(lineno() + 1)
        group.count(0.0)
    else:
        sites.append(lineno() + 1)
        group.all_reduce(np.ones(1, dtype=np.float32))


def _heartbeat_vs_all_reduce(group: ThreadGroup, sites: list[int]) -> None:
    if group.rank == 0:
        sites.append(lineno() + 1)
        group.heartbeat(1.0).wait()
    else:
        sites.append(lineno() + 1)
        group.all_reduce(np.zeros(1, dtype=np.float32), async_op=True).wait()


@pytest.mark.parametrize(
    ("scenario", "join_kind"),
    [(_count_vs_all_reduce, "all_reduce (count)"),
     (_heartbeat_vs_all_reduce, "all_reduce (heartbeat)")],
)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_join_collective_never_matches_a_user_collective(
    scenario: Any, join_kind: str, world_size: int
) -> None:
    # Both are a 1-element float32 SUM all-reduce: on a wire they would pair.
    def rank_fn(group: ThreadGroup) -> tuple[str, int]:
        sites: list[int] = []
        with pytest.raises(CollectiveMismatch) as caught:
            scenario(group, sites)
        return str(caught.value), sites[0]

    results = spawn(rank_fn, world_size, timeout=TIMEOUT)
    message = results[0][0]
    assert all(text == message for text, _ in results)
    lines = message.splitlines()
    assert lines[0] == (
        f"collective #1 differs across the {world_size} ranks (they disagree on join vs user):"
    )
    rows = [[c.strip() for c in row.split("|")] for row in lines[3:3 + world_size]]
    assert [row[1] for row in rows] == [join_kind] + ["all_reduce"] * (world_size - 1)
    assert all(row[2:6] == ["sum", "(1,)", "float32", "-"] for row in rows)
    for row, (_, site_line) in zip(rows, results, strict=True):  # both call sites
        assert row[-1].split(" in ")[0].endswith(f"{THIS_FILE}:{site_line}")
    note = " ".join(lines[3 + world_size:])
    others = "rank 1 ran one of its own" if world_size == 2 else "ranks 1, 2 ran their own"
    assert note.startswith(f"rank 0 ran a collective of the Join (its heartbeat, count or "
                           f"object exchange) where {others}, and a join collective")
    assert "JoinHook.main_hook" in note


def test_join_collectives_match_each_other_and_user_collectives_each_other() -> None:
    def rank_fn(group: ThreadGroup) -> tuple[float, float]:
        # heartbeat (active) with count (joined): the Join's own pairing
        joined = group.heartbeat(1.0).wait() if group.rank else group.count(0.0)
        t = np.full(1, group.rank, dtype=np.float32)
        if group.rank == 1:  # blocking or not: both user collectives
            group.all_reduce(t, async_op=True).wait()
        else:
            group.all_reduce(t)
        return joined, float(t[0])

    assert spawn(rank_fn, 3, timeout=TIMEOUT) == [(2.0, 3.0)] * 3


def _counts(world_size: int) -> list[float]:
    """What each rank's Counter holds when rank r has 5 + r inputs."""
    # Each iteration counts the ranks still active in it.
    active = [sum(1 for r in range(world_size) if 5 + r > i) for i in range(5 + world_size)]
    return [float(sum(active[:5 + r])) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_hook_that_forgets_to_shadow_is_a_mismatch(world_size: int) -> None:
    # Rank r has 5 + r inputs. Rank 0 joins first; its count pairs with the
    # others' heartbeat (#12, after the agreement check and 5 x 2 collectives),
    # its hook issues nothing, so its next count (#13) meets their all-reduce.
    with_line = lineno() + 5
    all_reduce_line = Counter.collective.__code__.co_firstlineno + 2

    def rank_fn(group: ThreadGroup) -> float:
        counter = Counter(group, forgetful=True)
        with Join([counter]):
            for _ in range(5 + group.rank):
                counter()
        return counter.count

    start = time.monotonic()
    with pytest.raises(CollectiveMismatch) as caught:
        spawn(rank_fn, world_size, timeout=TIMEOUT)
    assert time.monotonic() - start < TIMEOUT / 2  # reported, not timed out
    lines = str(caught.value).splitlines()
    assert lines[0] == (
        f"collective #13 differs across the {world_size} ranks (they disagree on join vs user):"
    )
    rows = [[c.strip() for c in row.split("|")] for row in lines[3:3 + world_size]]
    # The joined rank's count at its `with` (the Join's exit), the active
    # ranks' all-reduce in Counter.__call__.
    assert rows[0][1] == "all_reduce (count)"
    assert rows[0][-1].endswith(f"{THIS_FILE}:{with_line} in rank_fn")
    for row in rows[1:]:
        assert row[1] == "all_reduce"
        assert row[-1].endswith(f"{SUPPORT_FILE}:{all_reduce_line} in collective")


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_hook_that_shadows_passes(world_size: int) -> None:
    def rank_fn(group: ThreadGroup) -> float:
        return count_inputs(group, 5 + group.rank)

    assert spawn(rank_fn, world_size, timeout=TIMEOUT) == _counts(world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_fused_shadow_is_a_user_collective_matching_the_active_ranks_own(
    world_size: int
) -> None:
    # examples/counter.py fuses the heartbeat into its own all-reduce: there the
    # joined rank's count *is* its hook's fused_shadow, a user collective that
    # matches the active ranks' fused all-reduce. No join collective pairs with
    # a user one, so the run passes.
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
    try:
        import counter
    finally:
        sys.path.pop(0)

    def rank_fn(group: ThreadGroup) -> tuple[float, float]:
        c = counter.Counter(group)
        with Join([c], sync_max_count=True):
            for _ in range(counter.NUM_INPUTS + group.rank):
                c()
        return float(c.count[0]), float(c.max_count[0])

    total = float(sum(5 + r for r in range(world_size)))
    assert spawn(rank_fn, world_size, timeout=TIMEOUT) == [
        (count, total) for count in _counts(world_size)]


# -- the harness: missing ranks --------------------------------------------------------


def test_a_rank_that_never_arrives_gives_rank_timeout() -> None:
    release = threading.Event()
    seen: dict[int, BaseException] = {}

    def rank_fn(group: ThreadGroup) -> None:
        group.barrier()  # collective #1: everyone
        if group.rank == 2:
            release.wait(TIMEOUT)  # stuck in its own code
            return
        try:
            group.all_reduce(np.ones(2))  # collective #2
        except PeerError as exc:
            seen[group.rank] = exc
            raise

    timeout = 0.5
    start = time.monotonic()
    try:
        with pytest.raises(RankTimeout) as caught:
            spawn(rank_fn, 3, timeout=timeout)
    finally:
        release.set()
    assert time.monotonic() - start >= timeout
    # Every waiting rank gets the RankTimeout, naming the missing rank.
    assert sorted(seen) == [0, 1]
    for rank, exc in seen.items():
        assert isinstance(exc, RankTimeout)
        message = str(exc)
        assert message.startswith(f"rank {rank} waited in collective #2 (all_reduce) at ")
        assert f"{THIS_FILE}:" in message
        assert f"rank 2 did not arrive within the {timeout:g} s timeout" in message
        assert "rank 2: last called collective #1 (barrier) at " in message
    assert isinstance(caught.value, RankTimeout)
    notes = getattr(caught.value, "__notes__", [])
    assert any("rank 2 still running" in note for note in notes)


def test_a_rank_that_arrives_after_the_others_gave_up_gets_rank_timeout() -> None:
    given_up = threading.Event()

    def rank_fn(group: ThreadGroup) -> str:
        if group.rank == 1:
            given_up.wait(TIMEOUT)  # arrives only after rank 0 timed out
        with pytest.raises(RankTimeout) as caught:
            group.barrier()
        given_up.set()
        return str(caught.value)

    waited, late = spawn(rank_fn, 2, timeout=0.3)
    assert waited.startswith("rank 0 waited in collective #1 (barrier) at ")
    assert "rank 1 did not arrive within the 0.3 s timeout" in waited
    assert "rank 1: has made no collective call" in waited
    assert late.startswith("rank 1 reached collective #1 (barrier) at ")
    assert late.endswith("too late: the other ranks gave up waiting for it after the 0.3 s timeout")


def test_a_rank_that_returned_is_reported_at_once() -> None:
    def rank_fn(group: ThreadGroup) -> None:
        group.barrier()
        if group.rank == 1:
            return  # skips the second collective
        group.barrier()

    start = time.monotonic()
    with pytest.raises(RankTimeout) as caught:
        spawn(rank_fn, 2, timeout=30.0)
    assert time.monotonic() - start < 15.0  # not after the timeout
    message = str(caught.value)
    assert "collective #2 (barrier)" in message
    assert "rank 1 returned from fn before making that call" in message
    assert "rank 1: returned from fn after 1 collective calls" in message


def test_a_rank_that_does_not_return_after_the_others_gives_rank_timeout() -> None:
    release = threading.Event()

    def rank_fn(group: ThreadGroup) -> None:
        group.barrier()
        if group.rank == 1:
            release.wait(TIMEOUT)

    try:
        with pytest.raises(RankTimeout, match="rank 1 did not return within 0.3 s after rank 0"):
            spawn(rank_fn, 2, timeout=0.3)
    finally:
        release.set()


# -- the harness: failures --------------------------------------------------------------


def test_an_exception_releases_the_others_and_is_reraised_naming_its_rank() -> None:
    raised: dict[int, BaseException] = {}

    def rank_fn(group: ThreadGroup) -> None:
        group.barrier()
        if group.rank == 2:
            time.sleep(0.2)  # let the others start waiting for it
            raised[2] = ValueError("boom")
            raise raised[2]
        try:
            group.all_reduce(np.ones(2))  # rank 2 never comes
        except BaseException as exc:
            raised[group.rank] = exc
            raise

    start = time.monotonic()
    with pytest.raises(ValueError, match="boom") as caught:
        spawn(rank_fn, 4, timeout=30.0)
    assert time.monotonic() - start < 15.0  # released, not timed out
    assert caught.value is raised[2]  # the original object, still catchable
    notes = getattr(caught.value, "__notes__", [])
    assert "raised on rank 2 (backends.threads.spawn)" in notes
    for rank in (0, 1, 3):
        exc = raised[rank]
        assert isinstance(exc, SpawnAborted)
        assert isinstance(exc, PeerFailure) and isinstance(exc, PeerError)
        assert (exc.rank, exc.exc_type, exc.exc_message) == (2, "ValueError", "boom")
        assert str(exc).startswith("rank 2 raised ValueError: boom; ")
        # Released while waiting (or, if slow to get there, refused at entry).
        assert re.search(
            f"rank {rank} (was released from|cannot enter) collective #2 [(]all_reduce[)]",
            str(exc),
        )


def test_first_root_cause_wins_over_errors_that_followed_it() -> None:
    def rank_fn(group: ThreadGroup) -> None:
        if group.rank == 0:
            raise KeyError("root cause")
        try:
            group.all_reduce(np.ones(2))
        except SpawnAborted:
            if group.rank == 1:
                # An error raised while handling the abort is not a root cause.
                raise RuntimeError("cleanup failed") from None
            raise
        # Once aborted, every later collective is refused at once.

    with pytest.raises(KeyError, match="root cause") as caught:
        spawn(rank_fn, 3, timeout=30.0)
    notes = getattr(caught.value, "__notes__", [])
    assert notes[0] == "raised on rank 0 (backends.threads.spawn)"
    assert any(n.startswith("other ranks failed too:") for n in notes)


def test_spawn_prefers_a_root_cause_even_if_recorded_later() -> None:
    # A released rank can finish before the failing rank has been recorded;
    # the exception it raised while handling the abort must not win.
    aborted = SpawnAborted(0, "KeyError", "'x'", where="rank 1 was released")
    try:
        try:
            raise aborted
        except SpawnAborted:
            raise RuntimeError("cleanup failed") from None
    except RuntimeError as exc:
        derived = exc
    peer_failure = PeerFailure(0, "KeyError", "'x'")  # the Join's report of it
    root = KeyError("x")
    failures = [(1, derived), (2, aborted), (3, peer_failure), (0, root)]
    assert _root_cause(failures, stuck=[]) is root
    assert root.__notes__ == [
        "raised on rank 0 (backends.threads.spawn)",
        "other ranks failed too: RuntimeError on rank 1; SpawnAborted on rank 2; "
        "PeerFailure on rank 3",
    ]


def test_spawn_aborted_survives_pickling() -> None:
    error = SpawnAborted(3, "ValueError", "boom", where="rank 1 was released")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is SpawnAborted
    assert (copy.rank, copy.exc_type, copy.exc_message) == (3, "ValueError", "boom")
    assert str(copy) == str(error) == "rank 3 raised ValueError: boom; rank 1 was released"


def test_after_an_abort_later_collectives_are_refused() -> None:
    outcome: dict[int, str] = {}

    def rank_fn(group: ThreadGroup) -> None:
        if group.rank == 0:
            raise OSError("disk full")
        for _ in range(3):
            try:
                group.barrier()
            except SpawnAborted as exc:
                outcome[group.rank] = str(exc)
        # All three barriers raised; the rank returns normally.

    with pytest.raises(OSError, match="disk full"):
        spawn(rank_fn, 2, timeout=30.0)
    assert outcome[1].startswith("rank 0 raised OSError: disk full; rank 1 ")


# -- scale ------------------------------------------------------------------------------


def test_64_ranks_200_iterations_of_async_and_blocking_all_reduce() -> None:
    iterations = 200

    def rank_fn(group: ThreadGroup) -> tuple[float, float]:
        pending = 0.0
        blocking = 0.0
        for i in range(iterations):
            heartbeat = np.ones(1, dtype=np.float32)
            work = group.all_reduce(heartbeat, async_op=True)
            value = np.full(1, float(group.rank + i), dtype=np.float64)
            group.all_reduce(value)
            work.wait()
            pending += float(heartbeat[0])
            blocking += float(value[0])
        return pending, blocking

    size = 64
    results = spawn(rank_fn, size, timeout=60.0)
    rank_sum = sum(range(size))
    expected_blocking = float(sum(rank_sum + size * i for i in range(iterations)))
    assert results == [(float(size * iterations), expected_blocking)] * size
