"""Multi-rank scenarios for FSDP1 (``FullyShardedDataParallel``) under joinkit's Join,
checked against single-process float64 references.

Theory of operation
-------------------
As ``fsdp_scenarios.py`` (FSDP2): ``test_fsdp1.py`` starts one process per rank
once per world size (2 and 3), and each runs every scenario in a row::

    python fsdp1_scenarios.py RANK WORLD_SIZE STORE_FILE OUT_DIR NAME [NAME ...]

Every scenario gets a fresh gloo group with a short timeout and writes one JSON
line per rank: per configuration, the largest deviation of this rank's *full*
parameters (``summon_full_params``) from a reference that one process computes
in float64 from every rank's data (at every step, the gradient of the ranks
still active, summed and divided by the initial world size or by the number of
active ranks), and the number of collectives its group issued, which the test
compares across ranks. The counts of inputs per rank depend on the world size
(``counts``), with a rank that has none; rank r's data is seeded by (r, step).
Mixed precision and FSDP1's own ``clip_grad_norm_`` (which computes norms in
float32 and refuses float64 gradients) train a float32 model; their references
apply the same casts.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from collections.abc import Callable
from typing import Any

import fsdp_scenarios
import torch
import torch.distributed as dist
from fsdp_scenarios import adamw, counts, sequence, sgd
from support import Ctx, scenario_registry
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from joinkit import Join

SCENARIOS, scenario = scenario_registry()

#: Inputs per rank, by world size: a rank with none in each.
UNEVEN = {2: [0, 3], 3: [3, 0, 2]}
UNEVEN_B = {2: [4, 1], 3: [1, 4, 0]}
WINDOWS = {"aligned": {2: [2, 6], 3: [4, 0, 6]}, "mid-window": {2: [3, 6], 3: [3, 6, 0]}}


# -- models, data, references -------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(self.a(x))))


def net(dtype: torch.dtype = torch.float64) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def wrap(model: nn.Module, group: Any, *, nested: bool = True, orig: bool = False,
         strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD, **kwargs: Any) -> FSDP:
    """FSDP1 on the CPU; ``nested``: every Linear a unit of its own (an auto-wrap policy)."""
    policy = ModuleWrapPolicy({nn.Linear}) if nested else None
    return FSDP(model, process_group=group, device_id=torch.device("cpu"),
                auto_wrap_policy=policy, use_orig_params=orig, sharding_strategy=strategy,
                **kwargs)


def data(rank: int, i: int, dtype: torch.dtype = torch.float64
         ) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + i)
    x, y = torch.randn(3, 4, generator=generator), torch.randn(3, 2, generator=generator)
    return x.to(dtype), y.to(dtype)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error in the target's dtype (a bfloat16 output is cast up)."""
    return ((output.to(target.dtype) - target) ** 2).mean()


def full(model: FSDP) -> list[torch.Tensor]:
    """Every parameter in full (FSDP1's all-gather: the same order on every rank)."""
    with FSDP.summon_full_params(model):
        return [p.detach().clone() for p in model.module.parameters()]


def deviation(model: FSDP, reference: nn.Module) -> float:
    return max(float((a.double() - b.detach().double()).abs().max())
               for a, b in zip(full(model), reference.parameters(), strict=True))


Grads = Callable[[nn.Module, int, int], list[torch.Tensor]]


def plain_grads(ref: nn.Module, rank: int, i: int) -> list[torch.Tensor]:
    x, y = data(rank, i, next(ref.parameters()).dtype)
    return list(torch.autograd.grad(mse(ref(x), y), list(ref.parameters())))


def reference(counts: list[int], make_optimizer: Callable[[Any], torch.optim.Optimizer], *,
              divide_by_initial: bool = True, window: int = 1, grads: Grads = plain_grads,
              dtype: torch.dtype = torch.float64,
              reduce: Callable[[list[list[torch.Tensor]], int], list[torch.Tensor]]
              | None = None,
              clip: float | None = None) -> nn.Module:
    """One process: per window, the gradients of the ranks that complete it, summed and
    divided by the world size (or the active ranks); a partial window is dropped."""
    world = len(counts)
    ref = net(dtype)
    params = list(ref.parameters())
    optimizer = make_optimizer(params)
    for start in range(0, max(counts), window):
        sync = start + window - 1
        contributors = [r for r in range(world) if counts[r] > sync]
        if not contributors:
            break
        divisor = world if divide_by_initial else len(contributors)
        per_rank = []
        for r in contributors:
            window_grads = [grads(ref, r, i) for i in range(start, sync + 1)]
            per_rank.append([sum(g[k] for g in window_grads) / window
                             for k in range(len(params))])
        if reduce is not None:
            total = reduce(per_rank, divisor)
        else:
            total = [sum(g[k] for g in per_rank) / divisor for k in range(len(params))]
        for p, g in zip(params, total, strict=True):
            p.grad = g.to(p.dtype)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
    return ref


def train(model: FSDP, optimizer: Any, n: int, rank: int, *, window: int = 1,
          step: Callable[[], Any] | None = None, dtype: torch.dtype = torch.float64,
          **join_kwargs: Any) -> Join:
    """``n`` iterations of this rank; windows of ``window`` batches under ``no_sync``."""
    step = step or optimizer.step
    with Join([model, optimizer], **join_kwargs) as join:
        for i in range(n):
            syncs = i % window == window - 1
            x, y = data(rank, i, dtype)
            with contextlib.nullcontext() if syncs else model.no_sync():
                (mse(model(x), y) / window).backward()
            if syncs:
                step()
                optimizer.zero_grad()
    return join


def shadowed(join: Join) -> int:
    return join.report.shadow_rounds if join.report else 0


# -- FSDP1 against the reference ------------------------------------------------------------


@scenario
def fsdp1_reference(ctx: Ctx) -> Any:
    """SGD and AdamW; nested and flat; use_orig_params; FULL_SHARD, SHARD_GRAD_OP,
    NO_SHARD; uneven counts with a rank that has none."""
    configs = [
        ("sgd-nested-full", sgd, True, False, ShardingStrategy.FULL_SHARD, UNEVEN),
        ("adamw-nested-orig", adamw, True, True, ShardingStrategy.FULL_SHARD, UNEVEN),
        ("adamw-flat-grad-op", adamw, False, False, ShardingStrategy.SHARD_GRAD_OP, UNEVEN_B),
        ("sgd-nested-orig-grad-op", sgd, True, True, ShardingStrategy.SHARD_GRAD_OP,
         UNEVEN_B),
        ("sgd-flat-no-shard", sgd, False, False, ShardingStrategy.NO_SHARD, UNEVEN),
    ]
    out = {}
    for name, make_optimizer, nested, orig, strategy, table in configs:
        n = counts(ctx, table)
        model = wrap(net(), ctx.group, nested=nested, orig=orig, strategy=strategy)
        optimizer = make_optimizer(model.parameters())
        join = train(model, optimizer, n[ctx.rank], ctx.rank)
        out[name] = {"deviation": deviation(model, reference(n, make_optimizer)),
                     "moved": deviation(model, net()),  # it trained: not the start
                     "shadow_rounds": shadowed(join), "wrapped": type(model).__name__}
    return out


@scenario
def fsdp1_hybrid(ctx: Ctx) -> Any:
    """HYBRID_SHARD over 4 ranks: shard groups {0, 1} and {2, 3}, replicate groups {0, 2}
    and {1, 3} (a reduce-scatter, then an all-reduce), nested and flat, uneven counts
    with a rank that has none. (FSDP1 runs a shard group of one rank as NO_SHARD and
    skips the replicate all-reduce, with or without joinkit: so 4 ranks.)"""
    assert ctx.world == 4, "run with 4 ranks"
    shards = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    replicas = [dist.new_group([0, 2], backend="gloo"), dist.new_group([1, 3], backend="gloo")]
    groups = (shards[ctx.rank // 2], replicas[ctx.rank % 2])
    out = {}
    for nested, table in ((True, {4: [3, 0, 1, 4]}), (False, {4: [2, 5, 0, 3]})):
        n = counts(ctx, table)
        model = FSDP(net(), process_group=groups, device_id=torch.device("cpu"),
                     auto_wrap_policy=ModuleWrapPolicy({nn.Linear}) if nested else None,
                     sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        optimizer = adamw(model.parameters())
        join = train(model, optimizer, n[ctx.rank], ctx.rank)
        out["nested" if nested else "flat"] = {
            "deviation": deviation(model, reference(n, adamw)),
            "moved": deviation(model, net()), "shadow_rounds": shadowed(join)}
    return out


@scenario
def fsdp1_accumulate(ctx: Ctx) -> Any:
    """no_sync() windows of 2, aligned and with ranks running out mid-window (a partial
    window is dropped: only the ranks active at a step contribute to it)."""
    out = {}
    for orig in (False, True):
        for name, table in WINDOWS.items():
            n = counts(ctx, table)
            model = wrap(net(), ctx.group, orig=orig)
            optimizer = adamw(model.parameters())
            train(model, optimizer, n[ctx.rank], ctx.rank, window=2)
            out[f"{name}{'-orig' if orig else ''}"] = deviation(
                model, reference(n, adamw, window=2))
    return out


@scenario
def fsdp1_divide_by_active(ctx: Ctx) -> Any:
    """divide_by_initial_world_size=False: each step divides by the ranks still active;
    after the Join FSDP1 divides by the world size again (its factors put back)."""
    n = counts(ctx, UNEVEN_B)
    model = wrap(net(), ctx.group)
    optimizer = sgd(model.parameters())
    train(model, optimizer, n[ctx.rank], ctx.rank, divide_by_initial_world_size=False)
    out = {"deviation": deviation(model, reference(n, sgd, divide_by_initial=False))}
    before = full(model)
    x, y = data(ctx.rank, 100)
    mse(model(x), y).backward()
    optimizer.step()
    ref = net()
    with torch.no_grad():
        for p, value in zip(ref.parameters(), before, strict=True):
            p.copy_(value)
    ref_optimizer = sgd(ref.parameters())
    for r in range(ctx.world):
        x, y = data(r, 100)
        (mse(ref(x), y) / ctx.world).backward()
    ref_optimizer.step()
    out["after"] = deviation(model, ref)
    return out


@scenario
def fsdp1_clip_grad_norm(ctx: Ctx) -> Any:
    """FSDP1's own clip_grad_norm_ (a norm all-reduce over the group) through
    shadow_step: joined ranks clip their shards with the active ranks' norm. FSDP1
    computes the norms in float32: a float32 model, against the float64 reference."""
    out = {}
    for orig in (False, True):
        n = counts(ctx, UNEVEN_B)
        model = wrap(net(torch.float32), ctx.group, orig=orig)
        optimizer = sgd(model.parameters())
        norms: list[float] = []

        def step(model: FSDP = model, optimizer: Any = optimizer,
                 norms: list[float] = norms) -> None:
            norms.append(float(model.clip_grad_norm_(0.05)))
            optimizer.step()

        train(model, optimizer, n[ctx.rank], ctx.rank, step=step, shadow_step=step,
              dtype=torch.float32)
        out["orig" if orig else "flat"] = {
            "deviation": deviation(model, reference(n, sgd, clip=0.05)),
            "clipped": max(norms) > 0.05}
    return out


def bf16_grads(ref: nn.Module, rank: int, i: int) -> list[torch.Tensor]:
    """One rank's gradient as FSDP1's MixedPrecision computes it: the parameters and the
    input in bfloat16, the loss in float32, the gradient cast to float32 to reduce."""
    low = copy.deepcopy(ref).to(torch.bfloat16)
    x, y = data(rank, i, torch.float32)
    grads = torch.autograd.grad(mse(low(x.to(torch.bfloat16)), y), list(low.parameters()))
    return [g.float() for g in grads]


def fsdp1_reduce(world: int) -> Callable[[list[list[torch.Tensor]], int], list[torch.Tensor]]:
    """FSDP1's reduction in float32: each rank's gradient over the pre-divide factor,
    summed, over the post-divide factor (their product is the world size)."""
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    post = world / pre

    def reduce(per_rank: list[list[torch.Tensor]], divisor: int) -> list[torch.Tensor]:
        assert divisor == world
        total = [sum(g[k] / pre for g in per_rank) for k in range(len(per_rank[0]))]
        return [t / post if post > 1 else t for t in total]

    return reduce


@scenario
def fsdp1_mixed_precision(ctx: Ctx) -> Any:
    """MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32): forward and backward in
    bfloat16, reductions in float32, float32 parameters stepped; the reference applies the
    same casts, per rank, in one process."""
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                            buffer_dtype=torch.bfloat16)
    out = {}
    for orig in (False, True):
        n = counts(ctx, UNEVEN)
        model = wrap(net(torch.float32), ctx.group, orig=orig, mixed_precision=policy)
        optimizer = sgd(model.parameters())
        train(model, optimizer, n[ctx.rank], ctx.rank, dtype=torch.float32)
        ref = reference(n, sgd, grads=bf16_grads, dtype=torch.float32,
                        reduce=fsdp1_reduce(ctx.world))
        # Against float32 training without the casts, for scale: bfloat16 mattered.
        plain = reference(n, sgd, dtype=torch.float32)
        out["orig" if orig else "flat"] = {"deviation": deviation(model, ref),
                                           "from_float32": deviation(model, plain)}
    return out


@scenario
def fsdp1_eval(ctx: Ctx) -> Any:
    """Forward only under torch.no_grad: joined ranks replay the forward alone."""
    model = wrap(net(), ctx.group)
    model.eval()
    before = full(model)
    outputs = 0
    with Join([model]), torch.no_grad():
        for i in range(counts(ctx, UNEVEN)[ctx.rank]):
            outputs += model(data(ctx.rank, i)[0]).shape[0]
    change = max(float((a - b).abs().max()) for a, b in zip(full(model), before, strict=True))
    return {"outputs": outputs, "change": change}


def grad_state(model: FSDP) -> list[tuple[Any, torch.Tensor | None]]:
    """Every gradient this rank holds, as (object, value): each flat parameter's, then
    each parameter's (the original ones with use_orig_params)."""
    tensors = [m._handle.flat_param.grad for m in FSDP.fsdp_modules(model)
               if m._handle is not None]
    tensors += [p.grad for p in model.parameters()]
    return [(t, None if t is None else t.detach().clone()) for t in tensors]


def grad_change(before: list[Any], after: list[Any]) -> dict[str, Any]:
    same = all(a is b for (a, _), (b, _) in zip(before, after, strict=True))
    change = 0.0
    for (_, a), (_, b) in zip(before, after, strict=True):
        if (a is None) != (b is None) or (a is not None and b is not None
                                          and a.shape != b.shape):
            change = float("inf")
        elif a is not None and b is not None and a.numel():
            change = max(change, float((a - b).abs().max()))
    return {"same_objects": same, "change": change}


@scenario
def fsdp1_gradients_given_back(ctx: Ctx) -> Any:
    """After the Join every gradient is the very object, with the very value, that the
    rank's loop left: the last backward's shard (zero_grad before each step's forward),
    and a partial no_sync window's unsharded gradient (its original parameters' views
    included) of a rank that ran out mid-window; two epochs, each one Join."""
    out = {}
    for orig in (False, True):
        for name, window, table in (("window1", 1, UNEVEN), ("mid-window", 2,
                                                             WINDOWS["mid-window"])):
            n = counts(ctx, table)
            model = wrap(net(), ctx.group, orig=orig)
            optimizer = sgd(model.parameters())
            changes = []
            for _epoch in range(2):
                with Join([model, optimizer]):
                    for i in range(n[ctx.rank]):
                        syncs = i % window == window - 1
                        if i % window == 0:
                            optimizer.zero_grad()
                        x, y = data(ctx.rank, i)
                        with contextlib.nullcontext() if syncs else model.no_sync():
                            (mse(model(x), y) / window).backward()
                        if syncs:
                            optimizer.step()
                    left = grad_state(model)
                changes.append(grad_change(left, grad_state(model)))
            out[f"{name}{'-orig' if orig else ''}"] = changes
    return out


@scenario
def fsdp1_after_exit(ctx: Ctx) -> Any:
    """After the Join the model issues exactly FSDP1's own collectives."""

    def per_iteration(model: FSDP, optimizer: Any) -> int:
        before = sequence(ctx.group)
        x, y = data(ctx.rank, 50)
        mse(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        return sequence(ctx.group) - before

    plain = wrap(net(), ctx.group)
    plain_optimizer = sgd(plain.parameters())
    per_iteration(plain, plain_optimizer)  # lazy init
    alone = per_iteration(plain, plain_optimizer)
    model = wrap(net(), ctx.group)
    optimizer = sgd(model.parameters())
    train(model, optimizer, counts(ctx, UNEVEN)[ctx.rank], ctx.rank)
    return {"alone": alone, "after": per_iteration(model, optimizer)}


@scenario
def fsdp1_peer_failure(ctx: Ctx) -> Any:
    """Rank 1 raises between iterations; every rank leaves with an error."""
    model = wrap(net(), ctx.group)
    optimizer = sgd(model.parameters())
    try:
        train(model, optimizer, 5, ctx.rank, step=_failing_step(ctx, optimizer))
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


def _failing_step(ctx: Ctx, optimizer: Any) -> Callable[[], Any]:
    calls = [0]

    def step() -> None:
        calls[0] += 1
        if ctx.rank == 1 and calls[0] == 2:
            raise ValueError("bad batch on rank 1")
        optimizer.step()

    return step


@scenario
def fsdp1_refusals(ctx: Ctx) -> Any:
    """What a Join refuses with an FSDP1 model, on every rank before any collective."""
    out: dict[str, Any] = {}
    model = wrap(net(), ctx.group)
    optimizer = sgd(model.parameters())
    hooked = wrap(net(), ctx.group)
    hooked.register_comm_hook(None, _sum_hook)
    offloaded = wrap(net(), ctx.group, nested=False,
                     cpu_offload=CPUOffload(offload_params=True))
    cases: dict[str, tuple[list[Any], dict[str, Any]]] = {
        "finish": ([model, optimizer], {"on_rank_loss": "finish"}),
        "comm_hook": ([hooked, sgd(hooked.parameters())],
                      {"divide_by_initial_world_size": False}),
        "offload": ([offloaded, sgd(offloaded.parameters())], {}),
        "shared_windows_divisor": ([model, optimizer], {
            "shared_windows": True, "divide_by_initial_world_size": False}),
    }
    out["collectives"] = {}
    for name, (joinables, kwargs) in cases.items():
        before = sequence(ctx.group)
        try:
            with Join(joinables, **kwargs):
                pass
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = None
        out["collectives"][name] = sequence(ctx.group) - before
    return out


def _sum_hook(state: Any, grad: torch.Tensor, output: Any = None) -> None:
    raise AssertionError("never called: the Join is refused on entry")


@scenario
def cuda_fsdp1_mixed_precision(ctx: Ctx) -> Any:
    """FSDP1 on CUDA (its streams), bfloat16 mixed precision, no_sync windows of 2 with a
    rank running out mid-window, FSDP1's clip_grad_norm_: against the float64 reference
    with the same casts."""
    device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    n = counts(ctx, WINDOWS["mid-window"])
    model = FSDP(net(torch.float32).to(device), process_group=ctx.group, device_id=device,
                 auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), mixed_precision=policy)
    optimizer = sgd(model.parameters())

    def step() -> None:
        model.clip_grad_norm_(0.5)
        optimizer.step()

    with Join([model, optimizer], shadow_step=step):
        for i in range(n[ctx.rank]):
            syncs = i % 2 == 1
            x, y = data(ctx.rank, i, torch.float32)
            with contextlib.nullcontext() if syncs else model.no_sync():
                (mse(model(x.to(device)), y.to(device)) / 2).backward()
            if syncs:
                step()
                optimizer.zero_grad()
    ref = reference(n, sgd, window=2, grads=bf16_grads, dtype=torch.float32,
                    reduce=fsdp1_reduce(ctx.world), clip=0.5)
    return {"deviation": max(float((a.cpu().double() - b.detach().double()).abs().max())
                             for a, b in zip(full(model), ref.parameters(), strict=True))}


# -- the runner ---------------------------------------------------------------------------


if __name__ == "__main__":
    warnings.filterwarnings("ignore")  # FSDP1's deprecation and CPU warnings, every scenario
    fsdp_scenarios.main(sys.argv[1:], SCENARIOS)
