"""FSDP2 (``fully_shard``) on gloo: alone, and inside joinkit's Join.

    torchrun --standalone --nproc-per-node 2 benchmarks/fsdp.py [iterations [repeats]]
    mpirun -n 2 python benchmarks/fsdp.py [iterations [repeats]]

The model is an MLP 128-512-512-1 (ReLU) on the CPU, each Linear its own
``fully_shard`` unit inside the root unit, trained with AdamW on a fixed batch
of 32; an iteration is ``zero_grad``, forward, MSE loss, backward and the step
(per iteration: 4 parameter all-gathers in forward, 2 in backward, 3 gradient
reduce-scatters). Variants, each with its own model:

- ``FSDP alone``: no Join;
- ``joinkit Join``: ``Join([model, optimizer])`` on even inputs (the step check,
  one 1-element all-reduce per iteration carrying the heartbeat, and the
  forward hook that sends it);
- ``drain: joinkit Join``: rank 0 has no inputs, so every iteration of the
  other ranks is a shadow round for it (the replay of forward and backward on
  an empty batch, and the optimizer step on its shards); the time is the whole
  ``with`` block per iteration of the ranks with inputs (the slowest rank
  decides). Against ``FSDP alone (all ranks active)`` it says whether a
  shadow round keeps up with an active iteration.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import _bench
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from joinkit import Join, backends


def main() -> None:
    iterations = _bench.int_arg(1, 100)
    repeats = _bench.int_arg(2, 15)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the drain's input-skew warning, by design
    launcher = backends.detect_launcher() or "?"
    backends.init_torch("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 128, generator=generator)
    y = torch.randn(32, 1, generator=generator)
    slowest = _bench.slowest_rank()

    def model() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                               nn.Linear(512, 1))
        for layer in module:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
        return module, torch.optim.AdamW(module.parameters(), lr=1e-4)

    def train(fsdp: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            nn.functional.mse_loss(fsdp(x), y).backward()
            opt.step()

    def alone() -> Callable[[int], None]:
        fsdp, opt = model()
        return lambda n: train(fsdp, opt, n)

    def inside(drain: bool = False) -> Callable[[int], float]:
        fsdp, opt = model()

        def loop(n: int) -> float:
            mine = 0 if drain and rank == 0 else n
            start = time.perf_counter()
            with Join([fsdp, opt]):
                inner = time.perf_counter()
                train(fsdp, opt, mine)
                inner = time.perf_counter() - inner
            return time.perf_counter() - start if drain else inner
        return loop

    info = {"ranks": world, "launcher": launcher, "iterations": iterations,
            "repeats": repeats}
    times = _bench.timed({
        "FSDP alone": alone(),
        "joinkit Join": inside(),
    }, iterations, repeats, slowest, dist.barrier)
    if rank == 0:
        _bench.report(f"FSDP2 MLP 128-512-512-1, batch 32, gloo ({launcher})", times, [
            ("joinkit Join", "FSDP alone", 1.03),
        ], info)
    times = _bench.timed({
        "FSDP alone (all ranks active)": alone(),
        "drain: joinkit Join": inside(drain=True),
    }, iterations, repeats, slowest, dist.barrier)
    if rank == 0:
        _bench.report(f"FSDP2 drain (rank 0 has no inputs), gloo ({launcher})", times, [
            ("drain: joinkit Join", "FSDP alone (all ranks active)", None),
        ], info)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
