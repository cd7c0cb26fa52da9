"""Every MPI backend scenario in one MPI program, so CI pays mpirun's start-up once.

Run as ``mpirun -n N python mpi_scenarios.py``. Each rank runs
every case in the same order and prints one line per case::

    JOINKIT-CASE {"rank": 0, "size": 2, "case": "...", "status": "ok", "detail": ""}

(status "ok", "fail" or "skip")

and ``JOINKIT-DONE {...}`` at the end. Case names as arguments run only those;
``--without CASE`` leaves one out. With ``--out DIR`` each rank writes its
lines to ``DIR/rank-<r>.jsonl`` instead (launchers may interleave the ranks'
standard output). ``test_mpi_backend.py`` parametrizes over
:func:`case_names` and reads the lines; a case written as it finishes means a
hang still shows how far each rank got.

Collective cases compare against NumPy: every rank derives every rank's input
(:func:`rank_data`) so it computes the expected result locally. A combination
of reduce op and dtype that is not meaningful (bitwise on floats, min on
complex) is a case too: it must raise ``TypeError`` on every rank before any
communication, so the ranks stay in step. Join cases are the scenarios of
``tests/core/test_join_threads.py`` on MPI, with totals checked against the closed
form. torch cases report ``skip`` when torch is not installed (the no-torch CI
env); the pytest side accepts that only where torch is missing.

This module imports neither mpi4py nor torch at import time: pytest imports it
to collect the case names.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/, for support
import support  # noqa: E402  (imports joinkit, neither mpi4py nor torch)
from support import AFTER, expected_total  # noqa: E402

sys.path.pop(0)

REDUCE_OPS = ("sum", "prod", "min", "max", "band", "bor", "bxor")
DTYPES = ("float32", "float64", "int32", "int64", "uint8", "bool", "complex128")
CONTAINERS = ("numpy", "torch")
MODES = ("sync", "async")
ROOTED = ("broadcast", "all_gather", "gather", "scatter")
N = 5  # elements per buffer

_UFUNCS = {
    "sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}


class Skip(Exception):
    """The case needs something this environment lacks (torch)."""


# -- case names (pure: pytest imports these) -----------------------------------------


def collective_cases() -> list[str]:
    cases = []
    for kind in ("all_reduce", "reduce"):
        for op, dtype, container, mode in itertools.product(
            REDUCE_OPS, DTYPES, CONTAINERS, MODES
        ):
            cases.append(f"{kind}/{op}/{dtype}/{container}/{mode}")
    for kind, dtype, container, mode in itertools.product(ROOTED, DTYPES, CONTAINERS, MODES):
        cases.append(f"{kind}/{dtype}/{container}/{mode}")
    return cases


def case_names() -> list[str]:
    return (
        collective_cases()
        + [f"buffers/{name}" for name in BUFFER_CASES]
        + [f"join/{name}" for name in JOIN_CASES]
    )


def meaningful(op: str, dtype: str) -> bool:
    """Whether ``op`` is defined for ``dtype`` (the same table on every backend)."""
    kind = np.dtype(dtype).kind
    if kind == "f":
        return op in ("sum", "prod", "min", "max")
    if kind == "c":
        return op == "sum"
    return True


# -- data --------------------------------------------------------------------------------


def rank_data(dtype: str, rank: int, n: int = N) -> np.ndarray:
    """Rank ``rank``'s input: small values, so products of 4 ranks stay exact."""
    i = np.arange(n)
    if dtype == "bool":
        return (i + rank) % 3 == 0
    if dtype == "uint8":
        return ((i * 3 + rank * 5) % 7 + 1).astype(np.uint8)
    if dtype.startswith("int"):
        return ((i * 3 + rank * 5) % 7 - 3).astype(dtype)
    if dtype.startswith("float"):
        return ((i - 2) * 0.5 + rank * 0.25).astype(dtype)
    return ((i - 2) * 0.5 + 1j * (rank - 1)).astype(dtype)


def expected_reduction(op: str, dtype: str, size: int) -> np.ndarray:
    stacked = np.stack([rank_data(dtype, r) for r in range(size)])
    if dtype == "bool":
        logical = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
                   "prod": np.logical_and, "min": np.logical_and, "band": np.logical_and,
                   "bxor": np.logical_xor}[op]
        return np.asarray(logical.reduce(stacked, axis=0))
    return np.asarray(_UFUNCS[op].reduce(stacked, axis=0, dtype=stacked.dtype))


def check_equal(got: Any, expected: np.ndarray, what: str) -> None:
    got = _as_numpy(got)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        raise AssertionError(
            f"{what}: got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}"
        )
    if expected.dtype.kind in "fc":
        ok = np.allclose(got, expected, rtol=1e-6, atol=0)
    else:
        ok = np.array_equal(got, expected)
    if not ok:
        raise AssertionError(f"{what}: got {got.tolist()}, expected {expected.tolist()}")


def _as_numpy(buf: Any) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf
    return buf.detach().numpy()


def _torch() -> Any:
    if importlib.util.find_spec("torch") is None:
        raise Skip("torch is not installed")
    import torch

    return torch


def make_buffer(data: np.ndarray, container: str) -> Any:
    """A fresh buffer holding ``data`` (a copy: the case owns it)."""
    if container == "numpy":
        return data.copy()
    return _torch().from_numpy(data.copy())


# -- collective cases ----------------------------------------------------------------------


def run_collective(group: Any, case: str) -> None:
    parts = case.split("/")
    kind = parts[0]
    if kind in ("all_reduce", "reduce"):
        _, op, dtype, container, mode = parts
        _reduction(group, kind, op, dtype, container, mode)
    else:
        _, dtype, container, mode = parts
        _ROOTED_RUNNERS[kind](group, dtype, container, mode == "async")


def _finish(result: Any, async_op: bool) -> Any:
    if not async_op:
        return result
    assert hasattr(result, "wait"), f"async_op=True returned {type(result).__name__}"
    return result.wait()


def _reduction(group: Any, kind: str, op: str, dtype: str, container: str, mode: str) -> None:
    async_op = mode == "async"
    buf = make_buffer(rank_data(dtype, group.rank), container)
    dst = group.world_size - 1
    call: Callable[[], Any]
    if kind == "all_reduce":
        def call() -> Any:
            return group.all_reduce(buf, op=op, async_op=async_op)
    else:
        def call() -> Any:
            return group.reduce(buf, dst, op=op, async_op=async_op)
    if not meaningful(op, dtype):
        try:
            call()
        except TypeError:
            return
        raise AssertionError(f"{kind} op {op!r} on {dtype} did not raise TypeError")
    result = _finish(call(), async_op)
    if result is not buf:
        raise AssertionError(f"{kind} returned {type(result).__name__}, not the buffer")
    if kind == "all_reduce" or group.rank == dst:
        check_equal(buf, expected_reduction(op, dtype, group.world_size), kind)
    else:
        check_equal(buf, rank_data(dtype, group.rank), f"{kind} on a non-root rank")


def _broadcast(group: Any, dtype: str, container: str, async_op: bool) -> None:
    src = 1 % group.world_size
    buf = make_buffer(rank_data(dtype, group.rank), container)
    result = _finish(group.broadcast(buf, src, async_op=async_op), async_op)
    assert result is buf, "broadcast must return its buffer"
    check_equal(buf, rank_data(dtype, src), "broadcast")


def _all_gather(group: Any, dtype: str, container: str, async_op: bool) -> None:
    buf = make_buffer(rank_data(dtype, group.rank), container)
    parts = _finish(group.all_gather(buf, async_op=async_op), async_op)
    _check_parts(parts, buf, dtype, group.world_size, "all_gather")
    check_equal(buf, rank_data(dtype, group.rank), "all_gather's input")


def _gather(group: Any, dtype: str, container: str, async_op: bool) -> None:
    dst = group.world_size - 1
    buf = make_buffer(rank_data(dtype, group.rank), container)
    parts = _finish(group.gather(buf, dst, async_op=async_op), async_op)
    if group.rank == dst:
        _check_parts(parts, buf, dtype, group.world_size, "gather")
    elif parts is not None:
        raise AssertionError(f"gather returned {type(parts).__name__} off the root")


def _scatter(group: Any, dtype: str, container: str, async_op: bool) -> None:
    src = group.world_size - 1
    buf = make_buffer(np.zeros(N, dtype=dtype), container)
    chunks = None
    if group.rank == src:
        # Alternate the two accepted forms: a list of buffers, one stacked buffer.
        rows = [rank_data(dtype, r + 10) for r in range(group.world_size)]
        chunks = (
            [make_buffer(row, container) for row in rows]
            if async_op else make_buffer(np.stack(rows), container)
        )
    result = _finish(group.scatter(buf, src, chunks=chunks, async_op=async_op), async_op)
    assert result is buf, "scatter must return its buffer"
    check_equal(buf, rank_data(dtype, group.rank + 10), "scatter")


def _check_parts(parts: Any, buf: Any, dtype: str, size: int, what: str) -> None:
    if not isinstance(parts, list) or len(parts) != size:
        raise AssertionError(f"{what} returned {parts!r}, expected a list of {size}")
    for rank, part in enumerate(parts):
        if type(part) is not type(buf):
            raise AssertionError(f"{what}[{rank}] is {type(part).__name__}")
        check_equal(part, rank_data(dtype, rank), f"{what}[{rank}]")


_ROOTED_RUNNERS: dict[str, Callable[[Any, str, str, bool], None]] = {
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "gather": _gather,
    "scatter": _scatter,
}


# -- buffer semantics ------------------------------------------------------------------------


def _torch_in_place(group: Any) -> None:
    """A tensor (also a contiguous slice of a bigger one) is reduced in its own memory."""
    torch = _torch()
    big = torch.full((9,), -1.0)
    view = big[2:7]
    pointer = view.data_ptr()
    view.copy_(torch.from_numpy(rank_data("float32", group.rank)))
    assert group.all_reduce(view) is view
    assert view.data_ptr() == pointer
    check_equal(view, expected_reduction("sum", "float32", group.world_size), "slice")
    check_equal(big[:2], np.full(2, -1.0, np.float32), "outside the slice")
    check_equal(big[7:], np.full(2, -1.0, np.float32), "outside the slice")
    # A leaf that requires grad (a model parameter) is updated in place too.
    param = torch.nn.Parameter(torch.ones(3))
    group.all_reduce(param)
    check_equal(param, np.full(3, group.world_size, np.float32), "parameter")
    handle = group.broadcast(param, 0, async_op=True)
    assert handle.wait() is param


def _numpy_in_place(group: Any) -> None:
    big = np.full(9, -1, dtype=np.int64)
    view = big[2:7]
    view[:] = rank_data("int64", group.rank)
    group.all_reduce(view, op="max")
    check_equal(view, expected_reduction("max", "int64", group.world_size), "slice")
    check_equal(big[[0, 1, 7, 8]], np.full(4, -1, np.int64), "outside the slice")


def _rejects_bad_buffers(group: Any) -> None:
    """Every rank raises the same error before communicating, so no rank hangs."""
    bad: list[tuple[Any, type[Exception], str]] = [
        (np.zeros(2, np.float16), TypeError, "has dtype float16"),
        ([1.0, 2.0], TypeError, "NumPy arrays or torch tensors"),
    ]
    readonly = np.zeros(2, np.float32)
    readonly.flags.writeable = False
    bad.append((readonly, ValueError, "read-only"))
    if importlib.util.find_spec("torch") is not None:
        import torch

        bad.append((torch.zeros(2, dtype=torch.bfloat16), TypeError, "torch.bfloat16"))
    for buf, error, words in bad:
        try:
            group.all_reduce(buf)
        except error as exc:
            assert words in str(exc), f"{error.__name__} without {words!r}: {exc}"
        else:
            raise AssertionError(f"all_reduce({buf!r}) did not raise {error.__name__}")
    for call, error, words in [
        (lambda: group.all_reduce(np.zeros(1), op="mean"), ValueError, "unknown reduce op"),
        (lambda: group.broadcast(np.zeros(1), src=group.world_size), ValueError,
         "not a rank"),
        (lambda: group.reduce(np.zeros(1), dst=-1), ValueError, "not a rank"),
    ]:
        try:
            call()
        except error as exc:
            assert words in str(exc), f"{error.__name__} without {words!r}: {exc}"
        else:
            raise AssertionError(f"no {error.__name__} ({words})")
    # Still in step after all those refusals:
    group.barrier()
    check_equal(group.all_reduce(np.ones(1, np.int32)), np.array([group.world_size],
                                                                  np.int32), "after errors")


def _object_and_join_collectives(group: Any) -> None:
    objects = group.all_gather_object({"rank": group.rank})
    assert objects == [{"rank": r} for r in range(group.world_size)], objects
    handle = group.heartbeat(1.0)
    assert handle.wait() == group.world_size
    assert group.heartbeat_total(handle) == group.world_size
    assert group.count(0.5) == 0.5 * group.world_size
    # A heartbeat matches a count (what an active and a joined rank do).
    if group.rank == 0:
        total = group.count(0.0)
    else:
        total = group.heartbeat(1.0).wait()
    assert total == group.world_size - 1, total


def _all_gather_into(group: Any) -> None:
    """all_gather_into (Gather's per-call path): the same buffers twice, then new
    ones; rank 0 calls all_gather instead the last time (the same collective)."""
    rank, size = group.rank, group.world_size
    wire, rows = np.zeros(3, dtype=np.uint8), np.zeros((size, 3), dtype=np.uint8)
    for first in (1, 5):
        wire[:] = rank + first
        assert group.all_gather_into(wire, rows) is rows
        check_equal(rows, np.array([[r + first] * 3 for r in range(size)], np.uint8),
                    f"all_gather_into, call {first}")
    wire, rows = np.full(2, rank + 9, dtype=np.uint8), np.zeros((size, 2), dtype=np.uint8)
    if rank == 0:
        rows[...] = np.stack(group.all_gather(wire))
    else:
        group.all_gather_into(wire, rows)
    check_equal(rows, np.array([[r + 9] * 2 for r in range(size)], np.uint8),
                "all_gather_into mixed with all_gather")


def _group_equality(group: Any) -> None:
    from mpi4py import MPI

    from joinkit.backends.mpi import MPIGroup

    assert group == MPIGroup(group.comm) and group == group.comm
    assert hash(group) == hash(MPIGroup(group.comm))
    assert group != MPIGroup(MPI.COMM_SELF) and group != MPI.COMM_SELF


#: Seconds ``peer_status`` may wait where every peer can answer: it returns at
#: the last answer, so only a peer that never answers costs this much.
PATIENT = 120.0


def _status_board(group: Any) -> None:
    """peer_status asks the peers' listener threads, also while they block in a collective.

    Every rank runs the same collectives whatever it sees, and the checks are
    collected and raised only after the last one, so a failed check cannot
    leave the ranks in different collectives (and the launch hung). Where
    peers can answer, the wait is ``PATIENT``, not a short window.
    """
    import re

    from joinkit.backends import mpi

    rank, size = group.rank, group.world_size
    problems: list[str] = []

    def check(ok: bool, what: str, seen: Any) -> None:
        if not ok:
            problems.append(f"{what}: {seen}")

    comm = group.comm.Dup()  # a communicator nobody has posted on yet
    try:
        sub = mpi.MPIGroup(comm)
        if rank == 0:  # the peers have not posted here: none can answer, so wait briefly
            seen = sub.peer_status(patience=0.5)
            check(seen[0] == "no status posted", "own status before any post", seen)
            check(all(seen[peer].startswith("no answer within 0.5 s: dead, stuck")
                      for peer in range(1, size)), "peers before any post", seen)
        sub.barrier()
        sub.post_status(f"status of rank {rank}")
        sub.barrier()
        # Rank 0 asks while the peers wait for it in a collective.
        if rank == 0:
            seen = sub.peer_status(patience=PATIENT)
            check(sorted(seen) == list(range(size)), "ranks answering", seen)
            check(all(re.fullmatch(rf"status of rank {peer} \(\d+\.\d s ago\)", text)
                      for peer, text in seen.items()), "answers while in a collective", seen)
        sub.count(0.0)
        # Every rank asks at once (late answers to rank 0's first query are
        # told apart from the answers to these).
        sub.post_status(f"posted again by rank {rank}")
        seen = sub.peer_status(patience=PATIENT)
        check([text.partition(" (")[0] for text in seen.values()] == [
            f"posted again by rank {peer}" for peer in range(size)], "all asking at once", seen)
        sub.barrier()
    finally:
        comm.Free()
    # The listener drops the freed communicator and answers on the others.
    group.post_status("after the freed one")
    seen = group.peer_status(patience=PATIENT)
    check(all(text.startswith("after the freed one (") for text in seen.values()),
          "answers after a communicator was freed", seen)
    group.barrier()
    assert not problems, "\n".join(problems)


BUFFER_CASES: dict[str, Callable[[Any], None]] = {
    "torch-in-place": _torch_in_place,
    "numpy-in-place": _numpy_in_place,
    "rejects-bad-buffers": _rejects_bad_buffers,
    "object-and-join-collectives": _object_and_join_collectives,
    "all-gather-into": _all_gather_into,
    "group-equality": _group_equality,
    "status-board": _status_board,
}


# -- join scenarios ------------------------------------------------------------------------

def _join_classes() -> tuple[type, type]:
    """``support.AllReducer``; over a raw communicator it calls mpi4py's own
    (blocking) collectives, as code written against mpi4py would."""

    class AllReducer(support.AllReducer):
        def __init__(self, group: Any, log: list[Any] | None = None) -> None:
            super().__init__(group, log=log)

        def collective(self, kind: str, buf: np.ndarray, arg: Any) -> None:
            if hasattr(self.group, "all_reduce"):
                super().collective(kind, buf, arg)
                return
            from mpi4py import MPI

            if kind == "all_reduce":
                op = {"sum": MPI.SUM, "max": MPI.MAX}[arg]
                self.group.Allreduce(MPI.IN_PLACE, buf, op)
            else:
                self.group.Bcast(buf, root=arg)

    return AllReducer, support.AllReducerJoinHook


def _uneven(group: Any, num_joinables: int, raw: bool) -> None:
    from joinkit import Join

    AllReducer, _ = _join_classes()
    size, rank = group.world_size, group.rank
    inputs = [5 + 2 * r for r in range(size)]
    log: list[Any] = []
    target = group.comm if raw else group
    joinables = [AllReducer(target, log) for _ in range(num_joinables)]
    with Join(joinables) as join:
        for _ in range(inputs[rank]):
            for joinable in joinables:
                joinable()
    most = max(inputs)
    totals = [j.total for j in joinables]
    assert totals == [expected_total(inputs, rank)] * num_joinables, totals
    assert [j.post_value for j in joinables] == [AFTER] * num_joinables
    rounds = most - inputs[rank]
    assert log == ["main"] * num_joinables * rounds + [
        ("post", inputs[rank] == most)
    ] * num_joinables, log
    assert join.state.shadow_rounds == rounds
    assert join.state.heartbeats == inputs[rank]


def _heartbeat_handle_only_for_first(group: Any) -> None:
    from joinkit import Join

    AllReducer, _ = _join_classes()
    first, second = AllReducer(group), AllReducer(group)
    with Join([first, second]):
        handles = [first(), second()]
    assert handles[1] is None
    assert handles[0] is not None
    # Inputs were even, so the heartbeat saw every rank active.
    assert handles[0].wait() == group.world_size


def _enable_false(group: Any, num_joinables: int) -> None:
    from joinkit import Join

    AllReducer, _ = _join_classes()
    log: list[Any] = []
    joinables = [AllReducer(group, log) for _ in range(num_joinables)]
    with Join(joinables, enable=False) as join:
        handles = [[j() for j in joinables] for _ in range(3)]
    assert join.state is None
    assert [j.total for j in joinables] == [3.0 * group.world_size] * num_joinables
    assert log == []
    assert all(h is None for row in handles for h in row)


def _throw(group: Any, num_joinables: int) -> None:
    from joinkit import EarlyTermination, Join

    AllReducer, _ = _join_classes()
    fewest = 2
    inputs = [fewest if r == 1 else 6 for r in range(group.world_size)]
    joinables = [AllReducer(group) for _ in range(num_joinables)]
    try:
        with Join(joinables, throw_on_early_termination=True):
            for _ in range(inputs[group.rank]):
                for joinable in joinables:
                    joinable()
    except RuntimeError as exc:
        assert isinstance(exc, EarlyTermination), type(exc)
        message = str(exc)
    else:
        raise AssertionError("throw_on_early_termination=True did not raise")
    if group.rank == 1:
        assert message == "Rank 1 exhausted all inputs.", message
    else:
        assert message == (
            "Detected at least one rank that exhausted inputs. Throwing across all ranks."
        ), message


def _throw_even(group: Any) -> None:
    from joinkit import Join

    AllReducer, _ = _join_classes()
    joinable = AllReducer(group)
    with Join([joinable], throw_on_early_termination=True):
        for _ in range(4):
            joinable()
    assert joinable.post_value == AFTER
    assert joinable.total == 4.0 * group.world_size


def _kwargs(group: Any) -> None:
    from joinkit import Join

    AllReducer, _ = _join_classes()
    joinables = [AllReducer(group) for _ in range(2)]
    inputs = [2 + r for r in range(group.world_size)]
    with Join(joinables, num_allreduces=3, extra="x"):
        for _ in range(inputs[group.rank]):
            for joinable in joinables:
                joinable(num_allreduces=3)
    assert [j.kwargs for j in joinables] == [{"num_allreduces": 3, "extra": "x"}] * 2
    expected = expected_total(inputs, group.rank, per_iteration=3)
    assert [j.total for j in joinables] == [expected] * 2


def _sub_communicator(group: Any) -> None:
    """A Join over half the world (comm.Split) while the other half runs its own."""
    from joinkit import Join
    from joinkit.backends.mpi import MPIGroup

    AllReducer, _ = _join_classes()
    comm = group.comm.Split(color=group.rank % 2, key=group.rank)
    try:
        sub = MPIGroup(comm)
        inputs = [3 + r for r in range(sub.world_size)]
        joinable = AllReducer(sub)
        with Join([joinable]):
            for _ in range(inputs[sub.rank]):
                joinable()
        assert joinable.total == expected_total(inputs, sub.rank)
    finally:
        comm.Free()


def _mixed_group_and_comm(group: Any) -> None:
    """A joinable on the MPIGroup and one on its raw communicator share one Join."""
    from joinkit import Join

    AllReducer, _ = _join_classes()
    inputs = [2 + r for r in range(group.world_size)]
    joinables = [AllReducer(group), AllReducer(group.comm)]
    with Join(joinables):
        for _ in range(inputs[group.rank]):
            for joinable in joinables:
                joinable()
    expected = expected_total(inputs, group.rank)
    assert [j.total for j in joinables] == [expected, expected]


def _counter_tutorial(group: Any) -> None:
    """examples/counter.py's Counter (the tutorial's) with sync_max_count."""
    sys.path.insert(0, _examples_dir())
    try:
        import counter
    finally:
        sys.path.pop(0)
    from joinkit import Join

    c = counter.Counter(group)
    inputs = [counter.NUM_INPUTS + r for r in range(group.world_size)]
    with Join([c], sync_max_count=True):
        for _ in range(inputs[group.rank]):
            c()
    assert c.count[0] == expected_total(inputs, group.rank)
    assert c.max_count[0] == sum(inputs)


def _skew_warning(group: Any) -> None:
    from joinkit import Join

    AllReducer, _ = _join_classes()
    joinable = AllReducer(group)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Join([joinable]):
            for _ in range(0 if group.rank == 0 else 1002):
                joinable()
    skew = [w for w in caught if "uneven input skew" in str(w.message)]
    if group.rank == 0:
        assert len(skew) == 1, [str(w.message) for w in caught]
        assert "rank 0 has at least 1000 fewer inputs" in str(skew[0].message)
    else:
        assert skew == []


def _progress_line(group: Any) -> None:
    """A joined rank's INFO progress line (the interval at 0 s: a line at every
    drain batch boundary), naming the active ranks that the status board's
    listeners reported (a peer that did not answer in time is not named; with
    none named, the line counts them)."""
    import logging
    import re

    from joinkit import Join, _machine

    AllReducer, _ = _join_classes()
    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.INFO:
                lines.append(record.getMessage())

    logger = logging.getLogger("joinkit")
    handler, level, interval = Capture(), logger.level, _machine.PROGRESS_INTERVAL
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    _machine.PROGRESS_INTERVAL = 0.0
    joinable = AllReducer(group)
    try:
        with Join([joinable]):
            for _ in range(0 if group.rank == 0 else 20):
                joinable()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        _machine.PROGRESS_INTERVAL = interval
    if group.rank != 0:
        assert lines == [], lines
        return
    active = group.world_size - 1
    pattern = (rf"rank 0 joined after 0 inputs; shadowing (rank\(s\) [\d, ]+|{active} active "
               r"rank\(s\)) for \d+ s \([\d,]+ rounds\)")
    assert lines and all(re.fullmatch(pattern, line) for line in lines), lines
    everyone = ", ".join(str(rank) for rank in range(1, group.world_size))
    assert any(f"shadowing rank(s) {everyone} for" in line for line in lines), lines


def _examples_dir() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[4] / "examples")


def _side_collectives(group: Any, raw: bool) -> None:
    """SideCollectives beside an AllReducer (and alone, first, over a raw
    communicator): a logging sum per step and a barrier; rank 1 has no input."""
    from joinkit import Join, SideCollective

    AllReducer, _ = _join_classes()
    size, rank = group.world_size, group.rank
    inputs = [0 if r == 1 else 2 + 3 * r for r in range(size)]
    target = group.comm if raw else group

    def total(value: float) -> float:
        buf = np.array([value])
        if raw:
            from mpi4py import MPI

            target.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
        else:
            target.all_reduce(buf)
        return float(buf[0])

    barrier = target.Barrier if raw else target.barrier
    log_sum = SideCollective(total, shadow=lambda: total(0.0), name="log_sum",
                             process_group=target if raw else None)
    sync = SideCollective(barrier, name="barrier")
    reducer = AllReducer(target)
    joinables = [log_sum, sync] if raw else [reducer, log_sum, sync]
    sums = []
    with Join(joinables) as join:
        for _ in range(inputs[rank]):
            if not raw:
                reducer()
            sums.append(total_of := log_sum(rank + 1.0))
            assert total_of == sums[-1]
            sync()
    want = [float(sum(r + 1 for r in range(size) if inputs[r] > t)) for t in range(inputs[rank])]
    assert sums == want, (sums, want)
    if not raw:
        assert reducer.total == expected_total(inputs, rank)
    rounds = max(inputs) - inputs[rank]
    assert (log_sum.shadow_rounds, sync.shadow_rounds) == (rounds, rounds)
    assert join.state.heartbeats == inputs[rank]


def _side_collective_not_listed(group: Any) -> None:
    from joinkit import Join, LocalProtocolError, SideCollective

    AllReducer, _ = _join_classes()
    reducer, sync = AllReducer(group), SideCollective(group.barrier, name="sync")
    try:
        with Join([reducer]):
            sync()
    except LocalProtocolError as error:
        assert "SideCollective('sync') was called inside" in str(error), error
    else:
        raise AssertionError("a SideCollective missing from the Join was not refused")


def _silent_first_joinable(group: Any) -> None:
    """Issue 18 part 5 on MPI: ``tests/support/notify_cases.py``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    try:
        from support import notify_cases
    finally:
        sys.path.pop(0)
    size = group.world_size
    for counts in ([3 + 2 * r for r in range(size)], [0] + [4] * (size - 1)):
        for every in (0, 2):
            notify_cases.check_rank(notify_cases.silent_first(group, counts, every))
    counts = [2 + r for r in range(size)]
    result = notify_cases.legitimate(group, counts)
    total = expected_total(counts, group.rank)
    assert result == {"first": total, "twice": 2 * total, "in_hook": total}, result


JOIN_CASES: dict[str, Callable[[Any], None]] = {
    "side-collectives": lambda g: _side_collectives(g, raw=False),
    "side-collectives-alone-raw-comm": lambda g: _side_collectives(g, raw=True),
    "side-collective-not-listed": _side_collective_not_listed,
    "silent-first-joinable": _silent_first_joinable,
    "uneven-1-joinable": lambda g: _uneven(g, 1, raw=False),
    "uneven-3-joinables": lambda g: _uneven(g, 3, raw=False),
    "uneven-1-joinable-raw-comm": lambda g: _uneven(g, 1, raw=True),
    "uneven-3-joinables-raw-comm": lambda g: _uneven(g, 3, raw=True),
    "heartbeat-handle-only-for-first": _heartbeat_handle_only_for_first,
    "enable-false-1-joinable": lambda g: _enable_false(g, 1),
    "enable-false-2-joinables": lambda g: _enable_false(g, 2),
    "throw-1-joinable": lambda g: _throw(g, 1),
    "throw-3-joinables": lambda g: _throw(g, 3),
    "throw-even-inputs": _throw_even,
    "kwargs-forwarded": _kwargs,
    "sub-communicator": _sub_communicator,
    "group-and-raw-comm-in-one-join": _mixed_group_and_comm,
    "counter-tutorial": _counter_tutorial,
    "skew-warning": _skew_warning,
    "progress-line": _progress_line,
}


# -- the program ---------------------------------------------------------------------------


def _cases(group: Any) -> Iterator[tuple[str, Callable[[], None]]]:
    for case in collective_cases():
        yield case, lambda case=case: run_collective(group, case)  # type: ignore[misc]
    for name, fn in BUFFER_CASES.items():
        yield f"buffers/{name}", lambda fn=fn: fn(group)  # type: ignore[misc]
    for name, fn in JOIN_CASES.items():
        yield f"join/{name}", lambda fn=fn: fn(group)  # type: ignore[misc]


def main() -> None:
    from joinkit.backends.mpi import MPIGroup

    group = MPIGroup()
    args = sys.argv[1:]
    out = None
    if args[:1] == ["--out"]:
        out = open(f"{args[1]}/rank-{group.rank}.jsonl", "w")  # noqa: SIM115
        args = args[2:]
    without = {args[i + 1] for i, arg in enumerate(args) if arg == "--without"}
    only = {arg for arg in args if arg != "--without"} - without
    header = {"rank": group.rank, "size": group.world_size}

    def emit(tag: str, line: dict[str, Any]) -> None:
        print(f"{tag} {json.dumps(line)}", file=out, flush=True)

    for case, run in _cases(group):
        if only and case not in only or case in without:
            continue
        try:
            run()
        except Skip as exc:
            status, detail = "skip", str(exc)
        except Exception as exc:
            status = "fail"
            detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
        else:
            status, detail = "ok", ""
        emit("JOINKIT-CASE", {**header, "case": case, "status": status, "detail": detail})
    group.barrier()
    emit("JOINKIT-DONE", header)
    if out is not None:
        out.close()


if __name__ == "__main__":
    main()
