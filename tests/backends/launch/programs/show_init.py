"""Print what ``backends.init()`` (or ``init_torch()``) returned under a real launcher.

    python show_init.py [init|init_torch|ddp|raise]

Each rank prints one ``JOINKIT-INIT {...}`` line: the group's type, rank and
world size, the detected launcher, the sum of an all-reduce of ``rank + 1``
(proof that the group really connects the ranks) and the torchrun-style
variables afterwards. ``ddp`` also trains a DistributedDataParallel model
with uneven inputs under torch's own Join (torch.distributed initialised by
``init_torch``), and reports whether the ranks' parameters agree. ``raise``
makes rank 1 die of an exception while the others wait in a collective: the
job must end (init's excepthook aborts it) instead of hanging.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

from joinkit import backends

TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def ddp_parameters_agree(group: Any) -> bool:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    # joinkit's Join: torch's leaves DDP's join config enabled and its last
    # heartbeat unwaited, and a gloo thread that drops such work while the
    # interpreter shuts down aborts the process (about one run in five).
    from joinkit import Join

    torch.manual_seed(group.rank)  # different initial weights: DDP must sync them
    model = DistributedDataParallel(torch.nn.Linear(3, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):
        for step in range(3 + group.rank):  # uneven inputs
            optim.zero_grad()
            model(torch.full((2, 3), float(step))).sum().backward()
            optim.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = group.all_gather(flat)
    return all(torch.equal(gathered[0], other) for other in gathered)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "init"
    launcher = backends.detect_launcher()
    group = backends.init() if mode in ("init", "raise") else backends.init_torch()
    if mode == "raise":
        if group.rank == 1:
            raise ValueError("injected failure on rank 1")
        group.barrier()  # never completes: rank 1 is gone
    buf = np.array([group.rank + 1], dtype=np.int64)
    group.all_reduce(buf)
    line: dict[str, Any] = {
        "type": type(group).__name__,
        "rank": group.rank,
        "world_size": group.world_size,
        "launcher": launcher,
        "sum": int(buf[0]),
        "env": {name: os.environ.get(name) for name in TORCH_VARIABLES},
    }
    if mode == "ddp":
        line["ddp_agree"] = ddp_parameters_agree(group)
    print("JOINKIT-INIT " + json.dumps(line), flush=True)
    if type(group).__name__ == "TorchGroup":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
