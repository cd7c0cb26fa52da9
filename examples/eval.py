"""Exact evaluation on uneven shards: 13 samples on 2 ranks.

``torch.utils.data.DistributedSampler`` pads 13 samples to 14 by repeating
the first one, so every rank has as many batches and a plain per-batch
all-gather works; the repeated sample is counted twice. Here the classifier
gets 7 of the 13 right (0.5385) but sample 0 wrong, so the padded evaluation
reports 7 of 14 (0.5000).

joinkit's way gives each sample to exactly one rank (rank r takes samples
r, r + 2, ...: 7 and 6), so the ranks have different batches; ``Gather``
inside a ``Join`` gathers each batch's predictions and labels from the ranks
still evaluating, and with ``keep=True`` every rank ends with all 13, each
once, whatever batch it ran out at.

Run it three ways; each prints the same two lines (from rank 0):

    python examples/eval.py                          # 2 ranks as threads (NumPy)
    torchrun --nproc-per-node 2 examples/eval.py     # torch.distributed (torch tensors)
    mpirun -n 2 python examples/eval.py              # mpi4py (NumPy)

    exact (Gather in a Join): accuracy 0.5385 on 13 samples
    padded (DistributedSampler): accuracy 0.5000 on 14 samples
"""

from __future__ import annotations

from typing import Any

import numpy as np

from joinkit import Join, backends
from joinkit.adapters.gather import Gather

SAMPLES = 13
BATCH = 4
WORLD_SIZE = 2  # when no launcher started us, run this many ranks as threads


def dataset() -> tuple[np.ndarray, np.ndarray]:
    """13 samples with one feature; the labels that the classifier gets 7 of."""
    x = ((np.arange(SAMPLES) * 7) % SAMPLES / SAMPLES).astype(np.float32).reshape(-1, 1)
    y = (x[:, 0] > 0.5).astype(np.int64)
    wrong = [0, 1, 2, 4, 5, 8]
    y[wrong] = 1 - y[wrong]
    return x, y


def classify(x: Any) -> Any:
    """A fixed classifier: class 1 where the feature is above 0.5 (NumPy or torch)."""
    return (x[:, 0] > 0.5).long() if hasattr(x, "long") else (x[:, 0] > 0.5).astype(np.int64)


def padded_shard(rank: int, world: int) -> list[int]:
    """DistributedSampler(shuffle=False)'s indices: padded with the first samples."""
    total = -(-SAMPLES // world) * world
    indices = list(range(SAMPLES))
    indices += indices[: total - SAMPLES]
    return indices[rank:total:world]


def worker(group: Any) -> list[str]:
    """One rank's program: evaluate both ways; rank 0 prints and returns the lines."""
    rank, world = group.rank, group.world_size
    x, y = dataset()
    if backends.detect_launcher() == "torchrun":
        import torch

        x, y = torch.from_numpy(x), torch.from_numpy(y)

    # joinkit's way: exact shards, each batch gathered from the ranks still evaluating.
    shard = list(range(rank, SAMPLES, world))
    gather = Gather(group, keep=True)
    with Join([gather]):
        for start in range(0, len(shard), BATCH):
            batch = shard[start:start + BATCH]
            gather(classify(x[batch]), y[batch])
    preds, labels = gather.collected()
    accuracy = float((preds == labels).sum()) / len(labels)
    exact = f"exact (Gather in a Join): accuracy {accuracy:.4f} on {len(labels)} samples"

    # The padded way: as many equal batches on every rank, a plain all-gather each.
    shard = padded_shard(rank, world)
    rows = []
    for start in range(0, len(shard), BATCH):
        batch = shard[start:start + BATCH]
        pred = np.asarray(classify(x[batch]))
        rows += group.all_gather(np.stack([pred, np.asarray(y[batch])], 1))
    both = np.concatenate(rows)
    accuracy = np.mean(both[:, 0] == both[:, 1])
    padded = f"padded (DistributedSampler): accuracy {accuracy:.4f} on {len(both)} samples"
    lines = [exact, padded] if rank == 0 else []
    if lines:
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
