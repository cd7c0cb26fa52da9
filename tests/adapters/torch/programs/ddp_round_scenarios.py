"""DDP's heartbeat in its gradient all-reduce (issue 34), on real gloo groups.

Theory of operation
-------------------
One process per rank runs every scenario in a row (as ``torch_scenarios.py``)::

    python ddp_round_scenarios.py RANK WORLD STORE_FILE OUT_DIR NAME [NAME ...]
    python ddp_round_scenarios.py RANK WORLD STORE_FILE OUT_DIR --nccl NAME ...

Every scenario gets a fresh group with a short timeout and runs many cells.
Each rank compares what it trained with a float64 single-process reference it
computes itself (the same initial weights; per round, the gradients of the
ranks in that round, accumulated over their ``no_sync()`` inputs, summed and
divided by the world size or by the ranks in the round) and records the
largest difference, with the Join's report and path (``join.heartbeat``); the
test (``test_ddp_round.py``) asserts on the records.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.algorithms.join as torch_join
from support import Ctx, recording, scenario_registry
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import joinkit
from joinkit import AgreementError, Join, JoinHook
from joinkit.adapters.torch import _ddp_round

TIMEOUT = datetime.timedelta(seconds=30)
SCENARIOS, scenario = scenario_registry()
DEVICE = torch.device("cpu")
LR = 0.1
#: Inputs per rank, per world size (a rank with none; ranks that all have the same).
COUNTS = {2: [[3, 5], [0, 4], [2, 2], [4, 1]], 3: [[3, 5, 4], [0, 4, 2], [2, 2, 2], [1, 0, 3]]}
PATTERNS = ("every", "accumulate", "eval")


def batch(rank: int, i: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + i + 100_000 * salt)
    return torch.randn(3, 4, generator=g)


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def wrap(ctx: Ctx, module: nn.Module, **kwargs: Any) -> DDP:
    module = module.to(DEVICE)
    ids = [DEVICE.index] if DEVICE.type == "cuda" else None
    return DDP(module, process_group=ctx.group, device_ids=ids, **kwargs)


def params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().to("cpu", torch.float64) for p in module.parameters()]


def deviation(model: nn.Module, reference: nn.Module) -> float:
    return max(float((a - b).abs().max())
               for a, b in zip(params(model), params(reference), strict=True))


def syncs(pattern: str, i: int) -> bool:
    """Whether input ``i`` all-reduces gradients (``accumulate``: every second)."""
    return pattern != "accumulate" or i % 2 == 1


def train(model: DDP, optimizer: Any, rank: int, n: int, pattern: str) -> None:
    """``n`` inputs of ``pattern``: every input a step; ``accumulate``: no_sync()
    on even inputs, a step after each odd one; ``eval``: a step, then a
    forward without gradients."""
    for i in range(n):
        x = batch(rank, i).to(DEVICE)
        if not syncs(pattern, i):
            with model.no_sync():
                model(x).square().sum().backward()
            continue
        model(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if pattern == "eval":
            with torch.no_grad():
                model(batch(rank, i, salt=1).to(DEVICE))


def reference(counts: list[int], pattern: str, divide_by_world: bool,
              epochs: int = 1, start: nn.Module | None = None) -> nn.Module:
    """One process, float64: per round, the gradients of the ranks in it
    (over their accumulated inputs), summed, over the world or the round's ranks."""
    model = (start if start is not None else make()).to(torch.float64)
    world = len(counts)
    for _ in range(epochs):
        for i in range(max(counts)):
            if not syncs(pattern, i):
                continue
            ranks = [r for r in range(world) if counts[r] > i]
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for r in ranks:
                inputs = [i - 1, i] if pattern == "accumulate" else [i]
                for j in inputs:
                    model.zero_grad()
                    model(batch(r, j).double()).square().sum().backward()
                    for g, p in zip(grads, model.parameters(), strict=True):
                        g += p.grad
            divisor = world if divide_by_world else len(ranks)
            with torch.no_grad():
                for g, p in zip(grads, model.parameters(), strict=True):
                    p -= LR * g / divisor
    return model


def rounds_after(counts: list[int], pattern: str, n: int) -> int:
    """The rounds some rank runs from input ``n`` on: a rank with ``n`` inputs shadows them."""
    return sum(1 for i in range(n, max(counts)) if syncs(pattern, i))


# -- against one process ------------------------------------------------------------------


@contextlib.contextmanager
def carrier_at_most(nbytes: int | None) -> Iterator[None]:
    """``_ddp_round.CARRIER_BYTES`` set to ``nbytes`` (``None``: left as it is) inside."""
    default = _ddp_round.CARRIER_BYTES
    if nbytes is not None:
        _ddp_round.CARRIER_BYTES = nbytes
    try:
        yield
    finally:
        _ddp_round.CARRIER_BYTES = default


@scenario
def round_reference(ctx: Ctx) -> Any:
    """Divisor both ways x one bucket, several buckets, gradients as bucket views x
    uneven inputs (a rank with none) x every input a step, no_sync() accumulation,
    an evaluation forward after each step: parameters equal one float64 process;
    the report counts rounds, not inputs."""
    worst, cells, reports = 0.0, 0, []
    buckets = {"bucket_cap_mb": 1e-5}
    views = {"bucket_cap_mb": 1e-5, "gradient_as_bucket_view": True}
    # (DDP's options, the largest bucket that may carry the heartbeat): by
    # default the round's first bucket carries it; with 0 bytes its last one
    # (the buckets before it are all-reduced in DDP's own buffer).
    layouts = {"one bucket": ({}, None), "buckets": (buckets, None), "views": (views, None),
               "buckets, carrier last": (buckets, 0), "views, carrier last": (views, 0)}
    for divide in (True, False):
        for layout, (options, carrier_bytes) in layouts.items():
            for counts in COUNTS[ctx.world]:
                for pattern in PATTERNS:
                    model = wrap(ctx, make(), **options)
                    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
                    with carrier_at_most(carrier_bytes), \
                            Join([model], divide_by_initial_world_size=divide) as join:
                        train(model, optimizer, ctx.rank, counts[ctx.rank], pattern)
                    worst = max(worst, deviation(model, reference(counts, pattern, divide)))
                    report = join.report
                    assert report is not None
                    shadowed = rounds_after(counts, pattern, counts[ctx.rank])
                    reports.append({
                        "cell": f"{divide}-{layout}-{counts}-{pattern}",
                        "heartbeat": report.heartbeat, "path": join.heartbeat,
                        # Inputs are forwards (notifies), whatever the rounds.
                        "inputs": report.inputs == counts[ctx.rank] * (
                            2 if pattern == "eval" else 1),
                        "shadow_rounds": report.shadow_rounds == shadowed,
                        "last_joiner": report.is_last_joiner == (shadowed == 0),
                    })
                    cells += 1
    return {"worst": worst, "cells": cells, "reports": reports}


@scenario
def round_collectives(ctx: Ctx) -> Any:
    """Even inputs: inside the Join an iteration issues exactly what plain DDP's
    does (its bucket all-reduces); outside, after it, too. Uneven: the Join adds
    its entry agreement, one bucket per joined rank's round and the last round's
    first bucket, DDP's final-model sync, and nothing per input."""
    def per_iteration(model: DDP, n: int, join: Any = None) -> int:
        x = torch.ones(2, 4, device=DEVICE)
        model(x).sum().backward()  # warm up (the bucket rebuild)
        before = sequence(ctx.group)
        for _ in range(n):
            model(x).sum().backward()
        return (sequence(ctx.group) - before) // n

    out: dict[str, Any] = {}
    plain = wrap(ctx, make(), bucket_cap_mb=1e-5)
    out["plain"] = per_iteration(plain, 4)
    model = wrap(ctx, make(), bucket_cap_mb=1e-5)
    with Join([model]) as join:
        out["inside"] = per_iteration(model, 4)
    out["path"] = join.heartbeat
    out["after"] = per_iteration(model, 4)
    # Uneven: rank r has 3 + r inputs, each a round of one all-reduce per bucket.
    model = wrap(ctx, make(), bucket_cap_mb=1e-5)
    for _ in range(2):  # the bucket rebuild, outside
        model(torch.ones(2, 4, device=DEVICE)).sum().backward()
    buckets = len(model.reducer._get_zeros_like_grad_buckets())
    before = sequence(ctx.group)
    with Join([model]):
        for i in range(3 + ctx.rank):
            model(batch(ctx.rank, i).to(DEVICE)).sum().backward()
    out["uneven"] = sequence(ctx.group) - before
    out["buckets"] = buckets
    before = sequence(ctx.group)
    model._sync_final_model(ctx.rank == ctx.world - 1)  # what DDP's post hook sends
    out["post_hook"] = sequence(ctx.group) - before
    return out


def sequence(group: Any) -> int:
    return int(group._get_sequence_number_for_group())


# -- which path a configuration gets ---------------------------------------------------------


class Quiet(joinkit.Joinable):
    """A joinable with no collectives of its own (its hook is JoinHook's)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()

    @property
    def join_device(self) -> Any:
        return DEVICE

    @property
    def join_process_group(self) -> Any:
        return self.group


class Counted(Quiet):
    """A joinable whose main hook only counts this rank's shadow rounds and says so
    (``JoinHook.main_hook_is_local``)."""

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self.rounds = 0

    def join_hook(self, **kwargs: Any) -> JoinHook:
        counted = self

        class Hook(JoinHook):
            main_hook_is_local = True

            def main_hook(self) -> None:
                counted.rounds += 1

        return Hook()


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make()
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@scenario
def round_paths(ctx: Ctx) -> Any:
    """Each configuration's path (join.heartbeat, the report, the adapter's
    reason), each trained with uneven inputs against one process; ranks that
    disagree on the path get an AgreementError naming it, before any collective
    of the loop."""
    def hooked() -> DDP:
        model = wrap(ctx, make())
        model.register_comm_hook(ctx.group, default_hooks.allreduce_hook)
        return model

    configs: dict[str, Any] = {
        "plain": (lambda: wrap(ctx, make()), {}, []),
        "quiet second": (lambda: wrap(ctx, make()), {}, ["quiet"]),
        "local main hook second": (lambda: wrap(ctx, make()), {}, ["local"]),
        "side channel second": (lambda: wrap(ctx, make()), {}, ["side"]),
        "heartbeat_in_gradients=False": (lambda: wrap(ctx, make()),
                                         {"heartbeat_in_gradients": False}, []),
        "check_agreement=False": (lambda: wrap(ctx, make()), {"check_agreement": False}, []),
        "find_unused_parameters": (lambda: wrap(ctx, make(), find_unused_parameters=True),
                                   {}, []),
        "static_graph": (lambda: wrap(ctx, make(), static_graph=True), {}, []),
        "buffers": (lambda: wrap(ctx, WithBuffer()), {}, []),
        "buffers not broadcast": (lambda: wrap(ctx, WithBuffer(), broadcast_buffers=False),
                                  {}, []),
        "user comm hook": (hooked, {}, []),
        "float64": (lambda: wrap(ctx, make().double()), {}, []),
        "zero": (lambda: wrap(ctx, make()), {}, ["zero"]),
        "counter second": (lambda: wrap(ctx, make()), {}, ["counter"]),
    }
    counts = COUNTS[ctx.world][0]
    out: dict[str, Any] = {}
    for name, (build, options, extra) in configs.items():
        model = build()
        dtype = next(model.parameters()).dtype
        if "zero" in extra:
            optimizer: Any = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD,
                                                     lr=LR, process_group=ctx.group)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        others: list[Any] = []
        side_sums: list[int] = []
        if "quiet" in extra:
            others = [Quiet(ctx.group)]
        elif "local" in extra:
            others = [Counted(ctx.group)]
        elif "side" in extra:
            others = [joinkit.SideChannel(ctx.group)]
        elif "zero" in extra:
            others = [optimizer]
        elif "counter" in extra:
            others = [Ticker(ctx.group)]
        with Join([model, *others], **options) as join:
            for i in range(counts[ctx.rank]):
                model(batch(ctx.rank, i).to(DEVICE, dtype)).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                for other in others:  # after the model's, as the list orders them
                    if isinstance(other, Ticker):
                        other()
                    elif isinstance(other, joinkit.SideChannel):
                        # The active ranks' sum: joined ranks' service threads answer.
                        active = other.all_reduce(torch.ones(1, device=DEVICE))
                        side_sums.append(int(active.item()))
        module = model.module.net if isinstance(model.module, WithBuffer) else model.module
        report = join.report
        assert report is not None
        out[name] = {"path": join.heartbeat, "report": report.heartbeat,
                     "why": join.joinables[0].round_refusal,  # type: ignore[attr-defined]
                     "worst": deviation(module, reference(counts, "every", True))}
        if "side" in extra:  # input i's sum: the ranks with more than i inputs
            out[name]["side"] = side_sums == [sum(c > i for c in counts)
                                              for i in range(counts[ctx.rank])]
        if "local" in extra:
            out[name]["rounds"] = [others[0].rounds, max(counts) - counts[ctx.rank]]
    # The ranks disagree: rank 0 asks for the one-collective path.
    model = wrap(ctx, make())
    try:
        with Join([model], heartbeat_in_gradients=ctx.rank != 0):
            model(batch(ctx.rank, 0).to(DEVICE)).sum().backward()
        out["disagree"] = None
    except AgreementError as error:
        out["disagree"] = str(error)
    check_group(ctx)
    return out


class Ticker(joinkit.Joinable):
    """A joinkit Joinable with a collective per input: notify, all-reduce a one."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def __call__(self) -> None:
        Join.notify_join_context(self)
        dist.all_reduce(torch.ones(1, device=DEVICE), group=self.group)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        ticker = self

        class Hook(JoinHook):
            def main_hook(self) -> None:
                dist.all_reduce(torch.zeros(1, device=DEVICE), group=ticker.group)

        return Hook()

    @property
    def join_device(self) -> Any:
        return DEVICE

    @property
    def join_process_group(self) -> Any:
        return self.group


def check_group(ctx: Ctx) -> None:
    """The group still matches on every rank: one more all-reduce."""
    t = torch.ones(1, device=DEVICE)
    dist.all_reduce(t, group=ctx.group)
    assert t.item() == ctx.world


@scenario
def round_local_steps(ctx: Ctx) -> Any:
    """A counter-example to the idea taken alone: every input steps, gradients
    sync on every second (local steps under no_sync(), so replicas differ
    between rounds). After the last round the ranks hold different models, and
    a round heartbeat's last joiners (every rank that left after the last
    round) are not torch's (the ranks with the most inputs), whose highest
    rank's model DDP's post hook keeps. joinkit asks for torch's in the post
    hook: the final model equals torch's Join's."""
    out: dict[str, Any] = {"cells": []}
    for counts in ([3, 5, 4][: ctx.world], [4, 3, 4][: ctx.world], [5, 2, 5][: ctx.world]):
        finals = {}
        for name, join_cls in (("joinkit", Join), ("torch", torch_join.Join)):
            model = wrap(ctx, make())
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            with join_cls([model]) as join:
                for i in range(counts[ctx.rank]):
                    x = batch(ctx.rank, i).to(DEVICE)
                    if i % 2 == 0:
                        with model.no_sync():
                            model(x).square().sum().backward()
                    else:
                        model(x).square().sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            finals[name] = params(model)
            if name == "joinkit":
                report = join.report
                assert report is not None
                rounds_left = rounds_after(counts, "accumulate", counts[ctx.rank])
                round_last = report.is_last_joiner
        out["cells"].append({
            "counts": counts,
            "same_as_torch": max(float((a - b).abs().max()) for a, b in
                                 zip(finals["joinkit"], finals["torch"], strict=True)),
            "round_last_joiner": round_last, "left_after_last_round": rounds_left == 0,
            "most_inputs": counts[ctx.rank] == max(counts),
        })
    return out


# -- one model, every path in turn ----------------------------------------------------------


@scenario
def round_then_other_paths(ctx: Ctx) -> Any:
    """One model through epochs on every path, both divisors: the round path
    (which registers joinkit's comm hook for good), the one-collective path and
    torch's wire format (the hook then divides by the heartbeat's count of
    active ranks), torch's own Join, plain DDP, DDP with ZeRO; the parameters
    follow one float64 process throughout, and each Join took the path named."""
    counts = COUNTS[ctx.world][0]
    model = wrap(ctx, make(), bucket_cap_mb=1e-5)
    reference_model = make().double()
    worst = 0.0
    paths = []
    one = functools.partial(Join, heartbeat_in_gradients=False)
    compatible = functools.partial(Join, check_agreement=False)
    epochs: list[tuple[Any, bool, str]] = [
        (Join, True, "round"), (one, False, "fused"), (compatible, False, "classic"),
        (Join, False, "round"), (torch_join.Join, True, "torch"), (None, True, "none"),
        ("zero", False, "fused"), (one, True, "fused"),
    ]
    for join_cls, divide, _ in epochs:
        if join_cls == "zero":
            optimizer: Any = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD,
                                                     lr=LR, process_group=ctx.group)
            joinables = [model, optimizer]
            join_cls = Join
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            joinables = [model]
        if join_cls is None:  # no Join: every rank the same number of inputs
            even = [min(counts)] * ctx.world
            train(model, optimizer, ctx.rank, even[ctx.rank], "every")
            reference_model = reference(even, "every", True, start=reference_model)
            paths.append("none")
        else:
            with join_cls(joinables, divide_by_initial_world_size=divide) as join:
                train(model, optimizer, ctx.rank, counts[ctx.rank], "every")
            reference_model = reference(counts, "every", divide, start=reference_model)
            paths.append(getattr(join, "heartbeat", "torch"))
        worst = max(worst, deviation(model.module, reference_model))
    return {"worst": worst, "paths": paths,
            "expected": [path for _, _, path in epochs]}


class Branchy(nn.Module):
    """The test model and a branch that some inputs skip (so, on some ranks in
    some rounds, or on every rank, parameters without a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make()
        torch.manual_seed(1)
        self.branch = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out + self.branch(x) if float(x.sum()) > 0 else out


@scenario
def round_find_unused(ctx: Ctx) -> Any:
    """find_unused_parameters=True with parameters that some ranks, or all, do
    not use in a round: joinkit's Join takes the round path and trains what
    torch's Join trains on the same inputs (the joined ranks meet DDP's
    all-reduce of the used-parameter map)."""
    out: dict[str, Any] = {}
    for counts in COUNTS[ctx.world]:
        trained, path = {}, None
        for which in ("joinkit", "torch"):
            model = wrap(ctx, Branchy(), find_unused_parameters=True)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            join: Any = Join([model]) if which == "joinkit" else torch_join.Join([model])
            with join:
                for i in range(counts[ctx.rank]):
                    model(batch(ctx.rank, i).to(DEVICE)).square().sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            if which == "joinkit":
                path = join.heartbeat
            trained[which] = params(model.module)
        out[str(counts)] = {"path": path, "worst": max(
            float((a - b).abs().max())
            for a, b in zip(trained["joinkit"], trained["torch"], strict=True))}
    return out


# -- failures ------------------------------------------------------------------------------


class Failing(nn.Module):
    """The test model; on one rank, at one input, it raises in its forward, or
    in its backward after the first bucket's all-reduce went out."""

    def __init__(self, rank: int, where: str, at: tuple[int, int]) -> None:
        super().__init__()
        self.net = make()
        self.rank, self.where, self.at = rank, where, at
        self.calls = 0
        # The first layer's gradients come last in a backward, after the last
        # layer's bucket went out (several buckets after the rebuild).
        self.net[0].weight.register_hook(self._backward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.where == "forward" and (self.rank, self.calls) == self.at:
            raise ValueError(f"bad forward on rank {self.rank}")
        return self.net(x)

    def _backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.where == "backward" and (self.rank, self.calls) == self.at:
            raise ValueError(f"bad backward on rank {self.rank}")
        return grad


@scenario
def round_failures(ctx: Ctx) -> Any:
    """Rank 1 fails in the loop body before its forward, in its forward, or in
    its backward midway through its round (it completes the round from zeros
    first); also with rank 0 already joined. Every rank leaves with an error
    (rank 1 its own, the others PeerFailure naming it), nobody hangs, and the
    group still matches afterwards."""
    out: dict[str, Any] = {}
    for where, counts, carrier_bytes in itertools.product(
            ("body", "forward", "backward"), ([6] * ctx.world, [1] + [6] * (ctx.world - 1)),
            (None, 0)):
        model = wrap(ctx, Failing(ctx.rank, where, (1, 4)), bucket_cap_mb=1e-5)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        done, error = 0, None
        try:
            with carrier_at_most(carrier_bytes), Join([model]) as join:
                for i in range(counts[ctx.rank]):
                    if where == "body" and ctx.rank == 1 and i == 3:
                        raise ValueError("bad batch on rank 1")
                    model(batch(ctx.rank, i).to(DEVICE)).square().sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    done += 1
        except Exception as caught:  # noqa: BLE001 - recorded for the test
            error = {"type": type(caught).__name__, "message": str(caught),
                     "rank": getattr(caught, "rank", None)}
        check_group(ctx)
        report = join.report
        assert report is not None
        out[f"{where}-{counts}-{carrier_bytes}"] = {
            "error": error, "done": done, "path": report.heartbeat, "phase": report.phase}
    return out


# -- the runner ------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    global DEVICE
    rank_s, world_s, store, out_dir, *names = argv
    rank, world = int(rank_s), int(world_s)
    backend = "gloo"
    if names and names[0] == "--nccl":
        names = names[1:]
        backend = "nccl"
        DEVICE = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
        _ddp_round.ON_CUDA = True  # the path's CUDA branch, on a GPU
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    ctx = Ctx(rank, world, None)
    out = Path(out_dir) / f"rank{rank}.jsonl"
    for name in names:
        with recording(out, name) as record:
            ctx.group = dist.new_group(backend=backend, timeout=TIMEOUT)
            record["result"] = SCENARIOS[name](ctx)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
