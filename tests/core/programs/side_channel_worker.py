"""``side_channel_cases`` on real process groups: gloo (torch) and MPI.

``python side_channel_worker.py torch RANK WORLD STORE OUT`` (gloo over a
file store, a fresh ``dist.new_group`` per case) or ``mpirun -n W python
side_channel_worker.py mpi OUT`` (an ``MPIGroup`` over a duplicate of
``COMM_WORLD`` per case). Each rank writes ``OUT/rankR.jsonl``: one line per case
with its result (``side_channel_cases.normalize``) or its error.
``test_side_channel_dist.py`` compares them with ``side_channel_cases.expected``.
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import side_channel_cases as cases

#: Cases not run under mpirun: a hook that fails midway through a shadow round
#: makes the Join abort the group, which on MPI is MPI_Abort (the whole job ends).
NOT_ON_MPI = ("main_hook_call",)


def run(make_group: Any, rank: int, out: Path, skip: tuple[str, ...] = ()) -> None:
    with (out / f"rank{rank}.jsonl").open("w") as f:
        for name, (case, _) in cases.CASES.items():
            if name in skip:
                continue
            group = make_group()
            try:
                record = {"case": name, "ok": True, "result": cases.normalize(case(group))}
            except BaseException as error:  # noqa: BLE001 - reported by the test
                record = {"case": name, "ok": False,
                          "error": "".join(traceback.format_exception(error))}
            f.write(json.dumps(record) + "\n")
            f.flush()


def main(argv: list[str]) -> None:
    if argv[0] == "torch":
        import torch.distributed as dist

        from joinkit.backends.torch_dist import TorchGroup

        rank, world, store, out = int(argv[1]), int(argv[2]), argv[3], Path(argv[4])
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=timeout)
        run(lambda: TorchGroup(dist.new_group(backend="gloo", timeout=timeout)), rank, out)
        dist.destroy_process_group()
    else:
        from mpi4py import MPI

        from joinkit.backends.mpi import MPIGroup

        out = Path(argv[1])
        run(lambda: MPIGroup(MPI.COMM_WORLD.Dup()), MPI.COMM_WORLD.Get_rank(), out, NOT_ON_MPI)


if __name__ == "__main__":
    main(sys.argv[1:])
