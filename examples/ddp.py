"""The Join tutorial's DistributedDataParallel example, on joinkit's Join.

Rank r has 5 + r inputs; inside ``Join([model])`` the rank that runs out first
shadows DDP's collectives until the other finishes. Run it with

    torchrun --nproc-per-node 2 examples/ddp.py
    mpirun -n 2 python examples/ddp.py

It uses gloo on the CPU, or nccl and ``cuda:LOCAL_RANK`` when there is a CUDA
device per rank, and prints (in either order):

    Rank 0 has exhausted all 5 of its inputs!
    Rank 1 has exhausted all 6 of its inputs!
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from joinkit import Join, backends

NUM_INPUTS = 5


def setup() -> tuple[int, torch.device]:
    """Start torch.distributed under torchrun, mpirun or srun; return rank and device.

    ``backends.init_torch`` picks gloo on the CPU, or nccl and ``cuda:LOCAL_RANK``
    when there is a CUDA device per rank; under mpirun it takes rank and world
    size from MPI.
    """
    group = backends.init_torch()
    return group.rank, group.device


def wrap(module: torch.nn.Module, device: torch.device) -> DDP:
    """``module`` on ``device`` inside DDP."""
    module = module.to(device)
    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)


def main() -> None:
    rank, device = setup()
    model = wrap(torch.nn.Linear(1, 1), device)
    # Rank 1 gets one more input than rank 0
    inputs = [torch.tensor([1]).float().to(device) for _ in range(NUM_INPUTS + rank)]

    num_inputs = 0
    with Join([model]):
        for input in inputs:
            num_inputs += 1
            loss = model(input).sum()
            loss.backward()

    # One write per line, so the two ranks' lines never interleave.
    print(f"Rank {rank} has exhausted all {num_inputs} of its inputs!\n", end="", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
