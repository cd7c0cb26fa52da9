"""The Join tutorial's DDP + ZeroRedundancyOptimizer example, on joinkit's Join.

Both the model and the sharded optimizer go into one ``Join``: a joined rank
shadows DDP's gradient all-reduces and still steps (and broadcasts) its shard of
the parameters. Run it with

    torchrun --nproc-per-node 2 examples/ddp_zero.py
    mpirun -n 2 python examples/ddp_zero.py

and it prints (in either order):

    Rank 0 has exhausted all 5 of its inputs!
    Rank 1 has exhausted all 6 of its inputs!
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ddp import NUM_INPUTS, setup, wrap  # the tutorial's setup, shared
from torch.distributed.optim import ZeroRedundancyOptimizer as ZeRO
from torch.optim import Adam

from joinkit import Join


def main() -> None:
    rank, device = setup()
    model = wrap(torch.nn.Linear(1, 1), device)
    optim = ZeRO(model.parameters(), Adam, lr=0.01)
    # Rank 1 gets one more input than rank 0
    inputs = [torch.tensor([1]).float().to(device) for _ in range(NUM_INPUTS + rank)]

    num_inputs = 0
    # Pass both `model` and `optim` into `Join()`
    with Join([model, optim]):
        for input in inputs:
            num_inputs += 1
            loss = model(input).sum()
            loss.backward()
            optim.step()

    # One write per line, so the two ranks' lines never interleave.
    print(f"Rank {rank} has exhausted all {num_inputs} of its inputs!\n", end="", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
