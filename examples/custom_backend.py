"""Plug a collective library joinkit does not ship into Join: ranks as processes
talking over ``multiprocessing`` pipes.

Run it: ``python examples/custom_backend.py`` starts 2 processes (``--ranks N``
for more). Each runs the tutorial's Counter (``examples/counter.py``) with
5 + rank inputs inside ``Join`` over a :class:`PipeGroup`; the parent prints
what each rank reports, in rank order::

    10 inputs processed before rank 0 joined!
    11 inputs processed across all ranks!
    11 inputs processed before rank 1 joined!
    11 inputs processed across all ranks!

What a backend implements (docs/guide/writing-a-backend.md has the table):
``rank`` and ``world_size``; the two join collectives ``heartbeat(value)``
(start a SUM all-reduce of one float, return a handle with ``wait()``) and
``count(value)`` (the same all-reduce, blocking, returning the sum); and
``all_gather_object(obj)`` (the Join's agreement check and failure exchange).
Everything else the joinables' own collectives need (here ``all_reduce`` and
``broadcast``) is up to the backend and its joinables.

The group is a star: rank 0 holds a pipe to every other rank. Every
collective is one all-gather through rank 0 (each rank sends its
contribution, rank 0 sends back the list), then a local reduction. That makes
the heartbeat a blocking exchange; a backend over a library with nonblocking
collectives would start it and return at once. Pipes keep messages in order,
so every rank must issue the same collectives in the same order, which is what
Join guarantees for its own and what the hooks guarantee for the joinables'.

Registering. In code, before the first Join::

    backends.register(PipeGroup, lambda group, device: group)

``kind`` may be a type (instances match, subclasses too) or a predicate, and the
factory turns a joinable's ``join_process_group`` (and ``join_device``) into
the join backend; here the group is its own backend. A package that ships a
backend can instead declare an entry point in the ``joinkit.backends`` group,
so it is found without any import by the user::

    # pyproject.toml of the package "joinkit-pipes"
    [project.entry-points."joinkit.backends"]
    pipes = "joinkit_pipes:resolve"

    # joinkit_pipes/__init__.py
    def resolve(process_group, device):
        # Return a join backend for groups this package handles, else None.
        return process_group if isinstance(process_group, PipeGroup) else None

Entry points are consulted after the in-code registrations, in the order
``importlib.metadata`` lists them.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from joinkit import backends

sys.path.insert(0, str(Path(__file__).resolve().parent))
from counter import NUM_INPUTS, Counter  # noqa: E402  (the tutorial's joinable)

from joinkit import Join  # noqa: E402

_REDUCE: dict[str, Callable[..., Any]] = {
    "sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}


class _Done:
    """The handle of a collective that already completed."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result


class PipeGroup:
    """Collectives over ``multiprocessing`` pipes: a star around rank 0.

    Args:
        rank: this process's rank.
        world_size: the number of ranks.
        pipes: on rank 0, the connections to ranks 1..world_size-1 in order;
            on the other ranks, the one connection to rank 0.
    """

    device = "cpu"

    def __init__(self, rank: int, world_size: int, pipes: list[Connection]) -> None:
        self.rank = rank
        self.world_size = world_size
        self._pipes = pipes

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (the one primitive; blocking)."""
        if self.rank != 0:
            self._pipes[0].send(obj)
            return list(self._pipes[0].recv())
        gathered = [obj] + [pipe.recv() for pipe in self._pipes]
        for pipe in self._pipes:
            pipe.send(gathered)
        return gathered

    # -- the join backend ----------------------------------------------------------

    def heartbeat(self, value: float) -> _Done:
        """The SUM all-reduce of one float32 (float32: the wire type of every backend)."""
        return _Done(self.count(value))

    def count(self, value: float) -> float:
        return float(sum(self.all_gather_object(np.float32(value)), np.float32(0)))

    # -- what the Counter's own collectives need -------------------------------------

    def all_reduce(self, buf: np.ndarray, op: str = "sum") -> np.ndarray:
        parts = self.all_gather_object(np.array(buf))
        buf[...] = _REDUCE[op].reduce(np.stack(parts), axis=0)
        return buf

    def broadcast(self, buf: np.ndarray, src: int) -> np.ndarray:
        buf[...] = self.all_gather_object(np.array(buf) if self.rank == src else None)[src]
        return buf


# The registry now resolves a joinable whose join_process_group is a PipeGroup.
backends.register(PipeGroup, lambda group, device: group)


def rank_main(rank: int, world_size: int, pipes: list[Connection], results: Any) -> None:
    """One rank: the tutorial's loop, 5 + rank inputs, inside Join."""
    group = PipeGroup(rank, world_size, pipes)
    counter = Counter(group)
    try:
        with Join([counter], sync_max_count=True):
            for _ in range(NUM_INPUTS + rank):
                counter()
    except BaseException as exc:
        results.put((rank, exc))  # so the parent stops waiting for this rank
        raise
    results.put((rank, [
        f"{int(counter.count[0])} inputs processed before rank {rank} joined!",
        f"{int(counter.max_count[0])} inputs processed across all ranks!",
    ]))


def main(world_size: int = 2, timeout: float = 60.0) -> list[str]:
    """Start ``world_size`` processes wired as a star; return their lines in rank order."""
    ctx = mp.get_context("spawn")  # a fresh interpreter per rank, as on a cluster
    pipes = [ctx.Pipe() for _ in range(world_size - 1)]  # (rank 0's end, rank r's end)
    hub_ends = [hub for hub, _ in pipes]
    leaf_ends = [leaf for _, leaf in pipes]
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(0, world_size, hub_ends, results))]
    procs += [
        ctx.Process(target=rank_main, args=(rank, world_size, [leaf_ends[rank - 1]], results))
        for rank in range(1, world_size)
    ]
    for proc in procs:
        proc.start()
    reports: dict[int, list[str]] = {}
    try:
        for _ in procs:
            rank, report = results.get(timeout=timeout)
            if isinstance(report, BaseException):
                raise RuntimeError(f"rank {rank} failed: {report!r}") from report
            reports[rank] = report
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():  # a rank that hangs must not outlive the example
                proc.terminate()
    return [line for rank in sorted(reports) for line in reports[rank]]


def _launched_rank() -> int:
    """This process's rank if a launcher (torchrun, mpirun, srun) started it, else 0."""
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


if __name__ == "__main__":
    # This backend makes its own processes. Under a launcher every launched
    # process would start a world of its own, so only the first one runs it.
    if _launched_rank() != 0:
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    for line in main(parser.parse_args().ranks):
        print(line)
