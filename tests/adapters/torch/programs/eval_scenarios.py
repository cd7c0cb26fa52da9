"""Evaluation loops, a silent first joinable and the divisor, with DDP under joinkit's Join.

Theory of operation
-------------------
One process per rank runs many scenarios in a row (as ``torch_scenarios.py``)::

    python eval_scenarios.py RANK WORLD STORE_FILE OUT_DIR NAME [NAME ...]   # gloo
    mpirun -n W python eval_scenarios.py mpi OUT_DIR NAME [NAME ...]     # init_torch
    python eval_scenarios.py RANK WORLD STORE_FILE OUT_DIR --nccl NAME ...   # CUDA

Every scenario gets a fresh group with a short timeout. Rank r's batch counts
come from per-world tables (e.g. 3 vs 5 and 0 vs 4 on two ranks). Each rank
compares what it computed with a single-process reference it computes itself
(a plain module with the same initial weights, fed the batches of every rank
where the reference needs them) and records the largest difference, its
final parameters (the test compares ranks) and the errors it left the Join with.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support import Ctx, recording, scenario_registry
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import joinkit
from joinkit import Join, JoinHook, LocalProtocolError, PeerFailure, backends

TIMEOUT = datetime.timedelta(seconds=30)
SCENARIOS, scenario = scenario_registry()
DEVICE = torch.device("cpu")
TRACE = bool(os.environ.get("JOINKIT_TRACE_CASES"))

#: Batch counts per rank, per world size.
COUNTS = {2: [[3, 5], [0, 4], [5, 3]], 3: [[3, 5, 4], [0, 4, 2], [2, 2, 2]]}
EVAL_MODES = ["no_grad", "inference_mode", "eval_no_grad"]


def batch(rank: int, i: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + i + 100_000 * salt)
    return torch.randn(3, 4, generator=g)


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "bn":
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def flat(module: nn.Module) -> list[float]:
    tensors = [*module.parameters(), *module.buffers()]
    return [float(v) for t in tensors for v in t.detach().cpu().reshape(-1).tolist()]


def params(module: nn.Module) -> list[float]:
    return [float(v) for p in module.parameters() for v in p.detach().cpu().reshape(-1).tolist()]


def diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def wrap(ctx: Ctx, module: nn.Module) -> DDP:
    module = module.to(DEVICE)
    ids = [DEVICE.index] if DEVICE.type == "cuda" else None
    return DDP(module, process_group=ctx.group, device_ids=ids)


class Ticker(joinkit.Joinable):
    """A joinkit Joinable: notify, then an all-reduce of a one (a joined rank adds 0)."""

    def __init__(self, group: Any, notifies: bool = True) -> None:
        super().__init__()
        self.group = group
        self.notifies = notifies
        self.count = 0.0

    def __call__(self) -> None:
        if self.notifies:
            Join.notify_join_context(self)
        t = torch.ones(1, device=DEVICE)
        dist.all_reduce(t, group=self.group)
        self.count += float(t.item())

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


class Silent(Ticker):
    """A first joinable whose loop code forgot to notify (and has no collectives)."""

    def __init__(self, group: Any) -> None:
        super().__init__(group, notifies=False)

    def __call__(self) -> None:
        pass

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()


def outcome(error: BaseException | None) -> dict[str, str] | None:
    if error is None:
        return None
    return {"type": type(error).__name__, "message": str(error)}


def eval_forward(model: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "inference_mode":
        with torch.inference_mode():
            return model(x).clone()
    with torch.no_grad():
        return model(x)


# -- part 4: evaluation ------------------------------------------------------------------


@scenario
def ddp_eval_only(ctx: Ctx) -> Any:
    """Forward-only loops (no_grad, inference_mode, eval() + no_grad), DDP first or
    after a Ticker, fused or not: outputs equal a plain module's on each batch."""
    worst = 0.0
    cases = 0
    for kind in ("bn", "lin"):
        for mode in EVAL_MODES:
            for counts in COUNTS[ctx.world]:
                for options in ({}, {"check_agreement": False}, {"after": True}):
                    model = wrap(ctx, make(kind))
                    reference = make(kind).to(DEVICE)
                    if mode == "eval_no_grad":
                        model.eval()
                        reference.eval()
                    options = dict(options)
                    after = options.pop("after", False)
                    ticker = Ticker(ctx.group)
                    joinables = [ticker, model] if after else [model]
                    with Join(joinables, **options):
                        for i in range(counts[ctx.rank]):
                            if after:
                                ticker()
                            x = batch(ctx.rank, i).to(DEVICE)
                            out = eval_forward(model, x, mode)
                            with torch.no_grad():
                                ref = reference(x)
                            worst = max(worst, diff(out.reshape(-1).tolist(),
                                                    ref.reshape(-1).tolist()))
                    cases += 1
    return {"worst": worst, "cases": cases}


@scenario
def ddp_eval_throw_mode(ctx: Ctx) -> Any:
    """throw_on_early_termination=True around a no_grad loop (DDP's own sync
    check, not fused): even counts finish with exact outputs; uneven ones end
    with EarlyTermination on every rank, no abort."""
    out: dict[str, Any] = {"worst": 0.0}
    for counts in ([4] * ctx.world, COUNTS[ctx.world][0]):
        model = wrap(ctx, make("bn"))
        model.eval()
        reference = make("bn").to(DEVICE).eval()
        try:
            with Join([model], throw_on_early_termination=True):
                for i in range(counts[ctx.rank]):
                    x = batch(ctx.rank, i).to(DEVICE)
                    got = eval_forward(model, x, "no_grad")
                    with torch.no_grad():
                        want = reference(x)
                    out["worst"] = max(out["worst"], float((got - want).abs().max()))
            out[str(counts)] = None
        except joinkit.EarlyTermination as error:
            out[str(counts)] = type(error).__name__
    return out


def reference_train(kind: str, counts: list[int], world: int, divide_by_world: bool,
                    steps_eval: bool, lr: float = 0.1,
                    epochs: int = 1) -> tuple[nn.Module, list[list[float]]]:
    """One process: per global iteration the active ranks' gradients summed and
    divided by the world size (or the active count), SGD; with ``steps_eval``
    each active rank's eval output after its step, rank by rank."""
    model = make(kind).to(DEVICE)
    evals: list[list[float]] = [[] for _ in range(world)]
    for i in [i for _ in range(epochs) for i in range(max(counts))]:
        active = [r for r in range(world) if counts[r] > i]
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in active:
            model.zero_grad()
            model(batch(r, i).to(DEVICE)).square().sum().backward()
            for g, p in zip(grads, model.parameters(), strict=True):
                g += p.grad
        divisor = world if divide_by_world else len(active)
        with torch.no_grad():
            for g, p in zip(grads, model.parameters(), strict=True):
                p -= lr * g / divisor
        if steps_eval:
            with torch.no_grad():
                for r in active:
                    evals[r].append(model(batch(r, i, salt=1).to(DEVICE)).reshape(-1).tolist())
    return model, evals


def train_loop(ctx: Ctx, model: DDP, n: int, optimizer: Any, eval_each: bool,
               joinables: list[Any] | None = None, **options: Any) -> list[list[float]]:
    evals = []
    with Join(joinables or [model], **options):
        for i in range(n):
            for j in joinables or []:
                if j is not model:
                    j()
            optimizer.zero_grad()
            model(batch(ctx.rank, i).to(DEVICE)).square().sum().backward()
            optimizer.step()
            if eval_each:
                with torch.no_grad():
                    evals.append(model(batch(ctx.rank, i, salt=1).to(DEVICE))
                                 .reshape(-1).tolist())
    return evals


@scenario
def ddp_train_eval_mixed(ctx: Ctx) -> Any:
    """A no_grad eval forward after every training step, in one Join: the
    parameters and the eval outputs equal one process's."""
    worst, finals = 0.0, []
    for kind in ("lin", "bn"):
        for counts in COUNTS[ctx.world]:
            for options in ({}, {"check_agreement": False}):
                model = wrap(ctx, make(kind))
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                evals = train_loop(ctx, model, counts[ctx.rank], optimizer, True, **options)
                reference, ref_evals = reference_train(kind, counts, ctx.world, True, True)
                worst = max(worst, diff(params(model), params(reference)))
                if kind == "lin":  # BN's running statistics follow DDP's broadcasts
                    for out, ref in zip(evals, ref_evals[ctx.rank], strict=True):
                        worst = max(worst, diff(out, ref))
                finals.append(flat(model))
    return {"worst": worst, "finals": finals}


@scenario
def ddp_train_then_eval_epochs(ctx: Ctx) -> Any:
    """Two epochs of a training Join then an evaluation Join (model.eval(),
    no_grad), uneven in both: parameters equal one process's; ranks agree."""
    worst, finals = 0.0, []
    for kind in ("bn", "lin"):
        counts = COUNTS[ctx.world][0]
        eval_counts = COUNTS[ctx.world][1]
        model = wrap(ctx, make(kind))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model.train()
            train_loop(ctx, model, counts[ctx.rank], optimizer, False)
            model.eval()
            with Join([model]), torch.no_grad():
                for i in range(eval_counts[ctx.rank]):
                    model(batch(ctx.rank, i, salt=2).to(DEVICE))
        reference, _ = reference_train(kind, counts, ctx.world, True, False, epochs=2)
        worst = max(worst, diff(params(model), params(reference)))
        finals.append(flat(model))
    return {"worst": worst, "finals": finals}


@scenario
def ddp_grad_forward_without_backward(ctx: Ctx) -> Any:
    """model.eval() with gradients enabled and no backward: every rank leaves
    with a clear error (its own LocalProtocolError, or PeerFailure), no abort."""
    out = {}
    for counts in ([3, 5, 4][: ctx.world], [0, 4, 2][: ctx.world], [0, 1, 0][: ctx.world]):
        for options in ({}, {"check_agreement": False}, {"after": True},
                        {"after": True, "throw_on_early_termination": True}):
            if options.get("throw_on_early_termination") and min(counts) == 0:
                continue  # an empty rank ends a throw-mode Join first
            model = wrap(ctx, make("lin"))
            model.eval()
            options = dict(options)
            after = options.pop("after", False)
            ticker = Ticker(ctx.group)
            error: BaseException | None = None
            try:
                with Join([ticker, model] if after else [model], **options):
                    for i in range(counts[ctx.rank]):
                        if after:
                            ticker()
                        model(batch(ctx.rank, i).to(DEVICE))
            except (LocalProtocolError, PeerFailure) as caught:
                error = caught
            out[f"{counts}-{sorted(options)}-{after}"] = outcome(error)
            # The group still works: one more all-reduce matches on every rank.
            t = torch.ones(1, device=DEVICE)
            dist.all_reduce(t, group=ctx.group)
            assert t.item() == ctx.world
    return out


# -- part 5: a first joinable that never notifies ------------------------------------------


@scenario
def first_joinable_never_notifies(ctx: Ctx) -> Any:
    """Join([silent, ddp]) and Join([silent, ticker]): the rank that runs the
    later joinable's notify raises LocalProtocolError naming Silent."""
    out = {}
    for later in ("ddp", "ticker"):
        for counts in ([3, 5, 4][: ctx.world], [0, 4, 2][: ctx.world]):
            silent = Silent(ctx.group)
            model = wrap(ctx, make("lin"))
            ticker = Ticker(ctx.group)
            other = model if later == "ddp" else ticker
            error: BaseException | None = None
            try:
                with Join([silent, other]):
                    for i in range(counts[ctx.rank]):
                        silent()
                        if later == "ddp":
                            model(batch(ctx.rank, i).to(DEVICE)).sum().backward()
                        else:
                            ticker()
            except (LocalProtocolError, PeerFailure) as caught:
                error = caught
            out[f"{later}-{counts}"] = outcome(error)
            t = torch.ones(1, device=DEVICE)
            dist.all_reduce(t, group=ctx.group)
            assert t.item() == ctx.world
    return out


@scenario
def later_joinables_with_accumulation(ctx: Ctx) -> Any:
    """Legitimate patterns stay quiet: DDP first with no_sync() accumulation
    (a heartbeat per forward) and a Ticker after it ticking once per forward."""
    counts = COUNTS[ctx.world][0]
    model = wrap(ctx, make("lin"))
    ticker = Ticker(ctx.group)
    with Join([model, ticker]):
        for i in range(counts[ctx.rank]):
            with model.no_sync():
                model(batch(ctx.rank, i).to(DEVICE)).sum().backward()
                ticker()
            model(batch(ctx.rank, i, salt=1).to(DEVICE)).sum().backward()
            ticker()
    return {"params": flat(model), "count": ticker.count}


# -- part 6: the divisor -------------------------------------------------------------------


@scenario
def ddp_divisor_positions(ctx: Ctx) -> Any:
    """divide_by_initial_world_size=False with DDP first and after a Ticker
    (fused, check_agreement=False, throw-free): SGD equals one process dividing
    by the active count; True divides by the world size."""
    worst = 0.0
    for divide in (False, True):
        for after in (False, True):
            for options in ({}, {"check_agreement": False}):
                for counts in COUNTS[ctx.world][:2]:
                    if TRACE:
                        print(ctx.rank, "case", divide, after, options, counts, flush=True)
                    model = wrap(ctx, make("lin"))
                    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                    ticker = Ticker(ctx.group)
                    joinables = [ticker, model] if after else [model]
                    train_loop(ctx, model, counts[ctx.rank], optimizer, False, joinables,
                               divide_by_initial_world_size=divide, **options)
                    reference, _ = reference_train("lin", counts, ctx.world, divide, False)
                    worst = max(worst, diff(params(model), params(reference)))
    return {"worst": worst}


class FusedTicker(Ticker):
    """A first joinable that carries the heartbeat in its own collective."""

    join_fuses_heartbeat = True

    def join_hook(self, **kwargs: Any) -> JoinHook:
        class Hook(JoinHook):
            def fused_shadow(self, heartbeat: float) -> float:
                return heartbeat

        return Hook()


@scenario
def ddp_divisor_refused_after_a_fused_joinable(ctx: Ctx) -> Any:
    """No torch Work carries the active count: the Join refuses on entry, on
    every rank, and the group and the model stay usable."""
    model = wrap(ctx, make("lin"))
    error = None
    try:
        with Join([FusedTicker(ctx.group), model], divide_by_initial_world_size=False):
            raise AssertionError("entered")
    except LocalProtocolError as caught:
        error = str(caught)
    config = model._join_config
    model(batch(ctx.rank, 0).to(DEVICE)).sum().backward()  # plain DDP again
    return {"error": error, "enabled": bool(config.enable)}


class FusedCounter(Ticker):
    """examples/counter.py's Counter: its all-reduce carries ``[1, heartbeat]``."""

    join_fuses_heartbeat = True

    def __call__(self) -> None:
        t = torch.tensor([1.0, Join.fused_heartbeat(self)], device=DEVICE)
        dist.all_reduce(t, group=self.group)
        Join.record_heartbeat_total(self, float(t[1]))
        self.count += float(t[0])

    def join_hook(self, **kwargs: Any) -> JoinHook:
        counter = self

        class Hook(JoinHook):
            def fused_shadow(self, heartbeat: float) -> float:
                t = torch.tensor([0.0, heartbeat], device=DEVICE)
                dist.all_reduce(t, group=counter.group)
                return float(t[1])

        return Hook()


def fused_first(ctx: Ctx, kind: str) -> Any:
    from joinkit.adapters.gather import Gather

    return Gather(ctx.group) if kind == "gather" else FusedCounter(ctx.group)


def call_first(first: Any, x: torch.Tensor) -> Any:
    if isinstance(first, FusedCounter):
        first()
        return None
    return first(x)


@scenario
def ddp_after_fused_first(ctx: Ctx) -> Any:
    """Join([Gather, ddp]) and Join([FusedCounter, ddp]), whose first joinable
    fuses the heartbeat into its own collective: a forward with gradients and
    no backward gives every rank a clear error (checked before the first
    joinable's next collective); no_grad evaluation and training are exact."""
    errors: dict[str, Any] = {}
    worst, cases = 0.0, 0
    for first_kind in ("gather", "counter"):
        for counts in ([3, 5, 4][: ctx.world], [0, 4, 2][: ctx.world]):
            # A forward with gradients and no backward.
            model = wrap(ctx, make("lin"))
            model.eval()
            first = fused_first(ctx, first_kind)
            error: BaseException | None = None
            try:
                with Join([first, model]):
                    for i in range(counts[ctx.rank]):
                        x = batch(ctx.rank, i).to(DEVICE)
                        call_first(first, x)
                        model(x)
            except (LocalProtocolError, PeerFailure) as caught:
                error = caught
            errors[f"{counts}-{first_kind}"] = outcome(error)
            t = torch.ones(1, device=DEVICE)
            dist.all_reduce(t, group=ctx.group)
            assert t.item() == ctx.world
            # no_grad evaluation: gathered rows and outputs against one process.
            for mode in ("no_grad", "eval_no_grad"):
                model = wrap(ctx, make("bn"))
                reference = make("bn").to(DEVICE)
                if mode == "eval_no_grad":
                    model.eval()
                    reference.eval()
                first = fused_first(ctx, first_kind)
                with Join([first, model]), torch.no_grad():
                    for i in range(counts[ctx.rank]):
                        x = batch(ctx.rank, i).to(DEVICE)
                        rows = call_first(first, x)
                        if rows is not None:
                            union = torch.cat([batch(r, i) for r in range(ctx.world)
                                               if counts[r] > i]).to(DEVICE)
                            worst = max(worst, float((rows - union).abs().max()))
                        out = model(x)
                        worst = max(worst, float((out - reference(x)).abs().max()))
                if isinstance(first, FusedCounter):
                    want = sum(min(c, counts[ctx.rank]) for c in counts)
                    worst = max(worst, abs(first.count - want))
                cases += 1
            # Training stays quiet and exact (the check sees every backward).
            model = wrap(ctx, make("lin"))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            first = fused_first(ctx, first_kind)
            with Join([first, model]):
                for i in range(counts[ctx.rank]):
                    x = batch(ctx.rank, i).to(DEVICE)
                    call_first(first, x)
                    optimizer.zero_grad()
                    model(x).square().sum().backward()
                    optimizer.step()
            reference, _ = reference_train("lin", counts, ctx.world, True, False)
            worst = max(worst, diff(params(model), params(reference)))
            cases += 1
    return {"errors": errors, "worst": worst, "cases": cases}


# -- FSDP2 (fully_shard) ------------------------------------------------------------------


def _fsdp() -> Any:
    import fsdp_scenarios  # the FSDP2 helpers and references of test_fsdp.py

    return fsdp_scenarios


@scenario
def fsdp_eval_only(ctx: Ctx) -> Any:
    """Forward-only loops on a nested fully_shard model (reshard after forward or
    not), first or after a Ticker: outputs equal the plain module's."""
    f = _fsdp()
    worst, cases = 0.0, 0
    for mode in EVAL_MODES:
        for reshard in (True, False):
            for counts in COUNTS[ctx.world][:2]:
                for after in (False, True):
                    if TRACE:
                        print(ctx.rank, "case", mode, reshard, counts, after, flush=True)
                    model = f.shard(f.net(), ctx.group, reshard=reshard)
                    reference = f.net()
                    if mode == "eval_no_grad":
                        model.eval()
                    ticker = Ticker(ctx.group)
                    with Join([ticker, model] if after else [model]):
                        for i in range(counts[ctx.rank]):
                            if after:
                                ticker()
                            x = f.data(ctx.rank, i)[0]
                            out = eval_forward(model, x, mode)
                            with torch.no_grad():
                                ref = reference(x)
                            worst = max(worst, float((out - ref).abs().max()))
                    cases += 1
    return {"worst": worst, "cases": cases}


@scenario
def fsdp_train_eval_mixed(ctx: Ctx) -> Any:
    """A no_grad evaluation forward after every training step, one Join: the
    parameters equal one process's."""
    f = _fsdp()
    worst = 0.0
    for counts in COUNTS[ctx.world][:2]:
        for options in ({}, {"check_agreement": False}):
            model = f.shard(f.net(), ctx.group)
            optimizer = f.sgd(model.parameters())
            with Join([model, optimizer], **options):
                for i in range(counts[ctx.rank]):
                    x, y = f.data(ctx.rank, i)
                    f.mse_loss(model(x), y).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    with torch.no_grad():
                        model(f.data(ctx.rank, i + 50)[0])
            worst = max(worst, f.deviation(model, f.reference(counts, f.sgd)))
    return {"worst": worst}


@scenario
def fsdp_divisor_positions(ctx: Ctx) -> Any:
    """divide_by_initial_world_size False and True with the model first and
    after a Ticker: parameters equal one process dividing by the active count
    (or the world size)."""
    f = _fsdp()
    worst = 0.0
    for divide in (False, True):
        for after in (False, True):
            for counts in COUNTS[ctx.world][:2]:
                model = f.shard(f.net(), ctx.group)
                optimizer = f.sgd(model.parameters())
                ticker = Ticker(ctx.group)
                joinables = [ticker, model, optimizer] if after else [model, optimizer]
                with Join(joinables, divide_by_initial_world_size=divide):
                    for i in range(counts[ctx.rank]):
                        if after:
                            ticker()
                        x, y = f.data(ctx.rank, i)
                        f.mse_loss(model(x), y).backward()
                        optimizer.step()
                        optimizer.zero_grad()
                reference = f.reference(counts, f.sgd, divide_by_initial=divide)
                worst = max(worst, f.deviation(model, reference))
    return {"worst": worst}


@scenario
def fsdp_grad_forward_without_backward(ctx: Ctx) -> Any:
    """An FSDP2 model in eval() with gradients enabled and no backward, first,
    after a Ticker and after a fused Gather: every rank leaves with a clear
    error (its own LocalProtocolError, or PeerFailure), no abort, no hang."""
    f = _fsdp()
    out = {}
    for counts in ([3, 5, 4][: ctx.world], [0, 4, 2][: ctx.world], [0, 1, 0][: ctx.world]):
        for first in ("none", "ticker", "gather"):
            for reshard in (True, False) if first == "none" else (True,):
                if TRACE:
                    print(ctx.rank, "case", counts, first, reshard, flush=True)
                model = f.shard(f.net(), ctx.group, reshard=reshard)
                model.eval()
                head = None if first == "none" else (
                    Ticker(ctx.group) if first == "ticker" else fused_first(ctx, "gather"))
                error: BaseException | None = None
                try:
                    with Join([model] if head is None else [head, model]):
                        for i in range(counts[ctx.rank]):
                            x = f.data(ctx.rank, i)[0]
                            if isinstance(head, Ticker):
                                head()
                            elif head is not None:
                                head(x)
                            model(x)
                except (LocalProtocolError, PeerFailure) as caught:
                    error = caught
                out[f"{counts}-{first}-{reshard}"] = outcome(error)
                t = torch.ones(1, device=DEVICE)
                dist.all_reduce(t, group=ctx.group)
                assert t.item() == ctx.world
    # Training: once a backward reached the outputs, the adapter holds none of them.
    from joinkit.adapters.torch import fsdp

    model = f.shard(f.net(), ctx.group)
    held = []
    with Join([model]):
        for i in range(COUNTS[ctx.world][0][ctx.rank]):
            x, y = f.data(ctx.rank, i)
            f.mse_loss(model(x), y).backward()
            pending = fsdp.adapt(model)._pending
            held.append(-1 if pending is None else len(pending[0]))
    return {"errors": out, "held": held}


def main(argv: list[str]) -> None:
    global DEVICE
    if argv[0] == "mpi":
        out_dir, *names = argv[1:]
        group = backends.init_torch("gloo", timeout=TIMEOUT)
        rank, world = group.rank, group.world_size
    else:
        rank_s, world_s, store, out_dir, *names = argv
        rank, world = int(rank_s), int(world_s)
    backend = "gloo"
    if names and names[0] == "--nccl":
        names = names[1:]
        backend = "nccl"
        DEVICE = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    if argv[0] != "mpi":
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
