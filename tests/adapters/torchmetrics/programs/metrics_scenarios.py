"""Multi-rank scenarios for torchmetrics under Join, all in one gloo process group.

Theory of operation
-------------------
As ``tests/adapters/torch/programs/torch_scenarios.py``: ``test_metrics_dist.py`` starts one
process per rank once, and each runs many scenarios in a row::

    python metrics_scenarios.py RANK WORLD_SIZE STORE_FILE OUT_DIR NAME [NAME ...]

Every scenario gets a fresh gloo subgroup (``ctx.group``) with a short timeout
and appends one JSON line per rank to ``OUT_DIR/rank{RANK}.jsonl``. Each rank
makes every rank's batches from a seed, so it computes the single-process
references itself: a torchmetrics metric of the same class that never syncs
(``distributed_available_fn`` says no), updated with the union of the batches.
The test compares. ``naive_*`` scenarios run the same loops without Join; the
test launches them apart, with a short deadline, because they hang or abort.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support import Ctx, recording, scenario_registry
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torchmetrics import MeanSquaredError, Metric, MetricCollection
from torchmetrics.classification import (
    BinaryAccuracy,
    BinaryAUROC,
    BinaryF1Score,
    MulticlassAccuracy,
)

from joinkit import Join, LocalProtocolError, PeerFailure
from joinkit.adapters import torchmetrics as metrics_adapter

SCENARIO_TIMEOUT = datetime.timedelta(seconds=20)
SCENARIOS, scenario = scenario_registry()

#: Batch counts per rank, by world size (the issue's 3 vs 5, 0 vs 4, 2/5/0).
COUNTS = {2: [[3, 5], [0, 4]], 3: [[2, 5, 0]]}


# -- data and metrics ---------------------------------------------------------------


def batch(kind: str, rank: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch ``step``: sizes vary with rank and step (3 to 6 rows)."""
    g = torch.Generator().manual_seed(seed * 100_003 + rank * 1009 + step)
    n = 3 + (rank + step) % 4
    if kind == "multiclass":
        return torch.randn(n, 4, generator=g), torch.randint(4, (n,), generator=g)
    if kind == "regression":
        return 3 * torch.randn(n, generator=g), 3 * torch.randn(n, generator=g)
    return torch.rand(n, generator=g), torch.randint(2, (n,), generator=g)


def _collection(**kwargs: Any) -> MetricCollection:
    return MetricCollection([BinaryAccuracy(**kwargs), BinaryAUROC(**kwargs),
                             BinaryF1Score(**kwargs)])


#: name -> (data kind, factory(**metric kwargs)); comparisons exact except "mse".
METRICS: dict[str, tuple[str, Callable[..., Any]]] = {
    "accuracy": ("multiclass", lambda **kw: MulticlassAccuracy(num_classes=4, **kw)),
    "mse": ("regression", MeanSquaredError),
    "auroc": ("binary", BinaryAUROC),
    "collection": ("binary", _collection),
}


def value(x: Any) -> Any:
    """A metric value as JSON: floats, lists, dicts."""
    if isinstance(x, dict):
        return {k: value(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.detach().double().tolist()
    return x


def as_list(x: Any) -> list[Any]:
    """A cat metric's value as a list (torchmetrics squeezes one element to a scalar)."""
    v = value(x)
    return v if isinstance(v, list) else [v]


def local(make: Callable[..., Any]) -> Any:
    """A metric that never syncs: the single-process reference."""
    return make(distributed_available_fn=lambda: False)


def references(name: str, counts: list[int], rank: int, sync_on_step: bool,
               seed: int = 0) -> dict[str, Any]:
    """What this rank's per-step values and everyone's final compute() must be."""
    kind, make = METRICS[name]
    steps = []
    for i in range(counts[rank]):
        ref = local(make)
        for r in range(len(counts)):
            if (r == rank or sync_on_step) and counts[r] > i:
                ref.update(*batch(kind, r, i, seed))
        steps.append(value(ref.compute()))
    final = local(make)
    for r, count in enumerate(counts):
        for i in range(count):
            final.update(*batch(kind, r, i, seed))
    return {"ref_steps": steps, "ref_final": value(final.compute())}


def run_loop(ctx: Ctx, name: str, counts: list[int], sync_on_step: bool, *,
             join: bool = True, seed: int = 0) -> dict[str, Any]:
    kind, make = METRICS[name]
    metric = make(dist_sync_on_step=sync_on_step, process_group=ctx.group)
    steps = []
    with Join([metric], enable=join):
        for i in range(counts[ctx.rank]):
            steps.append(value(metric(*batch(kind, ctx.rank, i, seed))))
    return {"steps": steps, "final": value(metric.compute()),
            **references(name, counts, ctx.rank, sync_on_step, seed)}


# -- the matrix: every metric x dist_sync_on_step x counts of this world -------------------


@scenario
def matrix(ctx: Ctx) -> Any:
    out = {}
    for name in METRICS:
        for sync_on_step in (True, False):
            for counts in COUNTS[ctx.world]:
                key = f"{name}/{'step' if sync_on_step else 'compute'}/{counts}"
                if not key.startswith(os.environ.get("METRICS_ONLY", "")):
                    continue
                out[key] = run_loop(ctx, name, counts, sync_on_step)
    return out


@scenario
def with_ddp(ctx: Ctx) -> Any:
    """Join([ddp, metric]): DDP sends the heartbeat, the metric syncs after the step."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 4), process_group=ctx.group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for sync_on_step in (True, False):
        counts = COUNTS[ctx.world][0]
        metric = MulticlassAccuracy(num_classes=4, dist_sync_on_step=sync_on_step,
                                    process_group=ctx.group)
        steps = []
        with Join([model, metric]) as join:
            for i in range(counts[ctx.rank]):
                x, y = batch("multiclass", ctx.rank, i)
                logits = model(x)
                nn.functional.cross_entropy(logits, y).backward()
                optimizer.step()
                optimizer.zero_grad()
                # The metric scores the given logits: the reference uses the same.
                steps.append(value(metric(x, y)))
        assert join.state is not None
        out[str(sync_on_step)] = {
            "heartbeats": join.state.heartbeats, "inputs": counts[ctx.rank],
            "steps": steps, "final": value(metric.compute()),
            **references("accuracy", counts, ctx.rank, sync_on_step),
        }
    return out


@scenario
def heartbeat_per_forward(ctx: Ctx) -> Any:
    """The metric alone is the first joinable: one heartbeat per forward."""
    counts = COUNTS[ctx.world][0]
    out = {"inputs": counts[ctx.rank]}
    for name, metric in [
        ("metric", BinaryAccuracy(dist_sync_on_step=True, process_group=ctx.group)),
        ("collection", _collection(dist_sync_on_step=True, process_group=ctx.group)),
    ]:
        with Join([metric]) as join:
            for i in range(counts[ctx.rank]):
                metric(*batch("binary", ctx.rank, i))
        assert join.state is not None
        out[name] = join.state.heartbeats
    return out


# -- errors, raised before any collective can mismatch ------------------------------------


@scenario
def errors(ctx: Ctx) -> Any:
    out: dict[str, str] = {}
    counts = COUNTS[ctx.world][0]
    # compute() inside the Join.
    metric = MeanSquaredError(dist_sync_on_step=False, process_group=ctx.group)
    try:
        with Join([metric]):
            for i in range(counts[ctx.rank]):
                metric(*batch("regression", ctx.rank, i))
            metric.compute()
    except (LocalProtocolError, PeerFailure) as exc:  # the first to fail, or its peers
        out["compute_inside"] = str(exc)
    # After the failed Join the metric syncs again (the peers got as far as they got).
    out["after"] = value(metric.compute())

    class ListNone(Metric):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.add_state("x", default=[], dist_reduce_fx=None)

        def update(self, x: torch.Tensor) -> None:
            self.x.append(x)

        def compute(self) -> Any:
            return torch.cat(self.x).sum()

    try:
        Join([ListNone(dist_sync_on_step=True, process_group=ctx.group)])
    except ValueError as exc:
        out["list_none"] = str(exc)
    # A metric over another group than DDP's.
    other = dist.new_group(backend="gloo", timeout=SCENARIO_TIMEOUT)
    model = DDP(nn.Linear(2, 2), process_group=ctx.group)
    try:
        Join([model, BinaryAccuracy(dist_sync_on_step=True, process_group=other)])
    except ValueError as exc:
        out["other_group"] = str(exc)
    # The same metric twice.
    acc = BinaryAccuracy(process_group=ctx.group)
    try:
        Join([acc, MetricCollection([acc])])
    except ValueError as exc:
        out["twice"] = str(exc)
    # A compositional metric whose parts sync per step.
    composed = BinaryAccuracy(dist_sync_on_step=True, process_group=ctx.group) + 1
    try:
        Join([composed])
    except ValueError as exc:
        out["composed"] = str(exc)
    return out


# -- torchmetrics' own distributed tests, ported (tests/unittests/bases/test_ddp.py and
# -- tests/unittests/_helpers/testers.py _class_test), with uneven splits under Join ------


class DummyMetricSum(Metric):
    """torchmetrics' tests' DummyMetricSum: a sum state."""

    full_state_update = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("x", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, x: torch.Tensor) -> None:
        self.x += x

    def compute(self) -> torch.Tensor:
        return self.x


class DummyListMetric(Metric):
    """torchmetrics' tests' DummyListMetric: a cat list state."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("x", [], dist_reduce_fx="cat")

    def update(self, x: torch.Tensor) -> None:
        self.x.append(x)

    def compute(self) -> torch.Tensor:
        x = self.x  # a list here, one tensor once synced
        if isinstance(x, list):
            return torch.cat(x) if x else torch.tensor([])
        return x


class DummyMetricSumCount(Metric):
    """test_state_dict_is_synced's metric: sum and count states."""

    full_state_update = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("x", torch.tensor(0), dist_reduce_fx=torch.sum)
        self.add_state("c", torch.tensor(0), dist_reduce_fx=torch.sum)

    def update(self, x: int) -> None:
        self.x += x
        self.c += 1

    def compute(self) -> torch.Tensor:
        return self.x // self.c


@scenario
def ported_ddp_sum_cat(ctx: Ctx) -> Any:
    """_test_ddp_sum / _test_ddp_cat / _test_ddp_sum_cat, per step under Join, uneven:
    rank r runs r + 2 steps adding tensor(1) and appending tensor([r])."""
    r, world = ctx.rank, ctx.world
    total = DummyMetricSum(dist_sync_on_step=True, process_group=ctx.group)
    listed = DummyListMetric(dist_sync_on_step=True, process_group=ctx.group)
    steps = []
    with Join([total, listed]):
        for _ in range(r + 2):
            s = total(torch.tensor(1.0))
            c = listed(torch.tensor([float(r)]))
            steps.append({"sum": value(s), "cat": sorted(as_list(c))})
    expected = [{"sum": float(sum(1 for q in range(world) if q + 2 > i)),
                 "cat": sorted(float(q) for q in range(world) if q + 2 > i)}
                for i in range(r + 2)]
    final = {"sum": value(total.compute()), "cat": sorted(as_list(listed.compute()))}
    final_ref = {"sum": float(sum(q + 2 for q in range(world))),
                 "cat": sorted(float(q) for q in range(world) for _ in range(q + 2))}
    return {"steps": steps, "expected": expected, "final": final, "final_ref": final_ref}


@scenario
def ported_empty_and_unequal_lists(ctx: Ctx) -> Any:
    """_test_sync_with_empty_lists / _test_sync_with_unequal_size_lists under Join:
    rank 0 appends zeros(2) per step for 2 steps, the others have no data at all;
    then the multidimensional uneven gather (_test_ddp_gather_uneven_tensors_multidim)
    as a per-step state of shape (rank + 1, 2)."""
    r = ctx.rank
    listed = DummyListMetric(dist_sync_on_step=True, process_group=ctx.group)
    steps = []
    with Join([listed]):
        for _ in range(2 if r == 0 else 0):
            steps.append(value(listed(torch.zeros(2))))
    final = value(listed.compute())
    multi = DummyListMetric(dist_sync_on_step=True, process_group=ctx.group)
    shapes = []
    with Join([multi]):
        for _ in range(r + 1):
            shapes.append(list(multi(torch.ones(r + 1, 2)).shape))
    return {"steps": steps, "final": final, "shapes": shapes,
            "multi_final": list(multi.compute().shape)}


@scenario
def ported_state_dict_is_synced(ctx: Ctx) -> Any:
    """_test_state_dict_is_synced: forward per step under Join (rank r runs 3 + r steps
    with x = step), then sync / unsync / sync_context after the Join see the union."""
    r, world = ctx.rank, ctx.world
    metric = DummyMetricSumCount(dist_sync_on_step=True, process_group=ctx.group)
    metric.persistent(True)
    with Join([metric]):
        for i in range(3 + r):
            metric(i)
    local_state = (int(metric.x), int(metric.c))
    metric.sync()
    synced = (int(metric.x), int(metric.c), int(metric.state_dict()["x"]))
    metric.unsync()
    with metric.sync_context():
        in_context = (int(metric.x), int(metric.c))
    after = (int(metric.x), int(metric.c))
    expect_x = sum(sum(range(3 + q)) for q in range(world))
    expect_c = sum(3 + q for q in range(world))
    return {"local": local_state, "local_ref": (sum(range(3 + r)), 3 + r),
            "synced": synced, "synced_ref": (expect_x, expect_c, expect_x),
            "in_context": in_context, "after": after}


@scenario
def ported_non_contiguous_and_autograd(ctx: Ctx) -> Any:
    """_test_non_contiguous_tensors (a non-contiguous cat state, per step under Join)
    and _test_ddp_gather_all_autograd_*: gather_states keeps this rank's graph."""
    r = ctx.rank
    listed = DummyListMetric(dist_sync_on_step=True, process_group=ctx.group)
    with Join([listed]):
        for i in range(1 + r):
            listed(torch.arange(10.0 * (i + 1), 10.0 * (i + 1) + 10).reshape(5, 2)[:, 0])
    x = (r + 1) * torch.ones(r + 1, 2, requires_grad=True)
    a = torch.tensor(3.0)
    y = a * x + 1
    rows = metrics_adapter.gather_states([y], 1, ctx.group, torch.device("cpu"))[0]
    grad = torch.autograd.grad(rows[r].sum(), x)[0]
    return {"cat": sorted(as_list(listed.compute())),
            "cat_ref": sorted(float(v) for q in range(ctx.world) for i in range(1 + q)
                              for v in range(10 * (i + 1), 10 * (i + 1) + 10, 2)),
            "shapes": [list(t.shape) for t in rows], "grad_ok": bool((grad == 3).all())}


@scenario
def ported_class_test(ctx: Ctx) -> Any:
    """_class_test's ddp=True path with an uneven split: batches dealt round-robin
    (``range(rank, num_batches, world_size)``) from 2 * world + 1 batches, so rank 0
    has one more; rank 0 checks each step against the union of that step's batches."""
    world, r = ctx.world, ctx.rank
    num_batches = 2 * world + 1
    out = {}
    for name in ("accuracy", "mse", "auroc"):
        kind, make = METRICS[name]
        data = [batch(kind, i % world, i // world, seed=7) for i in range(num_batches)]
        for sync_on_step in (True, False):
            metric = make(dist_sync_on_step=sync_on_step, process_group=ctx.group)
            steps, refs = [], []
            with Join([metric]):
                for i in range(r, num_batches, world):
                    steps.append(value(metric(*data[i])))
                    ref = local(make)
                    group = range(i - r, min(i - r + world, num_batches)) if sync_on_step \
                        else [i]
                    for j in group:
                        ref.update(*data[j])
                    refs.append(value(ref.compute()))
            final_ref = local(make)
            for d in data:
                final_ref.update(*d)
            out[f"{name}/{sync_on_step}"] = {
                "steps": steps, "ref_steps": refs, "final": value(metric.compute()),
                "ref_final": value(final_ref.compute()),
            }
    return out


@scenario
def ported_compositional(ctx: Ctx) -> Any:
    """_test_ddp_compositional_tensor: a CompositionalMetric (sync at compute) under
    Join with uneven updates; compute() after the Join is the sum over ranks, twice."""
    # (clone() deep-copies, and a process group cannot be copied: two instances.)
    composed = (DummyMetricSum(process_group=ctx.group)
                + DummyMetricSum(process_group=ctx.group))
    with Join([composed]):
        for _ in range(ctx.rank + 1):
            composed.update(torch.tensor(1.0))
    return {"value": value(composed.compute()),
            "ref": 2.0 * sum(q + 1 for q in range(ctx.world))}


# -- the naive way (no Join), launched apart ---------------------------------------------


def naive_mse(ctx: Ctx) -> Any:
    """3 vs 5 batches, dist_sync_on_step=True, no Join: rank 0's compute() meets rank
    1's fourth per-step sync (a wrong number, or gloo's mismatch error), rank 1 then
    waits for a peer that has left (a timeout, or an abort)."""
    counts = [3, 5]
    out = run_loop(ctx, "mse", counts, True, join=False)
    return {"final": out["final"], "ref_final": out["ref_final"]}


def naive_auroc_empty(ctx: Ctx) -> Any:
    """0 vs 4 batches, BinaryAUROC syncing at compute(), no Join: rank 0's empty target
    list is gathered as float32, rank 1's as int64: gloo's size check aborts a process
    (inside Join the post hook aligns the empty list; the matrix covers that case)."""
    out = run_loop(ctx, "auroc", [0, 4], False, join=False)
    return {"final": out["final"], "ref_final": out["ref_final"]}


NAIVE = {"naive_mse": naive_mse, "naive_auroc_empty": naive_auroc_empty}


# -- the runner ------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    rank, world, store, out_dir, *names = argv
    ctx = Ctx(int(rank), int(world), None)
    out = Path(out_dir) / f"rank{rank}.jsonl"
    timeout = SCENARIO_TIMEOUT
    if set(names) <= set(NAIVE):
        timeout = datetime.timedelta(seconds=8)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=ctx.rank,
                            world_size=ctx.world, timeout=timeout)
    for name in names:
        with recording(out, name) as record:
            ctx.group = dist.new_group(backend="gloo", timeout=timeout)
            run = NAIVE.get(name) or SCENARIOS[name]
            record["result"] = run(ctx)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
