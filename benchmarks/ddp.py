"""A small DDP MLP on gloo: no Join, torch's Join, joinkit's Join.

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp.py [iterations [repeats]]
    mpirun -n 2 python benchmarks/ddp.py [iterations [repeats]]

The model is an MLP 64-256-1 (ReLU) in ``DistributedDataParallel`` on the CPU,
trained with SGD on a fixed batch of 32; an iteration is forward, MSE loss,
backward and the optimizer step. Under mpirun, torch.distributed (gloo) is
initialised by ``backends.init_torch()``. Variants, each with its own model:

- ``no Join``: plain DDP; ``no Join, again``: the same, a second model (an
  A/A pair: its ratio to ``no Join`` is the run's own scatter);
- ``no Join, Python comm hook``: plain DDP with torch's own Python
  ``allreduce_hook`` (``ddp_comm_hooks.default_hooks``) registered: what any
  comm hook written in Python costs here, the floor of a heartbeat carried by
  one;
- ``torch Join``: inside ``torch.distributed.algorithms.join.Join`` (a
  heartbeat and a gradient-sync check per iteration);
- ``joinkit Join``: inside joinkit's Join, its default path for this model
  (``join.heartbeat == "round"``): the heartbeat rides in DDP's gradient
  all-reduce, one more element per bucket; no collective of joinkit's own per
  iteration;
- ``joinkit, one collective``: ``Join([ddp], heartbeat_in_gradients=False)``,
  the path before issue 34 (``"fused"``): the heartbeat rides in DDP's
  gradient-sync check, one small collective per iteration;
- ``joinkit, torch-compatible``: ``Join([ddp], check_agreement=False)``, the
  wire format of torch's Join (a heartbeat and a check; ``"classic"``).

The *drain* variants give rank 0 no inputs, so it shadows every iteration of
the others; their time is the whole ``with`` block per iteration of the ranks
that have inputs (the slowest rank decides).
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


def model() -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    ddp = DDP(module)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3)


def main() -> None:
    iterations = _bench.int_arg(1, 300)
    repeats = _bench.int_arg(2, 15)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the drain's input-skew warning, by design
    launcher = backends.detect_launcher() or "?"
    backends.init_torch("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 64, generator=generator)
    y = torch.randn(32, 1, generator=generator)
    slowest = _bench.slowest_rank()

    def train(ddp: DDP, opt: torch.optim.Optimizer, n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()

    def plain(python_hook: bool = False) -> Callable[[int], None]:
        ddp, opt = model()
        if python_hook:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return lambda n: train(ddp, opt, n)

    def inside(make_join: Callable[[DDP], Any], drain: bool = False) -> Callable[[int], float]:
        ddp, opt = model()

        def loop(n: int) -> float:
            mine = 0 if drain and rank == 0 else n
            start = time.perf_counter()
            with make_join(ddp):
                inner = time.perf_counter()
                train(ddp, opt, mine)
                inner = time.perf_counter() - inner
            return time.perf_counter() - start if drain else inner
        return loop

    def torch_join_of(ddp: DDP) -> Any:
        return torch_join.Join([ddp])

    def joinkit_join_of(ddp: DDP) -> Any:
        return Join([ddp])

    def one_collective_join_of(ddp: DDP) -> Any:
        return Join([ddp], heartbeat_in_gradients=False)

    def compatible_join_of(ddp: DDP) -> Any:
        return Join([ddp], check_agreement=False)

    # Each variant takes the path it names (the report records it).
    for make, path in ((joinkit_join_of, "round"), (one_collective_join_of, "fused"),
                       (compatible_join_of, "classic")):
        ddp, _ = model()
        with make(ddp) as join:
            pass
        assert join.heartbeat == path, (join.heartbeat, path)

    info = {"ranks": world, "launcher": launcher, "iterations": iterations,
            "repeats": repeats}
    times = _bench.timed({
        "no Join": plain(),
        "no Join, again": plain(),
        "no Join, Python comm hook": plain(python_hook=True),
        "torch Join": inside(torch_join_of),
        "joinkit Join": inside(joinkit_join_of),
        "joinkit, one collective": inside(one_collective_join_of),
        "joinkit, torch-compatible": inside(compatible_join_of),
    }, iterations, repeats, slowest, dist.barrier)
    if rank == 0:
        _bench.report(f"DDP MLP 64-256-1, batch 32, gloo ({launcher})", times, [
            ("joinkit Join", "no Join", 1.03),
            ("no Join, again", "no Join", None),
            ("no Join, Python comm hook", "no Join", None),
            ("joinkit Join", "no Join, Python comm hook", None),
            ("joinkit, one collective", "no Join", None),
            ("joinkit Join", "joinkit, one collective", None),
            ("torch Join", "no Join", None),
            ("joinkit Join", "torch Join", None),
            ("joinkit, torch-compatible", "no Join", None),
            ("joinkit, torch-compatible", "torch Join", None),
        ], info)
    times = _bench.timed({
        "no Join (all ranks active)": plain(),
        "drain: torch Join": inside(torch_join_of, True),
        "drain: joinkit Join": inside(joinkit_join_of, True),
        "drain: joinkit, one collective": inside(one_collective_join_of, True),
        "drain: joinkit, torch-compatible": inside(compatible_join_of, True),
    }, iterations, repeats, slowest, dist.barrier)
    if rank == 0:
        _bench.report(f"DDP drain (rank 0 has no inputs), gloo ({launcher})", times, [
            ("drain: joinkit Join", "drain: torch Join", None),
            ("drain: joinkit, one collective", "drain: torch Join", None),
            ("drain: joinkit, torch-compatible", "drain: torch Join", None),
            ("drain: torch Join", "no Join (all ranks active)", None),
        ], info)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
