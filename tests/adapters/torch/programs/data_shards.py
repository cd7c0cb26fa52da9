"""ShardSampler under a real ``mpirun``, no torch.distributed (``test_data.py``).

    mpirun -n N python data_shards.py

Each rank builds ``ShardSampler(..., group=MPI.COMM_WORLD)`` over 13 samples
(rank and world size read through joinkit's MPI backend), loads its shard with
a torch DataLoader and, under ``joinkit.Join``, all-reduces each batch's id sum
and size over an ``MPIGroup`` (joined ranks shadow with zeros). It prints one
``JOINKIT-DATA {...}`` line: its ids in order, DistributedSampler's indices for
the same seed and epoch, and the totals the all-reduces summed.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from mpi4py import MPI
from torch.utils.data import DataLoader, DistributedSampler

from joinkit import Join, Joinable, JoinHook, backends
from joinkit.adapters.torch.data import ShardSampler

SAMPLES = 13


class BatchSums(Joinable):
    """Per batch, one all-reduce of ``[sum of ids, batch size]``."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.totals = np.zeros(2)

    def __call__(self, ids: list[int]) -> None:
        Join.notify_join_context(self)
        buf = np.array([float(sum(ids)), float(len(ids))])
        self.group.all_reduce(buf)
        self.totals += buf

    def join_hook(self, **kwargs: Any) -> JoinHook:
        owner = self

        class Shadow(JoinHook):
            def main_hook(self) -> None:
                owner.group.all_reduce(np.zeros(2))

        return Shadow()

    @property
    def join_device(self) -> Any:
        return self.group.device

    @property
    def join_process_group(self) -> Any:
        return self.group


def main() -> None:
    group = backends.init("mpi")
    comm = MPI.COMM_WORLD
    dataset = list(range(SAMPLES))
    sampler = ShardSampler(dataset, group=comm, seed=3)
    sampler.set_epoch(1)
    padded = DistributedSampler(dataset, num_replicas=comm.Get_size(), rank=comm.Get_rank(),
                                seed=3)
    padded.set_epoch(1)
    sums = BatchSums(group)
    ids: list[int] = []
    with Join([sums]):
        for batch in DataLoader(dataset, batch_size=2, sampler=sampler):
            ids += [int(i) for i in batch]
            sums([int(i) for i in batch])
    print("JOINKIT-DATA " + json.dumps({
        "rank": group.rank, "world": group.world_size,
        "sampler": [sampler.rank, sampler.num_replicas],
        "ids": ids, "distributed_sampler": list(padded), "totals": sums.totals.tolist(),
    }), flush=True)


if __name__ == "__main__":
    main()
