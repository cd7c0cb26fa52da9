"""One rank of the elastic MPI kill matrix (run by test_elastic_mpi.py).

Usage: ``mpirun --with-ft ulfm -n N python elastic_mpi_program.py CELLS``
where CELLS is a JSON list of cells, each::

    {"name": str, "inputs": {"<original rank>": n, ...},
     "kills": [{"rank": r, "where": "body" | "between" | "drain" | "post" |
                "recovery", "at": k}]}

``body`` kills rank r in its loop body before the heartbeat of input k;
``between`` after that heartbeat, before the iteration's all-reduce;
``drain`` in its main hook of shadow round k (it joined); ``post`` in its post
hook; ``recovery`` inside the next recovery of the group (after the shrink).
Kills are SIGKILL. A cell may also name ``"masked": [r, ...]``: on those ranks
the group's communicator reports a failure as ``MPI_ERR_OTHER`` until the
first recovery replaces it, as Open MPI's nonblocking collectives sometimes do
(:class:`MaskingComm`). Each survivor prints one JSON line per cell (its numbers,
report and iteration times); each victim prints one line just before it dies.
elastic_mpi_support.py says the rest.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic_mpi_support import DIM, LR, gradient  # noqa: E402

from joinkit import Join, Joinable, JoinHook  # noqa: E402
from joinkit.backends.mpi import MPIGroup, finalize_or_exit  # noqa: E402


def die(cell: str, rank: int, where: str, completed: int) -> None:
    """SIGKILL this rank, after saying when and how many rounds it completed."""
    print(json.dumps({"death": cell, "rank": rank, "where": where, "t": time.time(),
                      "completed": completed}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class _MaskingRequest:
    def __init__(self, request: MPI.Request) -> None:
        self._request = request

    def Wait(self) -> None:  # noqa: N802 - mpi4py's name
        try:
            self._request.Wait()
        except MPI.Exception as error:
            if error.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED):
                raise MPI.Exception(MPI.ERR_OTHER) from error
            raise


class MaskingComm:
    """A communicator whose nonblocking collectives report a dead peer or a
    revocation as ``MPI_ERR_OTHER``. Open MPI's ``coll/libnbc`` does that when a
    request of a later round fails as it is posted (the error class is lost in
    the round's start); here it happens every time, not by a race."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if name in ("Iallreduce", "Iallgather", "Ibarrier"):
            return lambda *args: _MaskingRequest(attr(*args))
        return attr


class TrainerHook(JoinHook):
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.rounds = 0

    def main_hook(self) -> None:
        # Shadow the iteration's one all-reduce with zeros (gradient and count).
        self.rounds += 1
        trainer = self.trainer
        if trainer.kill == ("drain", self.rounds):
            die(trainer.cell, trainer.me, "drain", len(trainer.ends))
        trainer.reduce(np.zeros(DIM + 1))

    def post_hook(self, is_last_joiner: bool) -> None:
        trainer = self.trainer
        if trainer.kill is not None and trainer.kill[0] == "post":
            die(trainer.cell, trainer.me, "post", len(trainer.ends))
        # Collectives after the loop: the counter's total and the parameters agree.
        count = np.array([trainer.count])
        trainer.group.all_reduce(count, op="max")
        low, high = trainer.w.copy(), trainer.w.copy()
        trainer.group.all_reduce(low, op="min")
        trainer.group.all_reduce(high, op="max")
        trainer.agree = bool(count[0] == trainer.count and (low == high).all())
        trainer.ends.append(time.time())


class Trainer(Joinable):
    """A linear model and a counter: one all-reduce of [gradient, 1] per iteration."""

    def __init__(self, group: MPIGroup, cell: str, kill: tuple[str, int] | None) -> None:
        super().__init__()
        self.group = group
        self.cell = cell
        self.me = group.initial_rank
        self.kill = kill
        self.divisor = group.world_size  # divide_by_initial_world_size
        self.w = np.zeros(DIM)
        self.count = 0.0
        self.ends: list[float] = []
        self.agree = False

    def reduce(self, buf: np.ndarray) -> None:
        self.group.all_reduce(buf)
        self.w = self.w - LR * buf[:DIM] / self.divisor
        self.count += float(buf[DIM])
        self.ends.append(time.time())

    def step(self, i: int) -> None:
        if self.kill == ("body", i):
            die(self.cell, self.me, "body", len(self.ends))
        Join.notify_join_context(self)
        if self.kill == ("between", i):
            die(self.cell, self.me, "between", len(self.ends))
        self.reduce(np.append(gradient(self.w, self.me, i), 1.0))

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return TrainerHook(self)

    @property
    def join_device(self) -> Any:
        return "cpu"

    @property
    def join_process_group(self) -> Any:
        return self.group


def run_cell(group: MPIGroup, cell: dict[str, Any]) -> None:
    me = group.initial_rank
    name = cell["name"]
    kill = None
    in_recovery = False
    for k in cell["kills"]:
        if k["rank"] == me:
            if k["where"] == "recovery":
                in_recovery = True
            else:
                kill = (k["where"], int(k.get("at", 0)))
    trainer = Trainer(group, name, kill)
    if in_recovery:
        group._recovery_hook = lambda attempt: die(name, me, "recovery", len(trainer.ends))
    out: dict[str, Any] = {"cell": name, "rank": me, "world": group.world_size}
    started = time.time()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            join = Join([trainer], on_rank_loss="finish")
            with join:
                if me in cell.get("masked", ()):
                    group.comm = MaskingComm(group.comm)  # type: ignore[assignment]
                for i in range(1, int(cell["inputs"][str(me)]) + 1):
                    trainer.step(i)
        report = join.report
        assert report is not None
        out.update(
            ok=True,
            lost=[attrs.asdict(lost) for lost in report.lost_ranks],
            outcome=report.outcome,
            warnings=[str(w.message) for w in caught if "was lost" in str(w.message)],
        )
    except BaseException as error:  # noqa: BLE001 - reported to the test
        out.update(ok=False, error="".join(traceback.format_exception(error)))
    group._recovery_hook = None
    out.update(w=trainer.w.tolist(), count=trainer.count, agree=trainer.agree,
               ends=trainer.ends, started=started, size_after=group.world_size)
    print(json.dumps(out), flush=True)


class RawCounter(Joinable):
    """A joinable whose group is the raw communicator (refused in finish mode)."""

    def __init__(self) -> None:
        super().__init__()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()

    @property
    def join_device(self) -> Any:
        return "cpu"

    @property
    def join_process_group(self) -> Any:
        return MPI.COMM_WORLD


def refusals() -> None:
    """The entry errors, each on every rank before any collective; then the
    group still works (one all-reduce in step)."""
    group = MPIGroup()
    errors = []
    for joinable in (Trainer(group, "refusal", None), RawCounter()):
        try:
            with Join([joinable], on_rank_loss="finish"):
                pass
            errors.append("entered")
        except ValueError as error:
            errors.append(str(error))
    total = np.ones(1)
    group.all_reduce(total)
    print(json.dumps({"rank": group.rank, "errors": errors, "total": float(total[0])}),
          flush=True)
    finalize_or_exit()


def raise_mode() -> None:
    """The default, on_rank_loss="raise", under ULFM: rank 1 dies at its 3rd input;
    each survivor prints the error that left its Join, with its notes."""
    group = MPIGroup()
    trainer = Trainer(group, "raise", ("body", 3) if group.rank == 1 else None)
    started = time.time()
    try:
        with Join([trainer]):
            for i in range(1, 7):
                trainer.step(i)
        text = "no error"
    except Exception as error:  # noqa: BLE001 - reported to the test
        text = "".join(traceback.format_exception_only(error))
        text += "\n".join(getattr(error, "__notes__", []))
    print(json.dumps({"rank": group.rank, "error": text, "seconds": time.time() - started}),
          flush=True)
    finalize_or_exit()


def main() -> None:
    # A hang shows where, on standard error, well before the test's timeout.
    faulthandler.dump_traceback_later(60, exit=True)
    if sys.argv[1] == "refusals":
        refusals()
        return
    if sys.argv[1] == "raise":
        raise_mode()
        return
    cells = json.loads(sys.argv[1])
    group = MPIGroup()
    for cell in cells:
        run_cell(group, cell)
    finalize_or_exit()  # after a rank loss MPI_Finalize can hang (docs/elastic.md)


if __name__ == "__main__":
    main()
