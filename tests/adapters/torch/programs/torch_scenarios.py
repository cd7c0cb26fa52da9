"""Multi-rank scenarios for the torch tests, all run in one gloo process group.

Theory of operation
-------------------
Starting a process and importing torch costs seconds, so ``test_torch_dist.py``
starts one process per rank once and each runs many scenarios in a row::

    python torch_scenarios.py RANK WORLD_SIZE STORE_FILE OUT_DIR NAME [NAME ...]

Rendezvous is a ``FileStore`` (no port to pick, so no clash). Every scenario gets
a fresh gloo subgroup over all ranks with a short timeout, so a scenario that
deadlocks fails with gloo's timeout error, and the next scenario does not
inherit its half-finished collectives. After each scenario a rank appends one
JSON line to ``OUT_DIR/rank{RANK}.jsonl``: ``{"name", "ok", "result", "error"}``;
the test reads them and asserts. Checks that compare ranks (identical
parameters, who got which message) are done by the test, not here.

Scenarios whose name starts with ``pre_init_`` run before
``init_process_group``. Rank r of a tutorial-style scenario has ``5 + r``
inputs.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.algorithms.join as torch_join
from support import Counter, Ctx, recording, scenario_registry
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import joinkit
from joinkit import Join, _machine, backends
from joinkit.backends.torch_dist import TorchGroup

SCENARIO_TIMEOUT = datetime.timedelta(seconds=20)


SCENARIOS, scenario = scenario_registry()


# -- helpers ------------------------------------------------------------------------


def flat(module: nn.Module) -> list[float]:
    """Every parameter and buffer of ``module``, flattened (to compare ranks)."""
    tensors = [*module.parameters(), *module.buffers()]
    return [float(v) for t in tensors for v in t.detach().reshape(-1).tolist()]


def sequence(group: Any) -> int:
    """How many collectives ``group`` has issued (DDP's C++ ones included)."""
    return int(group._get_sequence_number_for_group())


def error_of(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


def batch(rank: int, i: int, shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * rank + i))


class TorchCounter(torch_join.Joinable):
    """The tutorial's Counter, a torch Joinable, on an explicit group."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.count = torch.zeros(1)
        self.max_count = torch.zeros(1)

    def __call__(self) -> None:
        torch_join.Join.notify_join_context(self)
        t = torch.ones(1)
        dist.all_reduce(t, group=self.group)
        self.count += t

    def join_hook(self, **kwargs: Any) -> torch_join.JoinHook:
        return _TorchCounterHook(self, kwargs.get("sync_max_count", False))

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.group

    def find_common_rank(self, rank: int, to_consider: bool) -> int:
        t = torch.tensor([rank if to_consider else -1])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())


class _TorchCounterHook(torch_join.JoinHook):
    def __init__(self, counter: Any, sync_max_count: bool) -> None:
        self.counter = counter
        self.sync_max_count = sync_max_count

    def main_hook(self) -> None:
        dist.all_reduce(torch.zeros(1), group=self.counter.group)

    def post_hook(self, is_last_joiner: bool) -> None:
        if not self.sync_max_count:
            return
        counter = self.counter
        rank = dist.get_rank(counter.group)
        common = counter.find_common_rank(rank, is_last_joiner)
        if rank == common:
            counter.max_count = counter.count.detach().clone()
        dist.broadcast(counter.max_count, src=dist.get_global_rank(counter.group, common),
                       group=counter.group)


class DualCounter(joinkit.Joinable, torch_join.Joinable):
    """A Counter that both torch's and joinkit's Join can drive directly.

    It notifies whichever Join entered it: torch's sets a torch ``_JoinConfig``.
    """

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.count = torch.zeros(1)
        self.max_count = torch.zeros(1)

    def __call__(self) -> None:
        if isinstance(self._join_config, torch_join._JoinConfig):
            torch_join.Join.notify_join_context(self)
        else:
            Join.notify_join_context(self)
        t = torch.ones(1)
        dist.all_reduce(t, group=self.group)
        self.count += t

    def join_hook(self, **kwargs: Any) -> Any:
        return _TorchCounterHook(self, kwargs.get("sync_max_count", False))

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.group

    find_common_rank = TorchCounter.find_common_rank


def ddp(ctx: Ctx, module: nn.Module, **kwargs: Any) -> DDP:
    torch.manual_seed(0)
    return DDP(module, process_group=ctx.group, **kwargs)


def counts(inputs: list[int], rank: int) -> tuple[int, int]:
    """Expected (count before ``rank`` joined, total) of a Counter."""
    return sum(min(n, inputs[rank]) for n in inputs), sum(inputs)


# -- before init_process_group ---------------------------------------------------------


@scenario
def pre_init_uninitialised(ctx: Ctx) -> Any:
    """A group taken as dist.group.WORLD before init is None: a clear error."""
    out = {}
    counter = TorchCounter(dist.group.WORLD)
    try:
        Join([counter])
    except Exception as exc:
        out["join"] = error_of(exc)
    try:
        TorchGroup()
    except Exception as exc:
        out["group"] = error_of(exc)
    return out


# -- the tutorial, and DDP's keyword arguments ------------------------------------------


class SwitchedCounter(TorchCounter):
    """A torch Joinable whose code switched one import: it notifies joinkit's Join."""

    def __call__(self) -> None:
        Join.notify_join_context(self)
        t = torch.ones(1)
        dist.all_reduce(t, group=self.group)
        self.count += t


@scenario
def torch_joinable_notifies_joinkits_join(ctx: Ctx) -> Any:
    """``joinkit.Join.notify_join_context(torch_joinable)`` goes to its adapter."""
    counter = SwitchedCounter(ctx.group)
    outside = Join.notify_join_context(counter)  # outside any Join: nothing, as in torch
    with Join([counter], sync_max_count=True) as join:
        for _ in range(5 + ctx.rank):
            counter()
    return {
        "outside": outside,
        "count": int(counter.count.item()),
        "max_count": int(counter.max_count.item()),
        "inputs": join.report.inputs if join.report else None,
    }


@scenario
def progress_line(ctx: Ctx) -> Any:
    """A joined rank's INFO progress line, with the interval at 0 s (a line at
    every drain batch boundary); the names come from the store's status board,
    which each rank publishes at most twice a second (before that: the count)."""
    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.INFO:
                lines.append(record.getMessage())

    logger = logging.getLogger("joinkit")
    handler, level, interval = Capture(), logger.level, _machine.PROGRESS_INTERVAL
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    _machine.PROGRESS_INTERVAL = 0.0
    try:
        counter = SwitchedCounter(ctx.group)
        with Join([counter]) as join:
            for _ in range(2 if ctx.rank == 0 else 100):
                # A drain (about 5 s) long enough for the board to be
                # published (twice a second), also on a loaded machine.
                time.sleep(0.05)
                counter()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        _machine.PROGRESS_INTERVAL = interval
    assert join.report is not None
    return {"lines": lines, "shadow_rounds": join.report.shadow_rounds}


@scenario
def ddp_tutorial(ctx: Ctx) -> Any:
    model = ddp(ctx, nn.Linear(1, 1))
    num_inputs = 0
    with Join([model]):
        for _ in range(5 + ctx.rank):
            num_inputs += 1
            model(torch.tensor([1.0])).sum().backward()
    return {"inputs": num_inputs, "params": flat(model)}


@scenario
def ddp_divide(ctx: Ctx) -> Any:
    """The gradient of w*x with x = rank + 1, per iteration, both divide modes.

    Rank r has r + 1 inputs; after the Join every rank runs one more iteration,
    which must divide by the world size again (no stale count of active ranks).
    """
    out = {}
    for divide in (True, False):
        model = ddp(ctx, nn.Linear(1, 1, bias=False))
        with torch.no_grad():
            model.module.weight.fill_(1.0)
        x = torch.tensor([[ctx.rank + 1.0]])
        grads = []
        with Join([model], divide_by_initial_world_size=divide):
            for _ in range(ctx.rank + 1):
                model.zero_grad()
                model(x).sum().backward()
                grads.append(model.module.weight.grad.item())
        model.zero_grad()
        model(x).sum().backward()
        out[str(divide)] = {
            "grads": grads,
            "after": model.module.weight.grad.item(),
            "attribute": model._divide_by_initial_world_size,
        }
    return out


def _zero_reference(ctx: Ctx, join_cls: Any, divide: bool) -> dict[str, Any]:
    """DDP + ZeRO(Adam) with uneven inputs against one process applying the same
    averaged gradients: active ranks' gradients summed, over the initial world
    size (``divide``) or the number of active ranks; a joined rank adds zero."""
    inputs = [2 + 2 * r for r in range(ctx.world)]

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    model = DDP(make(), process_group=ctx.group)
    optim = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, process_group=ctx.group, lr=0.05
    )
    with join_cls([model, optim], divide_by_initial_world_size=divide):
        for i in range(inputs[ctx.rank]):
            optim.zero_grad()
            model(batch(ctx.rank, i)).pow(2).sum().backward()
            optim.step()

    reference = make()
    reference_optim = torch.optim.Adam(reference.parameters(), lr=0.05)
    for i in range(max(inputs)):
        active = [r for r in range(ctx.world) if i < inputs[r]]
        total = [torch.zeros_like(p) for p in reference.parameters()]
        for r in active:
            reference.zero_grad()
            reference(batch(r, i)).pow(2).sum().backward()
            for t, p in zip(total, reference.parameters(), strict=True):
                t += p.grad
        for t, p in zip(total, reference.parameters(), strict=True):
            p.grad = t / (ctx.world if divide else len(active))
        reference_optim.step()
    deviation = max(
        (p - q).abs().max().item()
        for p, q in zip(model.module.parameters(), reference.parameters(), strict=True)
    )
    return {"deviation": deviation, "params": flat(model.module)}


@scenario
def ddp_zero_reference(ctx: Ctx) -> Any:
    return {
        "joinkit": _zero_reference(ctx, Join, divide=True),
        "joinkit_effective": _zero_reference(ctx, Join, divide=False),
        # torch's own combination, for the record (not asserted by the tests).
        "torch": _zero_reference(ctx, torch_join.Join, divide=True),
    }


# -- gradients after the Join, over epochs (issue 10) -----------------------------------

EPOCHS = 3


def epoch_inputs(world: int, epoch: int) -> list[int]:
    """Inputs per rank in ``epoch``: 2..world+1, a different rank shortest each epoch."""
    return [2 + (rank + epoch) % world for rank in range(world)]


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05),
}


def zero_optimizer(params: Any, name: str, group: Any) -> ZeroRedundancyOptimizer:
    cls, kwargs = {
        "sgd": (torch.optim.SGD, {"lr": 0.1}),
        "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        "adamw": (torch.optim.AdamW, {"lr": 0.05}),
    }[name]
    return ZeroRedundancyOptimizer(params, cls, process_group=group, **kwargs)


def grads_of(module: nn.Module) -> list[list[float] | None]:
    return [None if p.grad is None else p.grad.reshape(-1).tolist() for p in module.parameters()]


def train_epochs(
    ctx: Ctx, join_cls: Any, optimizer: str, order: str, accumulate: int, zero: bool,
    join_kwargs: dict[str, Any] | None = None, **ddp_kwargs: Any,
) -> dict[str, Any]:
    """``EPOCHS`` epochs, one Join each, of the loop::

        for i, x in enumerate(inputs):
            if order == "first" and i % accumulate == 0: optim.zero_grad()
            with model.no_sync() unless i % accumulate == accumulate - 1:
                loss(model(x)).backward()
            if i % accumulate == accumulate - 1:
                optim.step()
                if order == "last": optim.zero_grad()

    ``join_kwargs`` go to joinkit's Join only (e.g. ``replay=True``: the
    joined rank shadows by replaying the iteration through DDP).

    Returns the parameters after every epoch and every parameter's ``.grad``
    right after each Join.
    """
    model = DDP(small_model(), process_group=ctx.group, **ddp_kwargs)
    optim = (
        zero_optimizer(model.parameters(), optimizer, ctx.group)
        if zero else OPTIMIZERS[optimizer](model.parameters())
    )
    joinables = [model, optim] if zero else [model]
    grads, params = [], []
    for epoch in range(EPOCHS):
        with join_cls(joinables, **(join_kwargs if join_cls is Join else {}) or {}):
            for i in range(epoch_inputs(ctx.world, epoch)[ctx.rank]):
                syncs = i % accumulate == accumulate - 1
                if order == "first" and i % accumulate == 0:
                    optim.zero_grad()
                with (contextlib.nullcontext() if syncs else model.no_sync()):
                    model(batch(ctx.rank, 100 * epoch + i)).pow(2).sum().backward()
                if syncs:
                    optim.step()
                    if order == "last":
                        optim.zero_grad()
        grads.append(grads_of(model.module))
        params.append(flat(model.module))
    return {"grads": grads, "params": params}


def simulate_ddp_epochs(
    world: int, optimizer: str, order: str, accumulate: int
) -> dict[str, Any]:
    """The same epochs in one process: ``world`` replicas, each with its own
    optimizer, exactly as DDP with a Join runs them. In a syncing iteration
    the active replicas' gradients are summed and divided by the world size (a
    joined replica adds zero and keeps its own ``.grad``); joined replicas do
    not step; at the end of each Join every replica takes the parameters of
    the highest-ranked last joiner (DDP's post hook).

    Returns, per rank, what ``train_epochs`` returns.
    """
    replicas = [small_model() for _ in range(world)]
    optims = [OPTIMIZERS[optimizer](m.parameters()) for m in replicas]
    grads: list[list[Any]] = [[] for _ in range(world)]
    params: list[list[Any]] = [[] for _ in range(world)]
    for epoch in range(EPOCHS):
        inputs = epoch_inputs(world, epoch)
        for i in range(max(inputs)):
            active = [r for r in range(world) if i < inputs[r]]
            syncs = i % accumulate == accumulate - 1
            for r in active:
                if order == "first" and i % accumulate == 0:
                    optims[r].zero_grad()
                replicas[r](batch(r, 100 * epoch + i)).pow(2).sum().backward()
            if not syncs:
                continue
            for tensors in zip(*(replicas[r].parameters() for r in active), strict=True):
                average = sum(p.grad for p in tensors) / world
                for p in tensors:
                    p.grad.copy_(average)
            for r in active:
                optims[r].step()
                if order == "last":
                    optims[r].zero_grad()
        source = max(r for r in range(world) if inputs[r] == max(inputs))
        with torch.no_grad():
            for replica in replicas:
                for p, q in zip(replica.parameters(), replicas[source].parameters(), strict=True):
                    p.copy_(q)
        for r in range(world):
            grads[r].append(grads_of(replicas[r]))
            params[r].append(flat(replicas[r]))
    return {"per_rank": [{"grads": grads[r], "params": params[r]} for r in range(world)]}


def simulate_zero_epochs(world: int, optimizer: str, order: str) -> dict[str, Any]:
    """DDP + ZeRO, in one process: every iteration applies the active ranks'
    gradients summed over the world size (a joined rank adds zero) to one model
    with one optimizer, since every shard is stepped every round by its owner.
    Each rank's ``.grad`` after a Join is what its own last iteration left: the
    average of that iteration, or nothing after ``zero_grad``."""
    model = small_model()
    optim = OPTIMIZERS[optimizer](model.parameters())
    grads: list[list[Any]] = [[] for _ in range(world)]
    params = []
    for epoch in range(EPOCHS):
        inputs = epoch_inputs(world, epoch)
        last_average: dict[int, list[Any]] = {}
        for i in range(max(inputs)):
            active = [r for r in range(world) if i < inputs[r]]
            total = [torch.zeros_like(p) for p in model.parameters()]
            for r in active:
                model.zero_grad()
                model(batch(r, 100 * epoch + i)).pow(2).sum().backward()
                for t, p in zip(total, model.parameters(), strict=True):
                    t += p.grad
            for t, p in zip(total, model.parameters(), strict=True):
                p.grad = t / world
            for r in active:
                last_average[r] = grads_of(model)
            optim.step()
        params.append(flat(model))
        for r in range(world):
            grads[r].append(last_average[r] if order == "first" else [None] * len(total))
    return {"per_rank": [{"grads": grads[r], "params": params} for r in range(world)]}


DDP_EPOCH_CASES = [
    (optimizer, order, accumulate)
    for optimizer in OPTIMIZERS
    for order in ("first", "last")
    for accumulate in (1, 2)
]


# The joined rank replays the iteration through DDP (adapters._ddp_replay)
# instead of running torch's hook: it must leave .grad as torch's Join does too.
DDP_EPOCH_REPLAY_CASES = [("sgd_momentum", "last", 2), ("adamw", "first", 1)]


@scenario
def ddp_epochs(ctx: Ctx) -> Any:
    """DDP alone over epochs: joinkit's Join, torch's, and the simulation."""
    out = {}
    cases = [(*case, False) for case in DDP_EPOCH_CASES]
    cases += [(*case, True) for case in DDP_EPOCH_REPLAY_CASES]
    for optimizer, order, accumulate, replay in cases:
        name = f"{optimizer}/{order}/accumulate={accumulate}" + ("/replay" if replay else "")
        out[name] = {
            "joinkit": train_epochs(ctx, Join, optimizer, order, accumulate, zero=False,
                                    join_kwargs={"replay": True} if replay else None),
            "torch": train_epochs(ctx, torch_join.Join, optimizer, order, accumulate, zero=False),
            "reference": simulate_ddp_epochs(ctx.world, optimizer, order, accumulate)[
                "per_rank"][ctx.rank],
        }
    return out


@scenario
def ddp_zero_epochs(ctx: Ctx) -> Any:
    """DDP + ZeRO over epochs: joinkit's Join against the single-process
    reference (torch's, known to step joined shards with stale gradients, is
    recorded for the record only)."""
    out = {}
    for optimizer in OPTIMIZERS:
        for order in ("first", "last"):
            out[f"{optimizer}/{order}"] = {
                "joinkit": train_epochs(ctx, Join, optimizer, order, 1, zero=True),
                "torch": train_epochs(ctx, torch_join.Join, optimizer, order, 1, zero=True),
                "reference": simulate_zero_epochs(ctx.world, optimizer, order)[
                    "per_rank"][ctx.rank],
            }
    # .grad a view into DDP's buckets: the shadow step's swap must give the
    # reducer back its views.
    out["adamw/last/gradient_as_bucket_view"] = {
        "joinkit": train_epochs(ctx, Join, "adamw", "last", 1, zero=True,
                                gradient_as_bucket_view=True),
        "reference": simulate_zero_epochs(ctx.world, "adamw", "last")["per_rank"][ctx.rank],
    }
    # The joined rank replays the iteration through DDP: the replay's average
    # reaches ZeRO's shadow step, and .grad comes back as it was (also as a
    # bucket view, which the replay writes into).
    for bucket_view in (False, True):
        out[f"sgd_momentum/last/replay/gradient_as_bucket_view={bucket_view}"] = {
            "joinkit": train_epochs(ctx, Join, "sgd_momentum", "last", 1, zero=True,
                                    join_kwargs={"replay": True},
                                    gradient_as_bucket_view=bucket_view),
            "reference": simulate_zero_epochs(ctx.world, "sgd_momentum", "last")[
                "per_rank"][ctx.rank],
        }
    return out


@scenario
def zero_alone(ctx: Ctx) -> Any:
    """Join([zero]) with uneven inputs: torch's Join deadlocks here."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optim = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, process_group=ctx.group, lr=0.1
    )
    steps = 0
    with Join([optim]):
        for i in range(2 + ctx.rank):
            optim.zero_grad()
            model(batch(ctx.rank, i)).sum().backward()
            optim.step()
            steps += 1
    return {"steps": steps, "params": flat(model)}


# -- throw mode, enable=False, leaving ------------------------------------------------


@scenario
def ddp_throw(ctx: Ctx) -> Any:
    model = ddp(ctx, nn.Linear(1, 1))
    iterations = 0
    try:
        with Join([model], throw_on_early_termination=True):
            for _ in range(5 + ctx.rank):
                model(torch.tensor([1.0])).sum().backward()
                iterations += 1
    except RuntimeError as exc:
        return {"iterations": iterations, **error_of(exc)}
    return {"iterations": iterations, "type": None}


def _per_iteration(model: DDP, group: Any, x: torch.Tensor, n: int = 3) -> dict[str, int]:
    """Collectives per forward/backward on ``group``, and Python all_reduce calls."""
    calls = []
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        before = sequence(group)
        for _ in range(n):
            model(x).sum().backward()
        return {"collectives": (sequence(group) - before) // n, "all_reduce_calls": len(calls)}
    finally:
        dist.all_reduce = original


@scenario
def ddp_after_exit(ctx: Ctx) -> Any:
    """After the block, DDP must send nothing but its own gradient all-reduce."""
    x = torch.ones(2, 3)
    plain = ddp(ctx, nn.Linear(3, 2))
    plain(x).sum().backward()  # warm up (bucket rebuild)
    baseline = _per_iteration(plain, ctx.group, x)

    ours = ddp(ctx, nn.Linear(3, 2))
    with Join([ours]):
        for _ in range(2 + ctx.rank):
            ours(x).sum().backward()
    after_ours = _per_iteration(ours, ctx.group, x)

    theirs = ddp(ctx, nn.Linear(3, 2))
    with torch_join.Join([theirs]):
        for _ in range(2 + ctx.rank):
            theirs(x).sum().backward()
    after_torch = _per_iteration(theirs, ctx.group, x)
    return {
        "baseline": baseline,
        "joinkit": after_ours,
        "torch": after_torch,
        "config": list(ours._join_config),
        "router_removed": "notify_join_context" in torch_join.Join.__dict__
        and torch_join.Join.__dict__["notify_join_context"].__func__.__module__
        == torch_join.__name__,
    }


@scenario
def ddp_disabled(ctx: Ctx) -> Any:
    """enable=False with even inputs: plain DDP, no join collectives."""
    x = torch.ones(2, 3) * (ctx.rank + 1)
    model = ddp(ctx, nn.Linear(3, 2))
    model(x).sum().backward()
    with Join([model], enable=False):
        inside = _per_iteration(model, ctx.group, x)
    model.zero_grad()
    model(x).sum().backward()
    plain = ddp(ctx, nn.Linear(3, 2))
    plain(x).sum().backward()
    return {
        "inside": inside,
        "baseline": _per_iteration(plain, ctx.group, x),
        "grad": model.module.weight.grad.reshape(-1).tolist(),
    }


@scenario
def ddp_no_sync(ctx: Ctx) -> Any:
    """Gradient accumulation (``no_sync()`` on every other input) with uneven inputs.

    A joined rank must shadow the backward pass exactly in the rounds in which
    the active ranks sync; joinkit's default path carries the heartbeat in the
    gradient all-reduce itself (so a joined rank meets the next syncing
    backward, whenever it comes), its one-collective path learns it from the
    fused heartbeat, torch from its separate check. All must end with the
    same model; the one-collective path sends one collective per iteration
    fewer than torch, and the default path none per iteration at all.
    """
    out: dict[str, Any] = {}
    one = functools.partial(Join, heartbeat_in_gradients=False)
    for name, join_cls in (("joinkit", Join), ("one", one), ("torch", torch_join.Join)):
        model = ddp(ctx, nn.Linear(2, 1))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        before = sequence(ctx.group)
        with join_cls([model]):
            for i in range(3 + 2 * ctx.rank):
                if i % 2 == 0:
                    with model.no_sync():
                        model(batch(ctx.rank, i, (2, 2))).sum().backward()
                else:
                    model(batch(ctx.rank, i, (2, 2))).sum().backward()
                    optim.step()
                    optim.zero_grad()
        out[name] = {"params": flat(model.module), "collectives": sequence(ctx.group) - before}
    return out


# -- DDP variants ---------------------------------------------------------------------


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.trunk(x)
        return self.b(h) if use_b else self.a(h)


@scenario
def ddp_find_unused(ctx: Ctx) -> Any:
    model = ddp(ctx, TwoHeads(), find_unused_parameters=True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):
        for i in range(3 + ctx.rank):
            optim.zero_grad()
            model(batch(ctx.rank, i), use_b=(i + ctx.rank) % 2 == 1).sum().backward()
            optim.step()
    return {"params": flat(model.module)}


@scenario
def ddp_buffers(ctx: Ctx) -> Any:
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model = ddp(ctx, module, broadcast_buffers=True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):
        for i in range(3 + ctx.rank):
            optim.zero_grad()
            model(batch(ctx.rank, i, (5, 4))).sum().backward()
            optim.step()
    return {"params": flat(model.module)}


@scenario
def ddp_buffer_source(ctx: Ctx) -> Any:
    """Buffers broadcast in forward from the highest active rank, as torch's Join does.

    The highest rank runs out first (inputs ``5 - rank``), so the rank that
    sources the buffers changes twice. BatchNorm's running statistics differ
    per rank before each broadcast, so a wrong source shows in the buffers.
    joinkit's fused path asks DDP's ``_find_common_rank`` only when the
    heartbeat sum changed (module doc of ``adapters.torch._joinables``).
    """
    out: dict[str, Any] = {}
    original = DDP._find_common_rank
    calls = [0]

    def counted(self: DDP, input_rank: int, rank_cond: bool) -> int:
        calls[0] += 1
        return original(self, input_rank, rank_cond)  # type: ignore[no-any-return]

    DDP._find_common_rank = counted  # type: ignore[method-assign]
    try:
        for name, join_cls in (("joinkit", Join), ("torch", torch_join.Join)):
            torch.manual_seed(0)
            module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
            model = ddp(ctx, module.double(), broadcast_buffers=True)
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            calls[0] = 0
            with join_cls([model]) as join:
                for i in range(5 - ctx.rank):
                    optim.zero_grad()
                    model(batch(ctx.rank, i, (5, 4)).double() * (1 + ctx.rank)).sum().backward()
                    optim.step()
            out[name] = {"state": flat(model.module), "calls": calls[0],
                         "heartbeat": getattr(join, "heartbeat", "torch")}
    finally:
        DDP._find_common_rank = original  # type: ignore[method-assign]
    return out


@scenario
def ddp_nested(ctx: Ctx) -> Any:
    model = ddp(ctx, nn.Linear(1, 1))
    try:
        with Join([model]):
            with Join([model]):
                pass
    except Exception as exc:
        return error_of(exc)
    return None


@scenario
def mixed_joinables(ctx: Ctx) -> Any:
    """A joinkit Joinable (on a TorchGroup) and DDP in one Join, both orders."""
    out = {}
    group = TorchGroup(ctx.group)
    for counter_first in (True, False):
        model = ddp(ctx, nn.Linear(2, 1))
        counter = Counter(group)
        joinables = [counter, model] if counter_first else [model, counter]
        with Join(joinables):
            for i in range(3 + ctx.rank):
                if counter_first:
                    counter()
                model(batch(ctx.rank, i, (2, 2))).sum().backward()
                if not counter_first:
                    counter()
        out[f"counter_first={counter_first}"] = {
            "count": int(counter.count),
            "params": flat(model.module),
        }
    return out


@scenario
def peer_failure(ctx: Ctx) -> Any:
    """Rank 1 raises between iterations; the others learn it from heartbeats."""
    model = ddp(ctx, nn.Linear(2, 1))
    iterations = 0
    try:
        with Join([model]):
            for i in range(6):
                if ctx.rank == 1 and i == 2:
                    raise ValueError("bad batch on rank 1")
                model(batch(ctx.rank, i, (2, 2))).sum().backward()
                iterations += 1
    except Exception as exc:
        return {"iterations": iterations, **error_of(exc)}
    return {"iterations": iterations, "type": None}


class FailingForward(nn.Module):
    """A Linear whose forward raises on one rank at one input (after DDP's heartbeat)."""

    def __init__(self, rank: int, fail_at: tuple[int, int]) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.rank = rank
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if (self.rank, self.calls) == self.fail_at:
            raise ValueError(f"bad forward on rank {self.rank}")
        return self.linear(x)


@scenario
def peer_failure_in_forward(ctx: Ctx) -> Any:
    """Rank 1 raises inside DDP's forward, right after the iteration's heartbeat:
    it shadows the rest of that iteration first (with the sync flag of its own
    heartbeat), then every rank learns of the failure."""
    torch.manual_seed(0)
    model = DDP(FailingForward(ctx.rank, (1, 3)), process_group=ctx.group)
    iterations = 0
    try:
        with Join([model]):
            for i in range(6):
                model(batch(ctx.rank, i, (2, 2))).sum().backward()
                iterations += 1
    except Exception as exc:
        return {"iterations": iterations, **error_of(exc)}
    return {"iterations": iterations, "type": None}


# -- bad input --------------------------------------------------------------------------


class NoInit(torch_join.Joinable):
    """A torch Joinable whose constructor forgot Joinable.__init__."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def join_hook(self, **kwargs: Any) -> torch_join.JoinHook:
        return torch_join.JoinHook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.group


@scenario
def bad_input(ctx: Ctx) -> Any:
    out = {}
    try:
        Join([NoInit(ctx.group)])
    except Exception as exc:
        out["no_init"] = error_of(exc)
    other = dist.new_group(backend="gloo", timeout=SCENARIO_TIMEOUT)
    try:
        Join([ddp(ctx, nn.Linear(1, 1)), TorchCounter(other)])
    except Exception as exc:
        out["two_groups"] = error_of(exc)
    model = ddp(ctx, nn.Linear(2, 2))
    optim = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD,
                                    process_group=ctx.group, lr=0.1)
    try:
        Join([optim, model])
    except Exception as exc:
        out["zero_before_ddp"] = error_of(exc)
    with Join([model, optim]):  # the right order
        optim.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optim.step()
    destroyed = dist.new_group(backend="gloo", timeout=SCENARIO_TIMEOUT)
    dist.destroy_process_group(destroyed)
    try:
        Join([TorchCounter(destroyed)])
    except Exception as exc:
        out["destroyed"] = error_of(exc)
    return out


# -- interoperability with torch's Join ---------------------------------------------------


def _interop_counter(ctx: Ctx, counter_cls: type, inputs: list[int]) -> dict[str, Any]:
    counter = counter_cls(ctx.group)
    join = (
        torch_join.Join([counter], sync_max_count=True)
        if ctx.rank == 0
        else Join([counter], sync_max_count=True, check_agreement=False)
    )
    with join:
        for _ in range(inputs[ctx.rank]):
            counter()
    expected = counts(inputs, ctx.rank)
    return {
        "count": int(counter.count.item()),
        "max_count": int(counter.max_count.item()),
        "expected": list(expected),
    }


@scenario
def interop_counter(ctx: Ctx) -> Any:
    """Rank 0 runs torch's Join, the others joinkit's; both orders of skew."""
    more_on_high = [5 + r for r in range(ctx.world)]
    more_on_low = list(reversed(more_on_high))
    return {
        f"{cls.__name__}/{name}": _interop_counter(ctx, cls, inputs)
        for cls in (TorchCounter, DualCounter)
        for name, inputs in (("rank0_fewest", more_on_high), ("rank0_most", more_on_low))
    }


class JoinkitNamedCounter(TorchCounter):
    """A torch Joinable that notifies through joinkit's ``Join`` by torch's name
    (as DDP does once ``torch.nn.parallel.distributed.Join`` is joinkit's)."""

    def __call__(self) -> None:
        Join.notify_join_context(self)
        t = torch.ones(1)
        dist.all_reduce(t, group=self.group)
        self.count += t


@scenario
def torch_joinable_notifies_joinkit_join(ctx: Ctx) -> Any:
    """joinkit's Join.notify_join_context(torch joinable): routed to the Join
    that holds it, joinkit's or torch's; outside any Join it does nothing."""
    inputs = [3 + rank for rank in range(ctx.world)]
    out: dict[str, Any] = {"expected": list(counts(inputs, ctx.rank))}
    for name, join_cls in (("joinkit", Join), ("torch", torch_join.Join)):
        counter = JoinkitNamedCounter(ctx.group)
        with join_cls([counter], sync_max_count=True):
            for _ in range(inputs[ctx.rank]):
                counter()
        out[name] = [int(counter.count.item()), int(counter.max_count.item())]
    out["outside"] = Join.notify_join_context(JoinkitNamedCounter(ctx.group))

    class Foreign:
        _join_config = torch_join._JoinConfig(False, False, False)

    try:
        Join.notify_join_context(Foreign())
    except Exception as exc:
        out["foreign"] = error_of(exc)
    try:
        Join.fused_heartbeat(JoinkitNamedCounter(ctx.group))
    except Exception as exc:
        out["fused"] = error_of(exc)
    return out


@scenario
def interop_ddp(ctx: Ctx) -> Any:
    out = {}
    for name, n in (("rank0_fewest", 3 + ctx.rank), ("rank0_most", 3 + ctx.world - ctx.rank)):
        model = ddp(ctx, nn.Linear(2, 1))
        join = (
            torch_join.Join([model])
            if ctx.rank == 0
            else Join([model], check_agreement=False)
        )
        with join:
            for i in range(n):
                model(batch(ctx.rank, i, (2, 2))).sum().backward()
        out[name] = flat(model.module)
    return out


# -- TorchGroup's collectives --------------------------------------------------------------


@scenario
def torch_group_collectives(ctx: Ctx) -> Any:
    g = TorchGroup(ctx.group)
    r, w = ctx.rank, ctx.world
    out: dict[str, Any] = {"rank": g.rank, "world_size": g.world_size}
    t = torch.tensor([r + 1.0, 2.0])
    out["sum_tensor"] = g.all_reduce(t).tolist()
    for op in ("sum", "prod", "min", "max"):
        a = np.array([r + 1.0], dtype=np.float64)
        g.all_reduce(a, op)
        out[f"{op}_numpy"] = a.tolist()
    for op in ("band", "bor", "bxor"):
        a = np.array([r + 1, 7], dtype=np.int32)
        g.all_reduce(a, op)
        out[f"{op}_int"] = a.tolist()
    for op in ("sum", "band", "bxor"):
        b = torch.tensor([r == 0, True, False])
        g.all_reduce(b, op)
        out[f"{op}_bool"] = b.tolist()
    z = torch.tensor([1 + 2j, r * 1j])
    g.all_reduce(z)
    out["complex_sum"] = [[v.real, v.imag] for v in z.tolist()]
    strided = torch.arange(6.0).reshape(2, 3).t() * (r + 1)
    g.all_reduce(strided)
    out["strided"] = strided.tolist()
    handle = g.all_reduce(np.array([float(r)]), async_op=True)
    out["async_all_reduce"] = handle.wait().tolist()
    out["async_is_completed"] = handle.is_completed()
    b = np.array([r, r], dtype=np.int64)
    g.broadcast(b, src=w - 1)
    out["broadcast"] = b.tolist()
    out["all_gather"] = [x.tolist() for x in g.all_gather(torch.tensor([r, 10 * r]))]
    out["all_gather_numpy_type"] = type(g.all_gather(np.zeros(1))[0]).__name__
    # all_gather_into (Gather's per-call path): the same buffers twice (its tensors
    # are kept), then new ones; rank 0 calls all_gather instead the last time.
    into = []
    wire, rows = np.zeros(3, dtype=np.uint8), np.zeros((w, 3), dtype=np.uint8)
    for value in (r + 1, r + 5):
        wire[:] = value
        assert g.all_gather_into(wire, rows) is rows
        into.append(rows.tolist())
    wire, rows = np.full(2, r + 9, dtype=np.uint8), np.zeros((w, 2), dtype=np.uint8)
    if r == 0:
        rows[...] = np.stack(g.all_gather(wire))
    else:
        g.all_gather_into(wire, rows)
    out["all_gather_into"] = [*into, rows.tolist()]
    gathered = g.gather(np.array([r * 1.5]), dst=1)
    out["gather"] = None if gathered is None else [x.tolist() for x in gathered]
    red = torch.tensor([float(r + 1)])
    g.reduce(red, dst=0, op="max")
    out["reduce"] = red.tolist()
    recv = np.zeros(2, dtype=np.float32)
    chunks = [np.full(2, k, dtype=np.float32) for k in range(w)] if r == 0 else None
    g.scatter(recv, src=0, chunks=chunks)
    out["scatter"] = recv.tolist()
    recv_t = torch.zeros(2)
    g.scatter(recv_t, src=w - 1, chunks=torch.arange(2.0 * w).reshape(w, 2) if r == w - 1 else None)
    out["scatter_stacked"] = recv_t.tolist()
    g.barrier()
    out["objects"] = g.all_gather_object({"rank": r})
    out["count"] = g.count(1.0 if r == 0 else 0.0)
    beat = g.heartbeat(1.0)
    out["heartbeat_total"] = g.heartbeat_total(beat)
    errors = {}
    for name, call in (
        ("bad_op", lambda: g.all_reduce(np.zeros(1), "mean")),
        ("bitwise_float", lambda: g.all_reduce(np.zeros(1), "bxor")),
        ("bad_root", lambda: g.broadcast(np.zeros(1), src=w)),
        ("bad_buffer", lambda: g.all_reduce([1.0])),
    ):
        try:
            call()
        except Exception as exc:
            errors[name] = type(exc).__name__
    out["errors"] = errors
    out["equals_process_group"] = g == ctx.group and TorchGroup(ctx.group) == g
    out["protocols"] = isinstance(g, backends.CollectiveGroup) and isinstance(
        g, backends.JoinBackend
    )
    return out


@scenario
def rebuilt_group_keeps_late_collectives_out(ctx: Ctx) -> Any:
    """An elastic rebuild (``TorchGroup._adopt``) while collectives of the old group
    are still pending: rank 2 completes them only after the new group's ran (a
    member left out of a rebuild, still alive, may do so), and their late results
    must land neither in the buffers the new group reads nor in the caller's."""
    old, new = ctx.group, dist.new_group(backend="gloo", timeout=SCENARIO_TIMEOUT)
    g = TorchGroup(old)
    # Finish mode's rebuild, without its store protocol: _adopt needs only these.
    g._elastic = types.SimpleNamespace(  # type: ignore[assignment]
        inside=True, generation=1, key=lambda generation, name: f"adopt-test/{name}",
        wait=lambda work: work.wait())
    # Ranks 0 and 1 start a heartbeat and an all-reduce (of a tensor and of an
    # array) on the old group; rank 2 is late for them.
    tensor, array = torch.full((4,), 1.0), np.full(4, 1.0)
    pending = [g.heartbeat(1.0), g.all_reduce(tensor, async_op=True),
               g.all_reduce(array, async_op=True)] if ctx.rank < 2 else []
    g._adopt(new, ctx.rank, ctx.world)  # the recovery drops them
    beats = [g.heartbeat(10.0 * (i + 1)) for i in range(3)]
    before = [g.heartbeat_total(h) for h in beats[1:]]  # the last two: both buffers
    count = g.count(100.0)
    tensor.fill_(2.0)
    array.fill(3.0)
    g.all_reduce(tensor)  # the units' re-runs, on the same buffers
    g.all_reduce(array)
    if ctx.rank == 2:
        late = [torch.tensor([5.0]), torch.full((4,), 5.0),
                torch.full((4,), 5.0, dtype=torch.float64)]  # the array's dtype
        for t in late:
            dist.all_reduce(t, group=old)  # completes the old collectives now
        old_totals = [t[0].item() for t in late]
    else:
        pending[0].wait()
        pending[1]._work.wait()
        pending[2]._work.wait()
        old_totals = []
    dist.barrier(group=new)
    after = [g.heartbeat_total(h) for h in beats[1:]]
    g._elastic = None
    return {"before": before, "after": after, "count": count, "old_totals": old_totals,
            "tensor": tensor.tolist(), "array": array.tolist()}


@scenario
def object_collectives_and_long_waits(ctx: Ctx) -> Any:
    """all_agree, gather_object, broadcast_object; a long wait starts no store
    helper per slice, and a peer's abort posted mid-wait ends it."""
    from joinkit.backends import torch_dist

    g = TorchGroup(ctx.group)
    r = ctx.rank
    out: dict[str, Any] = {
        "agree_same": g.all_agree(2**62 + 5),
        "agree_differ": g.all_agree(7 if r == 1 else 2**62 + 5),
        # Pickles of different lengths, to rank 1 only.
        "gathered": g.gather_object({"rank": r, "pad": "x" * 100 * r}, 1),
        "broadcast": g.broadcast_object(("from", r) if r == 2 else None, 2),
    }
    # A wait of ~3 slices that completes: the store is read by the watcher
    # thread alone (no _bounded helper per slice).
    # (torch_dist._board holds the store side; every caller looks _bounded up there.)
    from joinkit.backends.torch_dist import _board as _torch_board

    helpers: list[int] = []
    bounded = _torch_board._bounded

    def counting(action: Any) -> Any:
        helpers.append(1)
        return bounded(action)

    _torch_board._bounded = counting
    try:
        if r == 0:
            time.sleep(3.0)
        out["total"] = g.count(1.0)
    finally:
        _torch_board._bounded = bounded
    out["helpers"] = len(helpers)
    out["watcher"] = any(t.name == "joinkit-aborts" for t in threading.enumerate())
    # A peer's abort, posted while the others wait: they raise GroupAborted.
    if r == 0:
        time.sleep(1.5)
        reason = json.dumps({"rank": 0, "reason": "test abort"})
        torch_dist._board._store().compare_set(g._store_prefix + "abort", "", reason)
        time.sleep(6.0)  # until the others gave up; then complete their count
        try:
            g.count(0.0)
        except torch_dist.GroupAborted:
            pass
        out["aborted"] = None
    else:
        started = time.monotonic()
        try:
            g.count(0.0)
            out["aborted"] = None
        except torch_dist.GroupAborted as exc:
            out["aborted"] = str(exc)
        out["abort_seconds"] = time.monotonic() - started
    return out


# -- the runner ----------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    rank, world, store, out_dir, *names = argv
    ctx = Ctx(int(rank), int(world), None)
    out = Path(out_dir) / f"rank{rank}.jsonl"
    for name in [n for n in names if n.startswith("pre_init_")]:
        with recording(out, name) as record:
            record["result"] = SCENARIOS[name](ctx)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=ctx.rank, world_size=ctx.world,
        timeout=SCENARIO_TIMEOUT,
    )
    for name in [n for n in names if not n.startswith("pre_init_")]:
        with recording(out, name) as record:
            ctx.group = dist.new_group(backend="gloo", timeout=SCENARIO_TIMEOUT)
            record["result"] = SCENARIOS[name](ctx)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
