"""A worker of the elastic kill matrix under ``python -m joinkit run`` (test_joinkit_run.py).

Usage: ``python -m joinkit run [torchrun's arguments] elastic_run_program.py
OUT CELL [CELL ...]``. Each worker builds its gloo default group over the
agent's store (``env://``) and one ``TorchGroup``, and runs the CELLs one
after the other on it: each is one ``Join(..., on_rank_loss="finish")`` over
the Trainer of ``elastic_torch_runner.py`` (per input a heartbeat and
ONE all-reduce of the gradient and a 1, divided by the world size when the
cell began), over the survivors of the cells before.

A CELL is ``KILLS``: a ``+``-joined list of ``rank/point/at`` (original,
global ranks; ``-`` for none) with ``point`` as in elastic_torch_runner.py
(``body``, ``beat``, ``drain``, ``post``, ``recovery``) or ``node``: in the
loop body before input ``at``, the worker kills its whole node (its agent and
every worker the agent started, then itself). Rank ``r`` has ``INPUTS + r``
inputs in every cell. Each survivor writes ``OUT/rank{R}.json`` at the end
(every cell's count, parameters, lost ranks and the times of its all-reduces);
a worker about to die writes ``OUT/died-{R}.json``. ``ELASTIC_RUN_MODE=raise``
runs the Joins with the default ``on_rank_loss="raise"`` instead.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic_torch_runner import DIM, INPUTS, LR, sample  # noqa: E402


def parse(cell: str) -> list[tuple[int, str, int]]:
    out = []
    for item in filter(None, cell.split("+")):
        if item == "-":
            continue
        rank, point, at = item.split("/")
        out.append((int(rank), point, int(at)))
    return out


def kill_node(out: Path) -> None:
    """SIGKILL this node's agent, every worker it started, then this process.

    First wait (up to 60 s) until this node's agent has recorded every earlier
    death on this node as a loss (``lost-<RANK>`` in ``JOINKIT_RUN_DIR``): an agent
    starved of CPU on a loaded machine could otherwise be killed before it
    noticed the earlier death, which the test checks it reports.
    """
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    node = int(os.environ["GROUP_RANK"])
    folder = Path(os.environ["JOINKIT_RUN_DIR"])
    earlier = [int(path.stem.split("-")[1]) for path in out.glob("died-*.json")]
    waiting = [rank for rank in earlier if rank // local == node
               and rank != int(os.environ["RANK"])]
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline and not all(
            (folder / f"lost-{rank}").exists() for rank in waiting):
        time.sleep(0.05)
    agent = os.getppid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == agent:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.kill(agent, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    import torch
    import torch.distributed as dist

    from joinkit import Join, Joinable, JoinHook
    from joinkit.backends.torch_dist import TorchGroup
    from joinkit.backends.torch_dist import _elastic as _torch_elastic

    out = Path(sys.argv[1])
    cells = [parse(cell) for cell in sys.argv[2:]]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group = TorchGroup()  # the agent's store: it outlives every worker (guessed)
    me = group.initial_rank
    state: dict[str, Any] = {"cell": 0}

    def die(point: str) -> None:
        (out / f"died-{me}.json").write_text(json.dumps(
            {"rank": me, "cell": state["cell"], "point": point, "time": time.time()}))
        if point == "node":
            kill_node(out)
        os.kill(os.getpid(), signal.SIGKILL)

    def mine(point: str, at: int | None = None) -> bool:
        return any(r == me and p == point and (at is None or a == at)
                   for r, p, a in cells[state["cell"]])

    original = _torch_elastic.Elastic._decide

    def decide(self: Any, generation: int, expected: list[int]) -> Any:
        if mine("recovery"):
            self.store.set(self.key(generation, f"alive/{self.initial_rank}"), "1")
            die("recovery")
        return original(self, generation, expected)

    _torch_elastic.Elastic._decide = decide  # type: ignore[method-assign]

    class Hook(JoinHook):
        def __init__(self, trainer: Trainer) -> None:
            self.trainer = trainer
            self.shadows = 0

        def main_hook(self) -> None:
            if mine("drain", self.shadows):
                die("drain")
            self.shadows += 1
            self.trainer.sync(np.zeros(DIM + 1))

        def post_hook(self, is_last_joiner: bool) -> None:
            if mine("post"):
                die("post")
            ones = np.ones(1)
            group.all_reduce(ones)
            self.trainer.post_total = float(ones[0])

    class Trainer(Joinable):
        def __init__(self) -> None:
            super().__init__()
            self.world = group.world_size  # the divisor: the world when the cell began
            self.w = np.zeros(DIM)
            self.count = 0.0
            self.post_total = 0.0
            self.times: list[list[float]] = []

        def sync(self, buf: np.ndarray) -> np.ndarray:
            group.all_reduce(buf)
            self.times.append([time.time(), group.world_size])
            self.w = self.w - LR * buf[:DIM] / self.world
            return buf

        def step(self, index: int) -> None:
            if mine("body", index):
                die("body")
            if mine("node", index):
                die("node")
            Join.notify_join_context(self)
            if mine("beat", index):
                die("beat")
            x, y = sample(me, index)
            buf = np.concatenate([(self.w @ x - y) * x, [1.0]])
            self.count += float(self.sync(buf)[DIM])

        def join_hook(self, **kwargs: Any) -> JoinHook:
            return Hook(self)

        @property
        def join_device(self) -> Any:
            return torch.device("cpu")

        @property
        def join_process_group(self) -> Any:
            return group

    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(len(cells)):
            state["cell"] = index
            trainer = Trainer()
            members = group.world_size
            with Join([trainer], on_rank_loss=os.environ.get("ELASTIC_RUN_MODE", "finish")
                      ) as join:
                for step in range(INPUTS + me):
                    trainer.step(step)
            results.append({
                "world": members, "count": trainer.count, "w": trainer.w.tolist(),
                "lost": [[x.rank, x.iterations, list(x.survivors)]
                         for x in join.report.lost_ranks],
                "size": group.world_size, "post_total": trainer.post_total,
                "times": trainer.times})
    (out / f"rank{me}.json").write_text(json.dumps({
        "rank": me, "cells": results, "warnings": [str(w.message) for w in caught]}))


if __name__ == "__main__":
    main()
