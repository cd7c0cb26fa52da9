"""Exact evaluation (exact shards, Gather, Join) versus padded evaluation.

    torchrun --standalone --nproc-per-node 2 benchmarks/eval_gather.py [epochs [repeats]]
    mpirun -n 2 python benchmarks/eval_gather.py [epochs [repeats]]

One evaluation epoch over ``SAMPLES`` samples (not a multiple of the world
size) in batches of ``BATCH``: an MLP 64-512-512-10 (ReLU) forward under
``torch.no_grad()``, the argmax, and a per-batch gather of the predictions
and labels, accumulated over the epoch. Under torchrun the group is a gloo
``TorchGroup``; under mpirun an ``MPIGroup`` (mpi4py), the tensors torch CPU
tensors on both. Variants:

- ``padded``: ``torch.utils.data.DistributedSampler``'s shards (padded by
  repeating samples, so every rank has as many batches of the same sizes)
  and a plain ``all_gather`` of each batch's predictions and labels (one
  int64 tensor of both), appended to a list and concatenated at the end:
  the usual way, which counts the repeated samples;
- ``exact``: exact shards (``range(rank, n, world)``), ``Gather(group,
  keep=True)`` alone in a ``Join``, the epoch's rows from ``collected()``
  (every sample exactly once on every rank);
- ``exact, no keep``: the same, each call's rows used and dropped;
- ``padded, raw``: the padded loop with the collective library's own
  all-gather (``torch.distributed.all_gather`` into a list of tensors, or
  mpi4py's ``Allgather`` into one array) instead of the joinkit group's, as a
  user writes it: for the record (no target);
- ``padded, raw, again``: ``padded, raw`` a second time: its ratio to the
  first (an A/A comparison, 1 but for noise) shows how far this run's
  ratios scatter on the machine (no target);
- ``padded, no model`` and ``exact, no model``: the same loops with the
  labels standing in for the predictions (no forward): what the gathering
  itself costs, for the record (no target).

A figure is the slowest rank's time for ``epochs`` epochs over the same
samples, so the ratio is per sample. Target: exact / padded <= 1.05. A
second table measures the same loops by the processes' CPU time (on a shared
machine less moved by other jobs than the wall time; under MPI, whose waits
poll, it is close to the wall time).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import _bench
import torch
from torch import nn
from torch.utils.data import DistributedSampler

from joinkit import Join, backends
from joinkit.adapters.gather import Gather

BATCH = 256
FEATURES, HIDDEN, CLASSES = 64, 512, 10
BATCHES = 40  # full batches per rank and epoch, then an uneven remainder


def main() -> None:
    epochs = _bench.int_arg(1, 5)
    repeats = _bench.int_arg(2, 15)
    torch.set_num_threads(1)
    launcher = backends.detect_launcher() or "?"
    if launcher == "mpirun" and os.environ.get("JOINKIT_EVAL_BACKEND", "mpi") == "mpi":
        from mpi4py import MPI

        from joinkit.backends.mpi import MPIGroup

        group: Any = MPIGroup(MPI.COMM_WORLD)
        name = "MPI (mpirun)"

        def raw_all_gather(t: torch.Tensor) -> list[torch.Tensor]:
            out = torch.empty((group.world_size, *t.shape), dtype=t.dtype)
            MPI.COMM_WORLD.Allgather(t.contiguous().numpy(), out.numpy())
            return list(out)
    else:
        import torch.distributed as dist

        from joinkit.backends.torch_dist import TorchGroup

        backends.init_torch("gloo")
        group = TorchGroup(dist.group.WORLD)
        name = f"gloo ({launcher})"

        def raw_all_gather(t: torch.Tensor) -> list[torch.Tensor]:
            parts = [torch.empty_like(t) for _ in range(group.world_size)]
            dist.all_gather(parts, t)
            return parts
    rank, world = group.rank, group.world_size
    samples = world * BATCHES * BATCH + 37
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (samples,), generator=generator)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                        nn.ReLU(), nn.Linear(HIDDEN, CLASSES)).eval()
    clock = torch.zeros(1, dtype=torch.float64)

    def slowest(seconds: float) -> float:
        clock[0] = seconds
        group.all_reduce(clock, op="max")
        return float(clock[0])

    def batches(shard: list[int]) -> list[torch.Tensor]:
        index = torch.tensor(shard, dtype=torch.int64)
        return [index[i:i + BATCH] for i in range(0, len(shard), BATCH)]

    padded_batches = batches(list(DistributedSampler(range(samples), num_replicas=world,
                                                     rank=rank, shuffle=False)))
    exact_batches = batches(list(range(rank, samples, world)))
    results: dict[str, int] = {}

    def model(index: torch.Tensor) -> torch.Tensor:
        return mlp(x[index]).argmax(1)

    def labels(index: torch.Tensor) -> torch.Tensor:
        return y[index]

    def padded(predict: Callable[[torch.Tensor], torch.Tensor], name: str,
               all_gather: Callable[[torch.Tensor], list[Any]] = group.all_gather
               ) -> Callable[[int], None]:
        def loop(n: int) -> None:
            for _ in range(n):
                parts = []
                with torch.no_grad():
                    for index in padded_batches:
                        pred = predict(index)
                        parts += all_gather(torch.stack([pred, y[index]], 1))
                both = torch.cat(parts)
                results[name] = int(both.shape[0])
        return loop

    def exact(predict: Callable[[torch.Tensor], torch.Tensor], keep: bool, name: str
              ) -> Callable[[int], None]:
        gather = Gather(group, keep=keep)

        def loop(n: int) -> None:
            for _ in range(n):
                seen = 0
                with Join([gather]), torch.no_grad():
                    for index in exact_batches:
                        pred, label = gather(predict(index), y[index])
                        seen += int(pred.shape[0])
                if keep:
                    pred, label = gather.collected()
                    seen = int(pred.shape[0])
                results[name] = seen
        return loop

    info = {"ranks": world, "samples": samples, "batch": BATCH, "epochs": epochs,
            "repeats": repeats, "model": f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}"}
    times = _bench.timed({
        "padded": padded(model, "padded"),
        "exact": exact(model, True, "exact"),
        "exact, no keep": exact(model, False, "exact, no keep"),
        "padded, raw": padded(model, "padded, raw", raw_all_gather),
        "padded, raw, again": padded(model, "padded, raw, again", raw_all_gather),
        "padded, no model": padded(labels, "padded, no model"),
        "exact, no model": exact(labels, True, "exact, no model"),
    }, epochs, repeats, slowest, group.barrier)
    assert results["exact"] == samples, results  # every sample exactly once
    assert results["padded"] == results["padded, raw"] == -(-samples // world) * world, results
    if rank == 0:
        _bench.report(f"Exact evaluation, {name}", times, [
            ("exact", "padded", 1.05),
            ("exact, no keep", "padded", None),
            ("exact", "padded, raw", None),
            ("padded, raw, again", "padded, raw", None),
            ("exact, no model", "padded, no model", None),
        ], info)
    # The same loops by CPU time (the process's, gloo's threads included; MPI's
    # waits poll, so there it is close to the wall time): less moved by other
    # jobs on a shared machine than the wall time is.
    times = _bench.timed({
        "padded": cpu(padded(model, "padded")),
        "exact": cpu(exact(model, True, "exact")),
        "padded, raw": cpu(padded(model, "padded, raw", raw_all_gather)),
        "padded, no model": cpu(padded(labels, "padded, no model")),
        "exact, no model": cpu(exact(labels, True, "exact, no model")),
    }, epochs, repeats, slowest, group.barrier)
    if rank == 0:
        _bench.report(f"Exact evaluation, {name}, CPU time", times, [
            ("exact", "padded", None),
            ("exact", "padded, raw", None),
            ("exact, no model", "padded, no model", None),
        ], info)


def cpu(loop: Callable[[int], None]) -> Callable[[int], float]:
    """``loop``, counting the process's CPU seconds instead of the wall time."""
    def counted(n: int) -> float:
        start = time.process_time()
        loop(n)
        return time.process_time() - start
    return counted


if __name__ == "__main__":
    main()
