"""Side collectives beside DDP over real gloo groups: scenarios run in one launch.

Run as ``python side_scenarios.py [gloo|nccl] RANK WORLD STORE OUT NAME...``
(the protocol of ``torch_scenarios.py``: one subgroup per scenario, gloo
unless nccl is named, one JSON line per scenario and rank);
``test_side_torch.py`` launches it and compares every number with a
single-process reference it computes itself, and ``test_side_cuda.py``
runs the ``cuda_`` scenarios where CUDA is.

Rank r has ``INPUTS[r]`` batches (rank 1 none at all). Each step: the DDP
model's forward and backward, an SGD step, a logging collective (the mean loss
over the active ranks, or a sum) and a barrier; the side collectives are
listed in the Join where they run in the step.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support import Ctx, recording, scenario_registry
from torch.nn.parallel import DistributedDataParallel as DDP

from joinkit import Join, JoinError, SideCollective
from joinkit.adapters.torch import collectives
from joinkit.backends.torch_dist import TorchGroup

SCENARIO_TIMEOUT = datetime.timedelta(seconds=30)
INPUTS = [4, 0, 6]
LR = 0.1

SCENARIOS, scenario = scenario_registry()


def make_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch ``step``: 3 rows of 4 features and targets."""
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def params(module: torch.nn.Module) -> list[float]:
    return [float(v) for p in module.parameters() for v in p.detach().reshape(-1).tolist()]


def train(ctx: Ctx, side_first: bool) -> dict[str, Any]:
    group = ctx.group
    model = DDP(make_model(), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_mean = collectives.mean(torch.zeros(()), group=group, name="loss_mean")
    barrier = collectives.barrier(group)
    # A per-step flag broadcast from rank 0 before the forward, as Lightning's
    # SIGTERM check: a joined rank 0 sends 0 ("no signal").
    flag = collectives.broadcast(torch.zeros(1, dtype=torch.int32), src=0, group=group,
                                 name="flag")
    joinables: list[Any] = [flag, model, loss_mean, barrier] if side_first else [
        model, loss_mean, barrier]
    losses, flags = [], []
    with Join(joinables):
        for step in range(INPUTS[ctx.rank]):
            if side_first:
                flags.append(int(flag(torch.zeros(1, dtype=torch.int32) + 7 * (ctx.rank == 0))))
            x, y = make_batch(ctx.rank, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss_mean(loss.detach())))
            barrier()
    return {"params": params(model.module), "losses": losses, "flags": flags,
            "rounds": [loss_mean.shadow_rounds, barrier.shadow_rounds, flag.shadow_rounds]}


@scenario
def ddp_log_mean_and_barrier(ctx: Ctx) -> dict[str, Any]:
    return train(ctx, side_first=False)


@scenario
def broadcast_first_then_ddp(ctx: Ctx) -> dict[str, Any]:
    return train(ctx, side_first=True)


@scenario
def following_side_collective_with_a_lambda(ctx: Ctx) -> dict[str, Any]:
    group = ctx.group
    model = DDP(make_model(), process_group=group)
    total = SideCollective(lambda t: dist.all_reduce(t, group=group),
                           shadow=lambda: dist.all_reduce(torch.zeros(2), group=group))
    sums = []
    with Join([model, total]) as join:
        for step in range(INPUTS[ctx.rank]):
            x, y = make_batch(ctx.rank, step)
            model(x).sum().backward()
            t = torch.tensor([1.0, float(ctx.rank)])
            total(t)
            sums.append(t.tolist())
    return {"sums": sums, "follows": join.process_group is group}


@scenario
def not_listed_is_an_error(ctx: Ctx) -> dict[str, Any]:
    group = ctx.group
    model = DDP(make_model(), process_group=group)
    barrier = collectives.barrier(group)
    try:
        with Join([model]):
            for step in range(INPUTS[ctx.rank]):
                x, _ = make_batch(ctx.rank, step)
                model(x).sum().backward()
                barrier()
    except JoinError as error:
        return {"type": type(error).__name__, "error": str(error)}
    return {"type": None}


@scenario
def wrong_shape_is_an_error_before_the_collective(ctx: Ctx) -> dict[str, Any]:
    group = ctx.group
    side = collectives.all_reduce(torch.zeros(2), group=group, name="sums")
    messages = []
    for bad in (torch.zeros(3), torch.zeros(2, dtype=torch.float64)):
        try:
            side(bad)
        except ValueError as error:
            messages.append(str(error))
    try:
        collectives.all_reduce(torch.zeros(1), op=dist.ReduceOp.AVG)
    except ValueError as error:
        messages.append(str(error))
    # The group still works: nothing was sent.
    t = torch.ones(2)
    side(t)
    return {"messages": messages, "after": t.tolist()}


@scenario
def all_reduce_ops_shadow_with_their_identity(ctx: Ctx) -> dict[str, Any]:
    group = ctx.group
    out = {}
    for op in ("sum", "product", "max", "min"):
        side = collectives.all_reduce(torch.zeros(2), op=op, group=group)
        model = DDP(make_model(), process_group=group)
        got = []
        with Join([model, side]):
            for step in range(INPUTS[ctx.rank]):
                x, _ = make_batch(ctx.rank, step)
                model(x).sum().backward()
                got.append(side(torch.tensor([ctx.rank + 2.0, -(ctx.rank + 2.0)])).tolist())
        out[op] = got
    return out


@scenario
def tensor_layouts(ctx: Ctx) -> dict[str, Any]:
    """Strided, transposed and expand()ed tensors through the side collectives.

    Handed to gloo as they are (torch 2.13), a strided column is reduced as
    the first ``numel`` elements of its memory (a wrong sum, its neighbours
    overwritten), and an expand()ed tensor is written past its storage.
    """
    return _layouts(ctx, torch.device("cpu"), [DDP(make_model(), process_group=ctx.group)])


@scenario
def cuda_layouts(ctx: Ctx) -> dict[str, Any]:
    """``tensor_layouts`` with CUDA tensors and no model (``test_side_cuda.py``), and
    the group's own refusal of a CUDA tensor whose elements share memory."""
    device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    result = _layouts(ctx, device, [])
    try:
        TorchGroup(ctx.group, device).all_reduce(torch.ones(1, device=device).expand(3))
    except ValueError as error:
        result["group_refused"] = str(error)
    return result


def _layouts(ctx: Ctx, device: torch.device, models: list[DDP]) -> dict[str, Any]:
    """The steps of ``tensor_layouts`` on ``device``, with ``models`` trained beside."""
    group = ctx.group
    column = collectives.all_reduce(torch.zeros(3, 2, device=device)[:, 0], group=group,
                                    name="column")
    # like is transposed: a joined rank 0 must still send it in the active ranks' order.
    sent = torch.arange(6.0, device=device).reshape(3, 2).T
    matrix = collectives.broadcast(sent, src=0, group=group, name="matrix")
    sums, matrices, devices = [], [], set()
    with Join([*models, column, matrix]):
        for step in range(INPUTS[ctx.rank]):
            for model in models:
                x, _ = make_batch(ctx.rank, step)
                model(x).sum().backward()
            base = torch.full((3, 2), -1.0, device=device)
            base[:, 0] = torch.tensor([ctx.rank + 1.0, 10.0 * (ctx.rank + 1), step])
            column(base[:, 0])
            sums.append(base.tolist())
            mine = torch.full((2, 3), 100.0 + ctx.rank, device=device)
            matrix(mine)
            matrices.append(mine.tolist())
            devices |= {str(base.device), str(mine.device)}
    refused = []
    for side, shared in ((column, torch.ones(1, device=device).expand(3)),
                         (matrix, torch.ones(1, 1, device=device).expand(2, 3))):
        try:
            side(shared)
        except ValueError as error:
            refused.append(str(error))
    after = torch.ones(3, device=device)
    column(after)  # nothing was sent: the group is still in step
    return {"sums": sums, "matrices": matrices, "refused": refused, "after": after.tolist(),
            "devices": sorted(devices)}


def main(argv: list[str]) -> None:
    backend = argv.pop(0) if argv[0] in ("gloo", "nccl") else "gloo"
    rank, world, store, out_dir, *names = argv
    ctx = Ctx(int(rank), int(world), None)
    out = Path(out_dir) / f"rank{rank}.jsonl"
    if backend == "nccl":
        torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{store}", rank=ctx.rank,
                            world_size=ctx.world, timeout=SCENARIO_TIMEOUT)
    for name in names:
        with recording(out, name) as record:
            ctx.group = dist.new_group(backend=backend, timeout=SCENARIO_TIMEOUT)
            record["result"] = SCENARIOS[name](ctx)
    dist.destroy_process_group()


# -- what the tests expect of tensor_layouts (tests/adapters/torch/test_side_torch.py,
# test_side_cuda.py)


def check_layouts(got: dict[str, Any], rank: int, inputs: list[int]) -> None:
    """``rank``'s result of ``tensor_layouts`` (or ``cuda_layouts``) where rank r had
    ``inputs[r]`` steps, against the sums one process computes."""
    world = len(inputs)
    want_sums, want_matrices = [], []
    for step in range(inputs[rank]):
        active = [r for r in range(world) if inputs[r] > step]
        column = [sum(r + 1.0 for r in active), sum(10.0 * (r + 1) for r in active),
                  step * len(active)]
        want_sums.append([[v, -1.0] for v in column])  # the other column untouched
        # Rank 0 sends its own while active; joined, its like (arange(6) as (3, 2), .T).
        want_matrices.append([[100.0] * 3] * 2 if step < inputs[0]
                             else [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]])
    assert got["sums"] == want_sums
    assert got["matrices"] == want_matrices
    assert got["refused"] == [
        "column(tensor): the tensor's elements share memory (shape (3,), strides (0,): "
        "an expand()ed or as_strided view), but column writes a result into each "
        "element; pass a tensor of its own, e.g. tensor.clone()",
        "matrix(tensor): the tensor's elements share memory (shape (2, 3), strides "
        "(0, 0): an expand()ed or as_strided view), but matrix writes a result into "
        "each element; pass a tensor of its own, e.g. tensor.clone()",
    ]
    assert got["after"] == [float(world)] * 3


if __name__ == "__main__":
    main(sys.argv[1:])
