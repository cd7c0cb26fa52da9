"""Run the exact-data cells (resume, take-over) on real gloo ranks.

Theory of operation
-------------------
``python exact_runner.py --out DIR CELL [CELL ...]``: this process
imports torch once, hosts a TCPStore in a child of its own
(``elastic_fork.hosted_store``) and forks each cell's ranks. Every rank trains
``DistributedDataParallel(Linear(4, 1))`` with SGD on the ids dataset of
``exact_plan`` through ``ShardSampler`` and a DataLoader, one batch per
iteration, and writes what it trained on to ``DIR/cell{C}-{phase}-rank{R}.json``.

A ``CELL`` is one of:

``resume:W1>W2:K:WORKERS:LOADER``
    an epoch on ``W1`` ranks stopped after ``K`` iterations (``Join([model])``),
    every rank's ``sampler.state_dict()`` saved with the model; then ``W2``
    fresh ranks load it (``load_state_dict``) and train to the epoch's end.
    ``WORKERS``: the DataLoader's ``num_workers``; ``LOADER``: ``dl``
    (``torch.utils.data.DataLoader``), ``sdl`` (torchdata's
    ``StatefulDataLoader``, the sampler's state), ``sdl-own`` (the same world,
    restored from the StatefulDataLoader's own ``state_dict``).
``takeover:W:KILLS[,KILLS...][:N[:plain]]``
    ``take_over=True`` in ``Join([model], on_rank_loss="finish")``, one epoch
    per ``KILLS`` (a ``+``-joined list of ``rank/point/at``, ``point`` one of
    ``body``, ``beat``, ``step``, ``drain``; ``-`` for none); each epoch's
    passes (``sampler.passes()``) over the survivors of the one before; ``N``
    samples (default 29; a death while draining needs a world whose ranks
    have different numbers of batches). ``plain``: a loop that iterates the
    sampler once per epoch instead of looping over ``passes()``. Each rank
    records the loss warnings it saw.

With ``--mpirun`` each ``takeover`` cell runs under ``mpirun --with-ft ulfm``
instead (its ranks, started with ``--as-rank PORT``, build their gloo group
over this process's store); with ``--as-worker`` (under torchrun or ``python -m
joinkit run``: ``env://``) the process is one rank of one ``takeover`` cell.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import exact_plan as plan  # noqa: E402

N = int(os.environ.get("EXACT_N", "29"))
BATCH = 2
SEED = 7


def parse_kills(text: str) -> dict[int, tuple[str, int]]:
    kills = {}
    for item in filter(None, text.split("+")):
        if item == "-":
            continue
        rank, point, at = item.split("/")
        assert point in ("body", "beat", "step", "drain"), point
        kills[int(rank)] = (point, int(at))
    return kills


def parse(cell: str) -> dict[str, Any]:
    kind, _, rest = cell.partition(":")
    if kind == "resume":
        worlds, stop, workers, loader = rest.split(":")
        before, after = worlds.split(">")
        return {"kind": kind, "before": int(before), "after": int(after), "stop": int(stop),
                "workers": int(workers), "loader": loader}
    if kind == "takeover":
        world, epochs, *more = rest.split(":")
        n = more[0] if more else ""
        loop = more[1] if len(more) > 1 else "passes"
        assert loop in ("passes", "plain"), loop
        return {"kind": kind, "world": int(world), "n": int(n or N), "loop": loop,
                "epochs": [parse_kills(e) for e in epochs.split(",")]}
    raise ValueError(cell)


class Ids:
    """Sample ``i``: ``(i, x, y)`` of ``exact_plan.sample``, as float32 tensors."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        x, y = plan.sample(int(i))
        return i, torch.tensor(x, dtype=torch.float32), torch.tensor([y], dtype=torch.float32)


def params(model: Any) -> list[float]:
    import torch

    module = model.module
    return torch.cat([module.weight.detach().reshape(-1), module.bias.detach()]).tolist()


def loader_for(dataset: Any, sampler: Any, workers: int, kind: str) -> Any:
    if kind.startswith("sdl"):
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, sampler=sampler, batch_size=BATCH,
                                  num_workers=workers)
    from torch.utils.data import DataLoader

    return DataLoader(dataset, sampler=sampler, batch_size=BATCH, num_workers=workers)


def model_and_optimizer() -> tuple[Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(plan.DIM, 1))
    return model, torch.optim.SGD(model.parameters(), lr=plan.LR)


def step(model: Any, optimizer: Any, x: Any, y: Any, die: Any = None) -> None:
    import torch

    pred = model(x)
    if die is not None:
        die("beat")
    torch.nn.functional.mse_loss(pred, y).backward()
    if die is not None:
        die("step")
    optimizer.step()
    optimizer.zero_grad()


# -- resume ----------------------------------------------------------------------------


def resume_first(rank: int, spec: dict[str, Any], out: Path, cell: int) -> None:
    """Phase one: ``stop`` iterations on ``before`` ranks; save the states and the model."""
    import torch

    from joinkit import Join
    from joinkit.adapters.torch.data import ShardSampler

    dataset = Ids(N)
    model, optimizer = model_and_optimizer()
    init = params(model)
    sampler = ShardSampler(dataset, seed=SEED, batch_size=BATCH)
    loader = loader_for(dataset, sampler, spec["workers"], spec["loader"])
    trained: list[list[int]] = []
    state = loader_state = None
    with Join([model]):
        for index, (ids, x, y) in enumerate(loader):
            step(model, optimizer, x, y)
            trained.append(ids.tolist())
            if index + 1 == spec["stop"]:
                state = sampler.state_dict()  # every rank, after the same iteration
                if spec["loader"] == "sdl-own":
                    loader_state = loader.state_dict()
                break
    if rank == 0:
        torch.save({"model": model.module.state_dict()}, out / f"cell{cell}-model.pt")
    torch.save(loader_state, out / f"cell{cell}-loader-rank{rank}.pt")
    (out / f"cell{cell}-a-rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "init": init, "trained": trained, "state": state,
         "params": params(model)}))


def resume_second(rank: int, spec: dict[str, Any], out: Path, cell: int) -> None:
    """Phase two: ``after`` fresh ranks load the state and train to the epoch's end."""
    import torch

    from joinkit import Join
    from joinkit.adapters.torch.data import ShardSampler

    dataset = Ids(N)
    model, optimizer = model_and_optimizer()
    saved = torch.load(out / f"cell{cell}-model.pt")
    model.module.load_state_dict(saved["model"])
    state = json.loads((out / f"cell{cell}-a-rank0.json").read_text())["state"]
    sampler = ShardSampler(dataset, seed=SEED, batch_size=BATCH)
    loader = loader_for(dataset, sampler, spec["workers"], spec["loader"])
    if spec["loader"] == "sdl-own":
        loader.load_state_dict(torch.load(out / f"cell{cell}-loader-rank{rank}.pt"))
    else:
        sampler.load_state_dict(state)
    sampler.set_epoch(state["epoch"])  # the state's epoch: keeps what was consumed
    trained: list[list[int]] = []
    with Join([model]):
        for ids, x, y in loader:
            step(model, optimizer, x, y)
            trained.append(ids.tolist())
    (out / f"cell{cell}-b-rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "trained": trained, "params": params(model),
         "end_state": sampler.state_dict()}))


# -- take-over -------------------------------------------------------------------------


def takeover(rank: int, spec: dict[str, Any], out: Path, cell: int) -> None:
    """Epochs of take_over=True in finish mode, each with its kills (module doc)."""
    import torch

    from joinkit import Join
    from joinkit.adapters.torch.data import ShardSampler

    path = out / f"cell{cell}-rank{rank}.json"
    dataset = Ids(spec["n"])
    model, optimizer = model_and_optimizer()
    init = params(model)
    sampler = ShardSampler(dataset, seed=SEED, batch_size=BATCH, take_over=True)
    loader = loader_for(dataset, sampler, 0, "dl")
    record: dict[str, Any] = {"rank": rank, "init": init, "epochs": []}
    state: dict[str, Any] = {"epoch": -1, "pass": -1}

    def die(point: str, at: int | None = None) -> None:
        kill = spec["epochs"][state["epoch"]].get(rank) if state["pass"] == 0 else None
        if kill is None or kill[0] != point or (at is not None and kill[1] != at):
            return
        record["died"] = {"time": time.time(), "point": point}
        path.with_suffix(".died").write_text(json.dumps(record))
        os.kill(os.getpid(), signal.SIGKILL)

    rounds = _arm_drain(lambda shadow: die("drain", shadow))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # one loss warning per death
        for epoch in range(len(spec["epochs"])):
            sampler.set_epoch(epoch)
            passes = []
            for number in (sampler.passes() if spec["loop"] == "passes" else (0,)):
                state.update({"epoch": epoch, "pass": number})
                rounds[0] = 0  # DDP's shadow rounds of this Join
                trained: list[list[int]] = []
                times: list[float] = []
                with Join([model], on_rank_loss="finish", store_outlives_ranks=True) as join:
                    for index, (ids, x, y) in enumerate(loader):
                        if state["pass"] == 0:
                            kill = spec["epochs"][epoch].get(rank)
                            if kill is not None and kill[1] == index:
                                die("body")
                                step(model, optimizer, x, y, die)
                            else:
                                step(model, optimizer, x, y)
                        else:
                            step(model, optimizer, x, y)
                        trained.append(ids.tolist())
                        times.append(time.time())
                passes.append({
                    "trained": trained, "times": times,
                    "lost": [[x.rank, x.iterations, list(x.survivors)]
                             for x in join.report.lost_ranks]})
            record["epochs"].append({
                "passes": passes,
                "take_overs": [{"rank": t.rank, "consumed": list(t.consumed),
                                "moved": {str(k): list(v) for k, v in t.moved.items()}}
                               for t in sampler.take_overs],
                "world": list(sampler.world), "state": sampler.state_dict(),
                "remaining": sampler.remaining()})
    record["warnings"] = [str(w.message) for w in caught if " was lost " in str(w.message)]
    record["params"] = params(model)
    record["group_size"] = model.process_group.size()
    path.write_text(json.dumps(record))
    del torch


def _arm_drain(die: Any) -> list[int]:
    """Call ``die(shadow_round)`` at each of DDP's shadow rounds (its join hook asks
    ``check`` once per round on a joined rank); returns the round counter."""
    from joinkit.adapters.torch import _ddp_elastic

    original = _ddp_elastic.ElasticDDP.check
    rounds = [0]

    def check(self: Any, is_joined_rank: bool) -> bool | None:
        if is_joined_rank:
            die(rounds[0])
            rounds[0] += 1
        return original(self, is_joined_rank)

    _ddp_elastic.ElasticDDP.check = check  # type: ignore[method-assign]
    return rounds


# -- launching -------------------------------------------------------------------------


def init_forked(rank: int, world: int, port: int, prefix: str) -> None:
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=60),
                           wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, client), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def _forked(rank: int, *, world: int, port: int, prefix: str, run: Any) -> None:
    init_forked(rank, world, port, prefix)
    run(rank)


def run_cells(args: argparse.Namespace) -> None:
    from support.fork import fork_ranks, hosted_store, preload

    preload()  # once, before forking (elastic_fork.PRELOAD)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = hosted_store()
    for cell, text in enumerate(args.cells):
        spec = parse(text)
        started = time.monotonic()
        if spec["kind"] == "resume":
            phases = [("a", spec["before"], resume_first), ("b", spec["after"], resume_second)]
        else:
            phases = [("t", spec["world"], takeover)]
        record: dict[str, Any] = {"cell": cell, "spec": text, "exit": {}}
        for phase, world, body in phases:
            statuses = fork_ranks(world, args.deadline, functools.partial(
                _forked, world=world, port=server.port, prefix=f"cell{cell}{phase}/",
                run=functools.partial(body, spec=spec, out=out, cell=cell)))
            record["exit"][phase] = {str(r): statuses[r] for r in sorted(statuses)}
        record["seconds"] = time.monotonic() - started
        with (out / "cells.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=90.0)
    parser.add_argument("--as-rank", type=int, default=0, help="under mpirun: the store's port")
    parser.add_argument("--as-worker", action="store_true", help="under torchrun: env://")
    parser.add_argument("--mpirun", action="store_true",
                        help="run each takeover cell under mpirun --with-ft ulfm")
    parser.add_argument("--cell", type=int, default=0)
    parser.add_argument("cells", nargs="+")
    args = parser.parse_args()
    out = Path(args.out)
    if args.as_rank or args.as_worker:
        spec = parse(args.cells[0])
        if args.as_rank:
            rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
            init_forked(rank, spec["world"], args.as_rank, f"cell{args.cell}t/")
        else:
            import torch.distributed as dist

            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
            rank = dist.get_rank()
        takeover(rank, spec, out, args.cell)
        return
    if args.mpirun:
        from support.fork import run_under_mpirun

        run_under_mpirun(__file__, out, args.cells, args.deadline,
                         lambda text: int(parse(text)["world"]))
        return
    run_cells(args)


if __name__ == "__main__":
    main()
