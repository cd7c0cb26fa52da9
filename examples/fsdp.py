"""FSDP2 (``fully_shard``) with uneven inputs, on joinkit's Join.

The same loop as DDP's: ``Join([model, optimizer])``. The rank that runs out
first shadows the other's iterations by replaying the model's forward and
backward on an empty batch (so every parameter all-gather and gradient
reduce-scatter is matched, with zero contributions), and steps its own
parameter shards with the active rank's reduced gradients. Run it with

    torchrun --nproc-per-node 2 examples/fsdp.py
    mpirun -n 2 python examples/fsdp.py

It uses gloo on the CPU, or nccl and ``cuda:LOCAL_RANK`` when there is a CUDA
device per rank, and prints (in either order):

    Rank 0 has exhausted all 5 of its inputs!
    Rank 1 has exhausted all 6 of its inputs!
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ddp import NUM_INPUTS, setup  # the tutorial's setup, shared
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from joinkit import Join


def main() -> None:
    rank, device = setup()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    ).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)  # one unit per layer...
    fully_shard(model, mesh=mesh)  # ...inside the root unit
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # Rank 1 gets one more input than rank 0
    inputs = [torch.randn(8, 16, device=device) for _ in range(NUM_INPUTS + rank)]

    num_inputs = 0
    with Join([model, optimizer]):
        for input in inputs:
            num_inputs += 1
            optimizer.zero_grad()
            model(input).square().mean().backward()
            optimizer.step()

    # One write per line, so the two ranks' lines never interleave.
    print(f"Rank {rank} has exhausted all {num_inputs} of its inputs!\n", end="", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
