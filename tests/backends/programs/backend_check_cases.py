"""One table of collective calls that every backend must accept or refuse alike.

Theory of operation
-------------------
:data:`CASES` maps a case name to a call on a 2-rank group and what must come
of it: a result (the same on every backend, in plain JSON) or an exception
type and words of its message. ``test_backend_checks.py`` runs the
table on the threads backend in-process, and through this file as a program
on torch (a gloo group over a ``FileStore``) and on MPI (under ``mpirun``)::

    python backend_check_cases.py torch RANK WORLD STORE_FILE OUT_DIR
    mpirun -n 2 python backend_check_cases.py mpi OUT_DIR

Each rank writes ``OUT_DIR/rank{RANK}.json``: case name -> its outcome (see
:func:`run_cases`). Every call is the same on every rank (a root that differs
by rank is written ``g.rank``), so a refusal happens on every rank before any
communication; after each case the ranks all-reduce once, which shows they are
still in step. Cases that need torch report ``skip`` where it is missing.

Importing this module imports neither torch nor mpi4py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WORLD = 2
HAVE_TORCH = importlib.util.find_spec("torch") is not None


@dataclass(frozen=True)
class Case:
    call: Callable[[Any], Any]
    #: the result, as :func:`_plain` writes it (``per_rank``: a list of each
    #: rank's); ``None`` when the call is refused
    result: Any = None
    per_rank: bool = False
    #: (exception type name, words of its message) when the call is refused
    refused: tuple[str, str] | None = None
    needs_torch: bool = False


def _torch() -> Any:
    import torch

    return torch


def _readonly(n: int = 2) -> np.ndarray:
    arr = np.ones(n)
    arr.flags.writeable = False
    return arr


def _strided(dtype: str = "float64") -> np.ndarray:
    """Ranks' values in every other element of a bigger array: 1 + rank, 2 + rank, ..."""
    return np.zeros((3, 2), dtype)[:, 0]


def _filled(buf: np.ndarray, g: Any) -> np.ndarray:
    """``buf`` holding ``1 + rank, 2 + rank, ...``."""
    buf[:] = np.arange(1, len(buf) + 1) + g.rank
    return buf


def _plain(value: Any) -> Any:
    """``value`` (buffers, lists of them, None) as JSON: complex as [re, im]."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if not isinstance(value, np.ndarray):
        value = value.detach().resolve_conj().numpy()
    if value.dtype.kind == "c":
        return [[v.real, v.imag] for v in value.tolist()]
    return value.tolist()


def _non_contiguous_all_reduce_keeps_the_rest(g: Any) -> Any:
    big = np.full((3, 2), -1.0)
    view = big[:, 0]
    view[:] = [1.0 + g.rank, 2.0, 3.0]
    g.all_reduce(view)
    return big


def _tensor_strided(g: Any) -> Any:
    torch = _torch()
    big = torch.full((3, 2), -1.0)
    big[:, 0] = torch.tensor([1.0 + g.rank, 2.0, 3.0])
    g.all_reduce(big[:, 0])
    return big


def _tensor_conjugate(g: Any) -> Any:
    torch = _torch()
    z = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64).conj()
    g.all_reduce(z)
    return z


def _overlapping(n: int = 3) -> np.ndarray:
    """A writable array of ``n`` elements at one address (a stride of 0)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1), shape=(n,), strides=(0,))


def _expanded_gather(g: Any) -> Any:
    """An expand()ed tensor is read as its values: gloo given it raw reads past it."""
    torch = _torch()
    return g.all_gather(torch.full((1,), 1.0 + g.rank).expand(3))


def _expanded_chunks(g: Any) -> Any:
    torch = _torch()
    buf = torch.zeros(3)
    chunks = torch.arange(3.0).expand(2, 3)  # both rows are one row's memory
    g.scatter(buf, src=0, chunks=chunks if g.rank == 0 else None)
    return buf


def _scatter_strided(g: Any) -> Any:
    buf = _strided()
    chunks = np.arange(12, dtype=np.float64).reshape(2, 3, 2)[:, :, 1]  # not contiguous
    g.scatter(buf, src=0, chunks=chunks if g.rank == 0 else None)
    return buf


def _async_strided(g: Any) -> Any:
    big = np.zeros((2, 2))
    big[:, 1] = [1.0, 2.0 + g.rank]
    handle = g.all_reduce(big[:, 1], op="max", async_op=True)
    assert handle.wait() is not None
    return big


def _handle(g: Any) -> Any:
    buf = np.array([1.0 + g.rank])
    handle = g.all_reduce(buf, async_op=True)
    assert handle.wait() is buf and handle.wait() is buf, "wait() returns the buffer"
    assert handle.is_completed() is True
    return buf


def _t(make: Callable[[Any], Any], call: Callable[[Any, Any], Any]) -> Callable[[Any], Any]:
    """A call on a tensor ``make(torch)``."""
    return lambda g: call(g, make(_torch()))


_ONES = np.ones(2)
CASES: dict[str, Case] = {
    # -- reduce ops ---------------------------------------------------------------------
    "op/unknown": Case(
        lambda g: g.all_reduce(np.ones(2), op="avg"),
        refused=("ValueError", "all_reduce: unknown reduce op 'avg'; use one of sum")),
    "op/not-a-string": Case(lambda g: g.reduce(np.ones(2), dst=0, op=None),
                            refused=("ValueError", "reduce: unknown reduce op None")),
    "op/bitwise-on-float": Case(
        lambda g: g.all_reduce(np.ones(2), op="band"),
        refused=("TypeError", "all_reduce: op 'band' is not defined for dtype float64: bitwise")),
    "op/max-on-complex": Case(
        lambda g: g.reduce(np.ones(2, np.complex64), dst=0, op="max"),
        refused=("TypeError", "reduce: op 'max' is not defined for dtype complex64: complex "
                              "buffers reduce with 'sum' only")),
    "op/prod-on-complex": Case(
        lambda g: g.all_reduce(np.ones(2, np.complex128), op="prod"),
        refused=("TypeError", "all_reduce: op 'prod' is not defined for dtype complex128")),
    "op/prod-on-complex-tensor": Case(
        _t(lambda torch: torch.ones(2, dtype=torch.complex64),
           lambda g, t: g.all_reduce(t, op="prod")),
        refused=("TypeError", "op 'prod' is not defined for dtype torch.complex64"),
        needs_torch=True),
    "op/sum-on-complex": Case(
        lambda g: g.all_reduce(np.array([1 + 1j, 2 * g.rank - 1j])),
        result=[[2.0, 2.0], [2.0, -2.0]]),
    "op/bool-prod-is-and": Case(
        lambda g: g.all_reduce(np.array([True, g.rank == 0, False]), op="prod"),
        result=[True, False, False]),
    "op/bool-sum-is-or": Case(
        lambda g: g.all_reduce(np.array([True, g.rank == 0, False]), op="sum"),
        result=[True, True, False]),
    "op/int8-bxor": Case(lambda g: g.all_reduce(np.array([1, 3], np.int8) + g.rank, op="bxor"),
                         result=[3, 7]),
    # -- dtypes and buffer kinds ----------------------------------------------------------
    "dtype/float16": Case(lambda g: g.all_reduce(np.ones(2, np.float16)),
                          refused=("TypeError", "all_reduce: the buffer has dtype float16, but "
                                                "joinkit's collectives take")),
    "dtype/uint64": Case(lambda g: g.broadcast(np.ones(2, np.uint64), src=0),
                         refused=("TypeError", "broadcast: the buffer has dtype uint64")),
    "dtype/string": Case(lambda g: g.all_gather(np.array(["a"])),
                         refused=("TypeError", "all_gather: the buffer has dtype <U1")),
    "dtype/bfloat16-tensor": Case(
        _t(lambda torch: torch.ones(2, dtype=torch.bfloat16), lambda g, t: g.all_reduce(t)),
        refused=("TypeError", "all_reduce: the buffer has dtype torch.bfloat16"),
        needs_torch=True),
    "buffer/list": Case(lambda g: g.all_reduce([1.0, 2.0]),
                        refused=("TypeError", "all_reduce: buffers must be NumPy arrays or "
                                              "torch tensors, got builtins.list")),
    "buffer/read-only-all_reduce": Case(lambda g: g.all_reduce(_readonly()),
                                        refused=("ValueError", "all_reduce: the buffer is "
                                                               "read-only")),
    "buffer/read-only-broadcast": Case(lambda g: g.broadcast(_readonly(), src=0),
                                       refused=("ValueError", "broadcast: the buffer is "
                                                              "read-only")),
    "buffer/read-only-reduce": Case(lambda g: g.reduce(_readonly(), dst=0),
                                    refused=("ValueError", "reduce: the buffer is read-only")),
    "buffer/read-only-gather": Case(lambda g: g.gather(_readonly(), dst=0),  # writes no buf
                                    result=[[[1.0, 1.0], [1.0, 1.0]], None], per_rank=True),
    "buffer/meta-tensor": Case(
        _t(lambda torch: torch.ones(2, device="meta"), lambda g, t: g.all_reduce(t)),
        refused=("TypeError", "all_reduce: the buffer is on meta, but this group's "
                              "collectives run on cpu; move it there with .cpu()"),
        needs_torch=True),
    "buffer/sparse-tensor": Case(
        _t(lambda torch: torch.ones(2).to_sparse(), lambda g, t: g.all_reduce(t)),
        refused=("TypeError", "all_reduce: the buffer has layout torch.sparse_coo"),
        needs_torch=True),
    "buffer/non-contiguous-array": Case(_non_contiguous_all_reduce_keeps_the_rest,
                                        result=[[3.0, -1.0], [4.0, -1.0], [6.0, -1.0]]),
    "buffer/non-contiguous-tensor": Case(_tensor_strided,
                                         result=[[3.0, -1.0], [4.0, -1.0], [6.0, -1.0]],
                                         needs_torch=True),
    "buffer/conjugate-tensor": Case(_tensor_conjugate, result=[[2.0, -2.0], [4.0, 2.0]],
                                    needs_torch=True),
    "buffer/non-contiguous-async": Case(_async_strided, result=[[0.0, 1.0], [0.0, 3.0]]),
    "handle/wait-twice": Case(_handle, result=[3.0]),
    # Elements sharing memory: written, refused on every rank before anything is sent
    # (gloo, handed an expand()ed tensor, writes past its storage: a heap corruption);
    # read, fine.
    "buffer/overlapping-tensor-all_reduce": Case(
        _t(lambda torch: torch.ones(1).expand(3), lambda g, t: g.all_reduce(t)),
        refused=("ValueError", "all_reduce: the buffer's elements share memory (shape (3,), "
                               "strides (0,): an expand()ed, broadcast or as_strided view), "
                               "but all_reduce writes a result into each element; pass a "
                               "buffer of its own, e.g. t.clone()"),
        needs_torch=True),
    "buffer/overlapping-array-broadcast": Case(
        lambda g: g.broadcast(_overlapping(), src=0),
        refused=("ValueError", "broadcast: the buffer's elements share memory (shape (3,), "
                               "strides (0,)")),
    "buffer/overlapping-array-reduce": Case(
        lambda g: g.reduce(_overlapping(), dst=0),
        refused=("ValueError", "reduce: the buffer's elements share memory")),
    "buffer/overlapping-tensor-scatter": Case(
        _t(lambda torch: torch.zeros(2, 1).expand(2, 3),
           lambda g, t: g.scatter(t, src=0, chunks=[t, t] if g.rank == 0 else None)),
        refused=("ValueError", "scatter: the buffer's elements share memory (shape (2, 3), "
                               "strides (1, 0)"),
        needs_torch=True),
    "buffer/overlapping-tensor-all_gather": Case(_expanded_gather,
                                                 result=[[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]],
                                                 needs_torch=True),
    "buffer/overlapping-array-gather": Case(
        lambda g: g.gather(np.broadcast_to(np.float64(1 + g.rank), (3,)), dst=1),
        result=[None, [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]], per_rank=True),
    "buffer/overlapping-scatter-chunks": Case(_expanded_chunks,
                                              result=[[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]],
                                              per_rank=True, needs_torch=True),
    "buffer/non-contiguous-broadcast": Case(
        lambda g: g.broadcast(_filled(_strided(), g), src=1), result=[2.0, 3.0, 4.0]),
    "buffer/non-contiguous-reduce": Case(
        lambda g: g.reduce(_filled(_strided("int64"), g), dst=0),
        result=[[3, 5, 7], [2, 3, 4]], per_rank=True),
    "buffer/non-contiguous-gather": Case(
        lambda g: g.all_gather(_filled(_strided("int32"), g)),
        result=[[1, 2, 3], [2, 3, 4]]),
    # -- roots ----------------------------------------------------------------------------
    "root/out-of-range": Case(lambda g: g.broadcast(np.ones(2), src=2),
                              refused=("ValueError", "broadcast: src=2 is not a rank of this "
                                                     "group (world size 2)")),
    "root/negative": Case(lambda g: g.gather(np.ones(2), dst=-1),
                          refused=("ValueError", "gather: dst=-1 is not a rank")),
    "root/string": Case(lambda g: g.broadcast(np.ones(2), src="0"),
                        refused=("TypeError", "broadcast: src must be an int rank, got str")),
    "root/float": Case(lambda g: g.reduce(np.ones(2), dst=0.0),
                       refused=("TypeError", "reduce: dst must be an int rank, got float")),
    "root/numpy-int": Case(lambda g: g.broadcast(_filled(np.zeros(2), g), src=np.int64(1)),
                           result=[2.0, 3.0]),
    # -- scatter chunks -------------------------------------------------------------------
    "scatter/no-chunks-on-source": Case(
        lambda g: g.scatter(np.ones(2), src=g.rank),
        refused=("ValueError", "is the source and must pass chunks (one buffer per rank, 2")),
    "scatter/chunks-elsewhere": Case(
        lambda g: g.scatter(np.ones(2), src=1 - g.rank, chunks=[_ONES, _ONES]),
        refused=("ValueError", "scatter: only the source rank")),
    "scatter/chunk-count": Case(
        lambda g: g.scatter(np.ones(2), src=g.rank, chunks=[_ONES]),
        refused=("ValueError", "scatter: needs 2 chunks (one per rank), got 1")),
    "scatter/chunk-shape": Case(
        lambda g: g.scatter(np.ones(2), src=g.rank, chunks=[np.ones(3)] * 2),
        refused=("ValueError", "scatter: chunks[0] has shape (3,), but buf has (2,)")),
    "scatter/stacked-shape": Case(
        lambda g: g.scatter(np.ones(2), src=g.rank, chunks=np.ones((3, 2))),
        refused=("ValueError", "scatter: chunks as one buffer must have shape (2, 2)")),
    "scatter/chunk-dtype": Case(
        lambda g: g.scatter(np.ones(2), src=g.rank, chunks=[np.ones(2, np.int64)] * 2),
        refused=("TypeError", "scatter: chunks[0] has dtype int64, but buf has float64")),
    "scatter/chunk-not-a-buffer": Case(
        lambda g: g.scatter(np.ones(2), src=g.rank, chunks=[[1.0, 2.0]] * 2),
        refused=("TypeError", "scatter chunks[0]: buffers must be NumPy arrays")),
    "scatter/non-contiguous": Case(_scatter_strided, result=[[1.0, 3.0, 5.0], [7.0, 9.0, 11.0]],
                                   per_rank=True),
}


def run_cases(g: Any) -> dict[str, dict[str, Any]]:
    """Run every case on group ``g``; case name -> outcome.

    An outcome is ``{"outcome": "ok", "result": ...}``, ``{"outcome": <exception
    type name>, "message": ...}`` or ``{"outcome": "skip"}``, plus ``"in_step"``:
    whether the all-reduce after the case summed every rank.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, case in CASES.items():
        if case.needs_torch and not HAVE_TORCH:
            out[name] = {"outcome": "skip"}
            continue
        try:
            value = case.call(g)
        except Exception as exc:
            record: dict[str, Any] = {"outcome": type(exc).__name__, "message": str(exc)}
            if not isinstance(exc, (TypeError, ValueError)):
                record["traceback"] = traceback.format_exc(limit=8)
        else:
            record = {"outcome": "ok", "result": _plain(value)}
        ones = np.ones(1, np.int64)
        g.all_reduce(ones)
        record["in_step"] = int(ones[0]) == g.world_size
        out[name] = record
    return out


def main() -> None:
    kind, *args = sys.argv[1:]
    if kind == "torch":
        import datetime

        import torch.distributed as dist

        from joinkit.backends.torch_dist import TorchGroup

        rank, world, store, out = int(args[0]), int(args[1]), args[2], Path(args[3])
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        group: Any = TorchGroup()
    else:
        from joinkit.backends.mpi import MPIGroup

        group = MPIGroup()
        out = Path(args[0])
    outcomes = run_cases(group)
    (out / f"rank{group.rank}.json").write_text(json.dumps(outcomes, indent=1))
    group.barrier()
    if kind == "torch":
        from joinkit.backends import torch_dist

        torch_dist.settle_at_exit()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
