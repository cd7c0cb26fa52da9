"""Exact shards under Join with DDP, on real gloo ranks (``test_data.py``).

Run as ``torch_scenarios.py`` is::

    python data_scenarios.py RANK WORLD_SIZE STORE_FILE OUT_DIR NAME [NAME ...]

Every scenario trains a float64 DDP model under ``joinkit.Join([model])`` over
one kind of exact shard of 13 samples (``ShardSampler`` over two epochs and
with DataLoader workers, Hugging Face's ``split_dataset_by_node``, a
webdataset-style list of tar shards of uneven sizes written by the test into
``OUT_DIR/shards``). Each rank records the ids of its batches, in order, and
its final parameters; after the loop the ranks gather every rank's batches
and each computes :func:`simulate_ddp`, the same DDP steps in one process, as
the reference. The test asserts every sample was consumed exactly once, the
parameters are identical on every rank and equal the reference.
"""

from __future__ import annotations

import datetime
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support import Ctx, recording, scenario_registry
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, get_worker_info

from joinkit import Join
from joinkit.adapters.torch.data import ShardedIterable, ShardSampler

SCENARIO_TIMEOUT = datetime.timedelta(seconds=45)  # generous: CI machines are loaded
SAMPLES = 13
LR = 0.1
SCENARIOS, scenario = scenario_registry()
OUT = Path(".")  # set by main: where the test wrote the tar shards


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``i``'s input and target, the same in every process."""
    x = torch.tensor([math.sin(i), math.cos(i), i / SAMPLES], dtype=torch.float64)
    return x, torch.tensor([x.sum().item() * 0.5 + 1.0], dtype=torch.float64)


class Samples(Dataset[dict[str, Any]]):
    def __init__(self, n: int = SAMPLES) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        x, y = sample(i)
        return {"id": i, "x": x, "y": y}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1).double()


def loss_of(module: nn.Module, ids: list[int]) -> torch.Tensor:
    xs, ys = zip(*(sample(i) for i in ids), strict=True)
    return ((module(torch.stack(xs)) - torch.stack(ys)) ** 2).mean()


def flat(module: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()


def simulate_ddp(
    epochs: list[list[list[list[int]]]], world: int, divide: bool = True
) -> list[float]:
    """DDP with Join in one process, plain SGD: ``epochs[e][rank]`` is the
    list of batches (sample ids) rank ``rank`` ran in epoch ``e``.

    In iteration ``i`` the ranks with more than ``i`` batches are active; DDP
    sums their gradients and divides by the world size (a joined rank adds
    zero), or by the number of active ranks where ``divide`` is false
    (``Join(..., divide_by_initial_world_size=False)``); every active replica
    steps with that average, so they stay equal, and at the end of the Join
    the last joiner's parameters are broadcast.
    """
    reference = model()
    optim = torch.optim.SGD(reference.parameters(), lr=LR)
    for per_rank in epochs:
        for i in range(max((len(b) for b in per_rank), default=0)):
            grads = [torch.zeros_like(p) for p in reference.parameters()]
            active = sum(i < len(batches) for batches in per_rank)
            for batches in per_rank:
                if i < len(batches):
                    reference.zero_grad()
                    loss_of(reference, batches[i]).backward()
                    for g, p in zip(grads, reference.parameters(), strict=True):
                        g += p.grad
            for g, p in zip(grads, reference.parameters(), strict=True):
                p.grad = g / (world if divide else active)
            optim.step()
    return flat(reference)


def train(
    ctx: Ctx, loaders: list[Any], sampler: ShardSampler | None = None, divide: bool = True
) -> dict[str, Any]:
    """One Join per loader (an epoch each, ``sampler.set_epoch(epoch)`` first);
    return every rank's batches per epoch, this rank's parameters and the
    single-process reference."""
    ddp = DDP(model(), process_group=ctx.group)
    optim = torch.optim.SGD(ddp.parameters(), lr=LR)
    mine: list[list[list[int]]] = []
    workers: set[int] = set()
    for epoch, loader in enumerate(loaders):
        if sampler is not None:
            sampler.set_epoch(epoch)
        batches: list[list[int]] = []
        with Join([ddp], divide_by_initial_world_size=divide):
            for batch in loader:
                ids = [int(i) for i in batch["id"]]
                batches.append(ids)
                workers.update(int(w) for w in batch.get("worker", []))
                optim.zero_grad()
                out = ddp(batch["x"])
                ((out - batch["y"]) ** 2).mean().backward()
                optim.step()
        mine.append(batches)
    gathered: list[Any] = [None] * ctx.world
    dist.all_gather_object(gathered, mine, group=ctx.group)
    epochs = [[gathered[r][e] for r in range(ctx.world)] for e in range(len(loaders))]
    return {
        "epochs": epochs,
        "params": flat(ddp.module),
        "reference": simulate_ddp(epochs, ctx.world, divide),
        # The other divisor's reference: the shards are uneven enough to tell them apart.
        "other_divisor": simulate_ddp(epochs, ctx.world, not divide),
        "workers": sorted(workers),
    }


@scenario
def ddp_shard_sampler(ctx: Ctx) -> Any:
    """Two epochs, reshuffled by ``set_epoch``; rank and world from torch.distributed."""
    sampler = ShardSampler(Samples(), seed=7)
    loader = DataLoader(Samples(), batch_size=2, sampler=sampler)
    return {**train(ctx, [loader, loader], sampler), "length": len(sampler)}


@scenario
def ddp_shard_sampler_active_ranks(ctx: Ctx) -> Any:
    """``divide_by_initial_world_size=False``: gradients averaged over the active ranks."""
    sampler = ShardSampler(Samples(), seed=11)
    loader = DataLoader(Samples(), batch_size=2, sampler=sampler)
    return train(ctx, [loader, loader], sampler, divide=False)


@scenario
def ddp_shard_sampler_group_workers(ctx: Ctx) -> Any:
    """``group=`` a torch ProcessGroup, two DataLoader worker processes, no shuffle,
    and a second epoch of one sample (most ranks have no batch at all)."""
    loaders = [
        DataLoader(Samples(n), batch_size=2, num_workers=2,
                   sampler=ShardSampler(Samples(n), shuffle=False, group=ctx.group))
        for n in (SAMPLES, 1)
    ]
    return train(ctx, loaders)


@scenario
def ddp_hf_split_dataset_by_node(ctx: Ctx) -> Any:
    """Hugging Face's own split of an in-memory Dataset: contiguous, uneven."""
    from datasets import Dataset as HFDataset
    from datasets.distributed import split_dataset_by_node

    rows = [Samples()[i] for i in range(SAMPLES)]
    table = HFDataset.from_dict({
        "id": [r["id"] for r in rows],
        "x": [r["x"].tolist() for r in rows],
        "y": [r["y"].tolist() for r in rows],
    })
    shard = split_dataset_by_node(table, rank=ctx.rank, world_size=ctx.world)
    shard = shard.with_format("torch", dtype=torch.float64)
    return train(ctx, [DataLoader(shard, batch_size=2)])


def read_shard(path: str) -> Iterator[dict[str, Any]]:
    """The samples of one webdataset-style tar shard, read with webdataset."""
    import webdataset as wds

    info = get_worker_info()
    for record in wds.tarfile_to_samples()(iter([{"url": path}])):
        i = int(record["id"])
        x, y = sample(i)
        yield {"id": i, "x": x, "y": y, "worker": -1 if info is None else info.id}


@scenario
def ddp_webdataset_shards(ctx: Ctx) -> Any:
    """Uneven tar shards over rank x 2 DataLoader workers: each shard read once."""
    shards = sorted(str(p) for p in (OUT / "shards").glob("*.tar"))
    dataset = ShardedIterable(shards, expand=read_shard)
    return train(ctx, [DataLoader(dataset, batch_size=2, num_workers=2)])


def main(argv: list[str]) -> None:
    global OUT
    rank, world, store, out_dir, *names = argv
    OUT = Path(out_dir)
    ctx = Ctx(int(rank), int(world), None)
    out = OUT / f"rank{rank}.jsonl"
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=ctx.rank, world_size=ctx.world,
        timeout=SCENARIO_TIMEOUT,
    )
    for name in names:
        with recording(out, name) as record:
            ctx.group = dist.new_group(backend="gloo", timeout=SCENARIO_TIMEOUT)
            record["result"] = SCENARIOS[name](ctx)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
