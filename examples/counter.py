"""The Join tutorial's Counter, written once against joinkit's collectives.

Each rank counts, per iteration, how many ranks processed an input (one
all-reduce of a 1); a joined rank shadows that all-reduce with a 0. Once all
ranks have joined, the ``sync_max_count`` post hook broadcasts the count of a
last joiner, so every rank learns the total.

Unlike the tutorial's Counter it *fuses* the join heartbeat into its own
all-reduce (a second element), so an iteration costs one collective, not two:
it sets ``join_fuses_heartbeat = True``, puts ``Join.fused_heartbeat(self)``
into the extra element, and its hook's ``fused_shadow`` shadows that all-reduce
and returns the heartbeat slot's sum.

Run it three ways; each prints the tutorial's four lines (rank order varies):

    python examples/counter.py                          # 2 ranks as threads
    torchrun --nproc-per-node 2 examples/counter.py     # torch.distributed
    mpirun -n 2 python examples/counter.py              # mpi4py

Rank r has 5 + r inputs, so:

    10 inputs processed before rank 0 joined!
    11 inputs processed across all ranks!
    11 inputs processed before rank 1 joined!
    11 inputs processed across all ranks!
"""

from __future__ import annotations

from typing import Any

import numpy as np

from joinkit import Join, Joinable, JoinHook, backends

NUM_INPUTS = 5
WORLD_SIZE = 2  # when no launcher started us, run this many ranks as threads


class CounterJoinHook(JoinHook):
    """Join hook for :class:`Counter`.

    Args:
        counter: the counter using this hook.
        sync_max_count: whether to sync the max count once all ranks join.
    """

    def __init__(self, counter: Counter, sync_max_count: bool) -> None:
        self.counter = counter
        self.sync_max_count = sync_max_count

    def fused_shadow(self, heartbeat: float) -> float:
        """Shadow the counter's all-reduce: a zero, and ``heartbeat`` in the slot."""
        t = np.array([0.0, heartbeat], dtype=np.float32)
        self.counter.group.all_reduce(t)
        return float(t[1])

    def main_hook(self) -> None:
        """Nothing: the counter's only all-reduce was shadowed by fused_shadow."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Broadcast the count of a last joiner if ``sync_max_count``."""
        if not self.sync_max_count:
            return
        counter = self.counter
        common_rank = counter.find_common_rank(counter.group.rank, is_last_joiner)
        if counter.group.rank == common_rank:
            counter.max_count = counter.count.copy()
        counter.group.broadcast(counter.max_count, src=common_rank)


class Counter(Joinable):
    """Counts the inputs processed by all ranks in the iterations it takes part in."""

    join_fuses_heartbeat = True

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.count = np.zeros(1, dtype=np.float32)
        self.max_count = np.zeros(1, dtype=np.float32)

    def __call__(self) -> None:
        """Count this iteration's inputs across all ranks."""
        # [an input, the join heartbeat]: one all-reduce carries both.
        t = np.array([1.0, Join.fused_heartbeat(self)], dtype=np.float32)
        self.group.all_reduce(t)
        self.count += t[0]
        Join.record_heartbeat_total(self, float(t[1]))  # learn of failed peers early

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Return the hook; accepts ``sync_max_count`` (default ``False``)."""
        return CounterJoinHook(self, kwargs.get("sync_max_count", False))

    @property
    def join_device(self) -> Any:
        return self.group.device

    @property
    def join_process_group(self) -> Any:
        return self.group

    def find_common_rank(self, rank: int, to_consider: bool) -> int:
        """Return the largest rank among those with ``to_consider``."""
        t = np.array([rank if to_consider else -1], dtype=np.int64)
        self.group.all_reduce(t, op="max")
        return int(t[0])


def worker(group: Any) -> list[str]:
    """One rank's program: count 5 + rank inputs inside a Join, print, return lines."""
    counter = Counter(group)
    with Join([counter], sync_max_count=True):
        for _ in range(NUM_INPUTS + group.rank):
            counter()
    lines = [
        f"{int(counter.count[0])} inputs processed before rank {group.rank} joined!",
        f"{int(counter.max_count[0])} inputs processed across all ranks!",
    ]
    # One write per rank, so ranks' lines do not interleave mid-line.
    print("\n".join(lines) + "\n", end="", flush=True)
    return lines


def main() -> None:
    if backends.detect_launcher() is None:
        from joinkit.backends.threads import spawn

        spawn(worker, WORLD_SIZE)
    else:
        worker(backends.init())


if __name__ == "__main__":
    main()
