"""Elastic finish under torchrun's machinery, every sample once: ``python -m joinkit run``.

Run it with torchrun's arguments (the ``joinkit run`` console script is the same)::

    python -m joinkit run --standalone --nproc-per-node 3 examples/elastic_run.py

DDP on gloo reads 30 samples through ``ShardSampler(take_over=True)`` in
``Join([model], on_rank_loss="finish")``. Rank 1 SIGKILLs itself before its
third batch. torchrun's agent would now stop ranks 0 and 2; joinkit run's
agent keeps them (rank 1 had entered a finish-mode Join), they rebuild their
group over the agent's store, finish the epoch's pass and then, in a second
pass, train the samples rank 1 did not consume. Rank 0 prints::

    rank 1 consumed 4 samples; its other 6 went to ranks 0, 2
    every sample of the epoch trained once: True

and the launcher exits 0 after naming the lost rank on standard error
(``joinkit run: lost rank(s) 1 (SIGKILL, exit code -9); the survivors finished``).
"""

from __future__ import annotations

import os
import signal
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from joinkit import Join
from joinkit.adapters.torch.data import ShardSampler

SAMPLES = 30


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    samples = list(range(SAMPLES))
    sampler = ShardSampler(samples, seed=0, batch_size=2, take_over=True)
    loader = DataLoader(samples, sampler=sampler, batch_size=2)
    trained: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loss warning; the sampler's report says it
        for _ in sampler.passes():
            # The agent's store outlives every worker: any rank may die.
            with Join([model], on_rank_loss="finish"):
                for index, ids in enumerate(loader):
                    if rank == 1 and index == 2:
                        os.kill(os.getpid(), signal.SIGKILL)
                    x = ids.float().unsqueeze(1)
                    optimizer.zero_grad()
                    torch.nn.functional.mse_loss(model(x), x).backward()
                    optimizer.step()
                    trained += ids.tolist()
    # The survivors' ids, over the group DDP now runs on (the survivors').
    everyone: list[list[int]] = [[] for _ in range(model.process_group.size())]
    dist.all_gather_object(everyone, trained, group=model.process_group)
    if rank == 0:
        (take,) = sampler.take_overs
        moved = sum(len(ids) for ids in take.moved.values())
        print(f"rank {take.rank} consumed {len(take.consumed)} samples; its other {moved} "
              f"went to ranks {', '.join(map(str, sorted(take.moved)))}")
        seen = sorted([i for ids in everyone for i in ids] + list(take.consumed))
        print(f"every sample of the epoch trained once: {seen == samples}")


if __name__ == "__main__":
    main()
