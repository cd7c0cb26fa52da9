"""torch alone: does a gloo collective that times out while its peer is late corrupt the heap?

One of the suspects of issue 30 (docs/reliability.md, "A heap corruption in a
test job"), reduced to torch only: rank 1 comes 0.7 s late to a collective
whose group times out after 0.5 s, so rank 0's receive times out and gloo
closes the group's pairs while rank 1 sends into them; then both churn the
heap. A fresh group per round (a timed-out group is broken). Not a test and
not in ``benchmarks/run.py``; run it under glibc's checking allocator::

    for r in 0 1; do MALLOC_CHECK_=3 LD_PRELOAD=/lib/x86_64-linux-gnu/libc_malloc_debug.so.0 \\
        MALLOC_PERTURB_=165 python benchmarks/gloo_late_peer.py $r 2 /tmp/late.store 300 & done

Each rank prints its rounds and timeouts; a heap corruption would end a rank
with SIGABRT instead. Measured 2026-11-26 (2 cores, torch 2.13.0+cpu): 330
rounds, 327 timed out, no crash. Under Valgrind's memcheck instead (each rank
as ``PYTHONMALLOC=malloc valgrind --tool=memcheck --undef-value-errors=no
python benchmarks/gloo_late_peer.py R 2 STORE 60``), 2026-11-27: 60 rounds, 57
timed out, and no error but the dynamic loader's known one at start-up.
"""

from __future__ import annotations

import datetime
import gc
import sys
import time

import torch
import torch.distributed as dist


def main(rank: int, world: int, store: str, rounds: int, size: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    timeouts = 0
    for i in range(rounds):
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=0.5))
        tensor = torch.full((size,), float(rank))
        if rank == 1:
            time.sleep(0.7)  # late: rank 0's receive times out first
        try:
            if i % 3 == 0:
                dist.all_reduce(tensor, group=group)
            elif i % 3 == 1:
                dist.all_gather([torch.empty(size) for _ in range(world)], tensor, group=group)
            else:
                dist.broadcast(tensor, 0, group=group)
        except RuntimeError:
            timeouts += 1
        del tensor
        # Churn the heap: freed blocks are reused at once.
        churn = [torch.empty(max(1, size // 8)) for _ in range(8)]
        del churn
        gc.collect()
        dist.barrier()  # the world group lines the ranks up again
    print(f"rank {rank}: {rounds} rounds, {timeouts} timed out", flush=True)


if __name__ == "__main__":
    rank_, world_, store_, rounds_ = sys.argv[1:5]
    size_ = int(sys.argv[5]) if len(sys.argv) > 5 else 4096
    main(int(rank_), int(world_), store_, int(rounds_), size_)
