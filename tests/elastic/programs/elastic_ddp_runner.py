"""Run elastic DDP kill cells on gloo: ranks forked from a parent that hosts the store.

Theory of operation
-------------------
``python elastic_ddp_runner.py --out DIR CELL [CELL ...]``: this process
imports torch once, hosts a ``TCPStore`` (the store outlives any rank, as a
launcher's would) and, for each ``CELL``, forks its ranks, which initialise a
gloo group over the store under a prefix of their own and train a
``DistributedDataParallel(Linear(4, 1))`` with SGD in one Join with
``on_rank_loss="finish"``: rank ``r`` has ``INPUTS + r`` inputs, one per
iteration (forward, squared-error loss, backward, step).

A ``CELL`` is ``W:KILLS[~OPTION]``: ``KILLS`` a ``+``-joined list of
``rank/point/at`` with ``point`` one of ``body`` (in the loop body before
input ``at``'s forward), ``beat`` (after input ``at``'s forward, whose
heartbeat went out, before its backward's all-reduce), ``drain`` (in DDP's
join hook, shadow round ``at``) or ``post`` (in DDP's post hook); ``OPTION`` ``raise`` (the default
``on_rank_loss``), ``count`` (``divide_by_initial_world_size=False``), ``bn``
(DDP's defaults with buffers: :func:`bn_model`, a BatchNorm between two
linear layers, ``broadcast_buffers=True``, a batch of ``BN_BATCH`` samples
per input), ``bn0`` (the same, rank 0 with no input), ``bnraise`` (``bn`` in
the default ``on_rank_loss``); the reference of these is :func:`bn_reference`.
``W:refusals`` runs the refused configurations instead. Each rank writes
``DIR/cell{C}-rank{R}.json`` (its initial and final parameters, the report's
lost ranks, the group's size) and the parent, which gives each cell
``--deadline`` s and kills what is left, appends the exit statuses to
``DIR/cells.jsonl``; a killed rank writes the time of its death to
``DIR/cell{C}-rank{R}.died``. The reference is :func:`reference`. With
``--mpirun`` each cell runs under ``mpirun --with-ft ulfm`` instead (a
launcher that keeps the survivors), the store still hosted by this process.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from support.fork import cells_main, parse_cell

INPUTS = 6
DIM = 4
LR = 0.05
POINTS = ("body", "beat", "drain", "post")


def parse(cell: str) -> tuple[int, list[tuple[int, str, int]], str]:
    return parse_cell(cell, POINTS)


def sample(rank: int, index: int) -> tuple[np.ndarray, float]:
    """Input ``index`` of ``rank``: a deterministic (x, y)."""
    rng = np.random.default_rng(1000 * rank + index)
    x = rng.standard_normal(DIM)
    return x, float(x.sum() * 0.5 + rng.standard_normal() * 0.1)


def reference(init: list[float], world: int, consumed: dict[int, int],
              divide_by_initial_world_size: bool = True) -> np.ndarray:
    """The single-process run (float64) over exactly the consumed inputs.

    Args:
        init: the initial parameters, weight then bias.
        world: the initial world size (the divisor by default).
        consumed: rank -> how many of its inputs were consumed (its first ones).
        divide_by_initial_world_size: else divide by the ranks that contributed.

    Returns:
        The final parameters, weight then bias.
    """
    p = np.array(init, dtype=np.float64)
    for t in range(max(consumed.values(), default=0)):
        active = [r for r, n in consumed.items() if t < n]
        grad = np.zeros_like(p)
        for r in active:
            x, y = sample(r, t)
            xb = np.concatenate([x, [1.0]])
            grad += 2.0 * (p @ xb - y) * xb
        p -= LR * grad / (world if divide_by_initial_world_size else len(active))
    return p


BN_BATCH = 8
BN_WIDTH = 3


def bn_inputs(world: int, option: str) -> dict[int, int]:
    """Rank -> its number of inputs in a ``bn`` cell."""
    return {r: 0 if option == "bn0" and r == 0 else INPUTS + r for r in range(world)}


def bn_sample(rank: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Input ``index`` of ``rank`` in a ``bn`` cell: a batch (x, y)."""
    rng = np.random.default_rng(5000 + 1000 * rank + index)
    x = rng.standard_normal((BN_BATCH, DIM)) + 0.5 * rank  # each rank's own statistics
    return x, x.sum(axis=1, keepdims=True) * 0.5 + rng.standard_normal((BN_BATCH, 1)) * 0.1


def bn_model(dtype: Any = None) -> Any:
    """Linear, BatchNorm1d, Linear; seeded alike on every rank."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, BN_WIDTH),
                                torch.nn.BatchNorm1d(BN_WIDTH, momentum=0.3),
                                torch.nn.Linear(BN_WIDTH, 1))
    return model if dtype is None else model.to(dtype)


def bn_state(module: Any) -> dict[str, Any]:
    """The parameters (flat) and each buffer of a ``bn`` model, as lists."""
    import torch

    return {"params": torch.cat([p.detach().reshape(-1).double()
                                 for p in module.parameters()]).tolist(),
            "buffers": {name: b.detach().double().reshape(-1).tolist()
                        for name, b in module.named_buffers()}}


def bn_reference(world: int, option: str, kills: list[tuple[int, str, int]]
                 ) -> dict[str, Any]:
    """What DDP does, single-process in float64, over a ``bn`` cell.

    Each iteration every active rank (one that runs a forward) starts from the
    buffers of the highest active rank after its previous forward (DDP's
    buffer broadcast inside a Join), runs its batch in training mode (its own
    running statistics move), and the gradients of the ranks whose input was
    consumed are summed and divided by the world size for an SGD step. At the
    end every rank takes the buffers of the highest surviving last joiner (the
    post hook). A rank killed in its body before input ``at`` ran ``at``
    forwards; one killed after its forward of ``at`` ran ``at + 1`` and
    consumed ``at``.

    Returns:
        ``bn_state`` of the model the survivors should hold.
    """
    import torch
    from support.fork import consumed_inputs

    inputs = bn_inputs(world, option)
    forwards = dict(inputs)
    for rank, point, at in kills:
        if point == "body":
            forwards[rank] = at
        elif point == "beat":
            forwards[rank] = at + 1
    consumed = {r: min(n, inputs[r]) for r, n in consumed_inputs(world, kills, INPUTS).items()}
    model = bn_model(torch.float64)
    model.train()
    bn = model[1]
    names = ("running_mean", "running_var", "num_batches_tracked")
    synced = {name: getattr(bn, name).clone() for name in names}
    after: dict[int, dict[str, Any]] = {}
    rounds = max(forwards.values(), default=0)
    for t in range(rounds):
        active = [r for r in range(world) if t < forwards[r]]
        grads = [torch.zeros_like(p) for p in model.parameters()]
        after = {}
        for rank in active:
            for name in names:
                getattr(bn, name).copy_(synced[name])
            x, y = bn_sample(rank, t)
            model.zero_grad()
            loss = ((model(torch.tensor(x)) - torch.tensor(y)) ** 2).mean()
            loss.backward()
            after[rank] = {name: getattr(bn, name).clone() for name in names}
            if t < consumed[rank]:
                for g, p in zip(grads, model.parameters(), strict=True):
                    g += p.grad
        with torch.no_grad():
            for g, p in zip(grads, model.parameters(), strict=True):
                p -= LR * g / world
        upcoming = [r for r in range(world) if t + 1 < forwards[r]]
        if upcoming:
            synced = after[max(upcoming)]
    dead = {r for r, _, _ in kills}
    last = [r for r in after if r not in dead and forwards[r] == rounds]
    final = after[max(last)] if last else synced
    for name in names:
        getattr(bn, name).copy_(final[name])
    return bn_state(model)


def _die(path: Path) -> None:
    path.with_suffix(".died").write_text(json.dumps({"died": time.time()}))
    os.kill(os.getpid(), signal.SIGKILL)


def init_cell(rank: int, world: int, port: int, cell: int) -> None:
    """This rank's gloo default group for ``cell``, over the parent's store."""
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    store = dist.PrefixStore(f"cell{cell}/", client)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def arm_model_kills(mine: dict[str, int], path: Path) -> None:
    """Make this rank die at its ``"drain"`` shadow round or in its ``"post"`` hook."""
    from joinkit.adapters.torch import _ddp_elastic

    if "drain" in mine:
        # DDP's join hook asks the check first in each shadow round.
        original = _ddp_elastic.ElasticDDP.check
        rounds = [0]

        def check(self: Any, is_joined_rank: bool) -> bool | None:
            if is_joined_rank:
                if rounds[0] == mine["drain"]:
                    _die(path)
                rounds[0] += 1
            return original(self, is_joined_rank)

        _ddp_elastic.ElasticDDP.check = check  # type: ignore[method-assign]
    if "post" in mine:
        def sync_final_model(self: Any, is_last_joiner: bool) -> None:
            _die(path)

        _ddp_elastic.ElasticDDP.sync_final_model = sync_final_model  # type: ignore[method-assign]


def run_rank(rank: int, world: int, kills: list[tuple[int, str, int]], option: str,
             port: int, cell: int, out: Path) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from joinkit import Join
    path = out / f"cell{cell}-rank{rank}.json"
    mine = {point: at for r, point, at in kills if r == rank}
    init_cell(rank, world, port, cell)
    if option.startswith("bn"):
        run_bn_rank(rank, world, option, mine, path)
        return
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(DIM, 1))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    init = torch.cat([model.module.weight.detach().reshape(-1),
                      model.module.bias.detach()]).tolist()
    arm_model_kills(mine, path)
    mode = "raise" if option == "raise" else "finish"
    kwargs = {"divide_by_initial_world_size": False} if option == "count" else {}
    started = time.time()
    times: list[float] = []  # when each of this rank's iterations completed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The store lives in the parent: any rank may die.
        with Join([model], on_rank_loss=mode, store_outlives_ranks=True, **kwargs) as join:
            for index in range(INPUTS + rank):
                if mine.get("body") == index:
                    _die(path)
                x, y = sample(rank, index)
                pred = model(torch.tensor(x, dtype=torch.float32).reshape(1, DIM))
                if mine.get("beat") == index:
                    _die(path)
                loss = ((pred - y) ** 2).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
                times.append(time.time())
    final = torch.cat([model.module.weight.detach().reshape(-1),
                       model.module.bias.detach()]).tolist()
    # The model goes on over the survivors after the Join: one more all-reduce.
    after = model.process_group.size()
    probe = torch.ones(1)
    model.process_group.allreduce([probe]).wait()
    lost = [{"rank": x.rank, "iterations": x.iterations, "survivors": list(x.survivors)}
            for x in join.report.lost_ranks]
    path.write_text(json.dumps({
        "rank": rank, "init": init, "final": final, "lost": lost, "size_after": after,
        "probe": float(probe.item()), "started": started, "times": times, "ended": time.time(),
        "warnings": [str(w.message) for w in caught if "joinkit" in str(w.message)],
    }))


def run_bn_rank(rank: int, world: int, option: str, mine: dict[str, int], path: Path) -> None:
    """A ``bn`` cell's rank: DDP with its defaults (buffers broadcast in forward)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from joinkit import Join

    model = DDP(bn_model())  # broadcast_buffers=True: DDP's default
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    arm_model_kills(mine, path)
    mode = "raise" if option == "bnraise" else "finish"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Join([model], on_rank_loss=mode, store_outlives_ranks=True) as join:
            for index in range(bn_inputs(world, option)[rank]):
                if mine.get("body") == index:
                    _die(path)
                x, y = bn_sample(rank, index)
                pred = model(torch.tensor(x, dtype=torch.float32))
                if mine.get("beat") == index:
                    _die(path)
                ((pred - torch.tensor(y, dtype=torch.float32)) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
    lost = [{"rank": x.rank, "iterations": x.iterations, "survivors": list(x.survivors)}
            for x in join.report.lost_ranks]
    after = model.process_group.size()
    probe = torch.ones(1)
    model.process_group.allreduce([probe]).wait()
    path.write_text(json.dumps({
        "rank": rank, **bn_state(model.module), "lost": lost, "size_after": after,
        "probe": float(probe.item()),
        "warnings": [str(w.message) for w in caught if "joinkit" in str(w.message)],
    }))


def run_refusals(rank: int, world: int, port: int, cell: int, out: Path) -> None:
    """Each refused configuration, on every rank; then a Join that works, to prove no mismatch."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from joinkit import Join

    init_cell(rank, world, port, cell)
    torch.manual_seed(0)

    class WithBuffer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(DIM, 1)
            self.register_buffer("seen", torch.zeros(1))

        def forward(self, x: Any) -> Any:
            return self.lin(x)

    buffer_hooked = DDP(WithBuffer())
    buffer_hooked._register_buffer_comm_hook(None, _buffer_hook)
    hooked = DDP(torch.nn.Linear(DIM, 1))
    hooked.register_comm_hook(None, lambda _, bucket: _allreduce_future(bucket))
    plain = DDP(torch.nn.Linear(DIM, 1))
    cases = {
        "buffer_hook": lambda: [buffer_hooked],
        "unused": lambda: [DDP(torch.nn.Linear(DIM, 1), find_unused_parameters=True)],
        "hook": lambda: [hooked],
        # ZeRO stepping in DDP's comm hook (ZeRO beside DDP works: test_elastic_zero.py).
        "zero": lambda: [plain, ZeroRedundancyOptimizer(plain.parameters(),
                                                        torch.optim.Adam, lr=LR,
                                                        overlap_with_ddp=True)],
    }
    found: dict[str, str] = {}
    for name, make in cases.items():
        joinables = make()
        try:
            with Join(joinables, on_rank_loss="finish", store_outlives_ranks=True):
                pass
        except ValueError as exc:
            found[name] = str(exc)
        else:
            found[name] = "(not refused)"
    # The group still matches: a Join that works, with one input per rank.
    model = DDP(torch.nn.Linear(DIM, 1), broadcast_buffers=False)
    with Join([model], on_rank_loss="finish", store_outlives_ranks=True):
        model(torch.ones(1, DIM)).sum().backward()
    # Forward-only iterations (a zero unit each) between trained ones, uneven.
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with Join([model], on_rank_loss="finish", store_outlives_ranks=True):
        for index in range(2 + rank):
            if index % 2 == 0:
                with torch.no_grad():
                    model(torch.ones(1, DIM))
                continue
            model(torch.full((1, DIM), float(index))).sum().backward()
            opt.step()
            opt.zero_grad()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    # The model now carries joinkit's comm hook: a later Join that divides by the
    # active ranks still does, on the default path (the count rides in each
    # bucket) and on the one-collective path (the hook divides by the count of
    # this iteration's heartbeat): the bias's gradient of a sum is 1 on every
    # active rank, so its average over the active ranks is 1 in every iteration.
    counted = {}
    for name, options in (("round", {}), ("one", {"heartbeat_in_gradients": False})):
        grads = []
        with Join([model], divide_by_initial_world_size=False, **options) as join:
            for _ in range(1 + rank):
                model.zero_grad()
                model(torch.ones(1, DIM)).sum().backward()
                grads.append(float(model.module.bias.grad.item()))
        counted[name] = {"grads": grads, "heartbeat": join.heartbeat}
    # Finish mode again, after the Join that routed the hook for the heartbeat
    # in the gradients: the same hook takes finish mode's route; ranks agree.
    with Join([model], on_rank_loss="finish", store_outlives_ranks=True):
        for index in range(1 + rank):
            model(torch.full((1, DIM), float(index))).sum().backward()
            opt.step()
            opt.zero_grad()
    again = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    (out / f"cell{cell}-rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "refusals": found, "after": "ok", "params": params,
         "counted": counted, "again": again}))


def _buffer_hook(state: Any, buffers: Any) -> None:
    return None


def _allreduce_future(bucket: Any) -> Any:
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def main() -> None:
    cells_main(__file__, parse, run_rank, run_refusals)


if __name__ == "__main__":
    main()
