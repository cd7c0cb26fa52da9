"""Run elastic kill cells on gloo: ranks forked from a parent that hosts the store.

Theory of operation
-------------------
``python elastic_torch_runner.py --out DIR CELL [CELL ...]``: this
process imports torch once, hosts a ``TCPStore`` (so the store outlives any
rank, as a launcher's would) and, for each ``CELL``, forks its ranks, which
initialise a gloo group over the store under a prefix of their own and run
one Join with ``on_rank_loss="finish"`` over a :class:`Trainer` (a Counter
and a small linear model in one joinable: per input, a heartbeat, then ONE
all-reduce of the gradient and a 1, divided by the initial world size).

A ``CELL`` is ``W:KILLS`` with ``KILLS`` a ``+``-joined list of
``rank/point/at``: ``point`` one of ``body`` (in the loop body before input
``at``'s notify), ``beat`` (after input ``at``'s heartbeat, before its
all-reduce), ``drain`` (in its main hook, shadow round ``at``), ``post`` (in
its post hook), ``recovery`` (on entering the recovery, after registering as
alive: a kill during the recovery), or ``hookraise`` (its main hook raises at
shadow round ``at``: an error, which ends the Join on every rank as with
``on_rank_loss="raise"``), ``bodyraise`` (its loop body raises before input
``at``'s notify). Rank ``r`` has ``INPUTS + r`` inputs.
Each rank writes ``DIR/cell{C}-rank{R}.json``: its result (count, parameters,
the report's lost ranks, the wall-clock times of its completed all-reduces) or,
for a killed rank, the time of its death. The parent gives each cell
``--deadline`` s, kills what is left and records exit statuses in
``DIR/cells.jsonl``. With ``--mpirun`` the parent still hosts the store but
runs each cell under ``mpirun --with-ft ulfm`` (which keeps the survivors);
the ranks never initialise MPI and read their rank from mpirun's environment.
A cell ending in ``@0`` has rank 0 host its own store instead
(``init_process_group``'s way), so rank 0's death cannot be recovered.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from support.fork import fork_ranks, hosted_store, preload, run_under_mpirun

INPUTS = int(os.environ.get("ELASTIC_INPUTS", "8"))
#: ``on_rank_loss`` of the cells' Joins (the benchmark times "raise" beside it).
MODE = os.environ.get("ELASTIC_MODE", "finish")
#: Seconds a rank whose hook raised stays alive after leaving the Join.
HOLD_AFTER_RAISE = 10.0
DIM = 4
LR = 0.05
POINTS = ("body", "beat", "drain", "post", "recovery", "hookraise", "bodyraise")


def parse(cell: str) -> tuple[int, list[tuple[int, str, int]]]:
    world, _, kills = cell.partition(":")
    kills = kills.removesuffix("@0")
    if kills == "refusals":
        return int(world), []
    out = []
    for item in filter(None, kills.split("+")):
        rank, point, at = item.split("/")
        assert point in POINTS, point
        out.append((int(rank), point, int(at)))
    return int(world), out


def sample(rank: int, index: int) -> tuple[np.ndarray, float]:
    """Input ``index`` of ``rank``: a deterministic (x, y)."""
    rng = np.random.default_rng(1000 * rank + index)
    x = rng.standard_normal(DIM)
    return x, float(x.sum() * 0.5 + rng.standard_normal() * 0.1)


def reference(world: int, consumed: dict[int, int]) -> tuple[np.ndarray, dict[int, float]]:
    """The single-process run over exactly the consumed inputs.

    Args:
        world: the initial world size (the divisor).
        consumed: rank -> how many of its inputs were consumed.

    Returns:
        The final parameters and every rank's Counter total (over its inputs).
    """
    w = np.zeros(DIM)
    counts = {rank: 0.0 for rank in consumed}
    for t in range(max(consumed.values())):
        contributors = [r for r, n in consumed.items() if t < n]
        grad = np.zeros(DIM)
        for r in contributors:
            x, y = sample(r, t)
            grad += (w @ x - y) * x
        w = w - LR * grad / world
        for r in contributors:
            counts[r] += len(contributors)
    return w, counts


class _Die:
    def __init__(self, rank: int, kills: list[tuple[int, str, int]], out: Path) -> None:
        self.points = {(point, at) for r, point, at in kills if r == rank}
        self.out = out

    def maybe(self, point: str, at: int = 0) -> None:
        if (point, at) in self.points:
            self.now(point)

    def now(self, point: str) -> None:
        self.out.write_text(json.dumps({"killed": point, "time": time.time()}))
        os.kill(os.getpid(), signal.SIGKILL)


def run_rank(rank: int, world: int, kills: list[tuple[int, str, int]], host: str, port: int,
             cell: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from joinkit import Join, Joinable, JoinHook
    from joinkit.backends.torch_dist import TorchGroup
    from joinkit.backends.torch_dist import _elastic as _torch_elastic

    path = out / f"cell{cell}-rank{rank}.json"
    die = _Die(rank, kills, path)
    host0 = port < 0  # rank 0 hosts the store itself (init_process_group's way)
    port = abs(port)
    if os.environ.get("ELASTIC_DEBUG"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["ELASTIC_DEBUG"]))
    client = dist.TCPStore(host, port, world, host0 and rank == 0,
                           datetime.timedelta(seconds=30), wait_for_workers=False)
    store = dist.PrefixStore(f"cell{cell}/", client)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    group = TorchGroup(store_outlives_ranks=not host0)
    if any(r == rank and p == "recovery" for r, p, _ in kills):
        original = _torch_elastic.Elastic._decide

        def decide_then_die(self: Any, generation: int, expected: list[int]) -> Any:
            self.store.set(self.key(generation, f"alive/{self.initial_rank}"), "1")
            die.now("recovery")
            return original(self, generation, expected)

        _torch_elastic.Elastic._decide = decide_then_die  # type: ignore[method-assign]

    times: list[float] = []

    class Hook(JoinHook):
        def __init__(self, trainer: Trainer) -> None:
            self.trainer = trainer
            self.shadows = 0

        def main_hook(self) -> None:
            die.maybe("drain", self.shadows)
            if ("hookraise", self.shadows) in die.points:  # an error, not a death
                raise RuntimeError(f"injected main_hook fault on rank {rank}")
            self.shadows += 1
            self.trainer.sync(np.zeros(DIM + 1))

        def post_hook(self, is_last_joiner: bool) -> None:
            die.maybe("post")
            ones = np.ones(1)
            self.trainer.group.all_reduce(ones)
            self.trainer.post_total = float(ones[0])

    class Trainer(Joinable):
        def __init__(self) -> None:
            super().__init__()
            self.group = group
            self.w = np.zeros(DIM)
            self.count = 0.0
            self.post_total = 0.0

        def sync(self, buf: np.ndarray) -> np.ndarray:
            self.group.all_reduce(buf)
            times.append((time.time(), self.group.world_size))
            self.w = self.w - LR * buf[:DIM] / world
            return buf

        def step(self, index: int) -> None:
            die.maybe("body", index)
            if ("bodyraise", index) in die.points:  # the loop body's own error
                raise ValueError(f"injected loop body fault on rank {rank}")
            Join.notify_join_context(self)
            die.maybe("beat", index)
            x, y = sample(rank, index)
            buf = np.concatenate([(self.w @ x - y) * x, [1.0]])
            self.count += float(self.sync(buf)[DIM])

        def join_hook(self, **kwargs: Any) -> JoinHook:
            return Hook(self)

        @property
        def join_device(self) -> Any:
            return torch.device("cpu")

        @property
        def join_process_group(self) -> Any:
            return self.group

    trainer = Trainer()
    started = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with Join([trainer], on_rank_loss=MODE) as join:
                for index in range(INPUTS + rank):
                    trainer.step(index)
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            path.write_text(json.dumps({"rank": rank, "error": type(exc).__name__,
                                        "message": str(exc), "ended": time.time()}))
            if any(r == rank and p == "hookraise" for r, p, _ in kills):
                # Stay alive a while: the peers must learn of the abort from the
                # store, not from this process's sockets closing.
                time.sleep(HOLD_AFTER_RAISE)
            return
    report = join.report if hasattr(join, "report") else None
    lost = [] if report is None else [
        {"rank": lost.rank, "iterations": lost.iterations, "survivors": list(lost.survivors),
         "detected": lost.detected} for lost in report.lost_ranks]
    path.write_text(json.dumps({
        "rank": rank, "count": trainer.count, "w": trainer.w.tolist(), "lost": lost,
        "group_lost": [x.rank for x in group.lost_ranks()],
        "post_total": trainer.post_total, "times": times, "started": started,
        "size": group.world_size, "warnings": [str(w.message) for w in caught],
        "ended": time.time(),
    }))


def run_refusals(rank: int, world: int, host: str, port: int, cell: int, out: Path) -> None:
    """What ``on_rank_loss="finish"`` refuses or warns about, on every rank, before any
    collective (the next collective after each refusal must still match)."""
    import torch
    import torch.distributed as dist
    from support import Counter

    from joinkit import Join
    from joinkit.backends.torch_dist import TorchGroup

    client = dist.TCPStore(host, port, world, False, datetime.timedelta(seconds=30))
    store = dist.PrefixStore(f"cell{cell}/", client)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    found: dict[str, Any] = {}

    from joinkit.adapters import UnsupportedTorchError

    def refusal(joinables: list[Any]) -> str:
        """The ValueError a finish-mode Join over ``joinables`` raises on entry (or the
        UnsupportedTorchError of a torch that cannot run one of them at all)."""
        try:
            with Join(joinables, on_rank_loss="finish"):
                pass
        except (ValueError, UnsupportedTorchError) as exc:
            return str(exc)
        return "(not refused)"

    # A raw ProcessGroup (ZeroRedundancyOptimizer's; DDP alone works: test_elastic_ddp.py).
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = ZeroRedundancyOptimizer(torch.nn.Linear(2, 1).parameters(), torch.optim.SGD, lr=0.1)
    found["ddp"] = refusal([model])
    group = TorchGroup()  # a TCPStore: taken to live in rank 0
    os.environ["TORCHELASTIC_RUN_ID"] = "test"  # as under torchrun
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counter = Counter(group)
        with Join([counter], on_rank_loss="finish"):
            counter()
    del os.environ["TORCHELASTIC_RUN_ID"]
    found["warnings"] = [str(w.message) for w in caught]
    # DDP beside a joinable whose TorchGroup could be rebuilt (same default
    # group): the adapter refuses as the Join hands out its config.
    found["mixed"] = refusal([Counter(group), model])
    # DDP follows a rebuilt group only alone (two wrappers of one group otherwise).
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(torch.nn.Linear(2, 1))
    found["ddp_mixed"] = refusal([Counter(group), ddp])
    # FSDP2 beside the same Counter (it works only as [model] or [model, optimizer]).
    from torch.distributed.fsdp import fully_shard

    sharded = fully_shard(torch.nn.Linear(2, 2))
    found["fsdp"] = refusal([Counter(group), sharded])
    zero = ZeroRedundancyOptimizer(torch.nn.Linear(2, 2).parameters(),
                                   optimizer_class=torch.optim.Adam, lr=0.1)
    found["zero"] = refusal([Counter(group), zero])
    after = Counter(group)  # the next Join's collectives still match
    with Join([after], on_rank_loss="finish"):
        after()
    found["after"] = after.count
    found["count"] = counter.count
    found["lost"] = list(group.lost_ranks())
    found["initial_rank"] = group.initial_rank
    (out / f"cell{cell}-rank{rank}.json").write_text(json.dumps(found))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cell(rank: int, *, spec: str, world: int, kills: list[tuple[int, str, int]], port: int,
          cell: int, out: Path, store_port: int) -> None:
    """One forked rank of a cell."""
    if spec.endswith(":refusals"):
        run_refusals(rank, world, "127.0.0.1", store_port, cell, out)
    else:
        run_rank(rank, world, kills, "127.0.0.1", port, cell, out)


def run_cells(args: argparse.Namespace) -> None:
    preload()  # once, before forking (elastic_fork.PRELOAD)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = hosted_store()  # not a thread of this process: it forks
    for cell, spec in enumerate(args.cells):
        world, kills = parse(spec)
        started = time.monotonic()
        # "@0": rank 0 hosts the cell's store (a negative port says so).
        port = -_free_port() if spec.endswith("@0") else server.port

        statuses = fork_ranks(world, args.deadline, functools.partial(
            _cell, spec=spec, world=world, kills=kills, port=port, cell=cell, out=out,
            store_port=server.port))
        record = {"cell": cell, "spec": spec, "seconds": time.monotonic() - started,
                  "exit": {str(r): statuses[r] for r in sorted(statuses)}}
        with (out / "cells.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=40.0)
    parser.add_argument("--mpirun", action="store_true",
                        help="run each cell under mpirun --with-ft ulfm")
    parser.add_argument("--as-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cell", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("cells", nargs="+")
    args = parser.parse_args()
    if args.as_rank:  # one rank under mpirun: the port of the parent's store
        world, kills = parse(args.cells[0])
        run_rank(int(os.environ["OMPI_COMM_WORLD_RANK"]), world, kills, "127.0.0.1",
                 args.as_rank, args.cell, Path(args.out))
    elif args.mpirun:
        run_under_mpirun(__file__, Path(args.out), args.cells, args.deadline,
                         lambda spec: parse(spec)[0])
    else:
        run_cells(args)


if __name__ == "__main__":
    main()
