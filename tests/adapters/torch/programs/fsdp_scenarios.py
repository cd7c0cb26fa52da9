"""Multi-rank scenarios for FSDP2, replayed DDP models and the rest of a training
step under joinkit's Join, checked against single-process references.

Theory of operation
-------------------
As ``torch_scenarios.py``: ``test_fsdp.py`` starts one process per
rank once per world size, and each runs every scenario in a row::

    python fsdp_scenarios.py RANK WORLD_SIZE STORE_FILE OUT_DIR NAME [NAME ...]

Every scenario gets a fresh gloo group with a short timeout (a mismatch fails
with gloo's timeout, not a hang) and writes one JSON line per rank. A scenario
returns, per configuration, the largest deviation of this rank's *full*
parameters (``DTensor.full_tensor()``) from a reference that one process
computes from every rank's data: at every step, the gradient of the ranks
still active summed and divided by the initial world size (or by the number
of active ranks), with the same optimizer, scheduler and GradScaler. Each
scenario also returns the number of collectives its group issued, which the
test compares across ranks. Counts of inputs per rank depend on the world
size (``counts``); rank r's data is seeded by (r, step).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support import Counter, Ctx, recording, scenario_registry
from sync_bn import CPUSyncBatchNorm
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel as DDP

from joinkit import Join
from joinkit.backends.torch_dist import TorchGroup

SCENARIO_TIMEOUT = datetime.timedelta(seconds=30)


SCENARIOS, scenario = scenario_registry()


# -- models, data, references -------------------------------------------------------------


class Net(nn.Module):
    """Three fully_shard units when nested: a (Linear+ReLU), b, and the root (c)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(self.a(x))))


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def shard(model: nn.Module, group: Any, *, reshard: bool = True, nested: bool = True) -> Any:
    mesh = DeviceMesh.from_group(group, "cpu")
    if nested:
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def data(rank: int, i: int, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 2, generator=generator)


def full(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter in full (a collective for sharded ones: same order on all ranks)."""
    return [p.full_tensor().detach() if isinstance(p, DTensor) else p.detach()
            for p in model.parameters()]


def deviation(model: nn.Module, reference: nn.Module) -> float:
    return max(float((a - b.detach()).abs().max()) for a, b in
               zip(full(model), reference.parameters(), strict=True))


def reference(
    counts: list[int],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    divide_by_initial: bool = True,
    window: int = 1,
    make_scheduler: Callable[[Any], Any] | None = None,
    model: Callable[[], nn.Module] = net,
    loss: Callable[[nn.Module, int, int], torch.Tensor] | None = None,
) -> nn.Module:
    """One process: per window, the active ranks' gradients summed over / divided by..."""
    world = len(counts)
    ref = model()
    optimizer = make_optimizer(ref.parameters())
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    for start in range(0, max(counts), window):
        sync = start + window - 1
        contributors = [r for r in range(world) if counts[r] > sync]
        if not contributors:
            break
        divisor = world if divide_by_initial else len(contributors)
        optimizer.zero_grad()
        for r in contributors:
            for i in range(start, sync + 1):
                value = loss(ref, r, i) if loss else mse_loss(ref(data(r, i)[0]), data(r, i)[1])
                (value / window / divisor).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return ref


def train(model: Any, optimizer: Any, n: int, rank: int, *, window: int = 1,
          scheduler: Any = None, **join_kwargs: Any) -> Any:
    joinables = [model, optimizer] + ([scheduler] if scheduler is not None else [])
    with Join(joinables, **join_kwargs) as join:
        for i in range(n):
            if window > 1:
                model.set_requires_gradient_sync(i % window == window - 1)
            x, y = data(rank, i)
            (mse_loss(model(x), y) / window).backward()
            if i % window == window - 1:
                optimizer.step()
                optimizer.zero_grad()
                if scheduler is not None:
                    scheduler.step()
    return join


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)


def sequence(group: Any) -> int:
    return int(group._get_sequence_number_for_group())


def error_of(exc: BaseException) -> dict[str, str]:
    out = {"type": type(exc).__name__, "message": str(exc)}
    if os.environ.get("JOINKIT_SCENARIO_TRACEBACKS"):
        out["traceback"] = "".join(traceback.format_exception(exc))
    return out


def counts(ctx: Ctx, table: dict[int, list[int]]) -> list[int]:
    return table[ctx.world]


# -- FSDP2 against the reference ------------------------------------------------------------

UNEVEN = {2: [0, 3], 4: [3, 0, 1, 4]}
UNEVEN_B = {2: [4, 2], 4: [2, 5, 0, 3]}


@scenario
def fsdp_reference(ctx: Ctx) -> Any:
    """SGD and AdamW; nested and flat; reshard_after_forward True and False."""
    out = {}
    configs = [
        ("sgd-nested-reshard", sgd, True, True, UNEVEN),
        ("adamw-nested-keep", adamw, False, True, UNEVEN),
        ("adamw-flat-reshard", adamw, True, False, UNEVEN_B),
        ("sgd-flat-keep", sgd, False, False, UNEVEN_B),
    ]
    for name, make_optimizer, reshard, nested, table in configs:
        n = counts(ctx, table)
        model = shard(net(), ctx.group, reshard=reshard, nested=nested)
        optimizer = make_optimizer(model.parameters())
        join = train(model, optimizer, n[ctx.rank], ctx.rank)
        report = join.report
        out[name] = {
            "deviation": deviation(model, reference(n, make_optimizer)),
            "shadow_rounds": report.shadow_rounds if report else None,
        }
    return out


def hsdp_mesh(ctx: Ctx) -> DeviceMesh:
    """(replicate, shard) = (2, world / 2): a world of 4 is 2 x 2, a world of 2 is 2 x 1."""
    shard_size = ctx.world // 2
    layout = torch.arange(ctx.world).reshape(2, shard_size)
    groups = {}
    for dim, lines in ((0, layout.t().tolist()), (1, layout.tolist())):
        for line in lines:  # every rank creates every subgroup, in the same order
            group = dist.new_group(line, backend="gloo", timeout=SCENARIO_TIMEOUT)
            if ctx.rank in line:
                groups[dim] = group
    return DeviceMesh.from_group([groups[0], groups[1]], "cpu", mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))


@scenario
def hsdp_reference(ctx: Ctx) -> Any:
    """HSDP (reduce-scatter within a shard group, all-reduce across replicas),
    with a set_requires_gradient_sync window, against the reference."""
    out = {}
    for name, window, table in (("plain", 1, UNEVEN), ("accumulate", 2, {2: [2, 6],
                                                                           4: [4, 0, 6, 2]})):
        n = counts(ctx, table)
        model = net()
        mesh = hsdp_mesh(ctx)
        fully_shard(model.a, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = adamw(model.parameters())
        train(model, optimizer, n[ctx.rank], ctx.rank, window=window)
        out[name] = deviation(model, reference(n, adamw, window=window))
    return out


@scenario
def fsdp_divide_by_active(ctx: Ctx) -> Any:
    """divide_by_initial_world_size=False: each step divides by the ranks still active;
    after the Join the model divides by the world size again."""
    n = counts(ctx, UNEVEN_B)
    model = shard(net(), ctx.group)
    optimizer = sgd(model.parameters())
    train(model, optimizer, n[ctx.rank], ctx.rank, divide_by_initial_world_size=False)
    out = {"deviation": deviation(
        model, reference(n, sgd, divide_by_initial=False))}
    # One more even step outside the Join: FSDP's own averaging again.
    before = full(model)
    optimizer.zero_grad()
    x, y = data(ctx.rank, 100)
    mse_loss(model(x), y).backward()
    optimizer.step()
    ref = net()
    with torch.no_grad():
        for p, value in zip(ref.parameters(), before, strict=True):
            p.copy_(value)
    ref_optimizer = sgd(ref.parameters())
    for r in range(ctx.world):
        x, y = data(r, 100)
        (mse_loss(ref(x), y) / ctx.world).backward()
    ref_optimizer.step()
    out["after"] = deviation(model, ref)
    return out


@scenario
def fsdp_accumulate(ctx: Ctx) -> Any:
    """set_requires_gradient_sync(False) windows of 2; a rank may run out mid-window
    (its partial window is dropped: only ranks active at a step contribute to it)."""
    out = {}
    tables = {"aligned": {2: [2, 6], 4: [4, 0, 6, 2]},
              "mid-window": {2: [3, 6], 4: [3, 6, 0, 5]}}
    for name, table in tables.items():
        n = counts(ctx, table)
        model = shard(net(), ctx.group)
        optimizer = adamw(model.parameters())
        train(model, optimizer, n[ctx.rank], ctx.rank, window=2)
        out[name] = deviation(model, reference(n, adamw, window=2))
    return out


@scenario
def fsdp_shadow_input(ctx: Ctx) -> Any:
    """Join(..., shadow_input=...): an empty batch, and a batch of zeros (the zero
    loss cancels its contribution to the gradients)."""
    out = {}
    n = counts(ctx, UNEVEN)
    for name, given in (("empty", torch.zeros(0, 4)), ("zeros", torch.zeros(5, 4))):
        model = shard(net(), ctx.group)
        optimizer = sgd(model.parameters())
        train(model, optimizer, n[ctx.rank], ctx.rank, shadow_input=given)
        out[name] = deviation(model, reference(n, sgd))
    return out


@scenario
def fsdp_unfused(ctx: Ctx) -> Any:
    """check_agreement=False: the classic heartbeat, then the step check."""
    n = counts(ctx, UNEVEN)
    model = shard(net(), ctx.group)
    optimizer = sgd(model.parameters())
    train(model, optimizer, n[ctx.rank], ctx.rank, check_agreement=False)
    return {"deviation": deviation(model, reference(n, sgd))}


@scenario
def fsdp_not_first(ctx: Ctx) -> Any:
    """Join([counter, model, optimizer]): the counter sends the heartbeat; the
    model's step check still tells joined ranks what each round does."""
    n = counts(ctx, UNEVEN)
    model = shard(net(), ctx.group)
    optimizer = sgd(model.parameters())
    counter = Counter(TorchGroup(ctx.group))
    with Join([counter, model, optimizer]):
        for i in range(n[ctx.rank]):
            counter()
            x, y = data(ctx.rank, i)
            mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    expected = sum(min(c, n[ctx.rank]) for c in n)
    return {"deviation": deviation(model, reference(n, sgd)),
            "count": counter.count, "expected_count": expected}


@scenario
def fsdp_eval(ctx: Ctx) -> Any:
    """Forward only under torch.no_grad (evaluation with uneven shards): joined
    ranks replay forward only; nothing is stepped."""
    model = shard(net(), ctx.group)
    model.eval()
    before = full(model)
    outputs = 0
    with Join([model]), torch.no_grad():
        for i in range(counts(ctx, UNEVEN)[ctx.rank]):
            outputs += model(data(ctx.rank, i)[0]).shape[0]
    change = max(float((a - b).abs().max()) for a, b in zip(full(model), before, strict=True))
    return {"outputs": outputs, "change": change}


@scenario
def fsdp_paused_eval(ctx: Ctx) -> Any:
    """An evaluation every rank runs inside the training Join, rank 0 joined (it had
    1 batch): a side collective of the Join's agrees on the round (MAX) and, in
    round 1, every rank (an active rank's call, the joined one's shadow) evaluates,
    uneven (1/3, or 3/0/1/2 batches), in a Join of its own over a second adapter of
    the model while the training Join's is ``paused()``: its forwards are no
    training round; training then goes on to the reference."""
    from joinkit import SideCollective
    from joinkit.adapters.torch import fsdp

    n = counts(ctx, {2: [1, 3], 4: [1, 3, 2, 3]})
    model = shard(net(), ctx.group)
    optimizer = sgd(model.parameters())
    outputs = [0]

    def evaluate(step: int) -> None:
        agreed = torch.tensor([float(step)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ctx.group)
        if int(agreed) != 1:
            return
        model.eval()
        with fsdp.adapt(model).paused(), Join([fsdp.FSDPJoinable(model)]), torch.no_grad():
            for j in range(counts(ctx, {2: [1, 3], 4: [3, 0, 1, 2]})[ctx.rank]):
                outputs[0] += model(data(ctx.rank, 100 + j)[0]).shape[0]
        model.reshard()
        model.train()

    side = SideCollective(evaluate, shadow=lambda: evaluate(-1), name="evaluation")
    with Join([model, optimizer, side]):
        for i in range(n[ctx.rank]):
            x, y = data(ctx.rank, i)
            mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            side(i)
    return {"deviation": deviation(model, reference(n, sgd)), "outputs": outputs[0]}


@scenario
def fsdp_after_exit(ctx: Ctx) -> Any:
    """After the Join the model issues exactly FSDP's own collectives."""

    def per_iteration(model: Any, optimizer: Any) -> int:
        before = sequence(ctx.group)
        x, y = data(ctx.rank, 50)
        mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        return sequence(ctx.group) - before

    # The Join first: where this torch refuses FSDP2 (support.refusals), its refusal
    # is what every rank records, before any FSDP2 forward (2.6's cannot run on the CPU).
    model = shard(net(), ctx.group)
    optimizer = sgd(model.parameters())
    train(model, optimizer, counts(ctx, UNEVEN)[ctx.rank], ctx.rank)
    after = per_iteration(model, optimizer)
    plain = shard(net(), ctx.group)
    plain_optimizer = sgd(plain.parameters())
    per_iteration(plain, plain_optimizer)  # lazy init
    return {"alone": per_iteration(plain, plain_optimizer), "after": after}


# -- the rest of a training step ------------------------------------------------------------


def _step_lr(optimizer: Any) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


@scenario
def fsdp_scheduler(ctx: Ctx) -> Any:
    """An LR scheduler stepped per iteration advances on joined ranks too."""
    n = counts(ctx, UNEVEN_B)
    model = shard(net(), ctx.group)
    optimizer = adamw(model.parameters())
    scheduler = _step_lr(optimizer)
    train(model, optimizer, n[ctx.rank], ctx.rank, scheduler=scheduler)
    return {
        "deviation": deviation(model, reference(n, adamw, make_scheduler=_step_lr)),
        "lr": optimizer.param_groups[0]["lr"],
        "expected_lr": 0.02 * 0.5 ** max(n),
    }


@scenario
def fsdp_clip_grad_norm(ctx: Ctx) -> Any:
    """Gradient clipping (a norm all-reduce over the shards) through shadow_step:
    joined ranks clip their shards with the active ranks' global norm."""
    n = counts(ctx, UNEVEN_B)
    model = shard(net(), ctx.group)
    optimizer = sgd(model.parameters())
    norms = []

    def step() -> None:
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        optimizer.step()

    with Join([model, optimizer], shadow_step=step):
        for i in range(n[ctx.rank]):
            x, y = data(ctx.rank, i)
            mse_loss(model(x), y).backward()
            step()
            optimizer.zero_grad()

    class Clipped(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            torch.nn.utils.clip_grad_norm_(self.param_groups[0]["params"], 0.05)
            return super().step(closure)

    ref = reference(n, lambda p: Clipped(p, lr=0.1))
    return {"deviation": deviation(model, ref), "clipped": max(norms) > 0.05}


class TwoHeads(nn.Module):
    """``c`` sees a detached input, so an overflow in its loss term stays in its own
    gradients, and only in the rows of the output that term uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.c = nn.Linear(8, 2)
        self.e = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        head = self.c(h.detach())
        return head + self.e(h), head


def two_heads() -> TwoHeads:
    torch.manual_seed(0)
    return TwoHeads()


OVERFLOW_STEP = 3  # the step whose loss overflows in row 0 of c's gradient


def scaled_loss(model: nn.Module, rank: int, i: int, owner: int) -> torch.Tensor:
    x, y = data(rank, i)
    out, head = model(x)
    loss = mse_loss(out, y)
    if i == OVERFLOW_STEP and rank == owner:
        loss = loss + 1e38 * head[:, 0].sum()  # times the scale: inf in c's row 0 only
    return loss


@scenario
def fsdp_grad_scaler(ctx: Ctx) -> Any:
    """GradScaler: at OVERFLOW_STEP one active rank's loss overflows in row 0 of c's
    weight, whose shard lives on rank 0, which has joined by then; the other ranks'
    shards are finite. Every rank must skip that step and halve the scale, the
    joined one included, as one process does."""
    n = {2: [2, 5], 4: [2, 5, 0, 4]}[ctx.world]
    owner = 1  # an active rank at OVERFLOW_STEP
    model = two_heads()
    mesh = DeviceMesh.from_group(ctx.group, "cpu")
    fully_shard(model.c, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    scales = []
    with Join([model, optimizer, scaler]):
        for i in range(n[ctx.rank]):
            scaler.scale(scaled_loss(model, ctx.rank, i, owner)).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scales.append(scaler.get_scale())

    ref = two_heads()
    ref_optimizer = sgd(ref.parameters())
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    ref_scales = []
    for i in range(max(n)):
        active = [r for r in range(ctx.world) if n[r] > i]
        loss = sum(scaled_loss(ref, r, i, owner) for r in active) / ctx.world
        ref_scaler.scale(loss).backward()
        ref_scaler.step(ref_optimizer)
        ref_scaler.update()
        ref_optimizer.zero_grad()
        ref_scales.append(ref_scaler.get_scale())
    return {"deviation": deviation(model, ref), "scale": scaler.get_scale(),
            "scales": scales, "reference_scales": ref_scales}


# -- gradients after the Join, over epochs (issue 10 part 1) --------------------------------

# Inputs per rank in each of three epochs, one Join each; 0 included. Window 1:
# any counts; window 2 "aligned": every count a whole number of windows;
# window 2 "mid-window": some ranks run out in the middle of a window.
EPOCH_TABLES: dict[str, list[dict[int, list[int]]]] = {
    "window1": [{2: [0, 3], 4: [3, 0, 1, 4]}, {2: [4, 2], 4: [2, 5, 0, 3]},
                {2: [3, 1], 4: [1, 2, 4, 0]}],
    "window2-aligned": [{2: [0, 4], 4: [4, 0, 2, 6]}, {2: [4, 2], 4: [2, 6, 0, 4]},
                        {2: [2, 6], 4: [6, 2, 4, 0]}],
    "window2-mid-window": [{2: [3, 0], 4: [3, 0, 5, 2]}, {2: [1, 4], 4: [4, 3, 1, 0]},
                           {2: [4, 5], 4: [0, 5, 3, 4]}],
}


def _gamma_lr(optimizer: Any) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)


def grad_state(model: nn.Module) -> list[tuple[Any, torch.Tensor | None]]:
    """Every gradient this rank holds, as (object, value): each sharded parameter's
    ``.grad`` (a DTensor: its local shard), then FSDP's gradient accumulation
    (unsharded gradients kept between ``set_requires_gradient_sync(False)``
    backwards)."""
    from joinkit.adapters.torch._fsdp_state import param_groups as _param_groups

    tensors: list[Any] = [p.grad for p in model.parameters()]
    for group in _param_groups(model):
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            tensors.append(None if unsharded is None else unsharded.grad)
            tensors.append(fsdp_param.unsharded_accumulated_grad)
    return [(t, None if t is None else
             (t.to_local() if isinstance(t, DTensor) else t).detach().clone())
            for t in tensors]


def grad_change(before: list[Any], after: list[Any]) -> dict[str, Any]:
    """Whether every gradient is the same object, and the largest change of a value
    (``inf`` where one side has a gradient and the other none)."""
    same = all(a is b for (a, _), (b, _) in zip(before, after, strict=True))
    change = 0.0
    for (_, a), (_, b) in zip(before, after, strict=True):
        if (a is None) != (b is None):
            change = float("inf")
        elif a is not None and b is not None:
            change = max(change, float((a - b).abs().max()) if a.numel() else 0.0)
    return {"same_objects": same, "change": change}


def reference_epochs(world: int, tables: list[dict[int, list[int]]], window: int,
                     make_optimizer: Callable[[Any], torch.optim.Optimizer],
                     make_scheduler: Callable[[Any], Any] | None = None,
                     ) -> list[tuple[nn.Module, float]]:
    """One process, epoch after epoch: per window, the gradient of the ranks that
    complete it, over the world size, as ``reference`` does. A rank that runs out
    in the middle of a window keeps its partial window (FSDP accumulates it in
    unsharded gradients, which the Join gives back and ``optimizer.zero_grad()``
    does not clear): it enters that rank's next syncing backward, in a later
    epoch. Returns, after each epoch, a copy of the model and the learning rate."""
    import copy

    ref = net()
    params = list(ref.parameters())
    optimizer = make_optimizer(params)
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    pending: list[list[torch.Tensor] | None] = [None] * world
    after = []
    for epoch, table in enumerate(tables):
        n = table[world]

        def grads(r: int, first: int, last: int, epoch: int = epoch) -> list[torch.Tensor]:
            total = sum(mse_loss(ref(data(r, 100 * epoch + i)[0]), data(r, 100 * epoch + i)[1])
                        for i in range(first, last))
            return list(torch.autograd.grad(total / window / world, params))

        for start in range(0, max(n), window):
            sync = start + window - 1
            for r in range(world):
                if start < n[r] <= sync:  # runs out inside this window
                    partial = grads(r, start, n[r])
                    old = pending[r]
                    pending[r] = partial if old is None else [
                        a + b for a, b in zip(old, partial, strict=True)]
            contributors = [r for r in range(world) if n[r] > sync]
            if not contributors:
                continue
            total = [torch.zeros_like(p) for p in params]
            for r in contributors:
                own = grads(r, start, sync + 1)
                if pending[r] is not None:
                    own = [a + b for a, b in zip(own, pending[r], strict=True)]
                    pending[r] = None
                total = [t + g for t, g in zip(total, own, strict=True)]
            for p, g in zip(params, total, strict=True):
                p.grad = g
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        after.append((copy.deepcopy(ref), optimizer.param_groups[0]["lr"]))
    return after


def train_epochs(ctx: Ctx, tables: list[dict[int, list[int]]], window: int, order: str,
                 make_optimizer: Callable[[Any], torch.optim.Optimizer],
                 step_objects: bool = False) -> dict[str, Any]:
    """Three epochs, one Join each, of::

        for i, (x, y) in enumerate(shard):
            if order == "first" and i % window == 0: optimizer.zero_grad()
            model.set_requires_gradient_sync(i % window == window - 1)  # window > 1
            (loss(model(x), y) / window).backward()
            if i % window == window - 1:
                optimizer.step()            # with step_objects: scaler, scheduler
                if order == "last": optimizer.zero_grad()

    Returns, per epoch, every rank's deviation from ``reference_epochs``, how
    this rank's gradients after the Join differ from those it held when it left
    its loop (``grad_change``), its learning rate and the reference's, and its
    GradScaler's scale."""
    model = shard(net(), ctx.group)
    optimizer = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu") if step_objects else None
    scheduler = _gamma_lr(optimizer) if step_objects else None
    joinables = [model, optimizer] + ([scaler, scheduler] if step_objects else [])
    out: dict[str, Any] = {"deviation": [], "grads": [], "shadow_rounds": [], "lr": [],
                           "reference_lr": [], "scale": []}
    references = reference_epochs(ctx.world, tables, window, make_optimizer,
                                  _gamma_lr if step_objects else None)
    for epoch, table in enumerate(tables):
        with Join(joinables) as join:
            for i in range(table[ctx.world][ctx.rank]):
                syncs = i % window == window - 1
                if order == "first" and i % window == 0:
                    optimizer.zero_grad()
                if window > 1:
                    model.set_requires_gradient_sync(syncs)
                x, y = data(ctx.rank, 100 * epoch + i)
                loss = mse_loss(model(x), y) / window
                (scaler.scale(loss) if scaler else loss).backward()
                if syncs:
                    if scaler is not None and scheduler is not None:
                        scaler.step(optimizer)
                        scaler.update()
                        scheduler.step()
                    else:
                        optimizer.step()
                    if order == "last":
                        optimizer.zero_grad()
            left = grad_state(model)
        out["grads"].append(grad_change(left, grad_state(model)))
        out["shadow_rounds"].append(join.report.shadow_rounds if join.report else 0)
        ref, ref_lr = references[epoch]
        out["deviation"].append(deviation(model, ref))
        out["lr"].append(optimizer.param_groups[0]["lr"])
        out["reference_lr"].append(ref_lr)
        out["scale"].append(scaler.get_scale() if scaler else None)
    return out


@scenario
def fsdp_epochs(ctx: Ctx) -> Any:
    """Three epochs, one Join each: SGD and AdamW, zero_grad first and last, windows
    of 1 and 2 (aligned and mid-window); and AdamW with a GradScaler and an LR
    scheduler in the Join. Every rank equals the reference after every epoch, and
    the Join leaves every rank's gradients as its loop left them."""
    out = {}
    for table_name, tables in EPOCH_TABLES.items():
        window = 1 if table_name == "window1" else 2
        for optimizer_name, make_optimizer in (("sgd", sgd), ("adamw", adamw)):
            for order in ("first", "last"):
                out[f"{optimizer_name}/{order}/{table_name}"] = train_epochs(
                    ctx, tables, window, order, make_optimizer)
    out["adamw/last/window1/scaler+scheduler"] = train_epochs(
        ctx, EPOCH_TABLES["window1"], 1, "last", adamw, step_objects=True)
    return out


# -- throw mode, failures, misuse ------------------------------------------------------------


@scenario
def fsdp_throw(ctx: Ctx) -> Any:
    model = shard(net(), ctx.group)
    optimizer = sgd(model.parameters())
    iterations = 0
    try:
        with Join([model, optimizer], throw_on_early_termination=True):
            for i in range(2 + ctx.rank):
                x, y = data(ctx.rank, i)
                mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                iterations += 1
    except RuntimeError as exc:
        return {"iterations": iterations, **error_of(exc)}
    return {"iterations": iterations, "type": None}


@scenario
def fsdp_peer_failure(ctx: Ctx) -> Any:
    """Rank 1 raises between iterations; every rank leaves with an error."""
    model = shard(net(), ctx.group)
    optimizer = sgd(model.parameters())
    iterations = 0
    try:
        with Join([model, optimizer]):
            for i in range(5):
                if ctx.rank == 1 and i == 2:
                    raise ValueError("bad batch on rank 1")
                x, y = data(ctx.rank, i)
                mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                iterations += 1
    except Exception as exc:
        return {"iterations": iterations, **error_of(exc)}
    return {"iterations": iterations, "type": None}


class FailingRoot(nn.Module):
    """A root without parameters of its own: its forward raises on one rank at one
    call, after joinkit's step check and before any FSDP collective."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.inner = Net()
        self.rank = rank
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if (self.rank, self.calls) == (1, 3):
            raise ValueError("bad forward on rank 1")
        return self.inner(x)


@scenario
def fsdp_peer_failure_in_forward(ctx: Ctx) -> Any:
    """Rank 1 raises in the root's forward right after its step check: it replays
    the rest of that iteration first (flags from its own send, FSDP reset), then
    every rank learns of the failure."""
    torch.manual_seed(0)
    model = FailingRoot(ctx.rank)
    mesh = DeviceMesh.from_group(ctx.group, "cpu")
    fully_shard(model.inner.a, mesh=mesh)
    fully_shard(model.inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = sgd(model.parameters())
    iterations = 0
    try:
        with Join([model, optimizer]):
            for i in range(5):
                x, y = data(ctx.rank, i)
                mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                iterations += 1
    except Exception as exc:
        return {"iterations": iterations, **error_of(exc)}
    return {"iterations": iterations, "type": None}


@scenario
def misuse(ctx: Ctx) -> Any:
    """Combinations the adapters refuse at Join(...), and the missing-optimizer warning."""
    out: dict[str, Any] = {}
    model = shard(net(), ctx.group)
    optimizer = sgd(model.parameters())
    scheduler = _step_lr(optimizer)
    scaler = torch.amp.GradScaler("cpu")
    ddp_model = DDP(nn.Linear(2, 2), process_group=ctx.group)
    ddp_optimizer = sgd(ddp_model.parameters())
    zero = ZeroRedundancyOptimizer(ddp_model.parameters(), torch.optim.SGD,
                                   process_group=ctx.group, lr=0.1)
    cases = {
        "optimizer_alone": [optimizer],
        "optimizer_before_model": [optimizer, model],
        "ddp_optimizer": [ddp_model, ddp_optimizer],
        "scheduler_alone": [model, scheduler],
        "scheduler_first": [model, scheduler, optimizer],
        "scaler_alone": [model, scaler],
        "scaler_zero": [ddp_model, zero, scaler],
        "plateau": [model, optimizer,
                    torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)],
    }
    from joinkit.adapters import UnsupportedTorchError

    # Where this torch refuses FSDP2 on the CPU (torch 2.6), each FSDP2 case meets
    # that refusal first: recorded, and the test checks it.
    for name, joinables in cases.items():
        try:
            Join(joinables)
        except (ValueError, UnsupportedTorchError) as exc:
            out[name] = str(exc)
        else:
            out[name] = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            Join([model])
        except UnsupportedTorchError as exc:
            out["refused"] = str(exc)
    out["warning"] = [str(w.message) for w in caught]
    return out


# -- the torch internals the adapters rely on (issue 11 part 5) -------------------------------


@contextmanager
def _patched(owner: Any, name: str, value: Any = None) -> Iterator[None]:
    """Replace ``owner.name`` for the block (``None``: delete it), as a torch upgrade might."""
    saved = owner.__dict__[name]
    if value is None:
        delattr(owner, name)
    else:
        setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@scenario
def torch_guard(ctx: Ctx) -> Any:
    """For each adapter, one torch internal it relies on is deleted or changed:
    Join(...) raises UnsupportedTorchError naming the member and torch's version.
    With torch as it is, the same Joins are built; and once a kind of object
    passed, the check does not run again in this process."""
    from torch.distributed.algorithms import join as torch_join
    from torch.distributed.device_mesh import DeviceMesh as Mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.optim import zero_redundancy_optimizer as zero_module
    from torch.nn.parallel import distributed as ddp_module

    from joinkit.adapters import UnsupportedTorchError
    from joinkit.adapters.torch import _private as _torch_private

    model = shard(net(), ctx.group)
    optimizer = sgd(model.parameters())
    ddp = DDP(nn.Linear(2, 2), process_group=ctx.group)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD,
                                   process_group=ctx.group, lr=0.1)

    def renamed_ddp_hook(self: Any) -> None:  # calls a renamed method
        self.ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        self.ddp._match_all_reduce_for_bwd_pass_impl()

    def renamed_zero_hook(self: Any) -> None:
        self.zero._step_impl()

    def flatten(self: Any, mesh_dim_name: str, backend_override: Any) -> Any:
        raise AssertionError("not called")

    cases: dict[str, tuple[Callable[[], Any], list[Any]]] = {
        "ddp_deleted": (lambda: _patched(DDP, "_match_all_reduce_for_bwd_pass"), [ddp]),
        "ddp_hook_renamed": (lambda: _patched(ddp_module._DDPJoinHook, "main_hook",
                                              renamed_ddp_hook), [ddp]),
        "join_config_deleted": (lambda: _patched(torch_join, "_JoinConfig"), [ddp]),
        "zero_moved": (lambda: _patched(zero_module, "ZeroRedundancyOptimizer"), [ddp, zero]),
        "zero_hook_renamed": (lambda: _patched(zero_module._ZeROJoinHook, "main_hook",
                                               renamed_zero_hook), [ddp, zero]),
        "fsdp_deleted": (lambda: _patched(FSDPModule, "_get_fsdp_state"), [model, optimizer]),
        "fsdp_signature": (lambda: _patched(Mesh, "_flatten", flatten), [model, optimizer]),
    }
    out: dict[str, Any] = {"torch": torch.__version__}
    for name, (patch, joinables) in cases.items():
        _torch_private._checked.clear()
        with patch():
            try:
                Join(joinables)
            except UnsupportedTorchError as exc:
                out[name] = str(exc)
            else:
                out[name] = None
    _torch_private._checked.clear()
    # Where this torch refuses FSDP2 on the CPU (torch 2.6), the FSDP2 Join with torch
    # as it is meets that refusal, after the check passed: the same refusal again
    # with a member deleted shows the check did not run again.
    refused = []
    for joinables in ([ddp, zero], [model, optimizer]):
        try:
            Join(joinables)  # this torch as it is: no error
        except UnsupportedTorchError as exc:
            refused.append(str(exc))
    with _patched(DDP, "_match_all_reduce_for_bwd_pass"), _patched(Mesh, "_flatten"):
        Join([ddp, zero])  # checked once per process: not again
        try:
            Join([model, optimizer])
        except UnsupportedTorchError as exc:
            refused.append(str(exc))
    out["refused"] = refused
    out["cached"] = True
    return out


# -- models with collectives in forward: DDP + SyncBatchNorm ----------------------------------


class BNNet(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.norm = norm
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def bn_net(norm: nn.Module) -> BNNet:
    torch.manual_seed(0)
    return BNNet(norm)


def _sync_bn_reference(n: list[int], world: int, window: int, device: Any) -> BNNet:
    """One process, BatchNorm over the union of the active ranks' batches per
    forward; the loss is each rank's mean loss, summed, over the world size."""
    ref = bn_net(nn.BatchNorm1d(6)).to(device)
    optimizer = sgd(ref.parameters())
    for start in range(0, max(n), window):
        sync = start + window - 1
        optimizer.zero_grad()
        for i in range(start, sync + 1):
            active = [r for r in range(world) if n[r] > i]
            if not active:
                break
            batches = [data(r, i, rows=2 + r) for r in active]
            out = ref(torch.cat([x for x, _ in batches]).to(device))
            loss = torch.zeros((), device=device)
            offset = 0
            for (x, y), r in zip(batches, active, strict=True):
                rows = x.shape[0]
                # Ranks that drop out mid-window contribute to statistics, not to the step.
                weight = 1.0 if n[r] > sync else 0.0
                loss = loss + weight * mse_loss(out[offset:offset + rows], y.to(device))
                offset += rows
            (loss / world / window).backward()
        optimizer.step()
    return ref


def _sync_bn_run(ctx: Ctx, norm: nn.Module, n: list[int], window: int, device: Any,
                 zero: bool = False, **join_kwargs: Any) -> dict[str, Any]:
    """Without ``zero`` the optimizer stays out of the Join (DDP's post hook
    syncs the final model); with it, a ZeroRedundancyOptimizer(SGD) is in the
    Join and joined ranks step their shard with the replay's gradients. (SGD:
    the bias before the norm has a zero gradient up to rounding, which Adam
    would blow up to a full step of either sign.)"""
    module = bn_net(norm).to(device)
    model = DDP(module, process_group=ctx.group,
                device_ids=[device.index] if device.type == "cuda" else None)
    optimizer: Any = sgd(model.parameters())
    joinables: list[Any] = [model]
    if zero:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD,
                                            process_group=ctx.group, lr=0.1)
        joinables.append(optimizer)
    with Join(joinables, **join_kwargs):
        for i in range(n[ctx.rank]):
            x, y = data(ctx.rank, i, rows=2 + ctx.rank)
            syncs = i % window == window - 1
            context = model.no_sync() if not syncs else _nothing()
            with context:
                (mse_loss(model(x.to(device)), y.to(device)) / window).backward()
            if syncs:
                optimizer.step()
                optimizer.zero_grad()
    ref = _sync_bn_reference(n, ctx.world, window, device)
    params = max(float((a - b).abs().max()) for a, b in
                 zip(module.parameters(), ref.parameters(), strict=True))
    buffers = max(float((a.double() - b.double()).abs().max()) for a, b in
                  zip(module.buffers(), ref.buffers(), strict=True))
    return {"params": params, "buffers": buffers,
            "running_mean": module.norm.running_mean.tolist(),
            "batches": int(module.norm.num_batches_tracked)}


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@scenario
def ddp_sync_batch_norm(ctx: Ctx) -> Any:
    """DDP + a SyncBatchNorm-style CPU module, uneven inputs: every rank ends equal to
    one process normalising over the active ranks' union batch (parameters and
    running statistics). The replay is automatic (the module declares
    join_forward_collectives); also under no_sync() windows."""
    n = {2: [0, 3], 4: [2, 0, 4, 3]}[ctx.world]
    cpu = torch.device("cpu")
    return {
        "plain": _sync_bn_run(ctx, CPUSyncBatchNorm(6, ctx.group), n, 1, cpu),
        "no_sync": _sync_bn_run(ctx, CPUSyncBatchNorm(6, ctx.group),
                                {2: [2, 4], 4: [2, 4, 0, 4]}[ctx.world], 2, cpu),
        "zero": _sync_bn_run(ctx, CPUSyncBatchNorm(6, ctx.group), n, 1, cpu, zero=True),
        # DDP's own gradient-sync check instead of the fused one.
        "unfused": _sync_bn_run(ctx, CPUSyncBatchNorm(6, ctx.group), n, 1, cpu,
                                check_agreement=False),
        # The control: a joined rank replaying a non-empty batch pollutes the
        # statistics (the zero loss cancels its gradients, not its statistics).
        "nonempty_shadow": _sync_bn_run(ctx, CPUSyncBatchNorm(6, ctx.group), n, 1, cpu,
                                        shadow_input=torch.ones(4, 4)),
    }


@scenario
def cuda_sync_batch_norm(ctx: Ctx) -> Any:
    """The real torch.nn.SyncBatchNorm (CUDA only): every rank on cuda:0, gloo; plain,
    in no_sync() windows, and with a ZeroRedundancyOptimizer in the Join."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    n = {2: [0, 3], 4: [2, 0, 4, 3]}[ctx.world]
    device = torch.device("cuda", 0)

    def norm() -> nn.Module:
        return nn.SyncBatchNorm(6, process_group=ctx.group)

    return {
        "plain": _sync_bn_run(ctx, norm(), n, 1, device),
        "no_sync": _sync_bn_run(ctx, norm(), {2: [2, 4], 4: [2, 4, 0, 4]}[ctx.world], 2,
                                device),
        "zero": _sync_bn_run(ctx, norm(), n, 1, device, zero=True),
    }


# -- DDP + ZeRO + an LR scheduler ----------------------------------------------------------


@scenario
def ddp_zero_scheduler(ctx: Ctx) -> Any:
    """Joined ranks step their ZeRO shard with the active ranks' learning rate."""
    n = {2: [2, 4], 4: [2, 4, 0, 3]}[ctx.world]

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    model = DDP(make(), process_group=ctx.group)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                   process_group=ctx.group, lr=0.05)
    scheduler = _step_lr(zero)
    with Join([model, zero, scheduler]):
        for i in range(n[ctx.rank]):
            zero.zero_grad()
            x, y = data(ctx.rank, i)
            mse_loss(model(x), y).backward()
            zero.step()
            scheduler.step()

    def loss(ref: nn.Module, r: int, i: int) -> torch.Tensor:
        x, y = data(r, i)
        return mse_loss(ref(x), y)

    ref = reference(n, lambda p: torch.optim.Adam(p, lr=0.05), make_scheduler=_step_lr,
                    model=make, loss=loss)
    return {
        "deviation": max(float((a - b).abs().max()) for a, b in
                         zip(model.module.parameters(), ref.parameters(), strict=True)),
        "lr": zero.param_groups[0]["lr"],
    }


# -- CUDA and nccl (run by test_fsdp.py only where CUDA is available) -------------------


@scenario
def nccl_fsdp_reference(ctx: Ctx) -> Any:
    """FSDP2 over nccl, one GPU per rank, uneven inputs: equals the CPU reference."""
    n = {1: [3], 2: [0, 3]}[ctx.world]
    device = torch.device("cuda", torch.cuda.current_device())
    model = net().to(device)
    mesh = DeviceMesh.from_group(ctx.group, "cuda")
    for child in (model.a, model.b):
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = adamw(model.parameters())
    with Join([model, optimizer]):
        for i in range(n[ctx.rank]):
            x, y = data(ctx.rank, i)
            mse_loss(model(x.to(device)), y.to(device)).backward()
            optimizer.step()
            optimizer.zero_grad()
    ref = reference(n, adamw)
    return {"deviation": max(float((a.cpu() - b.detach()).abs().max())
                             for a, b in zip(full(model), ref.parameters(), strict=True))}


# -- the runner ---------------------------------------------------------------------------


def main(argv: list[str], scenarios: dict[str, Any] | None = None) -> None:
    """Run the named scenarios on this rank (``scenarios``: another program's registry)."""
    scenarios = SCENARIOS if scenarios is None else scenarios
    rank, world, store, out_dir, *names = argv
    backend = "gloo"
    if "--nccl" in names:
        names.remove("--nccl")
        backend = "nccl"
        torch.cuda.set_device(int(rank) % torch.cuda.device_count())
    ctx = Ctx(int(rank), int(world), None)
    out = Path(out_dir) / f"rank{rank}.jsonl"
    torch.set_num_threads(1)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=ctx.rank, world_size=ctx.world,
        timeout=SCENARIO_TIMEOUT,
    )
    for name in names:
        with recording(out, name) as record:
            start = time.monotonic()
            ctx.group = dist.new_group(backend=backend, timeout=SCENARIO_TIMEOUT)
            record["result"] = scenarios[name](ctx)
            record["collectives"] = sequence(ctx.group)
            record["seconds"] = round(time.monotonic() - start, 2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
