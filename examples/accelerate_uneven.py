"""Hugging Face Accelerate with uneven data per process, on joinkit's Join.

``Accelerator.join_uneven_inputs`` does nothing on CPU processes or under
FSDP; ``joinkit.adapters.accelerate.join_uneven_inputs`` takes the same
prepared objects and works there. The dataset has 7 batches; with
``even_batches=False`` process 0 gets 4 and process 1 gets 3 (no padding, no
sample seen twice), and the process that runs out first shadows the other's
all-reduces. Run it with either launcher::

    torchrun --nproc-per-node 2 examples/accelerate_uneven.py
    accelerate launch --cpu --num_processes 2 examples/accelerate_uneven.py

It prints (in either order)::

    Process 0 trained on all 4 of its batches!
    Process 1 trained on all 3 of its batches!
"""

from __future__ import annotations

import torch
from accelerate import Accelerator

from joinkit.adapters.accelerate import join_uneven_inputs


def main() -> None:
    # cpu=True on a machine without GPUs: else Accelerate sees one process each.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(14, 3)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    batches = 0
    with join_uneven_inputs(accelerator, [model, optimizer], even_batches=False):
        for inputs, targets in loader:
            optimizer.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            batches += 1

    # One write per line, so the two processes' lines never interleave.
    print(f"Process {accelerator.process_index} trained on all {batches} of its batches!\n",
          end="", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
