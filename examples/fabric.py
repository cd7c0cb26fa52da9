"""Lightning Fabric with uneven inputs: ``Join([model, optimizer])`` on ``fabric.setup``'s objects.

Rank r has ``5 + 3 * r`` batches. The model and optimizer from ``fabric.setup``
go into the Join as they are; ``fabric.backward`` works inside. After two
epochs every rank holds the same parameters and optimizer state (Adam), equal
to a single process that, at each step, averages the gradients of the ranks
that still had a batch (DDP divides by the world size). Run it with Fabric's own
launcher (2 CPU processes, gloo) or under torchrun:

    python examples/fabric.py
    torchrun --nproc-per-node 2 examples/fabric.py

It prints, from each rank (in either order):

    Rank 0 trained on 10 batches in 2 epochs; parameters checksum 1.234567
    Rank 1 trained on 16 batches in 2 epochs; parameters checksum 1.234567
"""

from __future__ import annotations

import os

import torch
from lightning_fabric import Fabric

from joinkit import Join

EPOCHS = 2


def batches(rank: int, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches of ``epoch``: ``5 + 3 * rank`` of them."""
    g = torch.Generator().manual_seed(1000 * epoch + rank)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g))
            for _ in range(5 + 3 * rank)]


def main() -> None:
    # Fabric's own launcher, unless a launcher (torchrun) already started the ranks.
    launched = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    devices = int(os.environ["WORLD_SIZE"]) if launched else 2
    fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    trained = 0
    for epoch in range(EPOCHS):
        with Join([model, optimizer]):  # one Join per epoch: an epoch ends on every rank at once
            for x, y in batches(fabric.global_rank, epoch):
                loss = torch.nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                trained += 1
    checksum = sum(float(p.detach().sum()) for p in model.parameters())
    # One write per line, so the ranks' lines never interleave.
    print(f"Rank {fabric.global_rank} trained on {trained} batches in {EPOCHS} epochs; "
          f"parameters checksum {checksum:.6f}\n", end="", flush=True)


if __name__ == "__main__":
    main()
