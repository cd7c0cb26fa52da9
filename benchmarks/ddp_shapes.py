"""DDP models of several bucket layouts: no Join, joinkit's Join, torch's Join (issue 50).

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_shapes.py SHAPE [iterations [repeats]]
    mpirun -n 2 python benchmarks/ddp_shapes.py SHAPE [iterations [repeats]]

``benchmarks/ddp.py`` times one small bucket; users' models have many, and
large ones. Each shape (:data:`SHAPES`) is an MLP (ReLU) in
``DistributedDataParallel`` on the CPU over gloo, trained with SGD with
momentum on a fixed batch; an iteration is forward, MSE loss, backward and the
optimizer step. The number of DDP buckets (after DDP's rebuild) is checked
and reported. Variants, each with its own model:

- ``no Join`` and ``no Join, again`` (an A/A pair: its ratio is the run's own
  scatter);
- ``no Join, Python comm hook``: torch's own Python ``allreduce_hook``
  registered: what any comm hook written in Python costs here;
- ``joinkit Join``: ``Join([ddp])``, its default path for these models (the
  heartbeat rides in one bucket's all-reduce: ``join.heartbeat == "round"``);
- ``torch Join``: ``torch.distributed.algorithms.join.Join([ddp])``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import _bench
import torch
import torch.distributed as dist
import torch.distributed.algorithms.join as torch_join
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from joinkit import Join, backends

#: name -> (layer widths, batch, bucket_cap_mb, DDP buckets after the rebuild).
SHAPES: dict[str, tuple[list[int], int, float, int]] = {
    "1 bucket": ([64, 256, 1], 32, 25.0, 1),
    "2 buckets": ([128, 512, 512, 10], 64, 1.0, 2),
    "24 buckets": ([256] * 25 + [10], 64, 0.25, 24),
    "25 MB buckets": ([1448] * 7, 16, 25.0, 2),
}


def model(widths: list[int], cap: float) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    ddp = DDP(nn.Sequential(*layers[:-1]), bucket_cap_mb=cap)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4, momentum=0.9)


def main() -> None:
    shape = _bench.str_arg(1, "2 buckets")
    widths, batch, cap, buckets = SHAPES[shape]
    iterations = _bench.int_arg(2, 40)
    repeats = _bench.int_arg(3, 15)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    launcher = backends.detect_launcher() or "?"
    backends.init_torch("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, widths[0], generator=generator)
    y = torch.randn(batch, widths[-1], generator=generator)
    clock = torch.zeros(1, dtype=torch.float64)

    def slowest(seconds: float) -> float:
        clock[0] = seconds
        dist.all_reduce(clock, op=dist.ReduceOp.MAX)
        return float(clock[0])

    def train(ddp: DDP, opt: torch.optim.Optimizer, n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()

    def plain(python_hook: bool = False) -> Callable[[int], None]:
        ddp, opt = model(widths, cap)
        if python_hook:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return lambda n: train(ddp, opt, n)

    def inside(make_join: Callable[[DDP], Any]) -> Callable[[int], float]:
        ddp, opt = model(widths, cap)

        def loop(n: int) -> float:
            with make_join(ddp):
                start = time.perf_counter()
                train(ddp, opt, n)
                return time.perf_counter() - start
        return loop

    # The layout this shape promises (after DDP's rebuild), and joinkit's path.
    ddp, opt = model(widths, cap)
    with Join([ddp]) as join:
        train(ddp, opt, 2)
    assert join.heartbeat == "round", join.heartbeat
    found = len(ddp.reducer._get_zeros_like_grad_buckets())
    assert found == buckets, f"{shape}: {found} buckets, not {buckets}"
    del ddp, opt

    megabytes = sum(a * b + b for a, b in zip(widths, widths[1:], strict=False)) * 4 / 2**20
    info = {"ranks": world, "launcher": launcher, "buckets": buckets,
            "parameters (MB)": round(megabytes, 1), "batch": batch,
            "iterations": iterations, "repeats": repeats}
    times = _bench.timed({
        "no Join": plain(),
        "no Join, again": plain(),
        "no Join, Python comm hook": plain(python_hook=True),
        "joinkit Join": inside(lambda ddp: Join([ddp])),
        "torch Join": inside(lambda ddp: torch_join.Join([ddp])),
    }, iterations, repeats, slowest, dist.barrier)
    if rank == 0:
        _bench.report(f"DDP MLP, {shape}, gloo ({launcher})", times, [
            ("joinkit Join", "no Join", 1.03),
            ("no Join, again", "no Join", None),
            ("no Join, Python comm hook", "no Join", None),
            ("joinkit Join", "no Join, Python comm hook", None),
            ("torch Join", "no Join", None),
        ], info)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
